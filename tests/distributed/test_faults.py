"""Faults injected for real into 2-rank runs (CPU, gloo), and what survives each.

- a rank killed with SIGKILL: the job exits non-zero within 60 s, names the rank, leaves no process;
- SIGTERM, SIGINT or SIGHUP to any pid of the job (its process group, as SLURM sends before a
  preemption; deepspeed's runner alone; one rank; `dsf launch`): a checkpoint at the current step on
  every rank, nothing of the job left within 60 s, the exit code; `--resume` continues exactly each
  time; a signal after the last step leaves a finished job (exit 0);
- a crash while a checkpoint is written (rank 0 dies after DeepSpeed wrote the shards, before the
  commit): `latest` still names the previous checkpoint, which resumes exactly; the same while
  DeepSpeed's decoupled writer (checkpoint.writer=decoupled) writes them in the background;
- a truncated or missing checkpoint file: exit 2 naming the file and the previous checkpoint,
  nothing deleted;
- a NaN loss (fp32): training stops naming the step, the last good checkpoint stays `latest` and
  resumes exactly; with fp16, DeepSpeed's loss scaler skips the step and training goes on;
- resume at another data-parallel size: 2 ranks -> 4 with the same global batch, through
  deepspeed's universal checkpoint, within 1e-4 of the 2-rank run.

"Exactly" is 1e-6 relative against one uninterrupted run of the same config, computed in the test.
The faults come from outside (signals) or from workers/faults.py, the real `dsf train` with rank 0
made to die at a named point of a checkpoint save (`--fault checkpoint@STEP`) or its loss poisoned
(`--fault nan@STEP`); dsframework itself has no fault hooks.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from dsframework.checkpoints.checkpoint import verify
from dsframework.checkpoints.export import export_checkpoint
from dsframework.checkpoints.integrity import step_tags
from dsframework.errors import UserError

from tests.distributed.launcher import (BIN, REPO, TINY_YAML, Prefixed, assert_close, dsf_started, free_port, losses,
                                        one_line, rank_env, read_metrics, run_overrides, train_args, train_run)

# 6 steps, a checkpoint every 2 (global_step2/4/6), ZeRO-1 so the optimizer state is sharded.
COMMON = ["parallel.zero_stage=1", "train.steps=6", "checkpoint.every=2", "checkpoint.save_final=true"]


# The schedule of a long run (100000 steps) cut short: what SIGTERM preempts.
LONG = ["train.steps=100000", "train.warmup_steps=2"]
LONG_STRAIGHT_STEPS = 200  # the signalled run's uninterrupted twin stops here (4 stops: 108 steps seen here)


@pytest.fixture(scope="module")
def straight(straight_runs) -> tuple[Path, dict[int, float]]:
    """The uninterrupted run every fault is compared with (and whose checkpoints some reuse)."""
    return straight_runs["common"]


STRAIGHT = {"common": COMMON, "long": [*LONG, f"train.stop_after={LONG_STRAIGHT_STEPS}"]}


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs at world 2 (named faults-<name>): the uninterrupted runs, "common"
    (COMMON) and "long" (LONG, stopped after LONG_STRAIGHT_STEPS: the twin of the preempted run)."""
    return [f"faults-{name}|eager|{';'.join(o)}" for name, o in STRAIGHT.items()] if ranks == 2 else []


@pytest.fixture(scope="module")
def straight_runs(shared_runs) -> dict[str, tuple[Path, dict[int, float]]]:
    """name -> (output_dir, step -> loss) of the uninterrupted runs (conftest.shared_runs' launch)."""
    root = Prefixed(shared_runs(2)[0], "faults-")
    return {name: (root / name, losses(root / name)) for name in STRAIGHT}


def start_job(output_dir: Path, overrides: list[str], *, log: Path, env: dict[str, str] | None = None,
              flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """`deepspeed --num_gpus 2 dsf train ...` in its own session (a job a signal can be sent to)."""
    sets = [a for o in run_overrides(output_dir, overrides) for a in ("--set", o)]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(BIN / "dsf"), "train", str(TINY_YAML), *sets, *flags]
    with open(log, "w") as out:  # a file, not a pipe: ranks outliving the launcher cannot block us
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**rank_env(), **(env or {})})


