"""faults.hang_timeout on the trainer's side: what each phase may take before this rank's watcher
(launching/supervise.py) calls it hung, written into its heartbeat as each phase starts.

    watch = HangWatch.for_run(run, device=engine.device)   # reads DSF_HEARTBEAT; a no-op without a watcher
    watch.enter("data", step=6)               # then "forward", "backward", "optimizer step", ...
    watch.step_done(seconds=0.41)             # the step time `auto` scales with
    watch.compiled()                          # the next step compiles: it gets the long limit
    watch.check_setting(step_seconds)         # UserError: a fixed timeout below the step time

Limits: a training phase (data, forward, backward, optimizer step, the pipeline's schedule) gets
the setting in seconds, or under `auto` max(AUTO_MIN_S, AUTO_STEPS x this rank's median step
time). The first step of a session, the step after compiling (before either, no step time is
known and kernels are being built), checkpoints and evaluation get max(LONG_MIN_S, 10 x the
training limit). Before the first step (building the model, deepspeed.initialize) and after the
last nothing is watched: those end in the launcher's or the collective's own timeouts.

Step times are the device's: on a GPU the host only queues a step's kernels and runs ahead until
something waits for them, so its clock would time the queueing. `StepTimer` records a CUDA event at
each step's start and end and reads a step's time once its end event has completed (`query()`: no
host synchronisation); on CPU ranks the host's clock is the device's.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any, Callable

from dsframework.errors import UserError
from dsframework.protocol.heartbeat import Beat

AUTO_MIN_S, AUTO_STEPS = 60.0, 10
LONG_MIN_S = 600.0
LONG_PHASES = ("checkpoint", "eval")
RECENT_STEPS = 20  # the median of this many recent step times


class StepTimer:
    """Step times as the device ran them (module docstring).

        timer = StepTimer.for_device(engine.device)
        timer.start(); ...one step...; finished = timer.stop()   # seconds of the steps the device finished
    """

    def __init__(self, event: Callable[[], Any] | None = None) -> None:
        self.event = event  # makes a recorded timing event (torch.cuda.Event); None: the host's clock
        self.started: Any = None
        self.pending: deque[tuple[Any, Any]] = deque()

    @classmethod
    def for_device(cls, device: Any) -> "StepTimer":
        import torch

        if torch.device(device).type != "cuda":
            return cls()

        def recorded() -> Any:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return cls(recorded)

    def start(self) -> None:
        self.started = self.event() if self.event else time.perf_counter()

    def stop(self) -> list[float]:
        """The seconds of every step whose end the device has reached, oldest first (none yet: [])."""
        if self.event is None:
            return [time.perf_counter() - self.started]
        self.pending.append((self.started, self.event()))
        done = []
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.popleft()
            done.append(start.elapsed_time(end) / 1000.0)  # milliseconds
        return done


class HangWatch:
    """This rank's phases and their limits, beaten into the heartbeat its watcher reads."""

    def __init__(self, setting: float | str, beat: Beat | None = None) -> None:
        self.setting = setting  # seconds, "auto", or 0: not watched
        self.beat = beat if beat is not None else Beat.from_env()
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._median: float | None = None  # of `recent`, kept at each step (`limit` runs at every phase)
        self.warm = False  # a step has finished since the session started or last compiled
        self.timer = StepTimer()  # the device's step times (for_run: CUDA events on a GPU)
        self.trained = 0  # steps this session has trained (the device may not have timed them all yet)

    @classmethod
    def for_run(cls, run: Any, *, device: Any = "cpu") -> "HangWatch":
        watch = cls(run.faults.hang_timeout)
        watch.timer = StepTimer.for_device(device)  # the device's step times (CUDA events on a GPU)
        return watch

    def training_limit(self) -> float | None:
        """Seconds a training phase may take; None while `auto` has no step time yet."""
        if self.setting != "auto":
            return float(self.setting)
        if self._median is None:
            return None
        return max(AUTO_MIN_S, AUTO_STEPS * self._median)

    def limit(self, phase: str) -> float:
        """What `phase` may take now (0: not watched)."""
        if self.setting == 0 or phase == "done":
            return 0.0
        base = self.training_limit()
        if base is None or not self.warm or phase in LONG_PHASES:
            return max(LONG_MIN_S, 10 * (base or 0.0))
        return base

    def enter(self, phase: str, *, step: int | None = None) -> None:
        self.beat.beat(phase, step=step, limit=self.limit(phase))

    def step_done(self, *, seconds: float) -> None:
        if self.warm:  # the first step of a session (or after compiling) is not a step time
            self.recent.append(seconds)
            self._median = statistics.median(self.recent)
        self.warm = True

    def compiled(self) -> None:
        self.warm = False

    def median_step(self) -> float | None:
        return self._median

    def check_setting(self, step_seconds: float) -> None:
        """UserError when a fixed faults.hang_timeout is below the step time all ranks measured
        (`step_seconds`, the same on every rank, so that every rank stops together)."""
        if self.setting not in ("auto", 0) and 0 < step_seconds and float(self.setting) < step_seconds:
            raise UserError("faults.hang_timeout", self.setting, f"is below the measured step time of "
                            f"{step_seconds:.3g} s: every step would count as a hang",
                            f"set it to at least {max(AUTO_MIN_S, AUTO_STEPS * step_seconds):.0f} or to auto")
