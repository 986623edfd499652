"""Supervised fine-tuning rows: packing, the masked loss against a hand-computed reference, zero
gradient on masked tokens, packed == unpacked per example (one process, a tiny Llama)."""
from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dsframework.config import DataSpec  # noqa: E402
from dsframework.data import IGNORE_INDEX, token_stores, train_tokenizer  # noqa: E402
from dsframework.data.store import pack_examples  # noqa: E402
from dsframework.train.step import micro_batch_loss  # noqa: E402

SEQ_LEN = 32


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def _pack(examples, *, packing=True, seq_len=8):
    counts = {"examples": 0, "truncated": 0, "dropped": 0, "padding": 0}
    return list(pack_examples(iter(examples), seq_len=seq_len, packing=packing, pad_id=0, counts=counts)), counts


def test_examples_pack_whole_in_order_with_their_own_positions():
    a, b, c = ([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7], [0, 0, 1, 1]), ([8, 9], [0, 1])
    rows, counts = _pack([a, b, c])
    assert [r[0] for r in rows] == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 0, 0, 0, 0, 0, 0]]
    assert [r[1] for r in rows] == [[0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert [r[2] for r in rows] == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]]  # padding: its own
    assert counts == {"examples": 3, "truncated": 0, "dropped": 0, "padding": 7}
    rows, _ = _pack([a, b, c], packing=False)
    assert [r[0][:4] for r in rows] == [[1, 2, 3, 0], [4, 5, 6, 7], [8, 9, 0, 0]]


def test_a_long_example_is_cut_and_one_left_untrained_is_dropped():
    rows, counts = _pack([(list(range(1, 12)), [0] * 5 + [1] * 6), (list(range(1, 12)), [0] * 9 + [1] * 2)])
    assert len(rows) == 1 and rows[0][0] == list(range(1, 9))
    assert counts["truncated"] == 2 and counts["dropped"] == 1  # the 2nd kept no trained token in 8


def _arithmetic(n: int, seed: int = 0) -> list[dict[str, str]]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": f"{a}+{b}=", "completion": f"{a + b}"})
    return rows


@pytest.fixture(scope="module")
def tokenizer():
    texts = [r["prompt"] + r["completion"] for r in _arithmetic(200)]
    return train_tokenizer(datasets.Dataset.from_dict({"text": texts}), DataSpec(dataset="addition"))


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


def _stores(tmp_path, tokenizer, *, packing=True, train_on_prompt=False, n=40):
    rows = datasets.Dataset.from_list(_arithmetic(n, seed=1))
    spec = DataSpec(dataset=str(tmp_path / "sft.jsonl"), format="prompt_completion", seq_len=SEQ_LEN,
                    eval_fraction=0.1, packing=packing, train_on_prompt=train_on_prompt)
    return token_stores(rows, tokenizer, spec, cache_dir=tmp_path / "stores")


def _hand_loss(model, tokenizer, example: dict[str, str]) -> tuple[float, int]:
    """(summed loss over the completion and EOS, their count) of one example run alone, by hand."""
    prompt = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
    answer = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    total = -sum(log_probs[t - 1, ids[0, t]].item() for t in range(len(prompt), ids.shape[1]))
    return total, len(answer)


def _examples_in(store, tokenizer) -> list[tuple[str, str]]:
    """(prompt, completion) of every example in the store's rows, read back from positions and masks."""
    found = []
    for row in range(len(store)):
        batch = store.micro_batch([row], weight=1.0)
        ids, labels, positions = (batch[k][0].tolist() for k in ("input_ids", "labels", "position_ids"))
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(ids)]
        for start, end in zip(starts, starts[1:]):
            trained = [t for t in range(start, end) if labels[t] != IGNORE_INDEX]
            if trained:  # (the padding tail trains nothing)
                found.append((tokenizer.decode(ids[start:trained[0]]), tokenizer.decode(ids[trained[0]:trained[-1]])))
    return found


