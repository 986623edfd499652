"""Supervised fine-tuning on real ranks: the loss is the mean over the trained tokens of the whole
global batch whatever the split into micro-batches, ranks and tensor shards (against the plain
PyTorch reference), and a pretrained model with a chat template fine-tunes under ZeRO-3."""
from __future__ import annotations

import json
import random

import pytest

from dsframework.config import load_run_config
from tests.distributed.launcher import TINY_YAML, assert_close, read_metrics, run_overrides, train_run
from tests.distributed.reference import reference_losses



def _arithmetic(path, n: int, *, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(1000), rng.randrange(1000)
            # Prompts of varied length: rows hold different numbers of trained tokens.
            f.write(json.dumps({"prompt": f"{'please ' * rng.randrange(3)}{a}+{b}=", "completion": f"{a + b}"}) + "\n")


SFT = ["data.format=prompt_completion", "data.seq_len=32", "data.tokenizer_vocab_size=300", "train.global_batch=8"]


@pytest.mark.parametrize("layout", [
    ["parallel.zero_stage=2", "train.micro_batch=2", "train.grad_accum=2"],       # dp 2 x accum 2
    ["parallel.tp=2", "parallel.zero_stage=1", "train.micro_batch=1", "train.grad_accum=8"],  # tp 2 x accum 8
], ids=["dp2-accum2-zero2", "tp2-accum8-zero1"])
def test_sft_loss_is_the_mean_over_the_global_batchs_trained_tokens(tmp_path, layout):
    _arithmetic(tmp_path / "sft.jsonl", 400)
    overrides = [f"data.dataset={tmp_path / 'sft.jsonl'}", *SFT, *layout]
    got = train_run(tmp_path / "run", overrides)
    run = load_run_config(TINY_YAML, run_overrides(tmp_path / "run", overrides))
    assert_close(got, reference_losses(run), rtol=1e-5, what=" ".join(layout))


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def pretrained_chat_model(directory, chats, *, model_type: str = "llama", **fields) -> None:
    """A saved model (a tiny `model_type`, models/tiny.py's sizes) and tokenizer with a chat
    template: what a user's pretrained directory holds."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from dsframework.config import DataSpec
    from dsframework.data import train_tokenizer
    from dsframework.models.tiny import tiny_config

    rows = datasets.Dataset.from_dict({"messages": chats})
    tokenizer = train_tokenizer(rows, DataSpec(dataset="chats.jsonl", format="chat", tokenizer_vocab_size=400))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=len(tokenizer), max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, **fields)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def addition_chats(path, n: int = 600) -> None:
    """`n` chats asking for a sum, written as chats.jsonl; returns the chats."""
    rng = random.Random(1)
    chats = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        chats.append([{"role": "system", "content": "You add numbers."},
                      {"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}])
    with open(path, "w") as f:
        f.writelines(json.dumps({"messages": chat}) + "\n" for chat in chats)
    return chats


def test_a_pretrained_chat_model_fine_tunes_under_zero3(tmp_path):
    chats = addition_chats(tmp_path / "chats.jsonl")
    pretrained_chat_model(tmp_path / "pretrained", chats, intermediate_size=176)
    train_run(tmp_path / "run", [
        f"model.name={tmp_path / 'pretrained'}", f"data.dataset={tmp_path / 'chats.jsonl'}", "data.format=chat",
        "data.seq_len=128", "data.eval_fraction=0.1", "parallel.zero_stage=3", "train.steps=30",
        "train.global_batch=8", "logging.eval_every=15"])
    evals = [row["eval_loss"] for row in read_metrics(tmp_path / "run") if "eval_loss" in row]
    assert len(evals) == 3 and evals[-1] < 0.7 * evals[0], evals  # held-out chats, assistant tokens only
