"""Data: built-in tasks, local files, tokenizers, packing, held-out split, DP-aware sampling."""
from __future__ import annotations

import itertools
import json
import mmap
import re
from pathlib import Path
from collections import Counter

import pytest

datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from dsframework.config import DataSpec  # noqa: E402
from dsframework.data import (BUILTIN_TASKS, SPECIAL_TOKENS, BlockSampler, eval_shard,  # noqa: E402
                              generate_task, load_texts, load_tokenizer, token_stores, train_tokenizer)
from dsframework.data import store as store_module  # noqa: E402
from dsframework.errors import UserError  # noqa: E402
from tests.packing_reference import pack, pack_splits  # noqa: E402

SEQ_LEN = 16


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    """load_dataset writes its Arrow cache under tmp_path, not the user's ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def _texts(dataset) -> list[str]:
    return list(dataset["text"])


# --- built-in tasks -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_task_is_deterministic_per_seed_and_differs_across_seeds(name):
    first = generate_task(name, num_examples=200, digits=3, seed=1)
    assert first == generate_task(name, num_examples=200, digits=3, seed=1)
    assert first != generate_task(name, num_examples=200, digits=3, seed=2)
    assert len(first) == 200 and len(set(first)) > 100  # varied, not one example repeated


@pytest.mark.parametrize("digits", [1, 3, 6])
def test_addition_is_well_formed(digits):
    for text in generate_task("addition", num_examples=300, digits=digits, seed=0):
        match = re.fullmatch(r"(\d+)\+(\d+)=(\d+)", text)
        assert match, text
        a, b, total = map(int, match.groups())
        assert a < 10**digits and b < 10**digits
        assert a + b == total, text


@pytest.mark.parametrize("digits", [1, 3])
def test_reverse_is_well_formed(digits):
    lengths = set()
    for text in generate_task("reverse", num_examples=300, digits=digits, seed=0):
        match = re.fullmatch(r"(\d+)>(\d+)", text)
        assert match, text
        forward, backward = match.groups()
        assert backward == forward[::-1]
        assert 1 <= len(forward) <= 2 * digits
        lengths.add(len(forward))
    assert lengths == set(range(1, 2 * digits + 1))


def test_counting_is_well_formed():
    for text in generate_task("counting", num_examples=300, digits=3, seed=0):
        numbers = [int(part) for part in text.split(",")]
        assert len(numbers) == 8
        assert numbers[0] < 1000
        assert numbers == list(range(numbers[0], numbers[0] + 8)), text


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_load_texts_of_a_builtin_task(name):
    spec = DataSpec(dataset=name, num_examples=150, max_digits=2, seed=5)
    texts = load_texts(spec)
    assert texts.column_names == ["text"]
    assert _texts(texts) == generate_task(name, num_examples=150, digits=2, seed=5)


# --- tokenizers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_builtin_tokenizer_round_trips_and_has_special_tokens(name):
    spec = DataSpec(dataset=name, num_examples=200, max_digits=3, seed=3)
    texts = load_texts(spec)
    tokenizer = train_tokenizer(texts, spec)
    for key, token in SPECIAL_TOKENS.items():
        assert getattr(tokenizer, key) == token
        assert getattr(tokenizer, key + "_id") is not None
    specials = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    assert len(specials) == 4
    alphabet = set("".join(_texts(texts)))
    assert len(tokenizer) == len(alphabet) + 4  # one token per character, plus the specials
    for text in _texts(texts)[:50]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # character level
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


USER_DOCS = [f"Document {i}: héllo wörld, the quick brown fox number {i * 7} jumps; 日本語 🙂" for i in range(150)]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    texts = datasets.Dataset.from_dict({"text": USER_DOCS})
    return train_tokenizer(texts, DataSpec(dataset="/data/user.jsonl", tokenizer_vocab_size=300))


def test_user_data_gets_a_byte_level_bpe_tokenizer(bpe_tokenizer):
    tokenizer = bpe_tokenizer
    assert len(tokenizer) == 300
    for key, token in SPECIAL_TOKENS.items():
        assert getattr(tokenizer, key) == token
    # Merges were learned: a document takes far fewer tokens than bytes.
    ids = tokenizer(USER_DOCS[0], add_special_tokens=False)["input_ids"]
    assert len(ids) < len(USER_DOCS[0].encode()) / 2
    # Byte level: any text round-trips, also characters never seen in training, without <unk>.
    for text in [USER_DOCS[3], "  two spaces\nnew line\ttab", "unseen: Ωmega ✓ ß"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_tokenizer_saves_and_loads(bpe_tokenizer, tmp_path):
    bpe_tokenizer.save_pretrained(str(tmp_path / "tok"))
    loaded = load_tokenizer(tmp_path / "tok")
    assert len(loaded) == len(bpe_tokenizer)
    for key in SPECIAL_TOKENS:
        assert getattr(loaded, key + "_id") == getattr(bpe_tokenizer, key + "_id")
    for text in USER_DOCS[:5] + ["unseen: Ωmega ✓"]:
        ids = bpe_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids
        assert loaded.decode(ids) == text


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no loadable tokenizer"):
        load_tokenizer(tmp_path / "empty")


# --- loading user data ----------------------------------------------------------------------------

ROWS = [
    {"content": "first document", "id": 1},
    {"content": "", "id": 2},
    {"content": "second, with a comma", "id": 3},
    {"content": "third\tdocument", "id": 4},
]
KEPT = ["first document", "second, with a comma", "third\tdocument"]


def _write(path, fmt: str) -> None:
    import pandas as pd

    if fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    elif fmt == "csv":
        pd.DataFrame(ROWS).to_csv(path, index=False)
    elif fmt == "parquet":
        pd.DataFrame(ROWS).to_parquet(path)


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet"])
def test_load_texts_reads_tabular_files_with_text_field(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    _write(path, fmt)
    texts = load_texts(DataSpec(dataset=str(path), text_field="content"))
    assert texts.column_names == ["text"]
    assert _texts(texts) == KEPT


def test_a_text_file_is_one_document_by_default_newlines_kept(tmp_path):
    text = "first line\n\n    indented block\n\tand a tab\n\n\nlast line\n"
    (tmp_path / "corpus.txt").write_text(text)
    assert _texts(load_texts(DataSpec(dataset=str(tmp_path / "corpus.txt")))) == [text]


@pytest.mark.parametrize("unit, expected", [
    ("line", ["first line", "second line", "third line"]),   # datasets' default, and ours before
    ("paragraph", ["first line\nsecond line", "third line"]),  # blank lines separate, newlines within kept
])
def test_text_unit_splits_a_file(tmp_path, unit, expected):
    (tmp_path / "corpus.txt").write_text("first line\nsecond line\n\n\nthird line\n")
    texts = load_texts(DataSpec(dataset=str(tmp_path / "corpus.txt"), text_unit=unit))
    assert [t.strip("\n") for t in _texts(texts)] == expected


def test_a_glob_reads_any_text_extension(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {"pkg/a.py": "def f(x):\n    return x + 1\n", "pkg/sub/b.py": "class B:\n    pass\n",
             "pkg/notes.md": "# title\n\ntext\n"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    texts = load_texts(DataSpec(dataset=str(tmp_path / "pkg" / "**" / "*.py")))
    assert sorted(_texts(texts)) == sorted(body for name, body in files.items() if name.endswith(".py"))
    with pytest.raises(UserError, match="neither a built-in task"):
        load_texts(DataSpec(dataset=str(tmp_path / "pkg" / "*.rst")))


def test_load_texts_reads_a_glob_and_a_directory(tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"text": f"doc {i}a"}) + "\n"
                                                 + json.dumps({"text": f"doc {i}b"}) + "\n")
    expected = [f"doc {i}{s}" for i in range(3) for s in "ab"]
    assert sorted(_texts(load_texts(DataSpec(dataset=str(tmp_path / "part*.jsonl"))))) == expected
    assert sorted(_texts(load_texts(DataSpec(dataset=str(tmp_path))))) == expected


def test_load_texts_reads_a_saved_dataset(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    texts = load_texts(DataSpec(dataset=str(tmp_path / "saved"), text_field="content"))
    assert texts.column_names == ["text"]
    assert _texts(texts) == KEPT


@pytest.mark.parametrize("splits, expected", [
    ({"test": ROWS[:1], "train": ROWS}, KEPT),           # "train" wins wherever it is
    ({"validation": ROWS[2:], "other": ROWS}, KEPT[1:]),  # else the first split
])
def test_load_texts_reads_a_saved_dataset_dict(tmp_path, splits, expected):
    dd = datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})
    dd.save_to_disk(str(tmp_path / "saved"))
    texts = load_texts(DataSpec(dataset=str(tmp_path / "saved"), text_field="content"))
    assert _texts(texts) == expected


def test_load_texts_wrong_text_field_suggests_a_column(tmp_path):
    path = tmp_path / "data.jsonl"
    _write(path, "jsonl")
    with pytest.raises(UserError) as info:
        load_texts(DataSpec(dataset=str(path), text_field="contnt"))
    assert "data.text_field='contnt'" in str(info.value)
    assert "did you mean 'content'?" in str(info.value)


def test_load_texts_errors(tmp_path):
    with pytest.raises(UserError, match="neither a built-in task"):
        load_texts(DataSpec(dataset=str(tmp_path / "absent.jsonl")))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x\n")
    _write(tmp_path / "mixed" / "b.jsonl", "jsonl")
    with pytest.raises(UserError, match="mixes formats"):
        load_texts(DataSpec(dataset=str(tmp_path / "mixed")))
    (tmp_path / "broken.json").write_text("{not json at all")
    with pytest.raises(UserError, match="could not be read"):
        load_texts(DataSpec(dataset=str(tmp_path / "broken.json")))


# --- token store ----------------------------------------------------------------------------------

UNIQUE_DOCS = [f"{i}+{i}={2 * i}" for i in range(300)]  # distinct, in the addition alphabet


@pytest.fixture(scope="module")
def char_tokenizer():
    spec = DataSpec(dataset="addition", num_examples=200)
    return train_tokenizer(datasets.Dataset.from_dict({"text": UNIQUE_DOCS}), spec)


def _rows(store):
    return store[list(range(len(store)))]


@pytest.mark.parametrize("seq_len", [8, SEQ_LEN, 37])
def test_store_holds_the_blocks_of_in_memory_packing_in_the_same_order(char_tokenizer, tmp_path, seq_len):
    texts = datasets.Dataset.from_dict({"text": UNIQUE_DOCS})
    spec = DataSpec(dataset="addition", seq_len=seq_len, eval_fraction=0.1, seed=11)
    train, held_out = token_stores(texts, char_tokenizer, spec, cache_dir=tmp_path)
    want_train, want_eval = pack_splits(texts, char_tokenizer, spec)
    assert torch.equal(_rows(train), want_train) and torch.equal(_rows(held_out), want_eval)
    assert train[3].tolist() == want_train[3].tolist()
    ids_file = next(tmp_path.glob("store-*/train.ids"))
    assert ids_file.stat().st_size // 2 >= want_train.numel()  # uint16 on disk (the uncut stream)
    assert not train.supervised and train.micro_batch([0, 1]).dtype == torch.long


def test_reference_pack_is_the_eos_joined_stream_cut_into_blocks(char_tokenizer):
    texts = datasets.Dataset.from_dict({"text": UNIQUE_DOCS[:100]})
    blocks = pack(texts, char_tokenizer, SEQ_LEN)
    eos = char_tokenizer.eos_token_id
    stream = [t for doc in UNIQUE_DOCS[:100]
              for t in char_tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]]
    n = len(stream) // SEQ_LEN
    assert blocks.flatten().tolist() == stream[: n * SEQ_LEN]


def test_ids_are_uint16_until_the_vocabulary_needs_uint32():
    assert store_module.id_dtype(65536).name == "uint16"
    assert store_module.id_dtype(65537).name == "uint32"


def _complete_docs(blocks, tokenizer) -> list[str]:
    """The documents that lie whole in a block stream (the stream starts at a document)."""
    stream = blocks.flatten().tolist()
    eos = tokenizer.eos_token_id
    docs, current = [], []
    for token in stream:
        if token == eos:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return docs  # the cut tail after the last EOS is left out


def test_store_holds_out_whole_documents(char_tokenizer, tmp_path):
    texts = datasets.Dataset.from_dict({"text": UNIQUE_DOCS})
    spec = DataSpec(dataset="addition", seq_len=SEQ_LEN, eval_fraction=0.1, seed=11)
    train, held_out = (_rows(s) for s in token_stores(texts, char_tokenizer, spec, cache_dir=tmp_path))
    train_docs, eval_docs = _complete_docs(train, char_tokenizer), _complete_docs(held_out, char_tokenizer)
    assert set(train_docs) <= set(UNIQUE_DOCS) and set(eval_docs) <= set(UNIQUE_DOCS)
    assert not set(train_docs) & set(eval_docs)
    assert 20 <= len(eval_docs) <= 30  # ~10% of 300 documents (minus a cut tail)
    assert len(train_docs) + len(eval_docs) >= 300 - 2 * 3
    _, other_eval = token_stores(texts, char_tokenizer, spec.model_copy(update={"seed": 12}), cache_dir=tmp_path)
    assert set(_complete_docs(_rows(other_eval), char_tokenizer)) != set(eval_docs)


def test_a_text_file_comes_back_from_the_store_as_it_was(tmp_path):
    """Files tokenized and decoded back from the rows are the files, with an EOS after each only."""
    bodies = [f"def f{i}(x):\n    'doc {i}'\n\n    return x * {i}  # tabs\there\n" for i in range(40)]
    for i, body in enumerate(bodies):
        (tmp_path / f"m{i:02d}.py").write_text(body)
    spec = DataSpec(dataset=str(tmp_path / "*.py"), seq_len=32, eval_fraction=0.1, tokenizer_vocab_size=300)
    texts = load_texts(spec)
    tokenizer = train_tokenizer(texts, spec)
    train, held_out = token_stores(texts, tokenizer, spec, cache_dir=tmp_path / "cache")
    docs = _complete_docs(_rows(train), tokenizer) + _complete_docs(_rows(held_out), tokenizer)
    assert set(docs) <= set(bodies) and len(docs) >= 40 - 2  # whole files; at most a cut tail per split


def test_store_is_built_once_keyed_and_rebuilt_when_torn(char_tokenizer, tmp_path, monkeypatch):
    texts = datasets.Dataset.from_dict({"text": UNIQUE_DOCS})
    spec = DataSpec(dataset="addition", seq_len=SEQ_LEN, eval_fraction=0.1, seed=11)
    train, held_out = token_stores(texts, char_tokenizer, spec, cache_dir=tmp_path)
    want = _rows(train)
    assert len(list(tmp_path.glob("store-*"))) == 1 and not list(tmp_path.glob(".store-*"))

    # A tokenizer saved and loaded again (what the other ranks and a resumed run use) finds it ...
    char_tokenizer.save_pretrained(str(tmp_path / "tok"))
    reloaded = load_tokenizer(tmp_path / "tok")
    monkeypatch.setattr(store_module, "build_store", lambda *a: pytest.fail("tokenized again"))
    again, _ = token_stores(texts, reloaded, spec, cache_dir=tmp_path)
    assert torch.equal(_rows(again), want)
    monkeypatch.undo()

    # ... other packing settings or other data do not, and a torn store is rebuilt.
    token_stores(texts, char_tokenizer, spec.model_copy(update={"seq_len": SEQ_LEN + 1}), cache_dir=tmp_path)
    token_stores(datasets.Dataset.from_dict({"text": UNIQUE_DOCS[:200]}), char_tokenizer, spec, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("store-*"))) == 3
    for ids in tmp_path.glob("store-*/train.ids"):
        ids.write_bytes(ids.read_bytes()[:100])  # torn
    rebuilt, _ = token_stores(texts, char_tokenizer, spec, cache_dir=tmp_path)
    assert torch.equal(_rows(rebuilt), want)


def test_pre_tokenized_data_is_used_as_is_and_checked_against_the_vocabulary(char_tokenizer, tmp_path):
    eos = char_tokenizer.eos_token_id
    docs = [char_tokenizer(d, add_special_tokens=False)["input_ids"] for d in UNIQUE_DOCS]
    datasets.Dataset.from_dict({"input_ids": [d + [eos] if i % 2 else d for i, d in enumerate(docs)]}).save_to_disk(
        str(tmp_path / "ids"))
    spec = DataSpec(dataset=str(tmp_path / "ids"), seq_len=SEQ_LEN, eval_fraction=0.1, seed=11)
    rows = load_texts(spec)
    assert rows.column_names == ["input_ids"]
    train, held_out = token_stores(rows, char_tokenizer, spec, cache_dir=tmp_path / "cache")
    text_spec = DataSpec(dataset="addition", seq_len=SEQ_LEN, eval_fraction=0.1, seed=11)
    want_train, _ = pack_splits(datasets.Dataset.from_dict({"text": UNIQUE_DOCS}), char_tokenizer, text_spec)
    assert torch.equal(_rows(train), want_train)  # an EOS added where a document had none, never twice
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [len(char_tokenizer) + 5, 1]] * 20}).save_to_disk(
        str(tmp_path / "bad"))
    bad = spec.model_copy(update={"dataset": str(tmp_path / "bad")})
    with pytest.raises(UserError, match=rf"data.dataset={len(char_tokenizer) + 5}: is an input_ids value outside"):
        token_stores(load_texts(bad), char_tokenizer, bad, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob(".store-*"))  # nothing half-written left behind


def test_reading_rows_does_not_grow_a_process_with_the_corpus(tmp_path):
    """Every row of a 256 MB store read in micro-batches: the pages go back after each read."""
    rows, width = 1 << 16, 2048
    path = tmp_path / "train.ids"
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(np.random.default_rng(0).integers(0, 60000, size=(rows // 16, width), dtype=np.uint16).tobytes())
    mapped = store_module._MappedRows(path, np.dtype(np.uint16), width=width, rows=rows)

    def rss_mb() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE / 2**20

    before = rss_mb()
    total = 0
    for start in range(0, rows, 64):
        total += int(mapped.take(list(range(start, start + 64)))[:, 0].sum())
    order = np.random.default_rng(1).permutation(rows)  # random rows: the kernel maps their neighbours too
    for start in range(0, rows // 4, 8):
        total += int(mapped.take(order[start:start + 8].tolist())[:, 0].sum())
    assert total > 0
    assert rss_mb() - before < 16, f"RSS grew {rss_mb() - before:.0f} MB reading a 256 MB store"


def test_store_errors(char_tokenizer, tmp_path):
    spec = DataSpec(dataset="addition", seq_len=SEQ_LEN)
    with pytest.raises(UserError, match="non-empty examples"):
        token_stores(datasets.Dataset.from_dict({"text": ["1+1=2"]}), char_tokenizer, spec, cache_dir=tmp_path)
    short = datasets.Dataset.from_dict({"text": ["1+1=2"] * 20})
    with pytest.raises(UserError, match="data.seq_len"):
        token_stores(short, char_tokenizer, spec.model_copy(update={"seq_len": 512}), cache_dir=tmp_path)
    assert not list(tmp_path.glob("store-*")) and not list(tmp_path.glob(".store-*"))


# --- sampling -------------------------------------------------------------------------------------

TRIPLES = list(itertools.product([1, 2, 4], [1, 2], [1, 2]))  # (dp_size, micro_batch, grad_accum)


def _samplers(num_blocks, dp, micro, accum, seed=0):
    return [BlockSampler(num_blocks, micro_batch=micro, grad_accum=accum, dp_size=dp, dp_rank=r, seed=seed)
            for r in range(dp)]


def _step(samplers, consumed) -> list[list[int]]:
    """Every rank's blocks for one step, in rank order."""
    shards = []
    for sampler in samplers:
        batches = sampler.micro_batches(consumed)
        assert len(batches) == sampler.grad_accum
        assert all(len(b) == sampler.micro_batch for b in batches)
        shards.append([i for b in batches for i in b])
    return shards


