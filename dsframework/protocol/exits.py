"""The exit codes of a job, the same whatever launcher ran it, so that a scheduler can tell a job
to requeue from one to leave alone (SLURM: `RequeueExit=143` in slurm.conf, and `#SBATCH --requeue`):

    0    finished
    2    bad input (a config, a hostfile, data, a checkpoint): the same again would fail; never requeue
    3    given up: `dsf launch --max-restarts` spent its restarts, or restarts made no progress
    124  a rank hung (faults.hang_timeout): its rank watcher's code (launching/supervise.py)
    143  preempted: stopped by SIGTERM after saving a checkpoint at the step it reached; requeue,
         and `--resume` continues exactly

deepspeed's per-node launcher turns every failing rank's code into 1, so `dsf train` (rank 0) also
leaves a marker, PREEMPTED_MARKER in output_dir, once its preemption checkpoint is saved; `dsf
launch` maps the launcher's code to 143 when the marker is newer than the job's start.

    code = job_code(runner_code, run.output_dir, since=started)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

FINISHED, BAD_INPUT, GIVEN_UP, HUNG, PREEMPTED = 0, 2, 3, 124, 143
PREEMPTED_MARKER = "preempted.json"


def mark_preempted(output_dir: str | Path, *, step: int, checkpoint: str) -> None:
    """Rank 0 of `dsf train`, once the preemption checkpoint is saved."""
    (Path(output_dir) / PREEMPTED_MARKER).write_text(json.dumps({"step": step, "checkpoint": checkpoint,
                                                                  "time": time.time()}) + "\n")


def clear_preempted(output_dir: str | Path) -> None:
    """Rank 0 of `dsf train` as it starts: an earlier preemption is over."""
    (Path(output_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)


def preempted_since(output_dir: str | Path, since: float) -> bool:
    path = Path(output_dir) / PREEMPTED_MARKER
    try:
        return json.loads(path.read_text()).get("time", 0) >= since
    except (OSError, ValueError):
        return False


def job_code(code: int, output_dir: str | Path, *, since: float) -> int:
    """The job's exit code: PREEMPTED when its ranks saved a preemption checkpoint since `since`."""
    return PREEMPTED if code != 0 and preempted_since(output_dir, since) else code
