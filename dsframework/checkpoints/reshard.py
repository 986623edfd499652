"""Resume at another layout: a ZeRO-1/2 checkpoint saved at one tp x pp x dp, resharded for another.

    from dsframework.checkpoints.reshard import reshard
    tag = reshard(ckpt_dir, "global_step4", config, target=ParallelDims(world=4, zero_stage=1))
    # -> "global_step4.universal-tp1pp1dp4"; the saved layout (tp 2 x pp 2) is read from its manifest
    ds_config["checkpoint"] = {"load_universal": True}        # every rank, before deepspeed.initialize
    engine.load_checkpoint(ckpt_dir, tag=tag)                 # weights, Adam moments, step, lr schedule

`reshard` converts in one process; a resuming job's ranks share the work (`Resharding`, below).
The result is cached beside the checkpoint, written under `<name>.partial` and renamed when
complete. Nothing of the saved checkpoint is changed. The route, through the dense
(transformers) layout, one parameter and one of its states at a time:

1. Open the saved ZeRO-1/2 optimizer partitions, `zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt`
   (mp = pipeline stage * tp + tensor rank), memory-mapped, and index them: a parameter's fp32
   weights, exp_avg and exp_avg_sq are its fragments in the data-parallel ranks' flat partitions,
   joined in dp order (`param_slice_mappings`: the arithmetic of deepspeed's ds_to_universal).
   A fragment is copied out when its parameter is converted, and the files' pages are then handed
   back (export's `_drop_mapped_pages`).
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

Memory: one state of one parameter is held at a time, as its saved shards, then dense, then cut
for the new layout (about 3 x that tensor at the peak), so the converting process grows by less
than 4 x the largest parameter's fp32 bytes plus 64 MB, whatever the model's size: a 374M-parameter
Llama saved at tp 2 x pp 2 grows it by 342 MB for dp 4 and 411 MB for tp 2 x dp 2 (the bound: 588 MB;
12 GB when the whole model was held; bench/reshard_memory.py). The fp32 partitions are Parameters:
they are read without autograd, or its graph would keep every temporary alive.

Every rank of the resuming job converts a share of the parameters, about 1/world of the model's
elements each (`share_of`; `Resharding`, driven by train/setup.reshard_in_shares): rank 0 clears
the folder first, and writes zero/optimizer_state.pt and renames it into place once every share is
written. The result is the same files, bit for bit, whichever ranks wrote them.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

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
from dsframework.checkpoints.export import _drop_mapped_pages
from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.models.hf import hf_parameter_shapes
from dsframework.models.tensor_parallel import merge_tensor_parallel_tensor, shard_layouts
from dsframework.models.pipeline import hf_names, pipeline_layer_specs
from dsframework.types import HFConfig

States = dict[str, torch.Tensor]  # state name ("fp32", "exp_avg", ...) -> tensor


def universal_tag(tag: str, dims: ParallelDims) -> str:
    """The name `tag` resharded for `dims` is cached under: global_step4.universal-tp1pp1dp4."""
    return f"{tag}{UNIVERSAL}-tp{dims.tp}pp{dims.pp}dp{dims.dp}"


# --- names: one layout's parameter names <-> transformers names ---------------------------------

def _pipeline_paths(config: HFConfig) -> dict[str, str]:
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

    def __init__(self, config: HFConfig, dims: ParallelDims):
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


def _tensor_layouts(config: HFConfig, tp: int) -> list[dict[str, tuple[int, torch.Tensor, bool]]]:
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


# --- reading the saved ZeRO partitions, memory-mapped ---------------------------------------------

def _load(path: Path) -> Any:
    """torch.load(mmap=True): the file's tensors are views of its pages, read only when used."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


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


def _flat_states(optim: dict, group: int) -> States:
    """One parameter group's flat partition of one dp rank: fp32 weights and Adam's moments."""
    fp32 = optim[SINGLE_PARTITION_OF_FP32_GROUPS][group]
    states = optim[BASE_OPTIMIZER_STATE]["state"].get(group, {})
    return {"fp32": fp32, **{key: value for key, value in states.items()
                             if torch.is_tensor(value) and value.shape == fp32.shape}}


