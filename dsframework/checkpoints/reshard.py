"""Resume at another layout: a ZeRO-1/2 checkpoint saved at one tp x pp x dp, resharded for another.

    from dsframework.checkpoints.reshard import reshard
    tag = reshard(ckpt_dir, "global_step4", config, target=ParallelDims(world=4, zero_stage=1))
    # -> "global_step4.universal-tp1pp1dp4"; the saved layout (tp 2 x pp 2) is read from its manifest
    ds_config["checkpoint"] = {"load_universal": True}        # every rank, before deepspeed.initialize
    engine.load_checkpoint(ckpt_dir, tag=tag)                 # weights, Adam moments, step, lr schedule

Rank 0 runs it once; the result is cached beside the checkpoint, written under `<name>.partial`
and renamed when complete. Nothing of the saved checkpoint is changed. The route, through the dense
(transformers) layout:

1. Read the saved ZeRO-1/2 optimizer partitions, `zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt`
   (mp = pipeline stage * tp + tensor rank): a parameter's fp32 weights, exp_avg and exp_avg_sq
   are its fragments in the data-parallel ranks' flat partitions, joined in dp order
   (`param_slice_mappings`: the arithmetic of deepspeed's ds_to_universal).
2. Name each tensor by its transformers name, the one name every layout shares:
   `model.layers.0.self_attn.q_proj.weight` (tp 1 x pp 1), `model.model.layers.0...` (tp > 1: the
   model inside `TensorParallelCausalLM`), `1.layer.self_attn.q_proj.weight` (pp > 1: layer index
   of the PipelineModule; `tied_modules.embed.*` for tied embeddings, one copy per end stage).
3. Put the tensor shards back where each shard's `dense_index` says (vocab padding dropped,
   GPT-2's per-head q|k|v rows re-interleaved, its Conv1D weights transposed back to [in, out]).
4. Write DeepSpeed's universal checkpoint, `zero/<name in the new layout>/{fp32,exp_avg,
   exp_avg_sq,step}.pt` and `zero/optimizer_state.pt`, beside the saved `mp_rank_*_model_states.pt`
   (lr schedule, step counters, dsf's client state) and `rng_rank*.pt`. DeepSpeed's own loader
   (`load_hp_checkpoint_state`) reads them: it chunks a stored 'param' along 'cat_dim' into tp
   pieces and takes its rank's, so a parameter sharded in the new layout is stored as the new
   ranks' shards, each cut from the dense tensor by the new layout's dense_index, concatenated
   along its partition dim: the chunk is exactly the rank's shard, padding and fused rows
   included. A replicated or tp-1 parameter is stored whole, which the loader copies as it is.
   Then ZeRO cuts each rank's share for the new dp, and copies the fp32 weights into the model.

Why not ds_to_universal with `universal_checkpoint_info` patterns: it keys its output by the saved
layout's parameter names, which the new engine does not have; its patterns describe Megatron's
layouts (row/column cat dims, trailing vocab padding, even sub-parameters) but not a Conv1D
weight stored transposed (a tensor of the right size is taken as it lies, silently wrong); and the
tied embedding's two pipeline copies write the same fragment files unless the checkpoint carried a
pipeline-replicated pattern. dsf keeps ds_to_universal for what it does exactly: a dp-only change
at tp = pp = 1 (`checkpoint.to_universal`, ZeRO-1/2/3).

Rank 0 holds the model's fp32 weights and both Adam moments in host memory while it converts
(from all tensor and pipeline ranks): 12 bytes a parameter on one host, once per layout change.
Unlike construction and export, this step is not yet streamed one parameter at a time.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    CAT_DIM,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARAM_SLICE_MAPPINGS,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)

from dsframework.checkpoints.checkpoint import MANIFEST, PARTIAL, UNIVERSAL, read_manifest, saved_layout
from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.models.hf import hf_parameter_shapes
from dsframework.models.tensor_parallel import merge_tensor_parallel_tensor, shard_layouts
from dsframework.parallel.pipeline import hf_names, pipeline_layer_specs

States = dict[str, torch.Tensor]  # state name ("fp32", "exp_avg", ...) -> tensor


def universal_tag(tag: str, dims: ParallelDims) -> str:
    """The name `tag` resharded for `dims` is cached under: global_step4.universal-tp1pp1dp4."""
    return f"{tag}{UNIVERSAL}-tp{dims.tp}pp{dims.pp}dp{dims.dp}"


# --- names: one layout's parameter names <-> transformers names ---------------------------------

def _pipeline_paths(config: Any) -> dict[str, str]:
    """{PipelineModule module path: transformers module path}: '3.layer' -> 'model.layers.2',
    'tied_modules.embed.embed_tokens' -> 'model.embed_tokens' (the copy on either end stage)."""
    paths = {}
    for idx, spec in enumerate(pipeline_layer_specs(config)):
        owner = f"tied_modules.{spec.key}" if hasattr(spec, "key") else str(idx)
        for child, hf in hf_names(spec).items():
            if hf:  # () for buffer-only children (rotary_emb) and dropout
                paths[f"{owner}.{child}"] = hf[0]  # hf[1:]: tied second names (lm_head)
    return paths


def _swap_prefix(name: str, table: dict[str, str]) -> str:
    """`name` with its longest module path found in `table` replaced by that entry's value."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:cut])
        if head in table:
            return ".".join([table[head], *parts[cut:]])
    raise KeyError(name)


