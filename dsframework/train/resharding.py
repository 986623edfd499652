"""A resume at another layout converts its checkpoint with every rank of the job: each writes the
universal files of its share of the parameters (checkpoints/reshard.py `Resharding`): about 1/world
of the elements each, one parameter's states at a time, so no process holds more than that and the
work is divided among the job's processes instead of left to rank 0.

    reshard_in_shares(run.checkpoint_dir, "global_step4", config, saved=was, target=dims)  # all ranks
    # -> "global_step4.universal-tp1pp1dp4", whole on disk when any rank returns

A rank that fails fails them all: bad input (a missing or wrong-shaped state) as its one line on
every rank, anything else as exit 1 beside that rank's traceback; the partial folder is removed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dsframework.checkpoints.reshard import Resharding, universal_tag
from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.parallel.host import host_group
from dsframework.train.world import rank_zero_first


def reshard_in_shares(ckpt_dir: Path, tag: str, config: Any, *, saved: ParallelDims, target: ParallelDims) -> str:
    """Convert `tag` for `target` with every rank (each calls this); returns the universal tag."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    with rank_zero_first():  # rank 0's bad-input line (no manifest, missing files) reaches every rank
        job = Resharding.plan(ckpt_dir, tag, config, target=target, saved=saved)
        if job is not None and rank == 0:
            job.clear()
    if job is None:
        return universal_tag(tag, target)
    failure, error = _try_share(job, rank=rank, world=world)
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, failure, group=host_group())  # pickled: host-side
    if any(outcomes):
        if rank == 0:
            job.clear()  # nothing half-written is left
        if error is not None:
            raise error
        first = next(o for o in outcomes if o)
        if first == "failed":
            raise SystemExit(1)  # that rank's traceback is the report
        raise UserError(*first)
    if rank == 0:  # (the all-gather above returned on every rank once every share was on disk)
        job.commit()
    dist.barrier()  # whole and renamed before any rank loads it
    return job.name


def _try_share(job: Resharding, *, rank: int, world: int) -> tuple[Any, BaseException | None]:
    """(None, None) when this rank's share is written; else what the other ranks are told (a
    UserError's fields, or "failed") and the exception this rank raises."""
    try:
        job.write_share(rank=rank, world=world)
    except UserError as err:
        return (err.field, err.value, err.rule, err.fix), err
    except Exception as err:  # noqa: BLE001 - re-raised on this rank after the others are told
        return "failed", err
    return None, None
