"""A rank's heartbeat: the trainer records what it is doing, its watcher (launching/supervise.py)
reads it and stops the job when the rank makes no progress for longer than its phase allows.

    # the watcher, before it starts the trainer (the path reaches the trainer as DSF_HEARTBEAT):
    pulse = Pulse.create()                    # a 48-byte file in /dev/shm (or the temp dir)
    ...
    stalled = pulse.stalled()                 # None, or Stall(phase="backward", step=5, seconds=61.2, limit=60.0)

    # the trainer (train/loop.py, train/step.py), a no-op without DSF_HEARTBEAT:
    beat = Beat.from_env()
    beat.beat("forward", step=5, limit=60.0)  # ~1 us: a struct written into a shared mapping

Why a shared mapping and not the rendezvous store or a socket: a rank stuck in a collective, or
stopped (SIGSTOP, a frozen node), cannot answer anything; what it wrote last is what tells where
it stopped, and reading it needs nothing from the rank. The watcher runs on the rank's node, so
the file never leaves it; each beat is a memcpy with no system call (cheap enough for three beats
a micro-batch), and a sequence number (odd while the record is written, even once it is: a
seqlock) lets the reader skip a record caught mid-write. Times are time.monotonic(), one clock
for every process of a node.
The trainer writes the limit of the phase it enters, since only it knows the step time it measured
(faults.hang_timeout, train/hang.py); a limit of 0 means "not watched" (start-up, a run with the
watch off).
"""
from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "DSF_HEARTBEAT"
PHASES = ("start-up", "data", "forward", "backward", "optimizer step", "pipeline schedule", "checkpoint", "eval",
          "done")
_RECORD = struct.Struct("<QddqiI")  # sequence, beat time, limit s, step, phase index, spare
_SEQUENCE = struct.Struct("<Q")
SIZE = _RECORD.size


@dataclass(frozen=True)
class Stall:
    """What a rank was doing when it stopped making progress."""

    phase: str
    step: int
    seconds: float  # since its last beat
    limit: float  # what its phase allows

    def describe(self) -> str:
        where = "before its first step" if self.phase == "start-up" else f"in the {self.phase} of step {self.step}"
        return f"no progress for {self.seconds:.0f} s {where} (limit {self.limit:g} s)"


class Pulse:
    """The watcher's side: the file, and what it says."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), SIZE)

    @classmethod
    def create(cls) -> "Pulse":
        folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, name = tempfile.mkstemp(prefix="dsf-heartbeat-", dir=folder)
        os.write(fd, bytes(SIZE))  # limit 0: not watched until the trainer says what its phase allows
        os.close(fd)
        return cls(Path(name))

    def read(self) -> tuple[str, int, float, float] | None:
        """(phase, step, beat time, limit), or None when caught mid-write three times."""
        for _ in range(3):
            (before,) = _SEQUENCE.unpack_from(self._map, 0)
            _seq, beat_time, limit, step, phase, _spare = _RECORD.unpack_from(self._map, 0)
            (after,) = _SEQUENCE.unpack_from(self._map, 0)
            if before == after and before % 2 == 0:
                return PHASES[phase] if phase < len(PHASES) else "?", step, beat_time, limit
        return None

    def stalled(self, now: float | None = None) -> Stall | None:
        """A Stall when the rank's last beat is older than its phase's limit (0: not watched)."""
        record = self.read()
        if record is None:
            return None
        phase, step, beat_time, limit = record
        seconds = (time.monotonic() if now is None else now) - beat_time
        return Stall(phase, step, seconds, limit) if limit > 0 and seconds > limit else None

    def close(self) -> None:
        self._map.close()
        self._file.close()
        self.path.unlink(missing_ok=True)


class Beat:
    """The trainer's side: `beat(phase, step=..., limit=...)` records a phase as it starts."""

    def __init__(self, path: str | None) -> None:
        self._map, self._seq, self.step, self.limit = None, 0, 0, 0.0
        if path:
            with open(path, "r+b") as file:
                self._map = mmap.mmap(file.fileno(), SIZE)

    @classmethod
    def from_env(cls) -> "Beat":
        return cls(os.environ.get(ENV))

    def beat(self, phase: str, *, step: int | None = None, limit: float | None = None) -> None:
        if step is not None:
            self.step = step
        if limit is not None:
            self.limit = limit
        if self._map is None:
            return
        self._seq += 1  # odd: being written
        _SEQUENCE.pack_into(self._map, 0, self._seq)
        _RECORD.pack_into(self._map, 0, self._seq, time.monotonic(), self.limit, self.step, PHASES.index(phase), 0)
        self._seq += 1  # even: complete
        _SEQUENCE.pack_into(self._map, 0, self._seq)
