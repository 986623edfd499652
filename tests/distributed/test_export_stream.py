"""Streamed export: `dsf export` writes transformers' sharded layout one shard at a time.

- A ~154M-parameter Llama under ZeRO-3 on 2 ranks (built and saved, no training step) exported at
  --max-shard-size 50MB: the export process's peak resident memory (VmHWM, measured inside it
  against its resident size just before) grows by less than 3 shards plus the largest tensor,
  and `from_pretrained` on the shards gives the engine's logits within 1e-5.
- A tied GPT-2 (ZeRO-3) exported in many small shards: the files, index and tensors that
  `save_pretrained(max_shard_size=...)` writes for the same weights; `from_pretrained` ties
  wte and lm_head again; a size that is not one is a one-line error that writes nothing.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.distributed.launcher import REPO, TINY_YAML, dsf, launch, rank_env, run_overrides

WORKERS = Path(__file__).parent / "workers"
# 12 layers of 12.85M parameters (full multi-head attention, SwiGLU 2816): 154M (617 MB) with the
# counting task's small vocabulary; the largest tensor is an MLP projection, 2816 x 1024 fp32 (11.5 MB).
BIG_LLAMA = ("{hidden_size: 1024, intermediate_size: 2816, num_hidden_layers: 12, num_attention_heads: 16, "
             "num_key_value_heads: 16}")
SHARD_BYTES = 50_000_000  # "50MB" as save_pretrained reads it


def test_big_zero3_export_holds_about_one_shard(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    sets = [arg for o in run_overrides(run_dir, ["parallel.zero_stage=3", f"model.overrides={BIG_LLAMA}"])
            for arg in ("--set", o)]
    launch([str(WORKERS / "save_fresh_checkpoint.py"), str(TINY_YAML), str(tmp_path / "engine.pt"), *sets],
           num_ranks=2)
    proc = subprocess.run([sys.executable, str(WORKERS / "export_memory.py"), str(run_dir / "checkpoints"),
                           str(hf_dir), "50MB"], capture_output=True, text=True, timeout=300, env=rank_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in hf_dir.glob("model*.safetensors")) == shards and len(shards) >= 12

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32).eval()
    assert model.num_parameters() >= 150_000_000
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    bound = 3 * SHARD_BYTES + largest
    print(f"\nexport of {model.num_parameters() / 1e6:.0f}M parameters into {len(shards)} shards: peak RSS growth "
          f"{measured['growth_bytes'] / 1e6:.0f} MB (bound {bound / 1e6:.0f} MB), {measured['seconds']} s")
    assert measured["growth_bytes"] < bound, measured

    engine = torch.load(tmp_path / "engine.pt")
    with torch.no_grad():
        exported = model(input_ids=engine["input_ids"]).logits
    diff = (exported - engine["logits"]).abs().max().item()
    print(f"max |logits - engine logits| = {diff:.3g}")
    assert diff <= 1e-5


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' spec at world 2: the tied GPT-2 the small-shards test exports."""
    overrides = ["model.name=tiny-gpt2", "parallel.zero_stage=3", "train.steps=2", "checkpoint.save_final=true"]
    return [f"stream-gpt2|eager|{';'.join(overrides)}"] if ranks == 2 else []


def test_small_shards_are_save_pretrained_layout(tmp_path, shared_runs):
    """The reference is save_pretrained of a model built from the config holding the exported weights
    (as the export builds it; a model from from_pretrained may order its shards differently)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    one, many, ref = tmp_path / "one", tmp_path / "many", tmp_path / "ref"
    run_dir = shared_runs(2)[0] / "stream-gpt2"
    dsf("export", str(run_dir / "checkpoints"), str(one))
    dsf("export", str(run_dir / "checkpoints"), str(many), "--max-shard-size", "40KB")
    assert not (one / "model.safetensors.index.json").exists()  # 50GB default: one file, no index

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(one))
    model.load_state_dict(load_file(one / "model.safetensors"), strict=False, assign=True)
    model.tie_weights()
    model.save_pretrained(ref, max_shard_size="40KB")
    files = sorted(p.name for p in many.glob("model*"))
    assert files == sorted(p.name for p in ref.glob("model*")) and len(files) > 3, files
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert index == json.loads((ref / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"], "a tied weight is written once"
    for name in (f for f in files if f.endswith(".safetensors")):
        got, want = load_file(many / name), load_file(ref / name)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name

    exported = AutoModelForCausalLM.from_pretrained(many, local_files_only=True)
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr(), "ties survive"
    single = AutoModelForCausalLM.from_pretrained(one, local_files_only=True)
    input_ids = torch.arange(32).remainder(exported.config.vocab_size).view(2, 16)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=input_ids).logits, single(input_ids=input_ids).logits)

    proc = subprocess.run([str(Path(sys.executable).parent / "dsf"), "export", str(run_dir / "checkpoints"),
                           str(tmp_path / "bad"), "--max-shard-size", "5 parsecs"],
                          capture_output=True, text=True, env=rank_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 2 and re.fullmatch(r"dsf: error: --max-shard-size=.*\n", proc.stderr), proc.stderr
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.*"))
