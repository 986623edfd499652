"""The model families dsframework can shard (tp) and cut into pipeline stages (pp), in one place.

    family_of("mistral")    # "llama"
    family_of("gpt2")       # "gpt2"
    family_of("phi")        # None: data parallel with ZeRO only (tp = pp = 1)

A family shares one module tree, so one tensor-parallel plan (`models.tensor_parallel.PLANS`), one
pipeline recipe (`parallel.pipeline.pipeline_layer_specs`) and one exact parameter count
(`planner.model.describe_model`) serve all its architectures: adding an architecture to a family
is one line here. Pure: no torch.
"""
from __future__ import annotations

FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("llama", "mistral", "qwen2"),  # RMSNorm, rotary, SwiGLU, grouped-query attention
    "gpt2": ("gpt2",),                       # LayerNorm, learned positions, fused q|k|v (Conv1D), tied head
}
SUPPORTED: tuple[str, ...] = tuple(model_type for types in FAMILIES.values() for model_type in types)


def family_of(model_type: str) -> str | None:
    """The family of a transformers `model_type`, or None when dsframework has no plan for it."""
    return next((family for family, types in FAMILIES.items() if model_type in types), None)
