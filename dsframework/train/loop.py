"""`dsf train`'s loop: the steps from where a prepared session stands to the end of the run.

    from dsframework.train.loop import run_steps
    last = run_steps(run, session, sinks, resume=False)  # session: train/setup.py's prepare

Each step, as nanoGPT's loop reads: train one step (train/step.py) -> (train.compile=auto: time
the first steps, then compile or not) -> at the end of a logging window, its metrics and the
evaluation -> a checkpoint when one is due (checkpoint.writer=decoupled: written in the background
during the next step, committed after it) -> stop at the last step, at train.stop_after, or on
SIGTERM, SIGINT or SIGHUP (`Preempted`, after a checkpoint, committed). DeepSpeed does gradient
accumulation, clipping, the lr schedule and ZeRO; the loop feeds it the right blocks and records
what happened.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.checkpoints.space import low_space_error, prune
from dsframework.config import RunConfig
from dsframework.data import BlockSampler
from dsframework.data.store import describe_store
from dsframework.errors import UserError
from dsframework.protocol.exits import clear_preempted, mark_finished, mark_preempted
from dsframework.protocol.goodput import record_checkpoint_time
from dsframework.models.experts import describe_experts
from dsframework.train import step as one_step
from dsframework.train.compiling import (
    AUTO_PROBE_STEPS,
    auto_compile,
    compile_engine,
    compile_seconds,
)
from dsframework.train.guards import NonFiniteWatch, StopRequest
from dsframework.train.hang import HangWatch
from dsframework.train.setup import Session, tf32_in_use
from dsframework.train.step import StepBreakdown
from dsframework.train.world import mean_over_ranks
from dsframework.train.throughput import FlopsMeter
from dsframework.types import accelerator


class Preempted(Exception):
    """Training stopped on SIGTERM, SIGINT or SIGHUP after saving a checkpoint (`dsf train` exits 143)."""


def run_steps(run: RunConfig, session: Session, sinks: Any, *, resume: bool) -> dict[str, Any]:
    """The steps from where `session` stands to the end (or to train.stop_after, or SIGTERM); the
    last logged metrics."""
    from tqdm import tqdm

    dims, batch, engine = session.dims, session.batch, session.engine
    step, consumed = session.step, session.consumed_samples
    sampler = BlockSampler(len(session.train_blocks), micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                           dp_size=dims.dp, dp_rank=session.dp_rank, seed=run.data.seed)
    meter, watch, last = start_steps(run, session, sinks, resume=resume)
    bar = tqdm(total=run.train.steps, initial=step, disable=session.rank != 0 or not run.logging.progress,
               dynamic_ncols=True, desc="train")
    window, stop = Window(session, meter, watch), min(run.train.steps, run.train.stop_after or run.train.steps)
    probe, stop_request = CompileProbe(run, session, watch), StopRequest()
    nonfinite = NonFiniteWatch(enabled=run.train.precision != "fp16", device=engine.device)
    # A checkpoint the decoupled writer still writes (pending): its files finished after the next step,
    # summed during the step after that (publishing), then published.
    pending = publishing = None
    while step < stop:
        step_loss, publishing = train_committing(session, sampler, consumed, watch, step=step + 1, pending=pending,
                                                 publishing=publishing, window=window)
        step, consumed, pending = step + 1, consumed + batch.global_batch, None
        window.add_step()
        probe.after_step(steps_left=stop - step)
        nonfinite.update(step, step_loss)
        window.breakdown.add_step()
        bar.update(1)
        done = step == stop
        logged = step % run.logging.every == 0 or done
        if logged:
            check_finite(run, nonfinite)
            last = window.metrics(step, step_loss, probe=probe, done=done)
            report(run, session, last, sinks=sinks, bar=bar)
        signum = stop_request.agreed()  # 0: none; else the stop signal the ranks agreed on
        preempted = signum != 0
        if publishing is not None and (done or preempted):  # the run ends at this step: published first
            publishing = publish_checkpoint(run, session, publishing, window=window, watch=watch)
        if checkpoint_due(run, step, done=done, preempted=preempted):
            check_finite(run, nonfinite)  # a diverged model is never saved over the last good one
            pending = save_checkpoint(run, session, step=step, consumed=consumed, window=window, watch=watch,
                                      wait=done or preempted)
        if logged:  # the next window starts after this step's evaluation and checkpoint
            window.restart()
        if preempted and not done:  # (on the last step the run is simply finished)
            stop_request.close()
            bar.close()
            preempt(run, session, step=step, signum=signum)
    watch.enter("done")
    stop_request.close()
    bar.close()
    if session.rank == 0:
        mark_finished(run.output_dir, step=step)  # exit 0 for any launcher, even if a signal comes now
        print(f"dsf: done at step {step}; checkpoints in {run.checkpoint_dir}", flush=True)
    return last


def start_steps(run: RunConfig, session: Session, sinks: Any, *, resume: bool) -> tuple[FlopsMeter, HangWatch,
                                                                                          dict[str, Any]]:
    """(the FLOPs meter, the hang watch, the baseline's metrics): the run's summary line and, on a
    fresh run with logging.eval_every, the evaluation the run is judged against (step 0)."""
    meter = FlopsMeter.for_run(run, session.model_config, world=session.dims.world)
    if session.rank == 0:
        clear_preempted(run.output_dir)
        print_summary(run, session, meter)
    last: dict[str, Any] = {}
    watch = HangWatch.for_run(run, device=session.engine.device)
    if not resume and run.logging.eval_every:
        watch.enter("eval", step=session.step)
        last = {"step": 0, "eval_loss": evaluate(session)}  # the baseline the run is judged against
        sinks.log(last, step=0)
    return meter, watch, last


def preempt(run: RunConfig, session: Session, *, step: int, signum: int) -> None:
    """End the run after the checkpoint of `step`, saved because of signal `signum` (on any rank):
    rank 0 marks the preemption (exit 143 for any launcher, protocol/exits.py) and says so in one line."""
    if session.rank == 0:
        mark_preempted(run.output_dir, step=step, checkpoint=ckpt.tag_for(step))
        print(f"dsf: stopped by {signal.Signals(signum).name} at step {step}; checkpoint {ckpt.tag_for(step)} "
              f"saved; continue with `dsf train ... --resume`", flush=True)
    raise Preempted(step)


def save_checkpoint(run: RunConfig, session: Session, *, step: int, consumed: int, window: Window,
                    watch: HangWatch, wait: bool) -> ckpt.Pending | None:
    """The checkpoint of `step` (checkpoints/checkpoint.py). With checkpoint.writer=decoupled it is
    left to DeepSpeed's background writer and returned pending (commit it after the next step), unless
    `wait` (the run's last checkpoint, or SIGTERM's): then, as with the sync writer, committed now."""
    watch.enter("checkpoint")
    low = ckpt.room_for_save(run.checkpoint_dir)  # the same answer on every rank
    if low is not None and (run.checkpoint.on_low_space == "stop" or wait):  # (the last save, SIGTERM's: never skipped)
        raise low_space_error(low)
    if low is not None:
        if session.rank == 0:
            print(f"dsf: warning: checkpoint of step {step} skipped (checkpoint.on_low_space=skip): {low}", flush=True)
        return None
    pending = ckpt.start_save(session.engine, run.checkpoint_dir, step=step, consumed_samples=consumed,
                              layout=session.dims)
    if wait or not ckpt.is_decoupled(session.engine):
        return commit_checkpoint(run, session, pending, window=window, watch=watch)
    return pending


def commit_checkpoint(run: RunConfig, session: Session, pending: ckpt.Pending, *, window: Window,
                      watch: HangWatch) -> None:
    """Commit `pending` now (it becomes `latest`): its files finished and published, the cost counted."""
    watch.enter("checkpoint")
    ckpt.finish_writes(session.engine, pending)
    publish_checkpoint(run, session, pending, window=window, watch=watch)


def publish_checkpoint(run: RunConfig, session: Session, pending: ckpt.Pending, *, window: Window,
                       watch: HangWatch) -> None:
    """Publish `pending` (its files finished and being summed: it becomes `latest`) and count what it
    cost the trainer in the window and in checkpoint_times.jsonl: with the decoupled writer, queuing the
    shards, the wait for DeepSpeed's writer inside the next optimizer step and the publishing; with the
    sync writer, the whole save. Rank 0 then removes what checkpoint.keep no longer keeps."""
    watch.enter("checkpoint")
    ckpt.publish(session.engine, pending)
    window.checkpoint_s += pending.seconds
    if session.rank == 0:  # what dsf launch's goodput count charges to checkpointing (a resume keeps it)
        record_checkpoint_time(run.output_dir, step=pending.step, seconds=pending.seconds)
        prune(run.checkpoint_dir, keep=run.checkpoint.keep, keep_every=run.checkpoint.keep_every)


def train_committing(session: Session, sampler: BlockSampler, consumed: int, watch: HangWatch, *, step: int,
                     pending: ckpt.Pending | None, publishing: ckpt.Pending | None,
                     window: Window) -> tuple[Any, ckpt.Pending | None]:
    """Train step `step` (train_watched); (its loss, the checkpoint to publish after the next step).
    A checkpoint DeepSpeed's decoupled writer still writes (`pending`) has its files finished after the
    step (DeepSpeed's engine.step() waits for the writer before the optimizer changes the weights) and
    summed in the background during the next one; `publishing`, summed during this one, is published
    after it. The pipeline engine's step does not wait for the writer, so there it is committed first."""
    run = session.run
    if pending is not None and session.dims.pp_enabled:
        pending = commit_checkpoint(run, session, pending, window=window, watch=watch)
    step_loss = train_watched(session, sampler, consumed, watch, step=step, committing=pending is not None)
    if pending is not None:
        watch.enter("checkpoint")
        ckpt.finish_writes(session.engine, pending)
    if publishing is not None:
        publish_checkpoint(run, session, publishing, window=window, watch=watch)
    return step_loss, pending


def train_watched(session: Session, sampler: BlockSampler, consumed: int, watch: HangWatch, *, step: int,
                  committing: bool = False) -> Any:
    """Train step `step` (train/step.py), each phase told to the rank's heartbeat; its loss. On the
    session's third step a fixed faults.hang_timeout is checked against the step time all ranks
    measured (one all-reduce). `committing`: a checkpoint's background write is still running, and the
    optimizer step waits for it (a checkpoint's time limit, not a step's)."""
    watch.enter("data", step=step)
    batches = one_step.step_batches(session.train_blocks, sampler, consumed)
    watch.timer.start()

    def enter(phase: str) -> None:
        watch.enter("checkpoint" if committing and phase == "optimizer step" else phase)

    step_loss = one_step.train_step(session.engine, batches, pipeline=session.dims.pp_enabled,
                                    loss_setup=session.loss_setup, enter=enter)
    for seconds in watch.timer.stop():  # the device's time of the steps it has finished (hang.StepTimer)
        watch.step_done(seconds=seconds)
    watch.trained += 1
    if watch.trained == 3 and watch.setting not in ("auto", 0):  # the same step on every rank: a collective
        watch.check_setting(mean_over_ranks(watch.median_step() or 0.0))
    return step_loss


def print_summary(run: RunConfig, session: Session, meter: FlopsMeter) -> None:
    """Rank 0's two lines on what is about to train: parameters, layout, batch, data, peak, loss, tf32."""
    dims, batch, train_blocks = session.dims, session.batch, session.train_blocks
    experts = describe_experts(session.model_config, ep=dims.ep)
    print(f"dsf: {session.num_parameters:,} parameters" + (f" ({experts})" if experts else "")
          + f" | world {dims.world} = {dims}" + (" sequence-parallel" if session.sequence_parallel else "") + " "
          f"| ZeRO-{dims.zero_stage} | batch {batch.micro_batch} x {batch.grad_accum} x {dims.dp}"
          f" = {batch.global_batch} | {len(train_blocks):,} train / {len(session.eval_blocks):,} eval "
          f"blocks of {run.data.seq_len} tokens | peak {meter.peak_per_rank / 1e12:.3g} TFLOP/s per rank "
          f"({meter.peak_source}) | compile {str(run.train.compile).lower()} | loss "
          + (f"in chunks of {session.loss_chunk_tokens} tokens" if session.loss_chunk_tokens else "whole logits")
          + f" | tf32 {'on' if tf32_in_use() else 'off'}", flush=True)

    print("dsf: data " + describe_store(train_blocks) + f" | store {train_blocks.directory}", flush=True)


def evaluate(session: Session) -> float:
    """The held-out loss (train/step.py's evaluate) with this session's engine, data and loss."""
    dims = session.dims
    return one_step.evaluate(session.engine, session.eval_blocks, micro_batch=session.batch.micro_batch,
                             dp_size=dims.dp, dp_rank=session.dp_rank, pipeline=dims.pp_enabled,
                             loss_setup=session.loss_setup)


class Window:
    """A logging window: its steps, their tokens/s and the metrics logged at its end.

    Each window's tokens/s is over its training time: compile seconds are taken out (reported as
    compile_s), and so are the evaluation and checkpoints after its last step (`restart` is called
    after them)."""

    def __init__(self, session: Session, meter: FlopsMeter, watch: HangWatch) -> None:
        run = session.run
        self.session, self.meter, self.watch = session, meter, watch
        self.tokens_per_step = session.batch.global_batch * run.data.seq_len
        self.breakdown = StepBreakdown(session.engine, enabled=run.logging.breakdown and not session.dims.pp_enabled)
        self.checkpoint_s = 0.0  # seconds saving checkpoints since the last record (logged with the next)
        self.restart()

    def restart(self) -> None:
        self.start, self.steps, self.compile_start = time.perf_counter(), 0, compile_seconds()

    def add_step(self) -> None:
        self.steps += 1

    def metrics(self, step: int, step_loss: Any, *, probe: CompileProbe, done: bool) -> dict[str, Any]:
        """What is logged at `step`, the window's last: loss, lr, tokens/s, MFU, the step's time
        breakdown, compile seconds, seconds spent saving checkpoints since the last record, the
        evaluation when due, fp16's skipped steps, a mixture of experts' aux loss and expert load."""
        run, engine = self.session.run, self.session.engine
        loss_value = mean_over_ranks(step_loss.item())
        compiling = compile_seconds() - self.compile_start
        elapsed = time.perf_counter() - self.start - compiling
        last = {"step": step, "loss": loss_value, "lr": engine.get_lr()[0],
                "tokens_per_s": self.tokens_per_step * self.steps / elapsed}
        last.update(self.meter.report(tokens_per_s=last["tokens_per_s"]))
        last.update(self.breakdown.read())
        if compiling > 0:
            last["compile_s"] = compiling
        if self.checkpoint_s > 0:  # what the goodput count (protocol/goodput.py) charges to checkpointing
            last["checkpoint_s"], self.checkpoint_s = self.checkpoint_s, 0.0
        probe.report_compiled(self.session.rank)
        if run.logging.eval_every and (step % run.logging.eval_every == 0 or done):
            self.watch.enter("eval")
            last["eval_loss"] = evaluate(self.session)
        if run.train.precision == "fp16":
            last["skipped_steps"] = engine.skipped_steps  # overflowing steps the loss scaler dropped
        if self.session.expert_load is not None:  # a mixture of experts: its router's figures
            last.update(self.session.expert_load.read())
        return last


def device_clock() -> float:
    """The host's clock once the device has caught up (a host synchronisation: for the two readings
    of the compile probe, not for every step; on a GPU the host otherwise times its own queueing)."""

    accelerator().synchronize()
    return time.perf_counter()


class CompileProbe:
    """train.compile=auto: time this session's eager steps 2..AUTO_PROBE_STEPS, then compile the
    engine or not (train/compiling.py's auto_compile); with train.compile=true, it compiled at
    start-up. Either way the first window after compiling says how long it took."""

    def __init__(self, run: RunConfig, session: Session, watch: HangWatch) -> None:
        self.engine, self.rank, self.watch = session.engine, session.rank, watch
        self.auto = run.train.compile == "auto"
        self.steps, self.start, self.compiled_note = 0, 0.0, run.train.compile is True

    def after_step(self, *, steps_left: int) -> None:
        self.steps += 1
        if self.auto and self.steps == 1:
            self.start = device_clock()
        elif self.auto and self.steps == AUTO_PROBE_STEPS:
            self.auto = False
            step_seconds = mean_over_ranks((device_clock() - self.start) / (AUTO_PROBE_STEPS - 1))
            verdict, why = auto_compile(step_seconds=step_seconds, steps_left=steps_left)
            if self.rank == 0:
                print(f"dsf: train.compile=auto: {why}", flush=True)
            if verdict:
                compile_engine(self.engine)
                self.watch.compiled()  # the next step compiles its kernels: the long limit
                self.compiled_note = True

    def report_compiled(self, rank: int) -> None:
        if self.compiled_note and rank == 0:
            print(f"dsf: compiled the model in {compile_seconds():.1f} s so far (kept out of tokens/s; "
                  f"kernels cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", flush=True)
            self.compiled_note = False


def report(run: RunConfig, session: Session, last: dict[str, Any], *, sinks: Any, bar: Any) -> None:
    """A window's metrics to the sinks, the progress bar, and (without it) rank 0's stdout."""
    sinks.log(last, step=last["step"])
    bar.set_postfix({k: f"{v:.4g}" for k, v in last.items() if k != "step"}, refresh=False)
    if session.rank == 0 and not run.logging.progress:
        print("dsf: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in last.items()), flush=True)


def checkpoint_due(run: RunConfig, step: int, *, done: bool, preempted: bool) -> bool:
    """Whether `step` saves: every checkpoint.every steps, at the end (checkpoint.save_final), on
    SIGTERM, and always when train.stop_after ends the run early (there is a run to resume)."""
    stopped_early = done and step < run.train.steps
    return ((preempted and not done) or (run.checkpoint.every and step % run.checkpoint.every == 0)
            or (done and run.checkpoint.save_final) or stopped_early)


def check_finite(run: RunConfig, nonfinite: NonFiniteWatch) -> None:
    """A UserError naming the first step whose loss was not finite, and the last good checkpoint."""
    bad = nonfinite.first_step()
    if bad is not None:
        good = ckpt.latest_tag(run.checkpoint_dir)
        raise UserError("loss", None, f"is not finite (nan or inf) at step {bad}; training stopped, "
                        + (f"{run.checkpoint_dir / good} is the last good checkpoint" if good
                           else "no checkpoint was saved"),
                        "lower train.lr or raise train.warmup_steps, then dsf train --resume")