def session_processes(sid: int) -> list[psutil.Process]:
    """The live processes of the job started as session leader `sid` (zombies do not count)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def wait_for(predicate, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def wait_for_step(output_dir: Path, step: int, job: subprocess.Popen, log: Path) -> None:
    def reached() -> bool:
        assert job.poll() is None, f"job ended early ({job.returncode}):\n{log.read_text()[-3000:]}"
        return max(losses(output_dir), default=0) >= step if (output_dir / "metrics.jsonl").exists() else False

    wait_for(reached, timeout=120, what=f"step {step}")


FAULTS_WORKER = REPO / "tests" / "distributed" / "workers" / "faults.py"


def dsf_train_with_fault(output_dir: Path, overrides: list[str], *, fault: str, fp16_on_cpu: bool = False,
                         timeout: int = 300) -> subprocess.CompletedProcess:
    """A 2-rank `dsf train` with `fault` (`nan@4`, `checkpoint@4`, ...) injected on rank 0 by
    workers/faults.py: returns its exit code and output (the caller judges)."""
    sets = [a for o in run_overrides(output_dir, overrides) for a in ("--set", o)]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(FAULTS_WORKER),
           *(("--fp16-on-cpu",) if fp16_on_cpu else ()), "--fault", fault, "train", str(TINY_YAML), *sets]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=rank_env())


def test_killed_rank_ends_the_job_and_names_it(tmp_path):
    log = tmp_path / "job.log"
    job = start_job(tmp_path / "run", LONG, log=log)
    try:
        wait_for_step(tmp_path / "run", 2, job, log)
        trainers = {int(p.environ()["RANK"]): p for p in session_processes(job.pid)
                    if p.environ().get("DSF_RANK_TRAINER") == "1"}
        assert sorted(trainers) == [0, 1], "one trainer process per rank under its watcher"
        killed_at = time.monotonic()
        trainers[1].send_signal(signal.SIGKILL)
        code = job.wait(timeout=60)
        took = time.monotonic() - killed_at
        wait_for(lambda: not session_processes(job.pid), timeout=10, what="the job's processes to end")
    finally:
        for proc in session_processes(job.pid):
            proc.kill()
    output = log.read_text()
    assert code != 0 and took < 60, (code, took)
    assert "rank 1 (local rank 1" in output and "killed by SIGKILL" in output, output[-3000:]


def job_processes(output_dir: Path) -> list[psutil.Process]:
    """The live processes of the job writing to `output_dir`, wherever they run from (dsf launch puts
    deepspeed's runner in a session of its own): the runner, its per-node launcher, the ranks."""
    found = []
    for proc in psutil.process_iter():
        try:
            if f"output_dir={output_dir}" in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def trainer(output_dir: Path, rank: int) -> psutil.Process:
    """Rank `rank`'s trainer (the rank watcher's child) of the job writing to `output_dir`."""
    for proc in job_processes(output_dir):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("DSF_RANK_TRAINER") == "1" and proc.environ().get("RANK") == str(rank):
                return proc
    raise AssertionError(f"rank {rank}'s trainer not found")


def start_launch(output_dir: Path, overrides: list[str], *, log: Path) -> subprocess.Popen:
    """`dsf launch tiny.yaml --num-gpus 2 --resume`, as a user types it."""
    sets = [a for o in run_overrides(output_dir, overrides) for a in ("--set", o)]
    cmd = [str(BIN / "dsf"), "launch", str(TINY_YAML), "--num-gpus", "2", "--master-port", str(free_port()),
           *sets, "--resume"]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env=rank_env())


# The stop signals, each to another pid of the job, one after the other on one run: each segment
# resumes from the checkpoint the previous one saved (how the job ended, where the signal went).
SIGNALLED = (("deepspeed", "group", signal.SIGTERM),  # every process of the job, as SLURM does
             ("deepspeed", "runner", signal.SIGINT),  # deepspeed's runner alone: it dies at once
             ("dsf launch", "rank 1", signal.SIGHUP),  # one rank's trainer
             ("dsf launch", "dsf launch", signal.SIGTERM))


# The first job also checkpoints every 2 steps keeping 2 (checkpoint.keep), and while it trains a second
# `dsf train` (plain, --overwrite, --resume) and `dsf export --overwrite` are aimed at its output_dir.
FIRST_JOB = ["checkpoint.every=2", "checkpoint.keep=2"]


