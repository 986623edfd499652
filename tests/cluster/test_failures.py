"""What a user sees when a node fails under `dsf launch` (pdsh) on two real nodes, and SLURM
preemption: each failure ends the job within 60 s, one line of the output names the node and the
cause, and no process of the job is left on any node.

- node1's sshd is down: pdsh cannot reach it (connection refused);
- node1 lacks the venv (a tmpfs hides /work/main/.venv in node1's mount namespace);
- a rank on node1 is killed with SIGKILL once training has started;
- a rank on node1 is stopped (SIGSTOP) once training has started: caught as hung (faults.hang_timeout);
- node1 dies whole under `--max-restarts 1`: the job goes on without it, re-planned, and finishes;
- `dsf launch --check` passes with both nodes up and names node1 (exit 2) with its sshd down;
- `scancel --signal=TERM` (what SLURM sends before preemption) during an sbatch training leaves a
  checkpoint at the step it stopped at; resuming it continues exactly (1e-6);
- under SLURM with `--max-restarts 2`, a rank killed twice on node1: restarted inside the allocation,
  then without node1, re-planned, and finished.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.jobs import (REFERENCE_STEPS, UNTIL_STOPPED, dsf_launch_cmd, job_processes, launch_args,
                               node_env, run_on)
from tests.cluster.nodes import missing, wait_until
from tests.cluster.test_launchers import TIMEOUT, assert_matches, job_state, sbatch, wait_job
from tests.distributed.launcher import BIN, REPO, assert_close, last_logged_step, launch, losses

pytestmark = pytest.mark.timeout(600)  # a watchdog: a hang fails, the tear-down still runs
LIMIT = 60  # seconds from the failure to the job's exit


@pytest.fixture
def pdsh_cluster(clean):
    if why := missing("pdsh"):
        pytest.skip(why)
    return clean


def one_line(output: str, *needles: str) -> str | None:
    """The first line of `output` holding every needle (case-insensitive)."""
    return next((line for line in output.splitlines() if all(n.lower() in line.lower() for n in needles)), None)


def assert_nothing_left(cluster) -> None:
    try:
        wait_until(lambda: not job_processes(cluster), timeout=10, what="the job's processes to end")
    except TimeoutError:
        left = job_processes(cluster)
        pytest.fail("processes of the job left behind:\n" + "\n".join(
            f"{node}: {pid} {line[:200]}" for node, procs in left.items() for pid, line in procs))


def failed_launch(cluster, tmp_path, *, overrides=()) -> tuple[int | None, str, float]:
    code, output, seconds = run_on(cluster, 0, dsf_launch_cmd(tmp_path, "pdsh", overrides=list(overrides)),
                                   cwd=tmp_path, timeout=LIMIT + 15, log=tmp_path / "job.log")
    print(f"exit {code} after {seconds:.1f} s\n{output[-3000:]}")
    return code, output, seconds


def test_node_without_sshd_ends_the_job_and_is_named(pdsh_cluster, tmp_path):
    cluster = pdsh_cluster
    cluster.stop_sshd(1)
    try:
        code, output, seconds = failed_launch(cluster, tmp_path)
        assert_nothing_left(cluster)
    finally:
        cluster.start_sshd(1)
    assert code not in (0, None) and seconds < LIMIT, f"exit {code} after {seconds:.0f} s"
    assert one_line(output, "node1", "connection refused"), output[-3000:]


def test_node_without_the_venv_ends_the_job_and_is_named(pdsh_cluster, tmp_path):
    cluster = pdsh_cluster
    venv = str(REPO / ".venv")
    hide = cluster.run(1, ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", venv], timeout=10)
    assert hide.returncode == 0, hide.stderr
    try:
        assert cluster.run(1, ["test", "-e", f"{venv}/bin/python"]).returncode != 0, "node1 sees no venv"
        code, output, seconds = failed_launch(cluster, tmp_path)
        assert_nothing_left(cluster)
    finally:
        cluster.run(1, ["umount", venv], timeout=10)
    assert code not in (0, None) and seconds < LIMIT, f"exit {code} after {seconds:.0f} s"
    assert one_line(output, "node1", f"{venv}/bin/python", "same checkout"), output[-3000:]  # the fix fits the cause


def trainers(cluster, node: int) -> dict[int, int]:
    """RANK -> pid of the trainer processes (dsf's watched child, DSF_RANK_TRAINER=1) on `node`."""
    found = {}
    for pid, _ in cluster.processes(node, "dsframework.commands.cli"):
        try:
            env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        except OSError:
            continue
        if env.get("DSF_RANK_TRAINER") == "1":
            found[int(env["RANK"])] = pid
    return found


def signal_the_job(cluster, tmp_path, sig: int, victim, *, overrides=()) -> tuple[int | None, float, str]:
    """Start the 2 x 2 job (node1 runs ranks 2 and 3), send `sig` to the pid `victim(cluster)` names once
    step 1 is logged on both nodes, wait for the job's end and for nothing of it to be left: (exit code,
    seconds from the signal to the end, the output)."""
    out = tmp_path / "out"
    job = cluster.popen(0, dsf_launch_cmd(tmp_path, "pdsh", overrides=[*UNTIL_STOPPED, *overrides]),
                        log=tmp_path / "job.log", cwd=tmp_path, env=node_env(cluster))
    try:
        def started() -> bool:
            assert job.poll() is None, f"job ended early ({job.returncode}):\n{(tmp_path / 'job.log').read_text()[-3000:]}"
            return last_logged_step(out / "metrics.jsonl") >= 1 and len(trainers(cluster, 1)) == 2

        wait_until(started, timeout=TIMEOUT, what="step 1 on both nodes", every=0.3)
        os.kill(victim(cluster), sig)
        sent = time.monotonic()
        try:
            code = job.wait(timeout=LIMIT + 15)
        except Exception:
            code = None
        seconds = time.monotonic() - sent
        assert_nothing_left(cluster)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return code, seconds, (tmp_path / "job.log").read_text()


def rank_3_on_node1(cluster) -> int:
    victims = trainers(cluster, 1)
    assert sorted(victims) == [2, 3], f"node1 runs ranks 2 and 3: {victims}"
    return victims[3]


def rank_failure_on_node1(cluster, tmp_path, sig: int, *, overrides=()) -> tuple[int | None, float, str]:
    """`sig` to rank 3's trainer (on node1): signal_the_job's (exit code, seconds, output)."""
    return signal_the_job(cluster, tmp_path, sig, rank_3_on_node1, overrides=overrides)


def test_rank_killed_on_node1_ends_the_job_and_is_named(pdsh_cluster, tmp_path):
    code, seconds, output = rank_failure_on_node1(pdsh_cluster, tmp_path, signal.SIGKILL)
    assert code not in (0, None) and seconds < LIMIT, f"exit {code} {seconds:.0f} s after the kill\n{output[-3000:]}"
    assert one_line(output, "node1", "rank 3", "SIGKILL"), output[-3000:]


HANG_TIMEOUT = 10


def test_rank_stopped_on_node1_is_caught_as_hung_and_named(pdsh_cluster, tmp_path):
    """SIGSTOP: the rank neither dies nor answers, and its peers wait in their next collective.
    Its watcher finds no heartbeat for faults.hang_timeout seconds and the job stops within
    hang_timeout + 15 s, one line naming node1, rank 3 and the phase it was in. (No evaluation or
    periodic checkpoint runs: the stop lands in a training phase, whose limit is the setting.)"""
    code, seconds, output = rank_failure_on_node1(
        pdsh_cluster, tmp_path, signal.SIGSTOP,
        overrides=[f"faults.hang_timeout={HANG_TIMEOUT}", "logging.eval_every=0", "checkpoint.every=0"])
    assert code not in (0, None) and seconds < HANG_TIMEOUT + 15, \
        f"exit {code} {seconds:.0f} s after SIGSTOP\n{output[-3000:]}"
    print(f"SIGSTOP -> the job ended {seconds:.1f} s later (hang_timeout {HANG_TIMEOUT} s)")
    line = one_line(output, "node1", "rank 3", "hung: no progress for")
    assert line and "its process is stopped" in line and " of step " in line, output[-3000:]


def dsf_launch_pid(cluster) -> int:
    launcher = [pid for pid, line in cluster.processes(0, "dsf launch") if "python" in line]
    assert len(launcher) == 1, cluster.processes(0, "dsf launch")
    return launcher[0]


def test_sigterm_to_dsf_launch_alone_checkpoints_on_every_node_and_leaves_nothing(pdsh_cluster, tmp_path):
    """SIGTERM to `dsf launch`'s pid alone (what `kill`, a supervisor or a scheduler sends to the pid it
    knows), pdsh across 2 nodes x 2 ranks: every rank stops at one agreed step with a checkpoint,
    `dsf launch` exits 143 (preempted, steps remain) within 60 s, and nothing of the job is left on
    either node. (The same signal to the deepspeed runner, its group and one rank on one node:
    tests/distributed/test_faults.py; a preempted checkpoint resumed exactly across nodes: SLURM's below.)"""
    out = tmp_path / "out"
    code, seconds, output = signal_the_job(pdsh_cluster, tmp_path, signal.SIGTERM, dsf_launch_pid)
    stopped = max(losses(out))
    assert code == 143 and seconds < 60, f"exit {code} {seconds:.0f} s after SIGTERM\n{output[-3000:]}"
    assert f"stopped by SIGTERM at step {stopped}" in output, output[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == f"global_step{stopped}"
    assert not list((out / "checkpoints").glob("*.partial"))


RESTART_STEPS, RESTART_EVERY = 24, 4


def kill_node_whole(cluster, k: int) -> None:
    """Node k dies: every process of the job there and its sshd (listener and sessions) killed at once."""
    cluster.sshd.pop(k, None)
    for pid, _ in cluster.processes(k, "sshd", "deepspeed", "dsframework", "/dsf ", "pdsh"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_node_lost_mid_run_is_left_out_and_the_job_finishes_replanned(pdsh_cluster, tmp_path):
    """tp 2 x pp 2 x dp 1 on 2 nodes x 2 ranks, `--max-restarts 1`; node1 dies whole past step 5.
    Unattended, the job leaves node1 out (its sshd refuses the pre-flight), re-plans for node0's 2
    ranks (tp 2 kept: it fits a node; the planner drops pp) and finishes all steps from the latest
    checkpoint; those steps equal a run resumed by hand from a copy of that checkpoint at the same
    layout within 1e-5."""
    cluster, out = pdsh_cluster, tmp_path / "out"
    overrides = ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", f"train.stop_after={RESTART_STEPS}",
                 f"checkpoint.every={RESTART_EVERY}"]
    job = cluster.popen(0, dsf_launch_cmd(tmp_path, "pdsh", overrides=overrides, flags=["--max-restarts", "1"]),
                        log=tmp_path / "job.log", cwd=tmp_path, env=node_env(cluster))
    try:
        def past_step_5() -> bool:
            assert job.poll() is None, \
                f"job ended early ({job.returncode}):\n{(tmp_path / 'job.log').read_text()[-3000:]}"
            return last_logged_step(out / "metrics.jsonl") >= 5

        wait_until(past_step_5, timeout=TIMEOUT, what="step 5", every=0.2)
        kill_node_whole(cluster, 1)
        code = job.wait(timeout=TIMEOUT)
        assert_nothing_left(cluster)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        cluster.start_sshd(1)
    output = (tmp_path / "job.log").read_text()
    assert code == 0, output[-4000:]
    (restart,) = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
    assert restart["nodes"] == ["node0"] and "node1" in restart["left_out"], restart
    assert restart["layout"] == "tp 2 x pp 1 x cp 1 x dp 1" and "parallel.pp=1" in restart["overrides"], restart
    assert json.loads((out / "blocklist.json").read_text()).keys() == {"node1"}
    assert_resumed_as_by_hand(out, restart, overrides, tmp_path / "by-hand", what="restarted on node0")


def assert_resumed_as_by_hand(out: Path, restart: dict, overrides: list[str], by_hand: Path, *, what: str) -> None:
    """Every step 1..RESTART_STEPS logged, and those after `restart` (restarts.jsonl's entry) equal
    the same checkpoint resumed by hand at the layout the restart chose, on node0's 2 ranks (1e-5)."""
    got = losses(out)
    assert sorted(got) == list(range(1, RESTART_STEPS + 1)), sorted(got)
    resumed_at = int(restart["resumes"].removeprefix("global_step"))
    shutil.copytree(out / "checkpoints", by_hand / "checkpoints", ignore=lambda folder, names: [
        n for n in names if n.startswith("global_step") and n != restart["resumes"]])
    (by_hand / "checkpoints" / "latest").write_text(restart["resumes"])
    args = launch_args(by_hand, [*overrides, *restart["overrides"]])
    launch([str(BIN / "dsf"), "train", *args, "--resume"], num_ranks=2, timeout=300)
    want = losses(by_hand)
    assert sorted(want) == list(range(resumed_at + 1, RESTART_STEPS + 1)), sorted(want)
    assert_close({s: got[s] for s in want}, want, rtol=1e-5, what=f"{what} vs resumed by hand")


def test_check_reports_every_host_then_names_node1_without_sshd(pdsh_cluster, tmp_path):
    cluster = pdsh_cluster
    code, output, _ = run_on(cluster, 0, dsf_launch_cmd(tmp_path, "pdsh", flags=["--check"]), cwd=tmp_path,
                             timeout=60, log=tmp_path / "check.log")
    assert code == 0, output[-3000:]
    assert one_line(output, "node1", "ok"), output[-3000:]
    assert not job_processes(cluster)
    cluster.stop_sshd(1)
    try:
        code, output, seconds = run_on(cluster, 0, dsf_launch_cmd(tmp_path, "pdsh", flags=["--check"]), cwd=tmp_path,
                                       timeout=60, log=tmp_path / "check-down.log")
    finally:
        cluster.start_sshd(1)
    assert code == 2, output[-3000:]
    assert one_line(output, "node1", "connection refused"), output[-3000:]
    assert not one_line(output, "node0", "refused"), "node0 is fine"


# --- SLURM preemption ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def preempted(slurm, tmp_path_factory):
    """An sbatch training stopped by `scancel --signal=TERM` once it has logged step 1:
    (workdir, job id, the job's output, seconds from the signal to the job's end, the last step logged,
    the checkpoint `latest` names then)."""
    workdir = tmp_path_factory.mktemp("preempted")
    out = workdir / "out"
    job = sbatch(slurm, workdir, launch_args(out, UNTIL_STOPPED))

    def running() -> bool:
        state = job_state(slurm, job)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job} {state} before step 1:\n" + \
            (workdir / f"slurm-{job}.out").read_text()[-3000:]
        return last_logged_step(out / "metrics.jsonl") >= 1

    wait_until(running, timeout=TIMEOUT, what=f"job {job} to reach step 1", every=0.2)
    env = {**node_env(slurm), **slurm.slurm_env()}
    cancel = slurm.run(0, ["scancel", "--signal=TERM", job], env=env, timeout=15)
    assert cancel.returncode == 0, cancel.stderr
    sent = time.monotonic()
    state = wait_job(slurm, job, timeout=LIMIT + 30)
    took = time.monotonic() - sent
    output = (workdir / f"slurm-{job}.out").read_text()
    shown = slurm.run(0, ["scontrol", "-o", "show", "job", job], env=env, timeout=15).stdout
    exit_code = re.search(r"ExitCode=(\d+):", shown)
    print(f"preempted job {job}: {state} {took:.1f} s after SIGTERM, {exit_code and exit_code.group(0)}")
    # (SLURM's step daemons may still be tearing the step down as the batch job ends: within 60 s of
    # the signal nothing of the job is left, as issue 34 asks)
    wait_until(lambda: not job_processes(slurm), timeout=max(60 - took, 5), what="the preempted job's processes to end")
    latest = out / "checkpoints" / "latest"
    return (workdir, job, output, took, max(losses(out)), latest.read_text().strip() if latest.exists() else None,
            int(exit_code.group(1)) if exit_code else None)


def test_slurm_restarts_inside_the_allocation_and_leaves_a_twice_failed_node_out(slurm, reference, tmp_path):
    """`sbatch launch/slurm.sbatch ... --max-restarts 2` on 2 nodes x 2 ranks (dp 4, tiny.yaml's
    ZeRO-2): rank 3's trainer on node1 is killed past step RESTART_EVERY + 3, and again past
    2 x RESTART_EVERY + 3 in the restarted attempt. Unattended, inside its allocation, the job restarts
    on both nodes (node1 passes the srun pre-flight), then, node1 being the site of its second
    failure, on node0 alone, re-planned for 2 ranks (dp 2: the checkpoint converted by DeepSpeed's
    ds_to_universal), and finishes every step; each failure names node1 and rank 3. Its first
    REFERENCE_STEPS steps, from all three attempts, equal the single-node reference: those of the
    dp 4 attempts within 1e-5, those trained at dp 2 within 1e-4 (another order of summation)."""
    out = tmp_path / "out"
    overrides = [f"train.stop_after={RESTART_STEPS}", f"checkpoint.every={RESTART_EVERY}"]
    job = sbatch(slurm, tmp_path, [*launch_args(out, overrides), "--max-restarts", "2"])
    log = tmp_path / f"slurm-{job}.out"
    try:
        for past in (RESTART_EVERY + 3, 2 * RESTART_EVERY + 3):
            def reached() -> bool:
                state = job_state(slurm, job)
                assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job} {state}:\n" + (
                    log.read_text()[-3000:] if log.exists() else "")
                return last_logged_step(out / "metrics.jsonl") >= past and len(trainers(slurm, 1)) == 2

            wait_until(reached, timeout=TIMEOUT, what=f"step {past} on both nodes", every=0.1)
            os.kill(trainers(slurm, 1)[3], signal.SIGKILL)
        state = wait_job(slurm, job, timeout=TIMEOUT)
    finally:
        if job_state(slurm, job) not in ("COMPLETED", "FAILED", "CANCELLED", "GONE"):
            slurm.run(0, ["scancel", job], env={**node_env(slurm), **slurm.slurm_env()}, timeout=15)
    output = log.read_text()
    assert state == "COMPLETED", f"job {job}: {state}\n{output[-4000:]}"
    assert not job_processes(slurm), "the job left processes"
    first, second = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
    for restart in (first, second):
        assert "node1" in restart["why"] and "rank 3" in restart["why"], restart
    assert first["nodes"] == ["node0", "node1"] and first["left_out"] == {} and first["layout"].endswith("dp 4")
    assert second["nodes"] == ["node0"] and "node1" in second["left_out"], second
    assert second["layout"] == "tp 1 x pp 1 x cp 1 x dp 2", second
    assert one_line(output, "restart 2 of 2", "node1 left out"), output[-3000:]
    got = losses(out)
    assert sorted(got) == list(range(1, RESTART_STEPS + 1)), sorted(got)
    at_dp2 = int(second["resumes"].removeprefix("global_step"))
    assert at_dp2 < REFERENCE_STEPS, second  # some dp 2 steps are compared
    assert_matches({s: got[s] for s in range(1, at_dp2 + 1)}, reference, rtol=1e-5, what="dp 4 attempts")
    later = range(at_dp2 + 1, REFERENCE_STEPS + 1)
    assert_close({s: got[s] for s in later}, {s: reference[s] for s in later}, rtol=1e-4,
                 what="the attempt re-planned for node0 (dp 2)")


