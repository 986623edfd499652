"""`dsf launch ... --max-restarts N`: a failed job restarted from its latest complete checkpoint,
on the nodes that pass a pre-flight check, at a layout re-planned for them.

    code = run_with_restarts(Pdsh(), job, run, max_restarts=3, cluster_name=None)

After a failure (a dead rank, a hung one: faults.hang_timeout, a node that stopped answering):
1. every node of the job is checked again (the launcher's `rank_probe`: pdsh's ssh, checkout and
   venv, then `import torch, deepspeed` by the venv's Python there; slurm's, that import as a
   one-task srun step on the node, inside the allocation); a node that fails
   is left out for the rest of the job, and so is a node that passes but is the site of its
   second failure. `blocklist.json` in output_dir keeps them, with the reason;
2. the layout is re-planned when the world changed (launching/replan.py: same global batch, same
   ZeRO stage, tp kept where it fits, memory checked), and the job starts again with `--resume`
   (`dsf train` reshards the checkpoint to the new layout), or from scratch when no checkpoint
   was complete yet;
3. each restart is printed and appended to `restarts.jsonl` in output_dir: when, why, the nodes,
   the layout, the checkpoint it resumes and the steps lost since it; at the end, where the job's
   wall time went (start-up, restarting, steps redone, checkpointing, training: its ETTR) is
   printed and written to `goodput.json` (protocol/goodput.py).
The loop ends when the job finishes, when it fails on bad input (exit 2: the same again would
fail), when it was preempted (exit 143: the scheduler requeues it), when dsf launch itself is told
to stop, or, exiting 3 (protocol/exits.py), after `--max-restarts` restarts or after
NO_PROGRESS_LIMIT restarts in a row that saved no new checkpoint. A fresh launch (no --resume)
starts a new blocklist and log; --resume continues them.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.errors import UserError
from dsframework.launching.launchers import LaunchJob, check_hosts
from dsframework.launching.replan import replan
from dsframework.layout import ParallelDims
from dsframework.protocol.exits import BAD_INPUT, FINISHED, GIVEN_UP, PREEMPTED, STOPPED
from dsframework.protocol.goodput import Timeline, last_step

BLOCKLIST, LOG, GOODPUT = "blocklist.json", "restarts.jsonl", "goodput.json"
NO_PROGRESS_LIMIT = 2


@dataclass
class RestartState:
    """What the restart loop remembers across attempts (and, through output_dir, across --resume)."""

    output_dir: Path
    blocked: dict[str, str] = field(default_factory=dict)  # host -> why it is left out
    failures: dict[str, int] = field(default_factory=dict)  # host -> failures it was the site of
    restarts: int = 0
    no_progress: int = 0

    @classmethod
    def begin(cls, output_dir: Path, *, resume: bool) -> "RestartState":
        state = cls(output_dir)
        path = output_dir / BLOCKLIST
        if resume and path.is_file():
            state.blocked = json.loads(path.read_text())
        elif not resume:
            path.unlink(missing_ok=True)
            (output_dir / LOG).unlink(missing_ok=True)
        return state

    def block(self, host: str, why: str) -> None:
        self.blocked[host] = why
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / BLOCKLIST).write_text(json.dumps(self.blocked, indent=1) + "\n")

    def record(self, entry: dict[str, Any]) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with (self.output_dir / LOG).open("a") as log:
            log.write(json.dumps(entry) + "\n")


def check_can_restart(how: Any, max_restarts: int) -> None:
    """UserError before anything starts when `how` (a launcher) cannot restart a job."""
    if max_restarts > 0 and how.cannot_restart:
        raise UserError("--max-restarts", max_restarts, f"--launcher {how.name} {how.cannot_restart}",
                        "use --launcher pdsh (or no hostfile) or slurm, or --max-restarts 0")


def run_with_restarts(how: Any, job: LaunchJob, run: Any, *, max_restarts: int, cluster_name: str | None) -> int:
    """Start `job` and restart it after each failure (module docstring); the job's final exit code."""
    state = RestartState.begin(Path(run.output_dir), resume="--resume" in job.train_flags)
    timeline = Timeline(Path(run.output_dir))
    try:
        return _restart_loop(how, without_blocked(job, state), run, state, timeline, max_restarts=max_restarts,
                             cluster_name=cluster_name)
    finally:
        if timeline.attempts:
            goodput = timeline.goodput()
            (Path(run.output_dir) / GOODPUT).write_text(json.dumps(goodput.as_dict(), indent=1) + "\n")
            click.echo(goodput.line(), err=True)


