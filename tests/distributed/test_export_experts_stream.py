"""Streamed export of expert-parallel checkpoints: `dsf export` reads a DeepSpeed AutoEP checkpoint at
ZeRO 1, 2 and 3 one tensor at a time from its memory-mapped optimizer files, as the dense paths do,
with no universal conversion (checkpoints/experts.py).

The shared 2-rank launch (conftest.shared_runs) trains a 10.6M-parameter Qwen3-MoE (6 layers of 4
experts, ep 2) one step at each stage and saves it. Each stage's export, at --max-shard-size 10MB:
- equals bit for bit, tensor for tensor, the export through DeepSpeed's ds_to_universal (what dsf
  export did before: the conversion into a scratch directory, its fp32 files under transformers'
  names by the same renaming and joining, experts.transformers_entries);
- grows the peak resident memory of a fresh process (workers/export_memory.py) by less than 3 shards
  plus twice the largest tensor (measured: 16-25 MB of a 38 MB bound). The universal path grew it by
  74-85 MB at ZeRO-1/2 and 252 MB at ZeRO-3 on these checkpoints.

Experts split over expert-data ranks too (ep 2 x dp 2) are test_experts.py's: its exports at ZeRO
1-3 give the trained engine's logits. Cost: ~25 s (its runs in the shared launch a few s; a stage
~7 s, of which the export's fresh process ~5 s and the universal conversion ~2 s).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import REPO, Prefixed, rank_env

WORKERS = Path(__file__).parent / "workers"
STAGES = (1, 2, 3)
SHARD_BYTES = 10_000_000  # "10MB" as save_pretrained reads it
# 6 layers of 4 experts (ffn 512, hidden 256): 10.6M parameters, 43 MB fp32 (the counting task's vocabulary);
# the largest tensor is an experts.gate_up_proj, [4, 1024, 256] (4.2 MB)
MODEL = {"hidden_size": 256, "moe_intermediate_size": 512, "num_hidden_layers": 6}
# glibc raises its mmap threshold at the first large free and then keeps freed blocks in the heap,
# which adds 0-20 MB to the peak from run to run; a fixed threshold measures what the export holds.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


PREFIX = "autoep-stream-"


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs: one step of the Qwen3-MoE at ep 2 and each ZeRO stage, saved."""
    if ranks != 2:
        return []
    from dsframework.models.tiny import tiny_config

    tiny_config("qwen3_moe", **MODEL).to_json_file(root / f"{PREFIX}qwen3_moe.json")
    return [f"{PREFIX}zero{stage}|eager|model.name={root / f'{PREFIX}qwen3_moe.json'};parallel.ep=2;"
            f"parallel.zero_stage={stage};train.steps=1;train.warmup_steps=0;checkpoint.save_final=true"
            for stage in STAGES]


@pytest.fixture(scope="module")
def checkpoints(shared_runs) -> Prefixed:
    """The shared world-2 launch's runs of this module, by their names here (`checkpoints / "zero1"`)."""
    return Prefixed(shared_runs(2)[0], PREFIX)


class _UniversalFile:
    """One parameter of a universal checkpoint, unread: its fp32.pt."""

    def __init__(self, path: Path):
        self.path = path

    def contiguous(self) -> torch.Tensor:
        value = torch.load(self.path, map_location="cpu", weights_only=False)
        return value["param"] if isinstance(value, dict) else value


def universal_export(ckpt_dir: Path, scratch: Path) -> dict:
    """{transformers name: unread tensor} as dsf export read an AutoEP checkpoint at ZeRO 1-3 before it
    streamed it: DeepSpeed's universal conversion into `scratch`, each parameter's fp32.pt."""
    from transformers import AutoConfig

    from dsframework.checkpoints.checkpoint import latest_tag, to_universal
    from dsframework.checkpoints.experts import autoep_layers, transformers_entries

    tag = latest_tag(ckpt_dir)
    zero = scratch / to_universal(ckpt_dir, tag, into=scratch) / "zero"
    raw = {folder.name: _UniversalFile(folder / "fp32.pt") for folder in zero.iterdir()
           if (folder / "fp32.pt").is_file()}
    config = AutoConfig.from_pretrained(ckpt_dir / "hf_config", local_files_only=True)
    return transformers_entries(raw, autoep_layers(ckpt_dir / tag), config)


def exported_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: tensor for path in sorted(hf_dir.glob("model*.safetensors"))
            for name, tensor in load_file(path).items()}


@pytest.fixture(scope="module")
def streamed(checkpoints, tmp_path_factory):
    """stage -> (the export's directory, its peak memory as workers/export_memory.py measured it in a
    fresh process), exported once a stage."""
    done: dict[int, tuple[Path, dict]] = {}

    def export(stage: int) -> tuple[Path, dict]:
        if stage not in done:
            hf_dir = tmp_path_factory.mktemp(f"hf{stage}") / "hf"
            worker = [str(WORKERS / "export_memory.py"), str(checkpoints / f"zero{stage}" / "checkpoints"), str(hf_dir)]
            proc = subprocess.run([sys.executable, *worker, "10MB"], capture_output=True, text=True, timeout=300,
                                  env={**rank_env(), **FIXED_MALLOC}, cwd=REPO)
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[stage] = hf_dir, json.loads(proc.stdout.strip().splitlines()[-1])
        return done[stage]

    return export


@pytest.mark.parametrize("stage", STAGES, ids=[f"zero{stage}" for stage in STAGES])
def test_streamed_export_is_the_universal_export_bit_for_bit(checkpoints, streamed, tmp_path, stage):
    """And nothing is written beside the checkpoint."""
    ckpt_dir = checkpoints / f"zero{stage}" / "checkpoints"
    before = sorted(p.name for p in ckpt_dir.iterdir())
    hf_dir, _ = streamed(stage)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == before
    got, want = exported_tensors(hf_dir), universal_export(ckpt_dir, tmp_path)
    assert sorted(got) == sorted(want) and len(got) == 69, sorted(set(got) ^ set(want))
    for name, tensor in got.items():
        reference = want[name].contiguous()
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference.reshape(tensor.shape)), name


@pytest.mark.parametrize("stage", STAGES, ids=[f"zero{stage}" for stage in STAGES])
def test_streamed_export_holds_about_one_shard(streamed, stage):
    from safetensors import safe_open

    hf_dir, measured = streamed(stage)
    shapes = []
    for path in sorted(hf_dir.glob("model-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shapes += [torch.Size(f.get_slice(name).get_shape()) for name in f.keys()]
    largest = 4 * max(shape.numel() for shape in shapes)  # fp32
    bound = 3 * SHARD_BYTES + 2 * largest
    print(f"\nZeRO-{stage} export of {sum(shape.numel() for shape in shapes) / 1e6:.1f}M parameters into "
          f"{len(list(hf_dir.glob('model-*.safetensors')))} shards: peak RSS growth "
          f"{measured['growth_bytes'] / 1e6:.1f} MB (bound {bound / 1e6:.1f} MB: shards of 10 MB, largest tensor "
          f"{largest / 1e6:.1f} MB), {measured['seconds']} s")
    assert len(shapes) == 69 and measured["growth_bytes"] < bound, measured
