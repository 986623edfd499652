"""The bytes autograd keeps for backward, counted as the planner's activation model is checked.

    measured, loss = saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)

Every distinct storage autograd packs while `run()` runs, the model's parameters excluded (a
view and its base count once). Used by the planner's unit tests and the context-parallel workers.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def saved_bytes(model: Any, run: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes saved for backward while `run()` runs, what `run()` returned)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(seen.values()), result
