"""The process group for host (CPU) tensors, beside the accelerator's default group.

    make_host_group(separate=dist.get_backend() != "gloo")   # train/world.py, once, on every rank
    all_reduce_host(torch.tensor([3.0]))                      # a host figure summed over every rank
    dist.all_gather_object(out, obj, group=host_group())      # pickled objects: host-side too
    with rank_zero_first(): ...                               # rank 0 first; its bad-input line reaches all

NCCL has no CPU backend ("No backend type associated with device type cpu"): on a GPU the default
group takes device tensors only, and every host tensor a rank reduces goes through a gloo group over
every rank made beside it. On CPU ranks the default group is gloo already and serves both
(host_group() is None, which collectives read as the default group).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from dsframework.errors import UserError

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


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the body first (writes caches, trains the tokenizer), then the others.

    When rank 0's body fails on bad input (a UserError: a malformed data row, say), the others do
    not run it: they raise the same one-line error instead of a lost-peer traceback; when it fails
    otherwise, they exit with code 1 and rank 0's traceback is the report."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        outcome: list = [None]
        dist.broadcast_object_list(outcome, src=0, group=host_group())
        if outcome[0] == "failed":
            raise SystemExit(1)
        if outcome[0] is not None:
            raise UserError(*outcome[0])
        yield
        return
    try:
        yield
    except UserError as err:
        dist.broadcast_object_list([(err.field, err.value, err.rule, err.fix)], src=0, group=host_group())
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            dist.broadcast_object_list(["failed"], src=0, group=host_group())
        raise
    dist.broadcast_object_list([None], src=0, group=host_group())