class Fragment(NamedTuple):
    """A parameter's elements in one dp rank's flat partitions: `numel` from `start` of each state."""
    flat: States
    start: int
    numel: int
    file: str  # the partition file, memory-mapped (its pages handed back once read)


class SavedPartitions:
    """The saved ZeRO-1/2 optimizer partitions of every (dp, mp) rank, memory-mapped and indexed
    (mp = pipeline stage * tp + tensor rank): per tensor rank, {saved parameter name: (shape, its
    fragments in dp order)}, the optimizer step and its global state. Nothing of the states is read
    until `read`, which copies one tensor rank's shard of one state and hands the pages back."""

    def __init__(self, tag_dir: Path, saved: ParallelDims, *, fix: str):
        self.ranks: list[dict[str, tuple[torch.Size, list[Fragment]]]] = [{} for _ in range(saved.tp)]
        self.step: Any = None
        self.common: dict | None = None
        for mp in range(saved.tp * saved.pp):
            rank = self.ranks[mp % saved.tp]
            for name, entry in self._index(tag_dir, saved, mp=mp, fix=fix).items():
                rank.setdefault(name, entry)  # a tied copy on the last stage: the same values as the first's

    def _open(self, path: Path, *, fix: str) -> dict:
        optim = _load(path)[OPTIMIZER_STATE_DICT]
        if PARAM_SLICE_MAPPINGS not in optim:
            raise UserError("checkpoint file", str(path), "holds no param_slice_mappings (not a ZeRO-1/2 "
                            "partition of DeepSpeed >= 0.10), so it cannot be resharded", fix)
        if self.common is None:  # the first file's: the same in every one
            base = optim[BASE_OPTIMIZER_STATE]
            self.common = {k: v for k, v in optim.items()
                           if k not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)}
            self.common[PARAM_GROUPS] = base[PARAM_GROUPS]
            self.step = base["state"][0].get("step") if base["state"] else None
        return optim

    def _index(self, tag_dir: Path, saved: ParallelDims, *, mp: int,
               fix: str) -> dict[str, tuple[torch.Size, list[Fragment]]]:
        """{saved parameter name: (shape, fragments)} of model-parallel rank `mp`."""
        model_states = _load(_required(tag_dir / f"mp_rank_{mp:02d}_model_states.pt", fix))
        shapes = {name: shape for group in model_states[PARAM_SHAPES] for name, shape in group.items()}
        del model_states  # unmapped: only its parameter shapes are used
        fragments: dict[str, list[Fragment]] = {}
        for dp in range(saved.dp):
            path = _optim_file(tag_dir, dp=dp, mp=mp, fix=fix)
            optim, file = self._open(path, fix=fix), str(path.resolve())
            for group, mapping in enumerate(optim[PARAM_SLICE_MAPPINGS]):
                flat = _flat_states(optim, group)
                for name, fragment in mapping.items():
                    fragments.setdefault(name, []).append(Fragment(flat, fragment.start, fragment.numel, file))
        return {name: (shapes[name], parts) for name, parts in fragments.items()}

    def keys(self, rank: int, name: str) -> dict[str, bool]:
        """{state saved of parameter `name` of tensor rank `rank` ("fp32", "exp_avg", ...): whether it
        requires grad} (DeepSpeed's fp32 partitions are Parameters: written so, read without autograd)."""
        keys: dict[str, bool] = {}
        for fragment in self.ranks[rank][name][1]:
            for key, tensor in fragment.flat.items():
                keys.setdefault(key, tensor.requires_grad)
        return keys

    @torch.no_grad()  # the fp32 partitions are Parameters: a graph through them would keep every temporary alive
    def read(self, rank: int, name: str, key: str) -> torch.Tensor:
        """State `key` of tensor rank `rank`'s whole shard of `name`, in memory of its own, without
        autograd history."""
        shape, fragments = self.ranks[rank][name]
        held = [fragment for fragment in fragments if key in fragment.flat]
        tensor = torch.cat([fragment.flat[key].narrow(0, fragment.start, fragment.numel) for fragment in held])
        _drop_mapped_pages(frozenset(fragment.file for fragment in held))
        return tensor.view(shape)


