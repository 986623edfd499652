"""Selective activation recomputation (parallel.activation_checkpointing=selective): the attention
core of every layer, softmax(Q K^T) V, runs under torch.utils.checkpoint, so the backward
recomputes it from the q, k, v the layer keeps anyway instead of keeping what the kernel saved
(Korthikanti et al. 2022, section 4.2: the projections and the MLP keep their activations).

    name = use_selective_recompute(model)   # "dsf_selective_sdpa": this model's attention, recomputed

Generic over transformers' architectures: their attention modules call
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`; the wrapper is registered in
transformers' AttentionInterface (and the original's mask function in AttentionMaskInterface)
under a name of its own that keeps the original's ("flash" in it keeps transformers' flash-only
paths), and only this model's config names it. It sits inside the decoder layer, so the
tensor-parallel and pipeline layouts run it unchanged; Ulysses (parallel/context.py) takes it as
its core, so the all-to-alls stay outside the recompute. Eager attention is a per-model function,
not in the registry: refused.
"""
from __future__ import annotations

from typing import Any

from dsframework.errors import UserError

SELECTIVE_PREFIX = "dsf_selective_"


def selective_attention(core: Any) -> Any:
    """`core` (a transformers attention function) run under non-reentrant checkpointing: only its
    inputs are kept for backward, its output and what its kernel saved (sdpa's log-sum-exp, eager's
    or the math kernel's s x s scores) are recomputed there."""
    import torch.utils.checkpoint

    def recomputed(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any):
        def run(q: Any, k: Any, v: Any, mask: Any) -> Any:
            return core(module, q, k, v, mask, *args, **kwargs)

        return torch.utils.checkpoint.checkpoint(run, query, key, value, attention_mask, use_reentrant=False)

    return recomputed


def use_selective_recompute(model: Any) -> str:
    """Route `model`'s attention through `selective_attention` of its own implementation; returns
    the registered name (SELECTIVE_PREFIX + the original's). UserError for eager attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    original = config._attn_implementation or "sdpa"
    if original.startswith(SELECTIVE_PREFIX):
        return original
    if original not in ALL_ATTENTION_FUNCTIONS:
        raise UserError("parallel.activation_checkpointing", "selective",
                        f"needs an attention implementation from transformers' AttentionInterface; this model runs "
                        f"{original!r} attention (a function of its own module)",
                        "use parallel.activation_checkpointing=full or none")
    name = SELECTIVE_PREFIX + original
    AttentionInterface.register(name, selective_attention(ALL_ATTENTION_FUNCTIONS[original]))
    if original in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    config._attn_implementation = name
    return name


def core_attention(model: Any) -> str:
    """The registered attention Ulysses runs between its all-to-alls: the selective wrapper of sdpa
    where use_selective_recompute installed it, else sdpa."""
    name = model.config._attn_implementation or "sdpa"
    return name if name == SELECTIVE_PREFIX + "sdpa" else "sdpa"