def signal_segment(out: Path, log: Path, starts: str, target: str, sig: signal.Signals, *, after: int,
                   while_live=None) -> tuple:
    """Run the job from `out`'s latest checkpoint (from scratch for the first, with FIRST_JOB), call
    `while_live(out)` once step `after` + 2 is logged, then send `sig` to `target`, and wait for every
    process of the job to end: (exit code, seconds from the signal to the last process, output,
    what `while_live` returned)."""
    overrides = LONG if after else [*LONG, *FIRST_JOB]
    resume = ("--resume",) if after else ()
    job = (start_job(out, overrides, log=log, flags=resume) if starts == "deepspeed"
           else start_launch(out, overrides, log=log))
    try:
        wait_for_step(out, after + 2, job, log)
        seen = while_live(out) if while_live else None
        assert job.poll() is None, f"the job ended before its signal:\n{log.read_text()[-3000:]}"
        signalled = time.monotonic()
        if target == "group":
            os.killpg(job.pid, sig)
        else:
            (trainer(out, 1) if target == "rank 1" else job).send_signal(sig)
        code = job.wait(timeout=60)
        wait_for(lambda: not job_processes(out), timeout=60 - (time.monotonic() - signalled),
                 what="every process of the job to end")
        took = time.monotonic() - signalled
    finally:
        for proc in job_processes(out):
            proc.kill()
        if job.poll() is None:
            job.kill()
    return code, took, log.read_text(), seen


def refused_while_live(out: Path) -> tuple[int, dict[str, str]]:
    """(the live rank 0's pid, the one line of each command aimed at its output_dir `out`): a second
    `dsf train` plain, with --overwrite and with --resume, each its own process, and `dsf export
    --overwrite` onto it (in this process: its UserError is the CLI's one line and exit 2)."""
    wait_for(lambda: (out / "checkpoints" / "latest").is_file(), timeout=60, what="its first checkpoint")
    trainers = [trainer(out, 0), trainer(out, 1)]
    for proc in trainers:  # paused, the lock held, while the commands start (~10 s), so the run is still
        proc.suspend()     # short when its SIGTERM comes (the straight twin is LONG_STRAIGHT_STEPS long)
    try:
        second = {"plain": dsf_started(*train_args(out, COMMON)),
                  "overwrite": dsf_started(*train_args(out, COMMON, "--overwrite")),
                  "resume": dsf_started(*train_args(out, COMMON, "--resume"))}
        with pytest.raises(UserError) as export:
            export_checkpoint(out / "checkpoints", out, overwrite=True)
        lines = {name: one_line(proc) for name, proc in second.items()}
    finally:
        for proc in trainers:  # (within the hang watch's 60 s: faults.hang_timeout=auto)
            proc.resume()
    return trainers[0].pid, {**lines, "export": str(export.value)}


@pytest.fixture(scope="module")
def signalled(tmp_path_factory) -> tuple[Path, list[tuple], tuple[int, dict[str, str]]]:
    """The run stopped by each of SIGNALLED in turn: (output_dir, [(code, took, output, stopped step,
    `latest` then, the partial checkpoints then, the committed ones then)], refused_while_live's answer
    in the first job)."""
    work = tmp_path_factory.mktemp("signalled")
    out, ends, stopped, live = work / "run", [], 0, None
    for i, (starts, target, sig) in enumerate(SIGNALLED):
        code, took, output, seen = signal_segment(out, work / f"job{i}.log", starts, target, sig, after=stopped,
                                                  while_live=None if i else refused_while_live)
        live = live or seen
        stopped = max(losses(out))
        ckpts = out / "checkpoints"
        latest = (ckpts / "latest").read_text().strip()
        ends.append((code, took, output, stopped, latest, list(ckpts.glob("*.partial")), step_tags(ckpts)))
    return out, ends, live


@pytest.mark.parametrize("segment", range(len(SIGNALLED)),
                         ids=[f"{sig.name}-to-{target}-of-{starts}" for starts, target, sig in SIGNALLED])
def test_a_stop_signal_to_any_pid_checkpoints_and_ends_the_whole_job(signalled, segment):
    out, ends, _ = signalled
    starts, target, sig = SIGNALLED[segment]
    code, took, output, stopped, latest, partial, _ = ends[segment]
    assert took < 60, f"the job's last process ended {took:.0f} s after the signal"
    said = [line for line in output.splitlines() if line.startswith("dsf: stopped by ")]
    # the ranks agree on the largest signal any had: DeepSpeed's per-node launcher passes each on as SIGTERM
    name = "SIGHUP" if target == "rank 1" else "SIGTERM"
    assert said == [f"dsf: stopped by {name} at step {stopped}; checkpoint global_step{stopped} saved; "
                    f"continue with `dsf train ... --resume`"], output[-3000:]
    if target != "runner":  # (deepspeed's runner prints its own KeyboardInterrupt as it dies)
        assert "Traceback" not in output, output[-3000:]
    if starts == "dsf launch":  # the job's code, whatever pid was signalled (deepspeed's runner has its own)
        assert code == 143, output[-3000:]
    if target == "runner":
        assert "lost its parent" in output, "the ranks noticed their launcher was orphaned"
    assert latest == f"global_step{stopped}" and not partial, (latest, partial)
    for earlier in (end[3] for end in ends):  # nothing deleted: every stop's checkpoint is still there
        assert (out / "checkpoints" / f"global_step{earlier}" / "dsf_manifest.json").is_file()