def _restart_loop(how: Any, job: LaunchJob, run: Any, state: RestartState, timeline: Timeline, *, max_restarts: int,
                  cluster_name: str | None) -> int:
    dims = ParallelDims.of(run.parallel, world=_world(job.active))
    while True:
        resumed_from, started = ckpt.latest_tag(run.checkpoint_dir), time.time()
        timeline.attempt_started(resumes=ckpt.step_of(resumed_from) if resumed_from and "--resume" in
                                 job.train_flags else 0)
        try:
            outcome = how.start_watched(job)
        finally:
            timeline.attempt_ended(failed=True)
        timeline.attempts[-1].failed = outcome.code != 0
        if outcome.code in (FINISHED, BAD_INPUT, PREEMPTED, STOPPED) or outcome.stopped:
            return outcome.code  # a preemption is the scheduler's to requeue (protocol/exits.py)
        why = outcome.failure.line() if outcome.failure else f"the job exited {outcome.code}"
        latest = ckpt.latest_tag(run.checkpoint_dir)
        state.no_progress = state.no_progress + 1 if state.restarts and latest == resumed_from else 0
        stop = _why_stop(state, max_restarts)
        if stop:
            click.echo(f"dsf: error: {why}; not restarted: {stop}", err=True)
            return GIVEN_UP
        if outcome.failure is not None:
            state.failures[outcome.failure.host] = state.failures.get(outcome.failure.host, 0) + 1
        previous = job.overrides
        job, dims, left_out = _next_attempt(how, job, run, state, dims, latest, cluster_name=cluster_name,
                                            failed=outcome.failure.host if outcome.failure else None)
        state.restarts += 1
        entry = {"restart": state.restarts, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "why": why, "attempt_s": round(time.time() - started, 1), "nodes": list(job.active),
                 "left_out": left_out, "layout": str(dims), "resumes": latest,
                 "overrides": [o for o in job.overrides if o not in previous],
                 "steps_lost": steps_lost(Path(run.output_dir), latest)}
        state.record(entry)
        click.echo(f"dsf: restart {state.restarts} of {max_restarts}: {why}; "
                   + "".join(f"{host} left out ({reason}); " for host, reason in left_out.items())
                   + (f"resuming {latest} ({entry['steps_lost']} step(s) lost)" if latest else "from the start")
                   + f" on {', '.join(job.active)} ({dims.world} ranks) at {dims}", err=True)


def _why_stop(state: RestartState, max_restarts: int) -> str | None:
    if state.restarts >= max_restarts:
        return f"the restart budget is spent (--max-restarts {max_restarts})"
    if state.no_progress >= NO_PROGRESS_LIMIT:
        return f"{state.no_progress} restarts in a row saved no new checkpoint"
    return None


def _next_attempt(how: Any, job: LaunchJob, run: Any, state: RestartState, dims: ParallelDims, latest: str | None, *,
                  cluster_name: str | None, failed: str | None) -> tuple[LaunchJob, ParallelDims, dict[str, str]]:
    """The job to start next: the nodes that pass the pre-flight, at the layout planned for them."""
    left_out = {}
    for host, why in check_hosts(how.hosts_to_check(job), how.rank_probe):
        if why is not None:
            left_out[host] = why
    if failed in job.active and failed not in left_out and state.failures.get(failed, 0) >= 2:
        left_out[failed] = f"the site of {state.failures[failed]} failures"
    for host, why in left_out.items():
        state.block(host, why)
    job = without_blocked(job, state)
    if not job.active:
        raise UserError("--max-restarts", None, "cannot restart: every node is left out (" + "; ".join(
            f"{h}: {w}" for h, w in state.blocked.items()) + ")", f"fix the nodes, remove "
            f"{state.output_dir / BLOCKLIST}, and dsf launch --resume")
    overrides, new_dims = replan(run, job.active, cluster_name=cluster_name, was=dims)
    flags = tuple(f for f in job.train_flags if f not in ("--resume", "--overwrite"))
    kept = _without_layout(job.overrides) if overrides else job.overrides
    job = replace(job, overrides=(*kept, *overrides),
                  train_flags=(*flags, "--resume" if latest else "--overwrite"),
                  master=next(iter(job.active)) if job.master not in job.active else job.master)
    how.prepare(job, starting=True)
    return job, new_dims, left_out


def without_blocked(job: LaunchJob, state: RestartState) -> LaunchJob:
    """`job` on its active hosts less the blocklist's. deepspeed's runner reads the hostfile again,
    so the hosts left are passed as its --include (the slots they had: the user's filters kept)."""
    active = OrderedDict((host, slots) for host, slots in job.active.items() if host not in state.blocked)
    if len(active) == len(job.active):
        return job
    include = "@".join(f"{host}:{','.join(map(str, slots))}" for host, slots in active.items())
    return replace(job, active=active, include=include, exclude="", num_nodes=-1, num_gpus=-1)


def _without_layout(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """The user's overrides less those a re-plan sets (its own come after, and win anyway: kept short)."""
    planned = ("parallel.tp=", "parallel.pp=", "parallel.cp=", "parallel.ep=", "parallel.dp=", "train.global_batch=",
               "train.micro_batch=", "train.grad_accum=")
    return tuple(o for o in overrides if not o.startswith(planned))


def steps_lost(output_dir: Path, tag: str | None) -> int:
    """Steps trained since checkpoint `tag`, which the restart redoes: the last step metrics.jsonl
    logged (every logging.every steps: a lower bound) less the checkpoint's."""
    return max(0, last_step(output_dir / "metrics.jsonl") - (ckpt.step_of(tag) if tag else 0))


def _world(active: "OrderedDict[str, list[int]]") -> int:
    return sum(len(slots) for slots in active.values())
