"""`dsf train`: start-up in phases (train/setup.py), then the loop (train/loop.py), one process per rank.

    deepspeed --num_gpus 2 $(which dsf) train launch/examples/tiny.yaml --set train.steps=50
    # or, in Python, inside each rank:
    from dsframework.config import load_run_config
    from dsframework.train.engine import train
    train(load_run_config("launch/examples/tiny.yaml"), resume=False)

The modules of `train/`, in the order a run meets them: setup.py (`prepare`: pre-flight checks ->
world -> tokenizer and data -> outputs -> resume plan -> the whole DeepSpeed JSON -> model for
this layout -> `deepspeed.initialize` -> restore, each phase timed; rank 0 prints the breakdown
as `dsf: start-up ...`), loop.py (`run_steps`: step, logging window and evaluation, checkpoint,
stop conditions), step.py (one step's micro-batches, loss and optimizer step; the evaluation).
"""
from __future__ import annotations

from typing import Any

from dsframework.checkpoints.checkpoint import close_writer
from dsframework.checkpoints.outputs import release_output_dir
from dsframework.config import RunConfig
from dsframework.train.loop import Preempted, run_steps
from dsframework.train.metrics import open_sinks
from dsframework.train.setup import StartupClock, prepare

__all__ = ["Preempted", "train"]


def train(run: RunConfig, *, resume: bool = False, overwrite: bool = False, force: bool = False) -> dict[str, Any]:
    """Train as configured; returns the last logged metrics (on every rank). `force`: on where the
    predicted memory does not fit this node (`dsf train --force`, `dsf launch --force`)."""
    clock = StartupClock()  # the process's age so far: the interpreter and the imports before this
    try:
        session = prepare(run, resume=resume, overwrite=overwrite, force=force, clock=clock)  # rank 0 locks output_dir
        # Rank 0's metric sinks (metrics.jsonl, TensorBoard, CSV, W&B): closed however the loop ends
        # (done, a UserError, SIGTERM's Preempted), so every file holds every logged step.
        sinks = open_sinks(run, resume_step=session.step if resume else None, enabled=session.rank == 0)
        try:
            return run_steps(run, session, sinks, resume=resume)
        finally:
            sinks.close()
            close_writer(session.engine)  # checkpoint.writer=decoupled: its process, done with what it was given
    finally:  # (the process's end releases it too; a process that trains again, as tests do, needs it now)
        release_output_dir(run.output_dir)
