"""Expert-parallel (DeepSpeed AutoEP) checkpoints under transformers' names, for `dsf export`.

    layers = autoep_layers(tag_dir)             # None: not an AutoEP checkpoint
    entries = expert_checkpoint_entries(ckpt_dir, tag, config)   # {HF name: unread tensor}

AutoEP replaces each MoE block (`model.layers.N.mlp`) by its own: the router as `router.gate`
(aliased `gate.gate`), the routed experts as grouped tensors `experts.w1` (gate), `experts.w3` (up)
[E, ffn, hidden] and `experts.w2` (down) [E, hidden, ffn], each rank holding E / ep of them
(`deepspeed/moe/ep_repack.py`). transformers' fused layout (Mixtral, Qwen3-MoE, DeepSeek in 5.x)
is `gate.weight`, `experts.gate_up_proj` [E, 2 ffn, hidden] (gate rows first) or [E, hidden,
2 ffn], and `experts.down_proj` [E, hidden, ffn] or [E, ffn, hidden]: the inverse of that repack.

Every tensor is read when export writes it, from the checkpoint's files memory-mapped (as export's
other paths: about one output shard plus one tensor in memory):
- ZeRO 1-3: the fp32 masters in the ranks' optimizer files. A weight is the run of its pieces in
  partition order: at ZeRO-1/2 the fragments each rank's file records (`param_slice_mappings`), at
  ZeRO-3 each rank's padded share of its sub-group (`ds_zero_partition_groups`: the data-parallel
  ranks, or an expert's expert-data ranks); an expert weight [E, ...] is ep rank 0's run, then ep rank
  1's, ... (AutoEP's contiguous placement). These are the pieces DeepSpeed's universal conversion
  (ds_to_universal) joins, in its order: the export equals the one through it bit for bit;
- ZeRO-0: the module states (everything but the experts) and the per-expert files
  `layer_<L>_expert_<e>_mp_rank_00_model_states.pt`, stacked in expert order.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from dsframework.errors import UserError
from dsframework.models.hf import hf_parameter_shapes
from dsframework.types import HFConfig

_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
_ZERO_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_(?:model|optim)_states\.pt$")
_GROUPED = ("w1", "w2", "w3")


def autoep_layers(tag_dir: Path) -> list[dict] | None:
    """The `ds_autoep_layers` DeepSpeed saved with the model states (None: not an AutoEP run)."""
    files = (sorted(tag_dir.glob("mp_rank_00_model_states.pt"))
             or sorted(tag_dir.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")))
    if not files:
        return None
    return _load(files[0]).get("ds_autoep_layers") or None


def _load(path: Path) -> Any:
    """A checkpoint file memory-mapped: its pickle read, its tensors not until sliced and copied."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


class _Pieces:
    """One fp32 master weight, unread: its pieces (views of memory-mapped ZeRO partitions, padding cut
    off) joined in order and viewed as `shape`."""

    def __init__(self, pieces: list[torch.Tensor], shape: torch.Size):
        self.pieces, self.shape = pieces, shape

    def contiguous(self) -> torch.Tensor:
        return torch.cat(self.pieces).view(self.shape)


class _Stacked:
    """One grouped expert weight of a ZeRO-0 checkpoint, unread: expert e's from its own file, stacked."""

    def __init__(self, grouped: str, files: dict[int, Path]):
        self.grouped, self.files = grouped, files

    def contiguous(self) -> torch.Tensor:
        return torch.stack([_load(self.files[e])[f"{self.grouped}.{e}"] for e in sorted(self.files)])


