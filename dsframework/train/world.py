"""This process's place in the job: the process group up, down, and in order.

    rank, world = init_distributed()       # under a launcher, or a world of one
    mean = mean_over_ranks(0.25)            # a host-side figure, reduced on the host group
    shutdown_distributed()                  # every rank leaves together
    supervise.exit_process(0)               # and the process ends without the interpreter's teardown

Host and device kept apart: the default group is the accelerator's (NCCL on a GPU), which takes
device tensors only ("No backend type associated with device type cpu"). Every host tensor a rank
reduces (eval sums, counters, the compile decision, the stop flag, hang and restart bookkeeping,
pickled objects) goes through `host_group()` (parallel/host.py): a gloo group over every rank beside
NCCL, made once here, or the default group itself where that is gloo (CPU ranks). Tensors that meet
the model's are made on the engine's device and reduced on the default group.
tests/device_discipline.py checks both rules on this CPU build (fake CUDA tensors, the default group
standing for NCCL).
"""
from __future__ import annotations

import contextlib
import datetime
import os

from dsframework.errors import UserError
from dsframework.jit import pin_build_tools, release_shm_buffers
from dsframework.parallel.host import all_reduce_host, host_group, make_host_group
from dsframework.ports import free_port
from dsframework.types import accelerator


def init_distributed() -> tuple[int, int]:
    """(rank, world_size), with a process group up; a plain `dsf train` is a world of one."""
    import deepspeed
    import torch

    pin_build_tools()
    if "RANK" not in os.environ:  # not under a launcher: a world of one on a free local port
        # (CROSS_*: the node's index and count, as deepspeed's launcher sets them; its decoupled
        # checkpoint writer reads CROSS_SIZE)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", CROSS_RANK="0",
                          CROSS_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = accelerator()
    if device.device_name() == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N CPU ranks on one host would each take every core; share them out instead.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if device.device_name() != "cpu":
        # Before the first collective: NCCL binds each rank's communicator to the current device,
        # which would otherwise be device 0 for every rank of the node.
        device.set_device(local_device(device.device_count()))
        debug_host_syncs()
    deepspeed.init_distributed(dist_backend=device.communication_backend_name(), verbose=False)
    make_host_group(separate=torch.distributed.get_backend() != "gloo")
    release_shm_buffers()
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def local_device(visible: int) -> int:
    """This rank's device index (LOCAL_RANK); UserError when the launcher counted more devices on
    this node than CUDA_VISIBLE_DEVICES leaves visible to the rank."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UserError("LOCAL_RANK", local_rank, f"names a device this rank cannot see: {visible} visible"
                        + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""),
                        "start as many ranks per node as visible devices (deepspeed --num_gpus / --include, "
                        "or unset CUDA_VISIBLE_DEVICES and let the launcher set it)")
    return local_rank


def debug_host_syncs() -> None:
    """DSF_CUDA_SYNC_DEBUG=warn|error: torch reports each host synchronisation (bench/gpu_smoke.sh)."""
    import torch

    mode = os.environ.get("DSF_CUDA_SYNC_DEBUG")
    if mode and torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def mean_over_ranks(value: float) -> float:
    """The mean of a host-side number over every rank (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)  # host: a Python number, reduced on the host group
    all_reduce_host(tensor)
    return tensor.item() / dist.get_world_size()


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
    else:  # monitored_barrier exists for gloo only: the host group's (a default NCCL group raises)
        with contextlib.suppress(Exception):
            dist.monitored_barrier(group=host_group(), timeout=datetime.timedelta(seconds=wait_s))
    make_host_group(separate=False)
    dist.destroy_process_group()
