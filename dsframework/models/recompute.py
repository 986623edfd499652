"""Selective activation recomputation (parallel.activation_checkpointing=selective): the attention
core of every layer, softmax(Q K^T) V, runs under torch.utils.checkpoint, so the backward
recomputes it from the q, k, v the layer keeps anyway instead of keeping what the kernel saved
(Korthikanti et al. 2022, section 4.2: the projections and the MLP keep their activations).

    name = use_selective_recompute(model)   # "dsf_selective_sdpa": this model's attention, recomputed

Generic over transformers' architectures: their attention modules call
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`; the wrapper is registered in
transformers' AttentionInterface (and the original's mask function in AttentionMaskInterface)
under a name of its own that keeps the original's ("flash" in it keeps transformers' flash-only
paths), and only this model's config names it (models/attention.py). It sits inside the decoder
layer, so the tensor-parallel and pipeline layouts run it unchanged; Ulysses (parallel/context.py)
takes it as its core, so the all-to-alls stay outside the recompute.
"""
from __future__ import annotations

from typing import Any

from dsframework.models.attention import wrap_attention
from dsframework.parallel.rng import checkpoint_contexts

SELECTIVE_PREFIX = "dsf_selective_"


def selective_attention(core: Any) -> Any:
    """`core` (a transformers attention function) run under non-reentrant checkpointing: only its
    inputs are kept for backward, its output and what its kernel saved (sdpa's log-sum-exp, eager's
    or the math kernel's s x s scores) are recomputed there, with the dropout masks the forward drew
    (torch restores the default generator; `checkpoint_contexts` the tensor-parallel stream)."""
    import torch.utils.checkpoint

    def recomputed(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any):
        def run(q: Any, k: Any, v: Any, mask: Any) -> Any:
            return core(module, q, k, v, mask, *args, **kwargs)

        return torch.utils.checkpoint.checkpoint(run, query, key, value, attention_mask, use_reentrant=False,
                                                 context_fn=checkpoint_contexts)

    return recomputed


def use_selective_recompute(model: Any) -> str:
    """Route `model`'s attention through `selective_attention` of the implementation its config
    names (models/attention.py); returns the new name, SELECTIVE_PREFIX + the one before."""
    name = model.config._attn_implementation or "eager"
    if name.startswith(SELECTIVE_PREFIX):
        return name
    return wrap_attention(model.config, selective_attention, tag="selective")


def core_attention(model: Any) -> str:
    """The registered attention Ulysses runs between its all-to-alls: dsf's wrappers of sdpa where
    the config names them (selective recompute, the tensor-parallel stream), else sdpa."""
    name = model.config._attn_implementation or "sdpa"
    return name if name.startswith("dsf_") and name.endswith("_sdpa") else "sdpa"
