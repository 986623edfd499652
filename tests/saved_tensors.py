"""The bytes autograd keeps for backward, counted as the planner's activation model is checked.

    measured, loss = saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)

Every distinct storage autograd packs while `run()` runs, the model's parameters excluded (a
view and its base count once). Used by the planner's unit tests and the context-parallel workers.
Saved-tensor hooks the model installs itself while it runs (sequence parallelism keeps a block's
gathered input as this rank's slice: parallel/tensor.py SequenceParallelBlock) stand in front of
the counter's; they are composed with it, and what they keep (a tensor, or an object holding one
in `.part`) is counted instead.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch


@contextmanager
def _counting_inner_hooks(count: Callable[[Any], Any]) -> Iterator[None]:
    original = torch.autograd.graph.saved_tensors_hooks

    class Composed(original):  # type: ignore[misc, valid-type]
        def __init__(self, pack_hook, unpack_hook):
            super().__init__(lambda tensor: count(pack_hook(tensor)), unpack_hook)

    torch.autograd.graph.saved_tensors_hooks = Composed  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autograd.graph.saved_tensors_hooks = original  # type: ignore[misc]


def saved_bytes(model: Any, run: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes saved for backward while `run()` runs, what `run()` returned)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def count(kept: Any) -> Any:
        tensor = kept if isinstance(kept, torch.Tensor) else getattr(kept, "part", None)
        if isinstance(tensor, torch.Tensor):
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in params:
                seen.setdefault(ptr, tensor.untyped_storage().nbytes())
        return kept

    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor), _counting_inner_hooks(count):
        result = run()
    return sum(seen.values()), result