class _Joined:
    """transformers' fused expert tensor from AutoEP's grouped ones: gate_up = [w1 | w3], down = w2,
    each transposed when transformers stores [E, in, out]; fp32. Each part is read, copied into the
    fused tensor and let go before the next."""

    def __init__(self, parts: list, *, dim: int, transpose: bool, shape: torch.Size):
        self.parts, self.dim, self.transpose, self.shape = parts, dim, transpose, shape

    def contiguous(self) -> torch.Tensor:
        joined, start = torch.empty(self.shape), 0  # host: export assembles on the CPU
        for part in self.parts:
            tensor = part.contiguous()
            tensor = tensor.transpose(1, 2) if self.transpose else tensor
            slab = joined.narrow(self.dim, start, min(tensor.shape[self.dim], self.shape[self.dim] - start))
            if slab.shape != tensor.shape:
                break
            slab.copy_(tensor)
            start += tensor.shape[self.dim]
        if start != self.shape[self.dim]:
            raise UserError("checkpoint", None, f"holds AutoEP experts of shape {tuple(tensor.shape)} that do not "
                            f"join into the config's {tuple(self.shape)}",
                            "export with the hf_config saved by the same run")
        return joined


def _expert_counts(layers: list[dict], where: str) -> dict[str, int]:
    """{grouped expert weight: experts} of AutoEP's layers, each placed as AutoEP places them by default
    (ep rank k holds experts k * E/ep ... (k+1) * E/ep - 1), the order a weight's runs are joined in."""
    counts = {}
    for layer in layers:
        experts, ep, local = layer["num_experts"], layer["ep_size"], layer["num_local_experts"]
        placement = layer.get("expert_placement")
        ranks = {entry["rank"]: list(entry["experts"]) for entry in (placement or {}).get("ranks", [])}
        if experts != local * ep or (placement and ranks != {k: list(range(k * local, (k + 1) * local))
                                                             for k in range(ep)}):
            raise ValueError(f"{where}: AutoEP places the experts of {layer['module_path']} other than evenly "
                             f"in order ({placement}); dsf export reads its default placement only")
        counts.update({f"{layer['expert_key_prefix']}.{w}": experts for w in _GROUPED})
    return counts


