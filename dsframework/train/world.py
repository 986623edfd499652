"""This process's place in the job: the process group up, down, and in order.

    rank, world = init_distributed()       # under a launcher, or a world of one
    with rank_zero_first():                 # rank 0 writes a cache, the others then read it
        ...
    shutdown_distributed()                  # every rank leaves together
    supervise.exit_process(0)               # and the process ends without the interpreter's teardown
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Iterator

from dsframework.errors import UserError
from dsframework.jit import pin_build_tools, release_shm_buffers
from dsframework.ports import free_port


def init_distributed() -> tuple[int, int]:
    """(rank, world_size), with a process group up; a plain `dsf train` is a world of one."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    pin_build_tools()
    if "RANK" not in os.environ:  # not under a launcher: a world of one on a free local port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N CPU ranks on one host would each take every core; share them out instead.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    release_shm_buffers()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def shutdown_distributed(*, wait_s: float | None = None) -> None:
    """Tear the process group down in step on every rank, then end with supervise.exit_process.

    No rank leaves while another still talks to it (a rank that trained fine then died with
    `terminate called without an active exception`, seen in CI at pp2 x dp2); the threads that
    outlive the group are the reason for exit_process. On an error path (`wait_s` set) the other
    ranks may never arrive: wait for them that long at most.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_s is None:
        dist.barrier()
    else:
        with contextlib.suppress(Exception):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=wait_s))
    dist.destroy_process_group()


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the body first (writes caches, trains the tokenizer), then the others.

    When rank 0's body fails on bad input (a UserError: a malformed data row, say), the others do
    not run it: they raise the same one-line error instead of a lost-peer traceback; when it fails
    otherwise, they exit with code 1 and rank 0's traceback is the report."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        outcome: list = [None]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] == "failed":
            raise SystemExit(1)
        if outcome[0] is not None:
            raise UserError(*outcome[0])
        yield
        return
    try:
        yield
    except UserError as err:
        dist.broadcast_object_list([(err.field, err.value, err.rule, err.fix)], src=0)
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            dist.broadcast_object_list(["failed"], src=0)
        raise
    dist.broadcast_object_list([None], src=0)