class LayoutNames:
    """A layout's parameter names (as its DeepSpeed engine names them) <-> transformers names."""

    def __init__(self, config: Any, dims: ParallelDims):
        self.tp_wrapped = dims.tp_enabled and not dims.pp_enabled  # TensorParallelCausalLM(.model)
        self.to_hf_paths = _pipeline_paths(config) if dims.pp_enabled else {}
        self.from_hf_paths = {hf: path for path, hf in self.to_hf_paths.items()}

    def to_hf(self, name: str) -> str:
        if self.to_hf_paths:
            return _swap_prefix(name, self.to_hf_paths)
        return name.removeprefix("model.") if self.tp_wrapped else name

    def from_hf(self, name: str) -> str:
        if self.from_hf_paths:
            return _swap_prefix(name, self.from_hf_paths)
        return "model." + name if self.tp_wrapped else name


def _tensor_layouts(config: Any, tp: int) -> list[dict[str, tuple[int, torch.Tensor, bool]]]:
    """Per tensor rank, {transformers name: (partition dim, dense index, transposed)} of every
    sharded parameter (models.tensor_parallel.shard_layouts); [{}] at tp 1."""
    if tp == 1:
        return [{}]

    return shard_layouts(config, tp)


# --- dense <-> shards -----------------------------------------------------------------------------

def concatenated_shards(dense: torch.Tensor, layouts: list[tuple[int, torch.Tensor, bool]]) -> torch.Tensor:
    """Every tensor rank's shard of `dense`, concatenated along the partition dim in rank order
    (padding slices zero): what `torch.chunk(tp, dim)` cuts back into the shards."""
    dim, _, transposed = layouts[0]
    base = dense.t() if transposed else dense
    parts = []
    for _, index, _ in layouts:
        part = base.index_select(dim, index.clamp(min=0))
        padding = (index < 0).nonzero().flatten()
        if padding.numel():
            part.index_fill_(dim, padding, 0)
        parts.append(part)
    return torch.cat(parts, dim)


# --- reading the saved ZeRO partitions ------------------------------------------------------------

def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def _required(path: Path, fix: str) -> Path:
    if not path.is_file():
        raise UserError("checkpoint file", str(path), "is missing, and resharding to another layout reads "
                        "every saved rank's model and optimizer files", fix)
    return path


def _optim_file(tag_dir: Path, *, dp: int, mp: int, fix: str) -> Path:
    name = f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
    for prefix in ("", "bf16_"):  # DeepSpeed names its files bf16_zero_... under bf16
        if (tag_dir / (prefix + name)).is_file():
            return tag_dir / (prefix + name)
    return _required(tag_dir / name, fix)


def read_partitions(tag_dir: Path, saved: ParallelDims, *, fix: str) -> tuple[list[dict[str, States]], Any, dict]:
    """Per tensor rank {saved parameter name: {state: that rank's whole shard}}, the optimizer
    step, and the optimizer's global state (loss scaler, param groups: zero/optimizer_state.pt)."""
    shards: list[dict[str, States]] = [{} for _ in range(saved.tp)]
    common, step = None, None
    for mp in range(saved.tp * saved.pp):
        model_states = _load(_required(tag_dir / f"mp_rank_{mp:02d}_model_states.pt", fix))
        shapes = {name: shape for group in model_states[PARAM_SHAPES] for name, shape in group.items()}
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
        for dp in range(saved.dp):
            path = _optim_file(tag_dir, dp=dp, mp=mp, fix=fix)
            optim = _load(path)[OPTIMIZER_STATE_DICT]
            if PARAM_SLICE_MAPPINGS not in optim:
                raise UserError("checkpoint file", str(path), "holds no param_slice_mappings (not a ZeRO-1/2 "
                                "partition of DeepSpeed >= 0.10), so it cannot be resharded", fix)
            states = optim[BASE_OPTIMIZER_STATE]["state"]
            if common is None:
                common = {k: v for k, v in optim.items()
                          if k not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)}
                common[PARAM_GROUPS] = optim[BASE_OPTIMIZER_STATE][PARAM_GROUPS]
                step = states[0].get("step") if states else None
            for group, mapping in enumerate(optim[PARAM_SLICE_MAPPINGS]):
                fp32 = optim[SINGLE_PARTITION_OF_FP32_GROUPS][group]
                flat = {"fp32": fp32, **{key: value for key, value in states.get(group, {}).items()  # Adam's moments
                                         if torch.is_tensor(value) and value.shape == fp32.shape}}
                for name, fragment in mapping.items():
                    for key, tensor in flat.items():
                        pieces.setdefault(name, {}).setdefault(key, []).append(
                            tensor.narrow(0, fragment.start, fragment.numel))
        rank = shards[mp % saved.tp]
        for name, states_of in pieces.items():
            if name not in rank:  # a tied copy on the last stage: the same values as the first's
                rank[name] = {key: torch.cat(parts).view(shapes[name]) for key, parts in states_of.items()}
    return shards, step, common


