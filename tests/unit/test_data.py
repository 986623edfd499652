"""Data: built-in tasks, local files, tokenizers, packing, held-out split, DP-aware sampling."""
from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest

datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from dsframework.config import DataSpec  # noqa: E402
from dsframework.data import (BUILTIN_TASKS, SPECIAL_TOKENS, BlockSampler, eval_shard,  # noqa: E402
                              generate_task, load_texts, load_tokenizer, pack, pack_splits,
                              train_tokenizer)
from dsframework.errors import UserError  # noqa: E402

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


def test_load_texts_reads_txt_lines_dropping_empty_ones(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nsecond line\n\n\nthird line\n")
    texts = load_texts(DataSpec(dataset=str(path)))
    assert texts.column_names == ["text"]
    assert _texts(texts) == ["first line", "second line", "third line"]


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


# --- packing --------------------------------------------------------------------------------------

UNIQUE_DOCS = [f"{i}+{i}={2 * i}" for i in range(300)]  # distinct, in the addition alphabet


@pytest.fixture(scope="module")
def char_tokenizer():
    spec = DataSpec(dataset="addition", num_examples=200)
    return train_tokenizer(datasets.Dataset.from_dict({"text": UNIQUE_DOCS}), spec)


@pytest.mark.parametrize("seq_len", [8, SEQ_LEN, 37])
def test_pack_is_the_eos_joined_stream_cut_into_blocks(char_tokenizer, seq_len):
    texts = datasets.Dataset.from_dict({"text": UNIQUE_DOCS[:100]})
    blocks = pack(texts, char_tokenizer, seq_len)
    eos = char_tokenizer.eos_token_id
    stream = [t for doc in UNIQUE_DOCS[:100]
              for t in char_tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]]
    n = len(stream) // seq_len
    assert blocks.dtype == torch.long
    assert tuple(blocks.shape) == (n, seq_len)
    assert blocks.flatten().tolist() == stream[: n * seq_len]
    assert len(stream) - n * seq_len < seq_len  # only an incomplete block is dropped


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


def test_pack_splits_holds_out_whole_documents(char_tokenizer):
    texts = datasets.Dataset.from_dict({"text": UNIQUE_DOCS})
    spec = DataSpec(dataset="addition", seq_len=SEQ_LEN, eval_fraction=0.1, seed=11)
    train, held_out = pack_splits(texts, char_tokenizer, spec)
    assert train.shape[1] == held_out.shape[1] == SEQ_LEN
    train_docs, eval_docs = _complete_docs(train, char_tokenizer), _complete_docs(held_out, char_tokenizer)
    assert set(train_docs) <= set(UNIQUE_DOCS) and set(eval_docs) <= set(UNIQUE_DOCS)
    assert not set(train_docs) & set(eval_docs)
    assert 20 <= len(eval_docs) <= 30  # ~10% of 300 documents (minus a cut tail)
    # Each split drops fewer than seq_len tokens at its end: at most 2 documents (>= 6 tokens each).
    assert len(train_docs) + len(eval_docs) >= 300 - 2 * 3
    # Deterministic for a seed; another seed holds out other documents.
    again, again_eval = pack_splits(texts, char_tokenizer, spec)
    assert torch.equal(again, train) and torch.equal(again_eval, held_out)
    _, other_eval = pack_splits(texts, char_tokenizer, spec.model_copy(update={"seed": 12}))
    assert set(_complete_docs(other_eval, char_tokenizer)) != set(eval_docs)


def test_blocks_are_tokenized_once_and_read_back(char_tokenizer, tmp_path, monkeypatch):
    import dsframework.data as data

    texts = datasets.Dataset.from_dict({"text": UNIQUE_DOCS})
    spec = DataSpec(dataset="addition", seq_len=SEQ_LEN, eval_fraction=0.1, seed=11)
    train, held_out = data.pack_splits_cached(texts, char_tokenizer, spec, cache_dir=tmp_path)
    want_train, want_eval = pack_splits(texts, char_tokenizer, spec)
    assert torch.equal(train, want_train) and torch.equal(held_out, want_eval)
    assert len(list(tmp_path.glob("blocks-*.pt"))) == 1

    # A tokenizer saved and loaded again (what the other ranks and a resumed run use) finds it ...
    char_tokenizer.save_pretrained(str(tmp_path / "tok"))
    reloaded = load_tokenizer(tmp_path / "tok")
    monkeypatch.setattr(data, "pack_splits", lambda *a: pytest.fail("tokenized again"))
    again, again_eval = data.pack_splits_cached(texts, reloaded, spec, cache_dir=tmp_path)
    assert torch.equal(again, train) and torch.equal(again_eval, held_out)
    monkeypatch.undo()

    # ... other packing settings or other data do not, and a torn file is rebuilt.
    data.pack_splits_cached(texts, char_tokenizer, spec.model_copy(update={"seq_len": SEQ_LEN + 1}), cache_dir=tmp_path)
    data.pack_splits_cached(datasets.Dataset.from_dict({"text": UNIQUE_DOCS[:200]}), char_tokenizer, spec,
                            cache_dir=tmp_path)
    assert len(list(tmp_path.glob("blocks-*.pt"))) == 3
    for path in tmp_path.glob("blocks-*.pt"):
        path.write_bytes(b"torn")
    rebuilt, _ = data.pack_splits_cached(texts, char_tokenizer, spec, cache_dir=tmp_path)
    assert torch.equal(rebuilt, train)


def test_pack_splits_errors(char_tokenizer):
    spec = DataSpec(dataset="addition", seq_len=SEQ_LEN)
    with pytest.raises(UserError, match="non-empty documents"):
        pack_splits(datasets.Dataset.from_dict({"text": ["1+1=2"]}), char_tokenizer, spec)
    short = datasets.Dataset.from_dict({"text": ["1+1=2"] * 20})
    with pytest.raises(UserError, match="data.seq_len"):
        pack_splits(short, char_tokenizer, spec.model_copy(update={"seq_len": 512}))


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