# --- one parameter at a time: saved shards -> dense -> the new layout's universal files ----------

class Conversion:
    """What converting a parameter needs: the saved partitions, each transformers parameter's saved
    names (one per tensor rank) and shape, and both layouts' tensor shards and names."""

    def __init__(self, config: HFConfig, saved: ParallelDims, target: ParallelDims, partitions: SavedPartitions, *,
                 where: Path, fix: str):
        self.partitions, self.where, self.fix = partitions, where, fix
        self.saved_layouts, self.target_layouts = _tensor_layouts(config, saved.tp), _tensor_layouts(config, target.tp)
        self.target_names = LayoutNames(config, target)
        names = LayoutNames(config, saved)
        by_hf = [{names.to_hf(name): name for name in rank} for rank in partitions.ranks]
        self.shapes = hf_parameter_shapes(config)
        missing = [hf for hf in self.shapes if any(hf not in rank for rank in by_hf)]
        if missing:
            raise UserError("checkpoint", str(where), f"holds no optimizer state for {missing[0]} ({len(missing)} "
                            f"of the model's {len(self.shapes)} parameters missing)",
                            "resume with the model the checkpoint was saved with")
        self.saved_names = {hf: [rank[hf] for rank in by_hf] for hf in self.shapes}

    def dense(self, hf: str, key: str) -> torch.Tensor:
        """State `key` of parameter `hf`, dense: the saved tensor ranks' shards merged (one at a time)."""
        saved = self.saved_names[hf]
        if hf not in self.saved_layouts[0]:
            return self.partitions.read(0, saved[0], key)  # replicated: the same on every tensor rank
        shards = [self.partitions.read(rank, name, key) for rank, name in enumerate(saved)]
        return merge_tensor_parallel_tensor(hf, shards, self.saved_layouts)

    def entry(self, hf: str, dense: torch.Tensor) -> dict:
        """What the universal loader reads of one state: the dense tensor, or the new ranks' shards."""
        if hf not in self.target_layouts[0]:
            return {PARAM: dense}
        per_rank = [layout[hf] for layout in self.target_layouts]
        return {PARAM: concatenated_shards(dense, per_rank), CAT_DIM: per_rank[0][0]}

    def write(self, zero: Path, hf: str) -> None:
        """zero/<name in the new layout>/<state>.pt of one parameter, one state in memory at a time."""
        folder = zero / self.target_names.from_hf(hf)
        folder.mkdir(parents=True)
        for key, requires_grad in self.partitions.keys(0, self.saved_names[hf][0]).items():
            dense = self.dense(hf, key)
            if dense.shape != self.shapes[hf]:
                raise UserError("checkpoint", str(self.where), f"holds {hf} as {tuple(dense.shape)}, the model has "
                                f"{tuple(self.shapes[hf])}", self.fix)
            entry = self.entry(hf, dense)
            del dense
            entry[PARAM].requires_grad_(requires_grad)  # as saved (the loader copies the values alone)
            torch.save(entry, folder / f"{key}.pt")
            del entry
        if self.partitions.step is not None:
            torch.save(self.partitions.step, folder / "step.pt")


def share_of(shapes: dict[str, torch.Size], rank: int, world: int) -> list[str]:
    """The parameters rank `rank` of `world` converts: the largest first, each to the rank with the
    fewest elements so far, so every rank converts about 1/world of the model (and no rank two of its
    largest tensors when there are as many ranks as those)."""
    load, mine = [0] * world, []
    for hf in sorted(shapes, key=lambda name: (-shapes[name].numel(), name)):
        least = min(range(world), key=lambda r: (load[r], r))
        load[least] += shapes[hf].numel()
        if least == rank:
            mine.append(hf)
    return mine


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # checkpoint files are never written again: a hard link is a copy
    except OSError:
        shutil.copy2(src, dst)


