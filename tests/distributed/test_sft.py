"""Supervised fine-tuning on real ranks: the loss is the mean over the trained tokens of the whole
global batch whatever the split into micro-batches, ranks and tensor shards (against the plain
PyTorch reference), and a pretrained model with a chat template fine-tunes under ZeRO-3. The runs
train in the world-2 launch other modules share (conftest.shared_runs)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dsframework.config import load_run_config
from tests.distributed.launcher import TINY_YAML, assert_close, losses, read_metrics, run_overrides
from tests.distributed.reference import reference_losses



def _arithmetic(path, n: int, *, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(1000), rng.randrange(1000)
            # Prompts of varied length: rows hold different numbers of trained tokens.
            f.write(json.dumps({"prompt": f"{'please ' * rng.randrange(3)}{a}+{b}=", "completion": f"{a + b}"}) + "\n")


SFT = ["data.format=prompt_completion", "data.seq_len=32", "data.tokenizer_vocab_size=300", "train.global_batch=8"]


LAYOUTS = {
    "dp2-accum2-zero2": ["parallel.zero_stage=2", "train.micro_batch=2", "train.grad_accum=2"],
    "tp2-accum8-zero1": ["parallel.tp=2", "parallel.zero_stage=1", "train.micro_batch=1", "train.grad_accum=8"],
}


def run_settings(root: Path) -> dict[str, list[str]]:
    """name -> overrides of this module's runs, their inputs under `root` (shared_specs writes them)."""
    inputs = root / "sft-inputs"
    sft = {name: [f"data.dataset={inputs / 'sft.jsonl'}", *SFT, *layout] for name, layout in LAYOUTS.items()}
    chat = [f"model.name={inputs / 'pretrained'}", f"data.dataset={inputs / 'chats.jsonl'}", "data.format=chat",
            "data.seq_len=128", "data.eval_fraction=0.1", "parallel.zero_stage=3", "train.steps=30",
            "train.global_batch=8", "logging.eval_every=15"]
    return {**sft, "chat": chat}


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs at world 2 (named sft-<name>), after writing their data and the
    pretrained chat model."""
    if ranks != 2:
        return []
    inputs = root / "sft-inputs"
    inputs.mkdir()
    _arithmetic(inputs / "sft.jsonl", 400)
    pretrained_chat_model(inputs / "pretrained", addition_chats(inputs / "chats.jsonl"), intermediate_size=176)
    return [f"sft-{name}|eager|{';'.join(overrides)}" for name, overrides in run_settings(root).items()]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sft_loss_is_the_mean_over_the_global_batchs_trained_tokens(shared_runs, name):
    root = shared_runs(2)[0]
    overrides = run_settings(root)[name]
    got = losses(root / f"sft-{name}")
    run = load_run_config(TINY_YAML, run_overrides(root / f"sft-{name}", overrides))
    assert_close(got, reference_losses(run), rtol=1e-5, what=name)


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


def test_a_pretrained_chat_model_fine_tunes_under_zero3(shared_runs):
    evals = [row["eval_loss"] for row in read_metrics(shared_runs(2)[0] / "sft-chat") if "eval_loss" in row]
    assert len(evals) == 3 and evals[-1] < 0.7 * evals[0], evals  # held-out chats, assistant tokens only