def test_masked_loss_equals_the_hand_computed_mean_over_completion_tokens(tmp_path, tokenizer, model):
    train, _ = _stores(tmp_path, tokenizer)
    rows = list(range(len(train)))
    batch = train.micro_batch(rows, weight=1.0 / train.trained_tokens(rows))
    with torch.no_grad():
        got = micro_batch_loss(model, batch)[0].item()
    examples = _examples_in(train, tokenizer)
    assert len(examples) >= 30 and all(p.endswith("=") for p, _ in examples)
    sums = [_hand_loss(model, tokenizer, {"prompt": p, "completion": c}) for p, c in examples]
    want = sum(s for s, _ in sums) / sum(n for _, n in sums)
    assert sum(n for _, n in sums) == train.trained_tokens(rows)
    assert abs(got - want) < 1e-5 * abs(want), (got, want)


def test_masked_tokens_get_exactly_zero_gradient(tmp_path, tokenizer, model):
    train, _ = _stores(tmp_path, tokenizer)
    rows = list(range(min(4, len(train))))
    batch = train.micro_batch(rows, weight=1.0 / train.trained_tokens(rows))
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(keep)
    try:
        micro_batch_loss(model, batch)[0].backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    grad = captured["logits"].grad  # logits at t predict the token at t + 1
    predicts_trained = torch.zeros_like(batch["labels"], dtype=torch.bool)
    predicts_trained[:, :-1] = batch["labels"][:, 1:] != IGNORE_INDEX
    assert predicts_trained.any() and (~predicts_trained).any()
    assert torch.count_nonzero(grad[~predicts_trained]) == 0
    assert (grad[predicts_trained].abs().sum(-1) > 0).all()


def test_train_on_prompt_trains_every_token_but_each_examples_first(tmp_path, tokenizer):
    train, _ = _stores(tmp_path, tokenizer, train_on_prompt=True)
    batch = train.micro_batch(list(range(len(train))), weight=1.0)
    starts, padding = batch["position_ids"] == 0, batch["input_ids"] == tokenizer.pad_token_id
    assert ((batch["labels"] != IGNORE_INDEX) == (~starts & ~padding)).all()


def test_packed_and_unpacked_rows_give_the_same_loss_per_example(tmp_path, tokenizer, model):
    packed, _ = _stores(tmp_path, tokenizer, packing=True)
    unpacked, _ = _stores(tmp_path, tokenizer, packing=False)
    assert len(packed) < len(unpacked)  # several examples share a row

    def per_example(store) -> dict[tuple[int, ...], float]:
        out = {}
        for row in range(len(store)):
            batch = store.micro_batch([row], weight=1.0)
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
            losses = torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], reduction="none",
                                                       ignore_index=IGNORE_INDEX)
            positions, ids = batch["position_ids"][0].tolist(), batch["input_ids"][0].tolist()
            starts = [t for t, p in enumerate(positions) if p == 0] + [len(ids)]
            for start, end in zip(starts, starts[1:]):
                loss = losses[max(start - 1, 0):end - 1].sum().item()
                if loss:
                    out[tuple(ids[start:end])] = loss
        return out

    got, want = per_example(packed), per_example(unpacked)
    assert got.keys() == want.keys() and len(got) >= 30
    assert max(abs(got[k] - want[k]) / want[k] for k in got) < 1e-5


def test_user_column_names_reach_the_store(tmp_path, tokenizer):
    from dsframework.data import load_texts

    with open(tmp_path / "qa.jsonl", "w") as f:
        f.writelines(f'{{"q": "{r["prompt"]}", "a": "{r["completion"]}"}}\n' for r in _arithmetic(40))
    spec = DataSpec(dataset=str(tmp_path / "qa.jsonl"), format="prompt_completion", prompt_field="q",
                    completion_field="a", seq_len=SEQ_LEN, eval_fraction=0.1)
    train, _ = token_stores(load_texts(spec), tokenizer, spec, cache_dir=tmp_path / "stores")
    assert all(p.endswith("=") and c.isdigit() for p, c in _examples_in(train, tokenizer))
