"""Where a restarted job's wall time went, and its effective training time ratio (ETTR, as Meta's
Llama 3 report and ByteDance's MegaScale count it: productive training time / wall time).

    timeline = Timeline(output_dir)        # polls metrics.jsonl and checkpoints/latest in a thread
    timeline.attempt_started(resumes=4)    # each start of the job (the step it resumes from)
    ...                                    # the job runs
    timeline.attempt_ended()               # it ended (finished, failed)
    goodput = timeline.goodput()           # Goodput(total_s, startup_s, restarting_s, lost_s, checkpoint_s, ...)
    print(goodput.line())                  # dsf: 812 s: training 701 s (ETTR 0.863), ...

What dsf launch sees is enough, with one figure from the trainer:
- start-up: from the launch to the first step of the first attempt;
- restarting: from each failure (the attempt's end) to the first new step of the next attempt;
- lost: in each failed attempt, the time from its last complete checkpoint (when `latest` named
  it; the attempt's first step when it saved none) to the failure: the steps redone;
- checkpointing: the seconds rank 0 spent saving each checkpoint of this job, appended to
  CHECKPOINT_TIMES in output_dir as it saves (metrics.jsonl's `checkpoint_s` says the same per
  logging window, but a resume drops the records past its checkpoint);
- training: the rest, and ETTR = training / total.
A step is "seen" when its record appears in metrics.jsonl: every logging.every steps, polled each
POLL_S, so each figure is good to about a logging window.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

POLL_S = 0.25
CHECKPOINT_TIMES = "checkpoint_times.jsonl"


@dataclass
class Attempt:
    started: float
    resumes: int  # the checkpoint's step it resumes from (0: the start)
    first_step: float | None = None  # when its first new step was seen
    last_checkpoint: float | None = None  # when `latest` last changed during it
    ended: float | None = None
    failed: bool = False


@dataclass
class Goodput:
    total_s: float
    startup_s: float
    restarting_s: float
    lost_s: float
    checkpoint_s: float
    restarts: int
    per_restart: list[dict] = field(default_factory=list)

    @property
    def training_s(self) -> float:
        return max(0.0, self.total_s - self.startup_s - self.restarting_s - self.lost_s - self.checkpoint_s)

    @property
    def ettr(self) -> float:
        return self.training_s / self.total_s if self.total_s > 0 else 0.0

    def line(self) -> str:
        return (f"dsf: the job took {self.total_s:.0f} s: training {self.training_s:.0f} s (ETTR {self.ettr:.3f}), "
                f"start-up {self.startup_s:.0f} s, {self.restarts} restart(s) {self.restarting_s:.0f} s, "
                f"lost (steps redone) {self.lost_s:.0f} s, checkpointing {self.checkpoint_s:.0f} s")

    def as_dict(self) -> dict:
        return {**asdict(self), "training_s": self.training_s, "ettr": self.ettr}


class Timeline:
    """The attempts of one job and when their steps and checkpoints were seen (module docstring)."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = Path(output_dir)
        self.begun = time.time()
        self.attempts: list[Attempt] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attempt_started(self, *, resumes: int) -> None:
        self.attempts.append(Attempt(started=time.time(), resumes=resumes))
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, args=(self.attempts[-1],), daemon=True)
        self._thread.start()

    def attempt_ended(self, *, failed: bool) -> None:
        attempt = self.attempts[-1]
        attempt.ended, attempt.failed = time.time(), failed
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _poll(self, attempt: Attempt) -> None:
        latest, metrics = self.output_dir / "checkpoints" / "latest", self.output_dir / "metrics.jsonl"
        tag = latest.read_text().strip() if latest.is_file() else None
        cleared = False  # the attempt's sink dropped the lines past its checkpoint (or there were none)
        while not self._stop.wait(POLL_S):
            seen = last_step(metrics)
            cleared = cleared or seen <= attempt.resumes
            if attempt.first_step is None and cleared and seen > attempt.resumes:
                attempt.first_step = time.time()
            now = latest.read_text().strip() if latest.is_file() else None
            if now != tag:
                tag, attempt.last_checkpoint = now, time.time()

    def goodput(self) -> Goodput:
        """The job's wall time so far, split (module docstring)."""
        end = self.attempts[-1].ended if self.attempts and self.attempts[-1].ended else time.time()
        first = self.attempts[0] if self.attempts else None
        startup = ((first.first_step or end) - self.begun) if first else 0.0
        restarting = lost = 0.0
        per_restart = []
        for failed, nxt in zip(self.attempts, self.attempts[1:]):
            gap = (nxt.first_step or nxt.ended or end) - (failed.ended or end)
            redone = (failed.ended or end) - (failed.last_checkpoint or failed.first_step or failed.ended or end)
            restarting, lost = restarting + gap, lost + max(0.0, redone)
            per_restart.append({"restarting_s": round(gap, 2), "lost_s": round(max(0.0, redone), 2)})
        return Goodput(total_s=end - self.begun, startup_s=startup, restarting_s=restarting, lost_s=lost,
                       checkpoint_s=checkpoint_seconds(self.output_dir, since=self.begun),
                       restarts=len(self.attempts) - 1, per_restart=per_restart)


def _records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    return out


def last_step(metrics: Path) -> int:
    return max((int(r.get("step", 0)) for r in _records(metrics)), default=0)


def record_checkpoint_time(output_dir: str | Path, *, step: int, seconds: float) -> None:
    """The trainer's rank 0, after each checkpoint it saved."""
    with (Path(output_dir) / CHECKPOINT_TIMES).open("a") as log:
        log.write(json.dumps({"step": step, "seconds": round(seconds, 4), "time": time.time()}) + "\n")


def checkpoint_seconds(output_dir: Path, *, since: float) -> float:
    """Seconds spent saving the checkpoints finished since `since` (this job's)."""
    return sum(float(r.get("seconds", 0.0)) for r in _records(Path(output_dir) / CHECKPOINT_TIMES)
               if r.get("time", 0) >= since)
