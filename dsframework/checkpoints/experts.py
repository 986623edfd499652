"""Expert-parallel (DeepSpeed AutoEP) checkpoints under transformers' names, for `dsf export`.

    layers = autoep_layers(tag_dir)             # None: not an AutoEP checkpoint
    entries = expert_checkpoint_entries(ckpt_dir, tag, config, scratch=tmp)   # {HF name: unread tensor}

AutoEP replaces each MoE block (`model.layers.N.mlp`) by its own: the router as `router.gate`
(aliased `gate.gate`), the routed experts as grouped tensors `experts.w1` (gate), `experts.w3` (up)
[E, ffn, hidden] and `experts.w2` (down) [E, hidden, ffn], each rank holding E / ep of them
(`deepspeed/moe/ep_repack.py`). transformers' fused layout (Mixtral, Qwen3-MoE, DeepSeek in 5.x)
is `gate.weight`, `experts.gate_up_proj` [E, 2 ffn, hidden] (gate rows first) or [E, hidden,
2 ffn], and `experts.down_proj` [E, hidden, ffn] or [E, ffn, hidden]: the inverse of that repack.

Where the whole experts come from:
- ZeRO 1-3: DeepSpeed's universal conversion (ds_to_universal knows AutoEP: each expert tensor is
  written whole, [E, ...], from the ep ranks' partitions), into a scratch directory: fp32 masters;
- ZeRO-0: the module states (everything but the experts) and the per-expert files
  `layer_<L>_expert_<e>_mp_rank_00_model_states.pt`, stacked in expert order.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from dsframework.checkpoints.checkpoint import to_universal
from dsframework.errors import UserError
from dsframework.models.hf import hf_parameter_shapes

_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")


def autoep_layers(tag_dir: Path) -> list[dict] | None:
    """The `ds_autoep_layers` DeepSpeed saved with the model states (None: not an AutoEP run)."""
    files = (sorted(tag_dir.glob("mp_rank_00_model_states.pt"))
             or sorted(tag_dir.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")))
    if not files:
        return None
    return torch.load(files[0], map_location="cpu", mmap=True, weights_only=False).get("ds_autoep_layers") or None


class _Loaded:
    """A tensor read from its file when needed, reshaped to `shape` (universal fp32 files of non-expert
    parameters hold them flat)."""

    def __init__(self, read: Any, shape: torch.Size | None):
        self.read_tensor, self.shape = read, shape

    def contiguous(self) -> torch.Tensor:
        value = self.read_tensor()
        return (value if self.shape is None else value.reshape(self.shape)).contiguous()


class _Joined:
    """transformers' fused expert tensor from AutoEP's grouped ones: gate_up = [w1 | w3], down = w2,
    each transposed when transformers stores [E, in, out]."""

    def __init__(self, parts: list, *, dim: int, transpose: bool, shape: torch.Size):
        self.parts, self.dim, self.transpose, self.shape = parts, dim, transpose, shape

    def contiguous(self) -> torch.Tensor:
        tensors = [part.contiguous() for part in self.parts]
        if self.transpose:
            tensors = [t.transpose(1, 2) for t in tensors]
        joined = torch.cat(tensors, dim=self.dim) if len(tensors) > 1 else tensors[0]
        if joined.shape != self.shape:
            raise UserError("checkpoint", None, f"holds experts of shape {tuple(joined.shape)} where the config has "
                            f"{tuple(self.shape)}", "export with the hf_config saved by the same run")
        return joined.contiguous()


def _universal_entries(ckpt_dir: Path, tag: str, scratch: Path) -> dict[str, Any]:
    out = scratch / "universal"
    out.mkdir(parents=True, exist_ok=True)
    universal = to_universal(ckpt_dir, tag, into=out)
    entries = {}
    for folder in sorted((out / universal / "zero").iterdir()):
        if (folder / "fp32.pt").is_file():
            def read(path=folder / "fp32.pt") -> torch.Tensor:
                value = torch.load(path, map_location="cpu", weights_only=False)
                return value["param"] if isinstance(value, dict) else value
            entries[folder.name] = read
    return entries


def _zero0_entries(tag_dir: Path) -> dict[str, Any]:
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True, weights_only=False)
    module = states["module"]
    entries: dict[str, Any] = {name: (lambda t=tensor: t.clone()) for name, tensor in module.items()}
    per_expert: dict[str, dict[int, Path]] = {}
    for path in tag_dir.iterdir():
        match = _EXPERT_FILE.match(path.name)
        if match:
            for key in torch.load(path, map_location="cpu", mmap=True, weights_only=True):
                grouped, expert = key.rsplit(".", 1)  # 'model.layers.0.mlp.experts.w1', '3'
                per_expert.setdefault(grouped, {})[int(expert)] = path
    for grouped, files in per_expert.items():
        def stack(grouped=grouped, files=files) -> torch.Tensor:
            return torch.stack([torch.load(files[e], map_location="cpu", weights_only=True)[f"{grouped}.{e}"]
                                for e in sorted(files)])
        entries[grouped] = stack
    return entries


def expert_checkpoint_entries(ckpt_dir: Path, tag: str, config: Any, *, scratch: Path) -> dict[str, Any]:
    """{transformers name: unread tensor} of an AutoEP checkpoint (any ZeRO stage; see the module
    docstring). A name AutoEP added that has no transformers counterpart is left in, under its own
    name, so that `weights_to_write` names it as unexpected rather than dropping a weight."""
    tag_dir = ckpt_dir / tag
    shapes = hf_parameter_shapes(config)
    layers = autoep_layers(tag_dir) or []
    zero = any(tag_dir.glob("zero_pp_rank_*_optim_states.pt"))  # ZeRO-0 saves expp_rank_* optimizer files
    raw = _universal_entries(ckpt_dir, tag, scratch) if zero else _zero0_entries(tag_dir)
    entries: dict[str, Any] = {}
    blocks = [layer["module_path"] for layer in layers]
    for name, read in raw.items():
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is None:
            entries[name] = _Loaded(read, shapes.get(name))
        elif name == f"{block}.router.gate.weight":
            entries[f"{block}.gate.weight"] = _Loaded(read, shapes[f"{block}.gate.weight"])
        elif name == f"{block}.gate.gate.weight" or name.startswith(f"{block}.experts."):
            continue  # the router's alias; the experts are joined below
        else:
            entries[name] = _Loaded(read, shapes.get(name))
    for block in blocks:
        grouped = {w: _Loaded(raw[f"{block}.experts.{w}"], None) for w in ("w1", "w2", "w3")}
        entries.update(_fused_experts(block, grouped, shapes))
    return entries


def _fused_experts(block: str, grouped: dict[str, _Loaded], shapes: dict[str, torch.Size]) -> dict[str, _Joined]:
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