def _stitched(found: dict[str, dict[int, dict[int, torch.Tensor]]], shapes: dict[str, torch.Size],
              counts: dict[str, int], where: str) -> dict[str, _Pieces]:
    """{name: _Pieces} from {name: {ep rank: {partition rank: piece}}} (ep rank 0 for a dense weight):
    each ep rank's pieces in partition order, cut to its `shapes[name]` (padding dropped), ep ranks in
    order; an expert weight's shape is [experts, ...]."""
    entries = {}
    for name, runs in found.items():
        pieces, local = [], shapes[name]
        for ep_rank in sorted(runs):
            left = local.numel()
            for _, piece in sorted(runs[ep_rank].items()):
                pieces.append(piece[:left])
                left -= len(pieces[-1])
            if left:
                raise ValueError(f"{where}: the optimizer files hold {local.numel() - left} of the {local.numel()} "
                                 f"elements of {name} (ep rank {ep_rank})")
        shape = local
        if name in counts:
            shape = torch.Size([counts[name], *local[1:]])
            if sorted(runs) != list(range(counts[name] // local[0])):
                raise ValueError(f"{where}: {name} has the runs of ep ranks {sorted(runs)}, of shape {tuple(local)}")
        entries[name] = _Pieces(pieces, shape)
    return entries


def _rank_files(tag_dir: Path, kind: str) -> dict[int, Path]:
    """{data-parallel rank: its zero_pp_rank_<r>_mp_rank_00_<kind>_states.pt}."""
    files = {}
    for path in tag_dir.glob(f"zero_pp_rank_*_mp_rank_00_{kind}_states.pt"):
        match = _ZERO_FILE.match(path.name)
        assert match is not None, path  # the glob's names are the pattern's
        files[int(match.group(1))] = path
    return files


def _zero12_entries(tag_dir: Path, layers: list[dict]) -> dict[str, Any]:
    """{DeepSpeed name: unread tensor} of a ZeRO-1/2 AutoEP checkpoint: buffers and frozen weights from
    the model states, each trained weight from the fragments the ranks' optimizer files record. An
    expert weight's fragments are on its ep rank's expert-data ranks (which: ds_to_universal's rule)."""
    from deepspeed.checkpoint.autoep_universal import _autoep_zero12_dp_ranks

    states = _load(tag_dir / "mp_rank_00_model_states.pt")
    files = _rank_files(tag_dir, "optim")
    ep = max((layer["ep_size"] for layer in layers), default=1)
    before = bool(states["ds_config"].get("use_data_before_expert_parallelism", False))
    ep_rank = {rank: k for k in range(ep) for rank in _autoep_zero12_dp_ranks(k, len(files), ep, before)}
    counts = _expert_counts(layers, str(tag_dir))
    found: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    for rank, path in sorted(files.items()):
        optim = _load(path)["optimizer_state_dict"]
        for flat, fragments in zip(optim["single_partition_of_fp32_groups"], optim["param_slice_mappings"]):
            for name, fragment in fragments.items():
                run = found.setdefault(name, {}).setdefault(ep_rank[rank] if name in counts else 0, {})
                run[rank] = flat.narrow(0, fragment.start, fragment.numel)
    shapes = {name: torch.Size(shape) for group in states["param_shapes"] for name, shape in group.items()}
    entries: dict[str, Any] = {name: states["module"][name] for name in states["buffer_names"]}
    entries.update(states.get("frozen_param_fragments") or {})
    entries.update(_stitched(found, shapes, counts, str(tag_dir)))
    return _with_shared(entries, states)


def _with_shared(entries: dict[str, Any], states: dict) -> dict[str, Any]:
    """`entries` and, for each weight shared under a second name (`shared_params`), that name too."""
    for alias, name in (states.get("shared_params") or {}).items():
        if name in entries:
            entries[alias] = entries[name]
    return entries


def _zero3_entries(tag_dir: Path, layers: list[dict]) -> dict[str, Any]:
    """{DeepSpeed name: unread tensor} of a ZeRO-3 AutoEP checkpoint: buffers from rank 0's model states,
    each trained weight from the ranks' padded shares of its sub-group, in the order and over the ranks
    each rank's `ds_zero_partition_groups` names (an expert weight's: its ep rank's expert-data ranks)."""
    models, optims = _rank_files(tag_dir, "model"), _rank_files(tag_dir, "optim")
    first = _load(models[0])
    entries: dict[str, Any] = {name: first["module"][name] for name in first["buffer_names"]}
    found: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    shapes: dict[str, torch.Size] = {}
    for rank, path in sorted(models.items()):
        states, optim = _load(path), _load(optims[rank])["optimizer_state_dict"]
        if states.get("frozen_param_shapes"):
            raise UserError("checkpoint", str(tag_dir), "holds frozen weights beside AutoEP's ZeRO-3 partitions, "
                            "which dsf export does not read", "export a checkpoint whose weights all trained")
        ep_rank = {f"{layer['expert_key_prefix']}.{w}": layer["ep_rank"]
                   for layer in states["ds_autoep_layers"] for w in _GROUPED}
        groups = optim.get("ds_zero_partition_groups") or []
        for index, (group, flat) in enumerate(zip(states["param_shapes"], optim["fp32_flat_groups"])):
            partition = groups[index] if index < len(groups) else {}
            count, order = partition.get("partition_count", len(models)), partition.get("partition_rank", rank)
            offset = 0
            for name, shape in group.items():
                size = math.ceil(math.prod(shape) / count)
                found.setdefault(name, {}).setdefault(ep_rank.get(name, 0), {})[order] = flat.narrow(0, offset, size)
                shapes[name] = torch.Size(shape)
                offset += size
            if offset != flat.numel():
                raise ValueError(f"{path}: sub-group {index} holds {flat.numel()} elements, its shapes {offset}")
    entries.update(_stitched(found, shapes, _expert_counts(layers, str(tag_dir)), str(tag_dir)))
    return _with_shared(entries, first)


def _zero0_entries(tag_dir: Path) -> dict[str, Any]:
    """{DeepSpeed name: tensor or unread tensor} of a ZeRO-0 AutoEP checkpoint: the module states
    (memory-mapped) and each grouped expert weight stacked from the per-expert files."""
    entries: dict[str, Any] = dict(_load(tag_dir / "mp_rank_00_model_states.pt")["module"])
    per_expert: dict[str, dict[int, Path]] = {}
    for path in tag_dir.iterdir():
        if _EXPERT_FILE.match(path.name):
            for key in torch.load(path, map_location="cpu", mmap=True, weights_only=True):
                grouped, expert = key.rsplit(".", 1)  # 'model.layers.0.mlp.experts.w1', '3'
                per_expert.setdefault(grouped, {})[int(expert)] = path
    entries.update({grouped: _Stacked(grouped, files) for grouped, files in per_expert.items()})
    return entries


def expert_checkpoint_entries(ckpt_dir: Path, tag: str, config: HFConfig) -> dict[str, Any]:
    """{transformers name: tensor (memory-mapped) or unread tensor (`.contiguous()` reads it)} of an
    AutoEP checkpoint (any ZeRO stage; see the module docstring)."""
    tag_dir = ckpt_dir / tag
    layers = autoep_layers(tag_dir) or []
    if any(tag_dir.glob("zero_pp_rank_*_model_states.pt")):  # ZeRO-3: model states per rank
        raw = _zero3_entries(tag_dir, layers)
    elif any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):  # ZeRO-0 saves expp_rank_* optimizer files
        raw = _zero12_entries(tag_dir, layers)
    else:
        raw = _zero0_entries(tag_dir)
    return transformers_entries(raw, layers, config)


def transformers_entries(raw: dict[str, Any], layers: list[dict], config: HFConfig) -> dict[str, Any]:
    """{transformers name: unread tensor} from {AutoEP's name: unread tensor}: the router renamed
    (`router.gate` -> `gate`, its alias `gate.gate` dropped), each block's w1 | w3 and w2 joined into
    transformers' fused experts. A name AutoEP added that has no transformers counterpart is left in,
    under its own name, so that `weights_to_write` names it as unexpected rather than dropping a weight."""
    shapes = hf_parameter_shapes(config)
    entries: dict[str, Any] = {}
    blocks = [layer["module_path"] for layer in layers]
    for name, tensor in raw.items():
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is None:
            entries[name] = tensor
        elif name == f"{block}.router.gate.weight":
            entries[f"{block}.gate.weight"] = tensor
        elif name == f"{block}.gate.gate.weight" or name.startswith(f"{block}.experts."):
            continue  # the router's alias; the experts are joined below
        else:
            entries[name] = tensor
    for block in blocks:
        grouped = {w: raw[f"{block}.experts.{w}"] for w in _GROUPED}
        entries.update(_fused_experts(block, grouped, shapes))
    return entries


def _fused_experts(block: str, grouped: dict[str, Any], shapes: dict[str, torch.Size]) -> dict[str, _Joined]:
    """transformers' gate_up_proj and down_proj of one MoE block from AutoEP's w1, w3 and w2."""
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    gate_up, down = f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"
    if gate_up not in shapes or down not in shapes:
        raise UserError("checkpoint", block, "holds AutoEP experts, and the config's model has no fused "
                        "experts.gate_up_proj / experts.down_proj there", "export with the hf_config of the same run")
    layout = classify_fused_gate_up_layout(tuple(shapes[gate_up]), tuple(shapes[down]))
    if layout is None:
        raise UserError("checkpoint", block, f"has experts of shapes {tuple(shapes[gate_up])} and "
                        f"{tuple(shapes[down])}, a fused layout DeepSpeed's AutoEP does not know", "export at ep=1")
    transpose = layout.layout != "gate_up_first"  # [E, hidden, 2 ffn]: transformers' alternate fused layout
    return {gate_up: _Joined([grouped["w1"], grouped["w3"]], dim=2 if transpose else 1, transpose=transpose,
                             shape=shapes[gate_up]),
            down: _Joined([grouped["w2"]], dim=1, transpose=transpose, shape=shapes[down])}