def test_a_live_run_refuses_a_second_run_and_an_export_onto_it(signalled):
    """The first job, while it trained: every command aimed at its output_dir refused in one line naming
    the live rank 0's pid, the job going on to its signal; its metrics one run's, none interleaved;
    checkpoint.keep=2 left two checkpoints, the newest the one its SIGTERM saved."""
    out, ends, (rank0, lines) = signalled
    code, took, output, stopped, latest, partial, tags = ends[0]
    for name in ("plain", "overwrite", "resume"):
        assert f"output_dir='{out}': is in use by another run (host " in lines[name], lines[name]
        assert f"pid {rank0}" in lines[name], (rank0, lines[name])
    assert lines["export"].startswith(f"OUT_DIR='{out}': is a run's output_dir, in use by host "), lines["export"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "one run's metrics at a time, none lost or interleaved"
    assert len(tags) == 2 and tags[-1] == latest == f"global_step{stopped}", tags


def test_every_stop_resumed_exactly_and_a_signal_after_the_last_step_is_finished(tmp_path, signalled, straight_runs):
    """The run stopped by each signal and resumed each time, then run to its end under dsf launch, with
    SIGTERM to dsf launch once rank 0 says it is done: exit 0 (finished), not 143 (preempted)."""
    out, ends, _ = signalled
    stopped = ends[-1][3]
    assert stopped + 2 <= LONG_STRAIGHT_STEPS, f"preempted at step {stopped}, later than the test expects"
    log = tmp_path / "last.log"
    job = start_launch(out, [*LONG, f"train.stop_after={stopped + 2}"], log=log)
    try:
        wait_for(lambda: "dsf: done at step" in log.read_text() or job.poll() is not None, timeout=180,
                 what="the run's end")
        with contextlib.suppress(ProcessLookupError):
            job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=60)
        wait_for(lambda: not job_processes(out), timeout=60, what="every process of the job to end")
    finally:
        for proc in job_processes(out):
            proc.kill()
    assert code == 0, log.read_text()[-3000:]
    resumed = losses(out)
    straight = {step: loss for step, loss in straight_runs["long"][1].items() if step <= stopped + 2}
    assert sorted(resumed) == list(range(1, stopped + 3))
    # exactly, over ~100 steps and 5 launches: each resume replays DeepSpeed's host Adam's beta^t products
    # (checkpoints/adam_products.py; without it the chain drifted up to 3.4e-5 from the straight run)
    assert_close(resumed, straight, rtol=1e-6, what="stopped by each signal + resumed vs straight")


def test_crash_during_checkpoint_keeps_latest(tmp_path, straight):
    out = tmp_path / "crashed"
    proc = dsf_train_with_fault(out, COMMON, fault="checkpoint@4")
    assert proc.returncode != 0, "rank 0 died in the middle of the step-4 checkpoint"
    assert "fault checkpoint@4" in proc.stdout + proc.stderr, "the injected fault, not something else, ended it"
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step2"
    assert (ckpts / "global_step4.partial").is_dir() and not (ckpts / "global_step4").exists()

    resumed = train_run(out, COMMON, flags=("--resume",))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert_close(resumed, straight[1], rtol=1e-6, what="resumed from global_step2 after the crash")
    assert not (ckpts / "global_step4.partial").exists(), "the next save cleans the leftover"