def dense_states(config: Any, saved: ParallelDims, shards: list[dict[str, States]], *,
                 where: Path, fix: str) -> dict[str, States]:
    """{transformers name: {state: dense tensor}} for every parameter of the model."""
    names = LayoutNames(config, saved)
    layouts = _tensor_layouts(config, saved.tp)
    by_hf = [{names.to_hf(name): shard for name, shard in rank.items()} for rank in shards]
    expected = hf_parameter_shapes(config)
    dense: dict[str, States] = {}
    for hf, shape in expected.items():
        if any(hf not in rank for rank in by_hf):
            missing = sum(name not in by_hf[0] for name in expected)
            raise UserError("checkpoint", str(where), f"holds no optimizer state for {hf} ({missing} of the "
                            f"model's {len(expected)} parameters missing)",
                            "resume with the model the checkpoint was saved with")
        if hf in layouts[0]:
            dense[hf] = {key: merge_tensor_parallel_tensor(hf, [rank[hf][key] for rank in by_hf], layouts)
                         for key in by_hf[0][hf]}
        else:
            dense[hf] = by_hf[0][hf]  # replicated: the same on every tensor rank
        got = dense[hf]["fp32"].shape
        if got != shape:
            raise UserError("checkpoint", str(where), f"holds {hf} as {tuple(got)}, the model has {tuple(shape)}",
                            fix)
    return dense


# --- writing the universal checkpoint for the new layout -----------------------------------------

def write_universal(out: Path, config: Any, target: ParallelDims, dense: dict[str, States], *, step: Any,
                    common: dict) -> None:
    """zero/<name in the target layout>/<state>.pt for every parameter, and zero/optimizer_state.pt."""
    names = LayoutNames(config, target)
    layouts = _tensor_layouts(config, target.tp)
    zero = out / "zero"
    for hf, states in dense.items():
        folder = zero / names.from_hf(hf)
        folder.mkdir(parents=True)
        for key, tensor in states.items():
            if hf in layouts[0]:
                per_rank = [layout[hf] for layout in layouts]
                entry = {PARAM: concatenated_shards(tensor, per_rank), CAT_DIM: per_rank[0][0]}
            else:
                entry = {PARAM: tensor}
            torch.save(entry, folder / f"{key}.pt")
        if step is not None:
            torch.save(step, folder / "step.pt")
    torch.save(common, zero / "optimizer_state.pt")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # checkpoint files are never written again: a hard link is a copy
    except OSError:
        shutil.copy2(src, dst)


def reshard(ckpt_dir: str | Path, tag: str, config: Any, *, target: ParallelDims,
            saved: ParallelDims | None = None) -> str:
    """Write `tag` (ZeRO-1/2) as a universal checkpoint for `target`, once; returns its tag.
    `config`: the transformers config of the model (the checkpoint's); `saved`: the layout it was
    saved at, read from its manifest when None."""
    ckpt_dir = Path(ckpt_dir)
    saved = saved or saved_layout(read_manifest(ckpt_dir, tag), zero_stage=target.zero_stage)
    if saved is None:
        raise UserError("checkpoint", str(ckpt_dir / tag), f"has no {MANIFEST}, so the layout it was saved at is "
                        "unknown", "resume it at the layout it was saved at")
    name = universal_tag(tag, target)
    out = ckpt_dir / name
    if out.is_dir():  # renamed into place only when complete
        return name
    source = ckpt_dir / tag
    fix = (f"restore it, or resume at the saved layout (parallel.tp={saved.tp}, parallel.pp={saved.pp} "
           f"on {saved.world} ranks)")
    shards, step, common = read_partitions(source, saved, fix=fix)
    dense = dense_states(config, saved, shards, where=source, fix=fix)
    del shards
    tmp = ckpt_dir / (name + PARTIAL)
    shutil.rmtree(tmp, ignore_errors=True)
    write_universal(tmp, config, target, dense, step=step, common=common)
    for path in sorted(source.iterdir()):
        if (path.name.startswith("mp_rank_") and path.name.endswith("_model_states.pt")
                or path.name.startswith("rng_rank") or path.name == MANIFEST):
            _link_or_copy(path, tmp / path.name)
    os.replace(tmp, out)
    return name
