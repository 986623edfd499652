"""Resharding streams one state of one parameter at a time (issue 24), and writes what it wrote when it
held the whole model.

The checkpoints are written here as DeepSpeed writes a ZeRO-1 checkpoint (per model-parallel rank,
mp_rank_XX_model_states.pt with its param_shapes; per (dp, mp) rank, the flat fp32 partition, a
Parameter, and Adam's moments, with their param_slice_mappings), from known dense states.
- In this process: every file `reshard` writes holds what the route before streaming writes
  (`old_reshard` below, a copy of reshard.py at 31affa5), tensor for tensor (torch.equal), across tp,
  pp and dp changes, vocab padding, a tied embedding at both pipeline ends and GPT-2's fused, transposed
  Conv1D; at tp 1 the stored tensors are the dense states themselves (about 5 s).
- In a fresh process (marked distributed, about 13 s): a 44M-parameter Llama (states 525 MB) saved at
  tp 2 x pp 2 x dp 2 and converted for dp 4 grows its peak RSS by less than 4 x the largest parameter's
  fp32 bytes + 64 MB (131 MB; measured 46 MB), where the route before grows by more than the states
  (measured 1.4 GB).
bench/reshard_memory.py measures both routes on a 374M-parameter Llama trained by dsf.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, CAT_DIM, OPTIMIZER_STATE_DICT, PARAM,
                                            PARAM_GROUPS, PARAM_SHAPES, PARAM_SLICE_MAPPINGS,
                                            SINGLE_PARTITION_OF_FP32_GROUPS)
from deepspeed.utils.tensor_fragment import fragment_address
from transformers import AutoConfig

from dsframework.checkpoints.reshard import (LayoutNames, _optim_file, _tensor_layouts, concatenated_shards,
                                             reshard, universal_tag)
from dsframework.layout import ParallelDims
from dsframework.models.hf import hf_parameter_shapes
from dsframework.models.presets import PRESETS
from dsframework.models.tensor_parallel import merge_tensor_parallel_tensor
from dsframework.models.pipeline import pipeline_layer_specs

TAG = "global_step4"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def model_config(preset: str, **overrides):
    fields = {**PRESETS[preset], **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# --- a ZeRO-1 checkpoint as DeepSpeed writes one ---------------------------------------------------

def _stages(saved_name: str, dims: ParallelDims, specs: int) -> set[int]:
    """The pipeline stages holding a parameter: a tied one both end stages, else its layer's."""
    head = saved_name.split(".")[0]
    if not dims.pp_enabled:
        return {0}
    return {0, dims.pp - 1} if head == "tied_modules" else {int(head) * dims.pp // specs}


def _shard(dense: torch.Tensor, hf: str, layouts: list, rank: int) -> torch.Tensor:
    if hf not in layouts[0]:
        return dense.clone()
    per_rank = [layout[hf] for layout in layouts]
    return concatenated_shards(dense, per_rank).chunk(len(layouts), dim=per_rank[0][0])[rank].contiguous()


def _optimizer_files(groups: list[dict[str, dict[str, torch.Tensor]]], dp: int) -> list[dict]:
    """Each dp rank's optimizer_state_dict: the groups' flat states cut into dp equal partitions."""
    ranks = [{SINGLE_PARTITION_OF_FP32_GROUPS: [], PARAM_SLICE_MAPPINGS: [], "state": {}} for _ in range(dp)]
    for group, params in enumerate(groups):
        flat = {key: torch.cat([states[key].flatten() for states in params.values()]) for key in STATES}
        size = -(-flat["fp32"].numel() // dp)
        flat = {key: torch.nn.functional.pad(value, (0, size * dp - value.numel())) for key, value in flat.items()}
        for dp_rank, rank in enumerate(ranks):
            lo, hi, offset, mapping = dp_rank * size, (dp_rank + 1) * size, 0, {}
            for name, states in params.items():
                start, end = max(offset, lo), min(offset + states["fp32"].numel(), hi)
                if start < end:
                    mapping[name] = fragment_address(numel=end - start, start=start - lo)
                offset += states["fp32"].numel()
            part = {key: value[lo:hi].clone() for key, value in flat.items()}
            rank[SINGLE_PARTITION_OF_FP32_GROUPS].append(torch.nn.Parameter(part.pop("fp32")))
            rank[PARAM_SLICE_MAPPINGS].append(mapping)
            rank["state"][group] = {"step": 4, **part}
    return [{"loss_scaler": None, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
             BASE_OPTIMIZER_STATE: {"state": rank.pop("state"),
                                    PARAM_GROUPS: [{"lr": 3e-3, "params": [g]} for g in range(len(groups))]},
             "zero_stage": 1, "partition_count": [dp] * len(groups), "ds_version": "0.19.8", **rank}
            for rank in ranks]


def write_checkpoint(tag_dir: Path, config, dims: ParallelDims) -> dict[str, dict[str, torch.Tensor]]:
    """A ZeRO-1 checkpoint of random states at `dims`; returns them dense, {transformers name: {state: tensor}}."""
    torch.manual_seed(0)
    dense = {hf: {key: torch.randn(shape) for key in STATES} for hf, shape in hf_parameter_shapes(config).items()}
    layouts, names = _tensor_layouts(config, dims.tp), LayoutNames(config, dims)
    specs = len(pipeline_layer_specs(config)) if dims.pp_enabled else 1
    tag_dir.mkdir(parents=True)
    for mp in range(dims.tp * dims.pp):
        stage, rank = divmod(mp, dims.tp)
        held = {names.from_hf(hf): {key: _shard(value, hf, layouts, rank) for key, value in states.items()}
                for hf, states in dense.items() if stage in _stages(names.from_hf(hf), dims, specs)}
        groups = [group for group in ({n: s for n, s in held.items() if s["fp32"].dim() > 1},  # decayed
                                      {n: s for n, s in held.items() if s["fp32"].dim() == 1}) if group]
        torch.save({PARAM_SHAPES: [OrderedDict((n, s["fp32"].shape) for n, s in g.items()) for g in groups]},
                   tag_dir / f"mp_rank_{mp:02d}_model_states.pt")
        for dp, optim in enumerate(_optimizer_files(groups, dims.dp)):
            torch.save({OPTIMIZER_STATE_DICT: optim}, tag_dir / f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt")
    return dense


def linked_copy(ckpt_dir: Path, to: Path) -> Path:
    (to / TAG).mkdir(parents=True)
    for path in (ckpt_dir / TAG).iterdir():
        os.link(path, to / TAG / path.name)
    return to


# --- the route before streaming (reshard.py at 31affa5): the whole model's states in memory ---------

def old_read_partitions(tag_dir: Path, saved: ParallelDims):
    shards, common, step = [{} for _ in range(saved.tp)], None, None
    for mp in range(saved.tp * saved.pp):
        model_states = torch.load(tag_dir / f"mp_rank_{mp:02d}_model_states.pt", weights_only=False)
        shapes = {name: shape for group in model_states[PARAM_SHAPES] for name, shape in group.items()}
        pieces = {}
        for dp in range(saved.dp):
            optim = torch.load(_optim_file(tag_dir, dp=dp, mp=mp, fix=""), weights_only=False)[OPTIMIZER_STATE_DICT]
            states = optim[BASE_OPTIMIZER_STATE]["state"]
            if common is None:
                common = {k: v for k, v in optim.items()
                          if k not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)}
                common[PARAM_GROUPS] = optim[BASE_OPTIMIZER_STATE][PARAM_GROUPS]
                step = states[0].get("step") if states else None
            for group, mapping in enumerate(optim[PARAM_SLICE_MAPPINGS]):
                fp32 = optim[SINGLE_PARTITION_OF_FP32_GROUPS][group]
                flat = {"fp32": fp32, **{key: value for key, value in states.get(group, {}).items()
                                         if torch.is_tensor(value) and value.shape == fp32.shape}}
                for name, fragment in mapping.items():
                    for key, tensor in flat.items():
                        pieces.setdefault(name, {}).setdefault(key, []).append(
                            tensor.narrow(0, fragment.start, fragment.numel))
        rank = shards[mp % saved.tp]
        for name, states_of in pieces.items():
            if name not in rank:
                rank[name] = {key: torch.cat(parts).view(shapes[name]) for key, parts in states_of.items()}
    return shards, step, common


def old_reshard(ckpt_dir: Path, config, *, saved: ParallelDims, target: ParallelDims) -> Path:
    """Read every partition, make every parameter dense, then write them all (no links: zero/ alone)."""
    shards, step, common = old_read_partitions(ckpt_dir / TAG, saved)
    saved_names, layouts = LayoutNames(config, saved), _tensor_layouts(config, saved.tp)
    by_hf = [{saved_names.to_hf(name): shard for name, shard in rank.items()} for rank in shards]
    dense = {hf: ({key: merge_tensor_parallel_tensor(hf, [rank[hf][key] for rank in by_hf], layouts)
                   for key in by_hf[0][hf]} if hf in layouts[0] else by_hf[0][hf])
             for hf in hf_parameter_shapes(config)}
    out = ckpt_dir / universal_tag(TAG, target)
    names, layouts = LayoutNames(config, target), _tensor_layouts(config, target.tp)
    for hf, states in dense.items():
        folder = out / "zero" / names.from_hf(hf)
        folder.mkdir(parents=True)
        for key, tensor in states.items():
            per_rank = [layout[hf] for layout in layouts] if hf in layouts[0] else None
            entry = {PARAM: concatenated_shards(tensor, per_rank), CAT_DIM: per_rank[0][0]} if per_rank else \
                {PARAM: tensor}
            torch.save(entry, folder / f"{key}.pt")
        torch.save(step, folder / "step.pt")
    torch.save(common, out / "zero" / "optimizer_state.pt")
    return out


# --- the checks ------------------------------------------------------------------------------------

def same(a, b) -> bool:
    """Equal: tensors bit for bit, with dtype, shape and requires_grad; through dicts, lists, tuples."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
                and (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_files(new: Path, old: Path) -> int:
    files = sorted(p.relative_to(new) for p in (new / "zero").rglob("*.pt"))
    assert files == sorted(p.relative_to(old) for p in (old / "zero").rglob("*.pt"))
    for rel in files:
        assert same(torch.load(new / rel, weights_only=False), torch.load(old / rel, weights_only=False)), rel
    return len(files)


CASES = {  # id: (preset, config overrides, saved tp, pp, dp, target tp, pp, dp)
    "llama-padded-vocab-tp2pp2dp2-to-dp8": ("tiny-llama", {"vocab_size": 17}, (2, 2, 2), (1, 1, 8)),
    "llama-tp2pp2dp2-to-tp2dp4": ("tiny-llama", {"vocab_size": 17}, (2, 2, 2), (2, 1, 4)),
    "llama-tied-tp2pp2-to-tp4pp2": ("tiny-llama", {"tie_word_embeddings": True, "num_key_value_heads": 4},
                                    (2, 2, 1), (4, 2, 1)),
    "llama-dp4-to-tp2pp2": ("tiny-llama", {}, (1, 1, 4), (2, 2, 1)),
    "gpt2-tp2dp2-to-pp2dp2": ("tiny-gpt2", {}, (2, 1, 2), (1, 2, 2)),
    "gpt2-tp4-to-tp2dp2": ("tiny-gpt2", {}, (4, 1, 1), (2, 1, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_writes_what_the_whole_model_route_wrote(tmp_path, case):
    preset, overrides, (tp, pp, dp), (ttp, tpp, tdp) = CASES[case]
    config = model_config(preset, **overrides)
    saved = ParallelDims(world=tp * pp * dp, tp=tp, pp=pp, zero_stage=1)
    target = ParallelDims(world=ttp * tpp * tdp, tp=ttp, pp=tpp, zero_stage=1)
    dense = write_checkpoint(tmp_path / "new" / TAG, config, saved)
    old = old_reshard(linked_copy(tmp_path / "new", tmp_path / "old"), config, saved=saved, target=target)
    name = reshard(tmp_path / "new", TAG, config, saved=saved, target=target)
    new = tmp_path / "new" / name
    assert name == old.name and not list((tmp_path / "new").glob("*.partial"))
    assert assert_same_files(new, old) == 1 + 4 * len(dense)
    assert sorted(p.name for p in new.glob("*.pt")) == sorted(p.name for p in (tmp_path / "new" / TAG).glob("mp_*"))
    names = LayoutNames(config, target)
    for hf, states in dense.items():
        for key, value in states.items():
            stored = torch.load(new / "zero" / names.from_hf(hf) / f"{key}.pt", weights_only=False)
            if CAT_DIM not in stored:  # whole: replicated, or at tp 1
                assert torch.equal(stored[PARAM], value), (hf, key)


def test_shares_written_by_several_ranks_make_the_same_files(tmp_path):
    """A job's ranks each write a share (here three ranks, one after the other, as processes would):
    every parameter once, about a third of the elements each, and the committed folder is the one
    process's, file for file."""
    from dsframework.checkpoints.reshard import Resharding, share_of

    config = model_config("tiny-llama", vocab_size=17)
    saved = ParallelDims(world=8, tp=2, pp=2, zero_stage=1)
    target = ParallelDims(world=4, tp=2, zero_stage=1)
    dense = write_checkpoint(tmp_path / "one" / TAG, config, saved)
    linked_copy(tmp_path / "one", tmp_path / "shared")
    alone = tmp_path / "one" / reshard(tmp_path / "one", TAG, config, saved=saved, target=target)

    job = Resharding.plan(tmp_path / "shared", TAG, config, saved=saved, target=target)
    shares = [share_of(job.conversion.shapes, rank, 3) for rank in range(3)]
    assert sorted(sum(shares, [])) == sorted(job.conversion.shapes)
    elements = [sum(job.conversion.shapes[hf].numel() for hf in share) for share in shares]
    largest = max(shape.numel() for shape in job.conversion.shapes.values())
    assert max(elements) - min(elements) <= largest, elements
    job.clear()
    for rank in range(3):
        job.write_share(rank=rank, world=3)
    assert not (tmp_path / "shared" / job.name).exists(), "not whole before the commit"
    assert job.commit() == alone.name
    assert assert_same_files(tmp_path / "shared" / job.name, alone) == 1 + 4 * len(dense)
    assert Resharding.plan(tmp_path / "shared", TAG, config, saved=saved, target=target) is None


# --- memory ------------------------------------------------------------------------------------------

MID_LLAMA = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 12,
             "num_attention_heads": 8, "num_key_value_heads": 4}  # 44M parameters, the largest 8192 x 512
MID_SAVED, MID_TARGET = ParallelDims(world=8, tp=2, pp=2, zero_stage=1), ParallelDims(world=8, zero_stage=1)


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_growth(convert) -> int | None:
    """How far this process's peak resident memory rises above its resident size while `convert`
    runs (the kernel's peak reset first); None where it cannot be reset."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        return None
    baseline = status_bytes("VmRSS")
    convert()
    return status_bytes("VmHWM") - baseline


def measure(ckpt_dir: str, old_dir: str) -> None:
    """In a fresh process (`python test_reshard_stream.py CKPT OLD`): the peak growth of `reshard` on
    CKPT, then of the route before on OLD (the same checkpoint), as json on the last line."""
    torch.set_num_threads(1)
    config = model_config("tiny-llama", **MID_LLAMA)
    _tensor_layouts(config, 2)  # the model's transformers code, imported before the baseline
    streamed = peak_growth(lambda: reshard(ckpt_dir, TAG, config, saved=MID_SAVED, target=MID_TARGET))
    whole = peak_growth(lambda: old_reshard(Path(old_dir), config, saved=MID_SAVED, target=MID_TARGET))
    print(json.dumps({"streamed": streamed, "whole": whole}))


@pytest.mark.distributed  # a fresh python process measures the conversion
def test_peak_memory_is_a_few_parameters_not_the_model(tmp_path):
    config = model_config("tiny-llama", **MID_LLAMA)
    shapes = hf_parameter_shapes(config)
    largest = 4 * max(shape.numel() for shape in shapes.values())
    states = 12 * sum(shape.numel() for shape in shapes.values())
    bound = 4 * largest + 64_000_000
    assert states > 3 * bound, "the model's states must be well above the bound, or the test could not fail"
    write_checkpoint(tmp_path / "new" / TAG, config, MID_SAVED)
    linked_copy(tmp_path / "new", tmp_path / "old")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "new"), str(tmp_path / "old")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["streamed"] is None:
        pytest.skip("the kernel's peak RSS cannot be reset here (/proc/self/clear_refs)")
    print(f"\n{sum(s.numel() for s in shapes.values()) / 1e6:.0f}M parameters, states {states / 1e6:.0f} MB: "
          f"peak RSS growth {got['streamed'] / 1e6:.0f} MB streamed, {got['whole'] / 1e6:.0f} MB the whole model "
          f"(bound {bound / 1e6:.0f} MB = 4 x {largest / 1e6:.1f} MB + 64 MB)")
    assert got["streamed"] < bound, got
    assert got["whole"] > states, "the route before holds the whole model's states (what the bound tells apart)"


if __name__ == "__main__":
    measure(*sys.argv[1:])
