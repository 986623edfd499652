"""What stops a training run early, and how the ranks agree on it.

    stop, nonfinite = StopRequest(), NonFiniteWatch(enabled=True, device=engine.device)
    for step in ...:
        loss = one_step()
        nonfinite.update(step, loss)              # on the device, no sync
        if step % log_every == 0 and nonfinite.first_step() is not None: stop with an error
        if stop.agreed(): save a checkpoint and exit   # a step after SIGTERM/SIGINT/SIGHUP on any rank

Both are collectives: every rank calls them at the same points of the loop.
"""
from __future__ import annotations

import signal
from typing import Any

from dsframework.parallel.host import all_reduce_host
from dsframework.protocol.exits import stop_signals


class StopRequest:
    """SIGTERM (what SLURM sends before preemption, and what DeepSpeed's launcher passes on to its
    ranks), SIGINT and SIGHUP ask for a checkpoint at the end of a step, then an exit: a signal to one
    rank, to the launcher, or to `dsf launch` ends the whole job, and `--resume` continues it exactly.

    The signal reaches the ranks at different moments, or one rank alone, so they agree on it: each
    step ends by starting an all-reduce (MAX) of the signal's number in the background, on the CPU (a
    gloo group beside NCCL), and reading the one started a step earlier, long finished. No device
    synchronisation and no wait; the stop comes one step after the signal, on every rank at the same
    step, named by the largest signal any rank had (SIGTERM over SIGINT over SIGHUP).

        stop = StopRequest()
        ... one step ...
        signum = stop.agreed()
        if signum: save and exit   # signal.Signals(signum).name for the message
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._pending: tuple[Any, Any] | None = None
        for signum in stop_signals():
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = max(signum, self.received or 0)

    def _collect(self) -> int:
        if self._pending is None:
            return 0
        work, flag = self._pending
        work.wait()
        self._pending = None
        return int(flag.item())

    def agreed(self) -> int:
        """The stop signal any rank had when the previous step ended, 0 for none (every rank, same answer)."""
        import torch
        import torch.distributed as dist

        stop = self._collect()
        flag = torch.tensor([self.received or 0], dtype=torch.int32)  # host: a signal's number, on the gloo group
        self._pending = (all_reduce_host(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return stop

    def close(self) -> None:
        """Finish the reduction still in flight (before the process group goes)."""
        self._collect()


class NonFiniteWatch:
    """The first step whose loss was not finite on any rank.

    Updated on the device every step (no host synchronisation); read, with one all-reduce, only
    where it matters: at logging, before a checkpoint is written, at the end. Off under fp16,
    where DeepSpeed's loss scaler skips overflowing steps itself.
    """

    NONE = 2 ** 62

    def __init__(self, *, enabled: bool, device: Any) -> None:
        import torch

        self.enabled = enabled
        self._first = torch.full((1,), self.NONE, dtype=torch.int64, device=device)

    def update(self, step: int, loss: Any) -> None:
        import torch

        if self.enabled:
            fresh = torch.isfinite(loss.to(self._first.device)).logical_not() & (self._first == self.NONE)
            self._first = torch.where(fresh, torch.full_like(self._first, step), self._first)

    def first_step(self) -> int | None:
        import torch.distributed as dist

        if not self.enabled:
            return None
        first = self._first.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        return None if int(first.item()) == self.NONE else int(first.item())