@pytest.mark.parametrize("dp, micro, accum", TRIPLES)
@pytest.mark.parametrize("num_blocks", [48, 37])  # 48: steps align with epochs; 37: they straddle
def test_ranks_cover_the_global_batch_exactly(num_blocks, dp, micro, accum):
    samplers = _samplers(num_blocks, dp, micro, accum)
    global_batch = dp * micro * accum
    assert samplers[0].global_batch == global_batch
    for step in range(3 * num_blocks // global_batch + 2):  # a few epochs
        consumed = step * global_batch
        shards = _step(samplers, consumed)
        expected = samplers[0].global_indices(consumed)
        assert len(expected) == global_batch
        assert all(0 <= i < num_blocks for i in expected)
        assert Counter(i for shard in shards for i in shard) == Counter(expected)
        if num_blocks % global_batch == 0:  # the step lies within one epoch: no block twice
            flat = [i for shard in shards for i in shard]
            assert len(set(flat)) == len(flat)
            for a, b in itertools.combinations(shards, 2):
                assert not set(a) & set(b)


@pytest.mark.parametrize("global_batch", [4, 8])
def test_global_batch_does_not_depend_on_the_factorization(global_batch):
    factorizations = [(dp, m, a) for dp in (1, 2, 4) for m in (1, 2, 4, 8) for a in (1, 2, 4, 8)
                      if dp * m * a == global_batch]
    assert len(factorizations) >= 6
    num_blocks = 50
    reference = None
    for dp, micro, accum in factorizations:
        samplers = _samplers(num_blocks, dp, micro, accum, seed=3)
        batches = [sorted(i for shard in _step(samplers, c) for i in shard)
                   for c in range(0, 4 * num_blocks, global_batch)]
        if reference is None:
            reference = batches
        assert batches == reference, (dp, micro, accum)
    other_seed = _samplers(num_blocks, 1, global_batch, 1, seed=4)[0]
    assert [sorted(other_seed.global_indices(c)) for c in range(0, 4 * num_blocks, global_batch)] != reference


@pytest.mark.parametrize("num_blocks, global_batch", [(12, 4), (10, 4), (7, 2), (5, 8)])
def test_every_block_once_per_epoch_and_epochs_reshuffle(num_blocks, global_batch):
    sampler = BlockSampler(num_blocks, micro_batch=global_batch, grad_accum=1, dp_size=1, dp_rank=0, seed=9)
    epochs = 4
    samples = []
    consumed = 0
    while consumed < epochs * num_blocks:
        samples += sampler.global_indices(consumed)
        consumed += global_batch
    orders = [samples[e * num_blocks:(e + 1) * num_blocks] for e in range(epochs)]
    for order in orders:
        assert sorted(order) == list(range(num_blocks))
    assert len({tuple(order) for order in orders}) > 1  # a new permutation per epoch
    assert orders[0] != list(range(num_blocks))         # and shuffled at all


def test_sampler_is_a_pure_function_of_consumed_samples():
    used = BlockSampler(23, micro_batch=2, grad_accum=2, dp_size=2, dp_rank=1, seed=5)
    forward = {c: used.micro_batches(c) for c in range(0, 200, 8)}
    for c in reversed(range(0, 200, 8)):  # a resumed run asks for any position, in any order
        fresh = BlockSampler(23, micro_batch=2, grad_accum=2, dp_size=2, dp_rank=1, seed=5)
        assert fresh.micro_batches(c) == forward[c] == used.micro_batches(c)


@pytest.mark.parametrize("dp, micro", list(itertools.product([1, 2, 3, 4], [1, 2, 4])))
@pytest.mark.parametrize("num_blocks", [4, 5, 9, 16, 33])
def test_eval_shard_balances_ranks_with_disjoint_blocks(num_blocks, dp, micro):
    shards = [eval_shard(num_blocks, micro_batch=micro, dp_size=dp, dp_rank=r) for r in range(dp)]
    counts = {len(shard) for shard in shards}
    assert len(counts) == 1  # every rank runs the same number of forwards
    assert counts.pop() >= 1  # there are at least as many blocks as ranks: everyone evaluates
    blocks = [i for shard in shards for batch in shard for i in batch]
    assert len(blocks) == len(set(blocks))
    assert all(0 <= i < num_blocks for i in blocks)
    for shard in shards:
        assert all(1 <= len(batch) <= micro for batch in shard)
        assert len({len(batch) for batch in shard}) == 1
    # Only a remainder smaller than one round of micro-batches is left out.
    effective_micro = len(shards[0][0])
    assert num_blocks - len(blocks) < effective_micro * dp


def test_stdlib_placeholder_is_this_interpreters_standard_library_without_site_packages():
    import sysconfig

    from dsframework.data.sources import data_files

    builder, files = data_files(DataSpec(dataset="{stdlib}/**/*.py"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert builder == "text" and str(stdlib / "json" / "decoder.py") in files
    assert all(Path(f).is_relative_to(stdlib) and "site-packages" not in Path(f).parts for f in files)