def test_crash_during_decoupled_write_keeps_latest_and_its_checkpoints_resume_exactly(tmp_path, straight):
    """checkpoint.writer=decoupled: DeepSpeed's background process writes each checkpoint while the next
    step runs. Rank 0 and its writer die while the step-4 shards are being written (queued, not
    committed): `latest` names global_step2, itself written in the background and committed after
    step 3, and resuming from it gives the straight run's losses; the resumed run's last checkpoint is
    committed before it exits."""
    out, decoupled = tmp_path / "crashed", [*COMMON, "checkpoint.writer=decoupled"]
    proc = dsf_train_with_fault(out, decoupled, fault="checkpoint@4")
    assert proc.returncode != 0 and "fault checkpoint@4" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step2"
    assert not (ckpts / "global_step4").exists() and not (ckpts / "global_step4.partial" / "dsf_manifest.json").exists()

    resumed = train_run(out, decoupled, flags=("--resume",))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert_close(resumed, straight[1], rtol=1e-6, what="resumed from a decoupled-written global_step2")
    assert (ckpts / "latest").read_text().strip() == "global_step6"
    assert not list(ckpts.glob("*.partial"))
    for tag in ("global_step4", "global_step6"):  # every file of every rank, as the manifest lists them
        assert verify(ckpts, tag).files.keys() >= {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                      "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                                      "mp_rank_00_model_states.pt", "rng_rank1.pt"}
    stalls = [json.loads(line)["step"] for line in (out / "checkpoint_times.jsonl").read_text().splitlines()]
    assert stalls == [2, 4, 6], "each checkpoint's stall is recorded once, when it is committed"


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_checkpoint_file_is_named(tmp_path, straight, damage):
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(straight[0] / "checkpoints", ckpts)
    shutil.copy(straight[0] / "metrics.jsonl", tmp_path / "run" / "metrics.jsonl")
    victim = ckpts / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = victim.stat().st_size
    if damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(size // 2)
    else:
        victim.unlink()
    before = sorted(p.relative_to(ckpts) for p in ckpts.rglob("*"))

    # Checked before any rank starts its engine, so a plain single-process resume shows it.
    sets = [a for o in run_overrides(tmp_path / "run", COMMON) for a in ("--set", o)]
    proc = subprocess.run([str(BIN / "dsf"), "train", str(TINY_YAML), *sets, "--resume"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=rank_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(victim) in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert ("truncated" if damage == "truncate" else "missing") in lines[0]
    assert "echo global_step4 >" in lines[0], "the fix names the previous checkpoint"
    assert sorted(p.relative_to(ckpts) for p in ckpts.rglob("*")) == before, "nothing deleted or written"
    # The fix the message gives (latest -> the previous checkpoint) is what the crash test resumes.


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, straight):
    out = tmp_path / "nan"
    proc = dsf_train_with_fault(out, COMMON, fault="nan@4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "loss: is not finite (nan or inf) at step 4" in proc.stderr
    assert "global_step2 is the last good checkpoint" in proc.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step2"
    assert not (ckpts / "global_step4").exists() and not (ckpts / "global_step4.partial").exists()
    assert sorted(losses(out)) == [1, 2, 3], "steps up to the divergence were logged"

    resumed = train_run(out, COMMON, flags=("--resume",))
    assert_close(resumed, straight[1], rtol=1e-6, what="resumed from global_step2 after the NaN")


def test_resume_on_more_ranks_through_universal_checkpoint(tmp_path, straight):
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(straight[0] / "checkpoints", ckpts)
    shutil.copy(straight[0] / "metrics.jsonl", tmp_path / "run" / "metrics.jsonl")
    (ckpts / "latest").write_text("global_step2")  # saved at dp 2 (micro 4 x accum 1 x dp 2 = 8)

    resumed = train_run(tmp_path / "run", COMMON, num_ranks=4, flags=("--resume",))  # 2 x 1 x 4 = 8
    assert (ckpts / "global_step2.universal").is_dir()
    assert_close({s: resumed[s] for s in range(3, 7)}, {s: straight[1][s] for s in range(3, 7)}, rtol=1e-4,
                 what="steps 3-6 on 4 ranks vs the 2-rank run")


def test_fp16_loss_scaler_skips_a_nan_step(tmp_path):
    """With fp16, an overflowing step is DeepSpeed's to skip (dynamic loss scaling), not a stop."""
    out = tmp_path / "fp16"
    proc = dsf_train_with_fault(out, ["parallel.zero_stage=1", "train.precision=fp16"], fault="nan@3",
                                fp16_on_cpu=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {m["step"]: m for m in read_metrics(out)}
    assert [records[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert records[3]["lr"] == records[2]["lr"], "the skipped step did not advance the lr schedule"
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5, 6, 7, 8))
    assert records[3]["loss"] is None, "the overflowing step's loss is null in metrics.jsonl (strict JSON)"
