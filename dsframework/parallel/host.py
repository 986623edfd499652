"""The process group for host (CPU) tensors, beside the accelerator's default group.

    make_host_group(separate=dist.get_backend() != "gloo")   # train/world.py, once, on every rank
    all_reduce_host(torch.tensor([3.0]))                      # a host figure summed over every rank
    dist.all_gather_object(out, obj, group=host_group())      # pickled objects: host-side too

NCCL has no CPU backend ("No backend type associated with device type cpu"): on a GPU the default
group takes device tensors only, and every host tensor a rank reduces goes through a gloo group over
every rank made beside it. On CPU ranks the default group is gloo already and serves both
(host_group() is None, which collectives read as the default group).
"""
from __future__ import annotations

from typing import Any

_HOST_GROUP: list = [None]  # host_group()'s group; None: the default group (gloo) serves host tensors


def make_host_group(*, separate: bool) -> None:
    """Make host_group(): a gloo group over every rank (`separate`), else the default group. Every
    rank calls it at the same point (new_group is a collective)."""
    import torch.distributed as dist

    _HOST_GROUP[0] = dist.new_group(backend="gloo") if separate else None


def host_group() -> Any:
    """The process group for host (CPU) tensors: collectives take it as `group=` (None: the default)."""
    return _HOST_GROUP[0]


def all_reduce_host(tensor: Any, *, op: Any = None, async_op: bool = False) -> Any:
    """All-reduce a host tensor over every rank on host_group() (SUM unless `op`); the work when async."""
    import torch.distributed as dist

    assert tensor.device.type == "cpu", f"a {tensor.device} tensor on the host group"  # internal invariant
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=host_group(), async_op=async_op)
