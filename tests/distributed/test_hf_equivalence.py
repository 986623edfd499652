"""A model loaded from a local pretrained directory - saved as several safetensors files with an
index - and sharded tp2 x pp2 over four ranks (the `dsf train` path: meta model, tensor-parallel
plan, pipeline stages, each rank reading only its slices) gives the logits of transformers' own
model loaded from the same directory, and each rank reads about its share of the bytes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import TINY_YAML, launch, run_overrides

WORKER = Path(__file__).parent / "workers" / "engine_logits.py"


def save_pretrained_model(model_type: str, path: Path) -> None:
    """A small random model with a vocabulary not divisible by tp (so padding is exercised),
    saved as a transformers directory - what a user's checkpoint looks like."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    if model_type == "llama":  # grouped-query attention: 4 heads over 2 kv heads
        config = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(config)
    else:  # tied embeddings, fused q|k|v
        config = GPT2Config(vocab_size=101, n_embd=64, n_layer=3, n_head=4, n_positions=64)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(path, max_shard_size="40KB")  # several files and model.safetensors.index.json
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 3


MODEL_TYPES = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict[str, Path]:
    """model type -> its directory: the pretrained model and the sharded engine's logits (sharded.pt,
    and each rank's read statistics), both models in one launch."""
    root = tmp_path_factory.mktemp("hf_equivalence")
    args = []
    for model_type in MODEL_TYPES:
        save_pretrained_model(model_type, root / model_type / "pretrained")
        overrides = [f"model.name={root / model_type / 'pretrained'}", "parallel.tp=2", "parallel.pp=2",
                     "parallel.zero_stage=0", "train.micro_batch=2"]
        sets = [arg for o in run_overrides(root / model_type / "run", overrides) for arg in ("--set", o)]
        args += [*(["--next"] if args else []), str(TINY_YAML), str(root / model_type / "sharded.pt"), "--fresh", *sets]
    launch([str(WORKER), *args], num_ranks=4)
    return {model_type: root / model_type for model_type in MODEL_TYPES}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tp2_pp2_logits_equal_transformers(sharded_runs, model_type):
    from transformers import AutoModelForCausalLM

    tmp_path = sharded_runs[model_type]
    pretrained = tmp_path / "pretrained"
    sharded = torch.load(tmp_path / "sharded.pt")

    reference = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(input_ids=sharded["input_ids"]).logits
    assert sharded["logits"].shape == want.shape == (2, 32, 101)
    assert torch.allclose(sharded["logits"], want, atol=1e-5, rtol=0), (
        f"max |diff| {(sharded['logits'] - want).abs().max().item():.3g}")

    # Each rank read its slices: what it keeps (fp32 on disk, so 4 bytes an element), less the
    # vocab padding rows it made up, and never the whole model.
    on_disk = sum(p.stat().st_size for p in pretrained.glob("*.safetensors"))
    for rank in range(4):
        stats = json.loads(Path(f"{tmp_path / 'sharded.pt'}.rank{rank}.json").read_text())
        kept = 4 * (stats["parameters"] - stats["padding"])
        assert 0.9 * kept <= stats["bytes_read"] <= kept, (rank, stats)
        assert stats["bytes_read"] < 0.5 * on_disk, (rank, stats["bytes_read"], on_disk)