def test_slurm_sigterm_checkpoints_the_step(preempted):
    """... and the batch job exits 143 (protocol/exits.py), which `RequeueExit=143` requeues, though
    deepspeed's per-node launcher ended with 1."""
    workdir, job, output, took, stopped, latest, exit_code = preempted
    out = workdir / "out"
    assert exit_code == 143, f"job {job} exited {exit_code}:\n{output[-3000:]}"
    assert took < LIMIT, f"job {job} took {took:.0f} s to stop"
    assert latest == f"global_step{stopped}", output[-3000:]
    assert f"stopped by SIGTERM at step {stopped}" in output, output[-3000:]
    assert not list((out / "checkpoints").glob("*.partial"))


def test_slurm_resume_after_preemption_is_exact(slurm, preempted, reference):
    """`sbatch launch/slurm.sbatch RUN.yaml ... --resume` goes on from the preemption checkpoint;
    steps 1..REFERENCE_STEPS (before and after the stop) equal one uninterrupted run within 1e-6.
    This is also the SLURM launcher's training check: both jobs train 2 nodes x 2 ranks through
    launch/slurm.sbatch (the hostfile it writes lists both nodes), and every step equals one
    node's 4-rank run (the 1e-5 the other launchers are held to, and tighter)."""
    workdir, _, _, _, stopped, _, _ = preempted
    out = workdir / "out"
    assert stopped < REFERENCE_STEPS, f"preempted only at step {stopped}: nothing left to resume"
    job = sbatch(slurm, workdir, [*launch_args(out, [f"train.stop_after={REFERENCE_STEPS}"]), "--resume"])
    state = wait_job(slurm, job, timeout=TIMEOUT)
    output = (workdir / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", f"resume job {job}: {state}\n{output[-3000:]}"
    assert (workdir / "hostfile").read_text() == "node0 slots=2\nnode1 slots=2\n"  # scontrol's nodes, in order
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, REFERENCE_STEPS + 1)), "metrics.jsonl holds each step once"
    assert_matches(resumed, reference, rtol=1e-6, what=f"preempted at step {stopped} + resumed on SLURM vs straight")