class Resharding:
    """One conversion of a saved tag into the universal tag of another layout, in three parts so the
    ranks of a job can share it (train/setup.reshard_in_shares): `clear` (once, first), `write_share`
    (each rank its share of the parameters, into `<name>.partial`) and `commit` (once, last: the
    common optimizer state, the model-state files linked, the rename that makes it whole).

        job = Resharding.plan(ckpt_dir, "global_step4", config, target=dims)  # None: already there
        job.clear(); job.write_share(rank=0, world=1); job.commit()
    """

    def __init__(self, ckpt_dir: Path, tag: str, name: str, conversion: Conversion):
        self.source, self.name, self.conversion = ckpt_dir / tag, name, conversion
        self.out, self.tmp = ckpt_dir / name, ckpt_dir / (name + PARTIAL)

    @classmethod
    def plan(cls, ckpt_dir: str | Path, tag: str, config: HFConfig, *, target: ParallelDims,
             saved: ParallelDims | None = None) -> "Resharding | None":
        """The conversion of `tag` for `target`, or None when its universal tag is already whole.
        `config`: the checkpoint's transformers config; `saved`: its layout (its manifest's when None)."""
        ckpt_dir = Path(ckpt_dir)
        saved = saved or saved_layout(read_manifest(ckpt_dir, tag), zero_stage=target.zero_stage)
        if saved is None:
            raise UserError("checkpoint", str(ckpt_dir / tag), f"has no {MANIFEST}, so the layout it was saved at "
                            "is unknown", "resume it at the layout it was saved at")
        name = universal_tag(tag, target)
        if (ckpt_dir / name).is_dir():  # renamed into place only when complete
            return None
        fix = (f"restore it, or resume at the saved layout (parallel.tp={saved.tp}, parallel.pp={saved.pp} "
               f"on {saved.world} ranks)")
        source = ckpt_dir / tag
        partitions = SavedPartitions(source, saved, fix=fix)
        return cls(ckpt_dir, tag, name, Conversion(config, saved, target, partitions, where=source, fix=fix))

    def clear(self) -> None:
        """Remove what an interrupted conversion left."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write_share(self, *, rank: int, world: int) -> None:
        """The folders of this rank's share of the parameters (`share_of`), one parameter at a time."""
        zero = self.tmp / "zero"
        for hf in share_of(self.conversion.shapes, rank, world):
            self.conversion.write(zero, hf)

    def commit(self) -> str:
        """After every share is written: zero/optimizer_state.pt, the saved model-state, RNG and
        manifest files linked in, and the rename; returns the universal tag."""
        zero = self.tmp / "zero"
        zero.mkdir(parents=True, exist_ok=True)
        torch.save(self.conversion.partitions.common, zero / "optimizer_state.pt")
        for path in sorted(self.source.iterdir()):
            if (path.name.startswith("mp_rank_") and path.name.endswith("_model_states.pt")
                    or path.name.startswith("rng_rank") or path.name == MANIFEST):
                _link_or_copy(path, self.tmp / path.name)
        os.replace(self.tmp, self.out)
        return self.name


def reshard(ckpt_dir: str | Path, tag: str, config: HFConfig, *, target: ParallelDims,
            saved: ParallelDims | None = None) -> str:
    """Write `tag` (ZeRO-1/2) as a universal checkpoint for `target`, once, in this process alone;
    returns its tag. `config`: the transformers config of the model (the checkpoint's); `saved`: the
    layout it was saved at, read from its manifest when None."""
    job = Resharding.plan(ckpt_dir, tag, config, target=target, saved=saved)
    if job is None:
        return universal_tag(tag, target)
    job.clear()
    try:
        job.write_share(rank=0, world=1)
        return job.commit()
    except BaseException:
        job.clear()  # nothing half-written is left
        raise
