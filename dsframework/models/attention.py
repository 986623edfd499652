"""What dsf runs around a transformers model's attention core (softmax(QK^T)V, its mask and its
dropout), for every architecture at once: transformers' attention modules look their core up
by `config._attn_implementation` in its AttentionInterface, so a wrapper is a new entry there
that calls the implementation the config named before (the module's own eager function for
"eager"), and the config names the wrapper. The mask function follows the name, so the model
builds the mask it built before.

    wrap_attention(model.config, fork_tensor_parallel_rng, tag="tp_rng")   # -> "dsf_tp_rng_sdpa"
    # attention dropout now draws this tensor rank's own mask (parallel/rng.py)

Wrappers compose (each wraps whatever the config names when it is applied: the tensor-parallel
stream's fork, then selective recompute, models/recompute.py, around it); only this model's
config names them, so another model in the process keeps its attention as it was.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from dsframework.parallel.rng import tensor_parallel_rng

Core = Callable[..., Any]  # transformers' attention function: (module, query, key, value, mask, ...) -> (out, weights)


def _core_of(name: str) -> Core:
    """The attention function `name` stands for; "eager" (not in the registry) is each module's own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        found = ALL_ATTENTION_FUNCTIONS[name]
        return lambda module, *args, **kwargs: found(module, *args, **kwargs)

    def eager(module: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")(module, *args, **kwargs)

    return eager


def wrap_attention(config: Any, wrapper: Callable[[Core], Core], *, tag: str) -> str:
    """Make `config`'s attention `wrapper(core)`, core being the implementation it names now;
    returns the new implementation's name, "dsf_<tag>_<the name before>": transformers' paths that
    look for "flash" in it still find it, and one wrapper (stateless, as these are) of one
    implementation is registered once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    current = config._attn_implementation or "eager"
    name = f"dsf_{tag}_{current}"
    AttentionInterface.register(name, wrapper(_core_of(current)))
    if current in ALL_MASK_ATTENTION_FUNCTIONS:  # (a name without one builds no mask: Ulysses')
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    config._attn_implementation = name
    return name


def fork_tensor_parallel_rng(core: Core) -> Core:
    """The attention core drawing its dropout from this tensor rank's own stream (its heads are its
    own); without dropout (evaluation, p = 0) it runs as it was, with no RNG state touched."""
    def forked(module: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("dropout"):
            return core(module, *args, **kwargs)
        with tensor_parallel_rng():
            return core(module, *args, **kwargs)

    return forked
