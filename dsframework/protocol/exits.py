"""The exit codes of a job, the same whatever launcher ran it, so that a scheduler can tell a job
to requeue from one to leave alone (SLURM: `RequeueExit=143` in slurm.conf, and `#SBATCH --requeue`):

    0    finished
    2    bad input (a config, a hostfile, data, a checkpoint): the same again would fail; never requeue
    3    given up: `dsf launch --max-restarts` spent its restarts, or restarts made no progress
    124  a rank hung (faults.hang_timeout): its rank watcher's code (launching/supervise.py)
    130  stopped: SIGINT, SIGTERM or SIGHUP ended the job before a preemption checkpoint was taken
         (during start-up, or a save that failed); `latest` is the last complete checkpoint; never requeue
    143  preempted: stopped by SIGTERM, SIGINT or SIGHUP after saving a checkpoint at the step it
         reached, steps remaining; requeue, and `--resume` continues exactly

deepspeed's per-node launcher turns every failing rank's code into 1, and a launcher ended by a
signal says nothing of how its ranks ended, so `dsf train` (rank 0) leaves a marker in output_dir:
PREEMPTED_MARKER once its preemption checkpoint is saved, FINISHED_MARKER once the last step is
done (a signal after it still ends the launchers with a signal's code); `dsf launch` reads the
markers newer than the job's start.

    code = job_code(runner_code, run.output_dir, since=started, signalled=told_to_stop)
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

FINISHED, BAD_INPUT, GIVEN_UP, HUNG, STOPPED, PREEMPTED = 0, 2, 3, 124, 130, 143
PREEMPTED_MARKER, FINISHED_MARKER = "preempted.json", "finished.json"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each ends the whole job (docs/launching.md)


def stop_signals() -> tuple[signal.Signals, ...]:
    """The STOP_SIGNALS this process handles: SIGTERM always (a preemption's signal: dsf's srun line
    starts deepspeed's runner with it ignored, and every process below inherits that, so each sets
    its own handler), SIGINT and SIGHUP unless the process was started with them ignored (`nohup`
    ignores SIGHUP, and a script's `cmd &` SIGINT, for the whole job; dsf keeps it so)."""
    return tuple(sig for sig in STOP_SIGNALS
                 if sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN)


def mark_preempted(output_dir: str | Path, *, step: int, checkpoint: str) -> None:
    """Rank 0 of `dsf train`, once the preemption checkpoint is saved."""
    (Path(output_dir) / PREEMPTED_MARKER).write_text(json.dumps({"step": step, "checkpoint": checkpoint,
                                                                  "time": time.time()}) + "\n")


def mark_finished(output_dir: str | Path, *, step: int) -> None:
    """Rank 0 of `dsf train`, once its last step (train.steps, or train.stop_after) is done and saved."""
    (Path(output_dir) / FINISHED_MARKER).write_text(json.dumps({"step": step, "time": time.time()}) + "\n")


def clear_preempted(output_dir: str | Path) -> None:
    """Rank 0 of `dsf train` as it starts: an earlier preemption, or an earlier end, is over."""
    for marker in (PREEMPTED_MARKER, FINISHED_MARKER):
        (Path(output_dir) / marker).unlink(missing_ok=True)


def preempted_since(output_dir: str | Path, since: float, *, marker: str = PREEMPTED_MARKER) -> bool:
    path = Path(output_dir) / marker
    try:
        return json.loads(path.read_text()).get("time", 0) >= since
    except (OSError, ValueError):
        return False


def job_code(code: int, output_dir: str | Path, *, since: float, signalled: bool = False) -> int:
    """The job's exit code from its launcher's `code` (128 + N for a launcher killed by signal N):
    FINISHED when rank 0 finished since `since` (a signal came after the last step), PREEMPTED when
    the ranks saved a preemption checkpoint since then, STOPPED when a signal ended it before either
    (`signalled`: dsf launch was sent one; or the launcher's code is a stop signal's)."""
    if code == 0 or preempted_since(output_dir, since, marker=FINISHED_MARKER):
        return FINISHED
    if preempted_since(output_dir, since):
        return PREEMPTED
    return STOPPED if signalled or code in {128 + sig for sig in STOP_SIGNALS} else code
