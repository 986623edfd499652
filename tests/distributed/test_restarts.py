"""`dsf launch --max-restarts 2` on one node (launching/restarts.py): a rank stopped (SIGSTOP) past
step 35 hangs, is caught (faults.hang_timeout=5) and the job restarts from global_step25; a rank
of the restarted attempt killed (SIGKILL) past step 85 makes localhost the site of a second
failure, which leaves it out: the job stops in one line, with the blocklist written. Every step
logged equals a straight run's (conftest.shared_runs, the same process order and data) within
1e-5; restarts.jsonl and the output say when, why, where and from which checkpoint. The multi-node
case (a node lost, the layout re-planned) is tests/cluster/test_failures.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed.launcher import BIN, TINY_YAML, assert_close, last_logged_step, losses, rank_env, run_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS, EVERY = 150, 25
COMMON = [f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "faults.hang_timeout=5"]


def shared_specs(ranks: int, root: Path) -> list[str]:
    return [f"restarts-straight|eager|{';'.join(COMMON)}"] if ranks == 2 else []


def trainer_pid(output_dir: Path, rank: int) -> int | None:
    """The pid of rank `rank`'s trainer (dsf's watched child) of the run writing to `output_dir`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"output_dir={output_dir}".encode() in cmdline and b"DSF_RANK_TRAINER=1" in environ \
                and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def wait_for_step(output_dir: Path, job: subprocess.Popen, step: int, log: Path) -> int:
    """Wait until metrics.jsonl logs `step` or later, past a checkpoint the attempt saved; that step."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert job.poll() is None, f"the job ended ({job.returncode}) before step {step}:\n{log.read_text()[-3000:]}"
        done = last_logged_step(output_dir / "metrics.jsonl")
        if done >= step:
            return done
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def restarted(shared_runs, tmp_path_factory):
    """The job, stopped (SIGSTOP, rank 0) past step 35 and killed (SIGKILL, rank 1) past step 85 of its
    restarted attempt: (its output directory, exit code, output, the straight run's directory)."""
    root = shared_runs(2)[0]
    work = tmp_path_factory.mktemp("restarts")
    out, log = work / "out", work / "job.log"
    sets = [arg for o in run_overrides(out, COMMON) for arg in ("--set", o)]
    cmd = [str(BIN / "dsf"), "launch", str(TINY_YAML), "--num-gpus", "2", "--max-restarts", "2",
           "--master-port", str(29400 + os.getpid() % 500), *sets]
    with log.open("w") as sink:
        job = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=rank_env(), cwd=work,
                               start_new_session=True)
    try:
        for rank, sig, step in ((0, signal.SIGSTOP, EVERY + 10), (1, signal.SIGKILL, 3 * EVERY + 10)):
            wait_for_step(out, job, step, log)
            pid = trainer_pid(out, rank)
            assert pid is not None, f"rank {rank}'s trainer not found"
            os.kill(pid, sig)
        code = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return out, code, log.read_text(), root / "restarts-straight"


def test_a_hung_rank_restarts_the_run_and_a_second_failure_leaves_the_node_out(restarted):
    out, code, output, straight = restarted
    assert code == 2, output[-4000:]
    got, want = losses(out), losses(straight)
    assert max(got) > 3 * EVERY, sorted(got)[-3:]
    assert_close(got, {step: want[step] for step in got}, rtol=1e-5, what="restarted vs straight")
    log = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
    assert len(log) == 1, log
    hung = log[0]
    assert "rank 0" in hung["why"] and "hung: no progress for" in hung["why"], hung
    assert "its process is stopped" in hung["why"], hung
    assert hung["restart"] == 1 and hung["resumes"] == f"global_step{EVERY}" and hung["steps_lost"] >= 10, hung
    assert hung["nodes"] == ["localhost"] and hung["left_out"] == {} and hung["layout"].endswith("dp 2"), hung
    restart = [line for line in output.splitlines() if line.startswith("dsf: restart ")]
    assert len(restart) == 1 and restart[0].startswith("dsf: restart 1 of 2: localhost failed (exit "), restart
    assert f"resuming global_step{EVERY}" in restart[0], restart
    assert json.loads((out / "blocklist.json").read_text()) == {"localhost": "the site of 2 failures"}
    goodput = json.loads((out / "goodput.json").read_text())  # where the wall time went, printed at the end
    assert goodput["restarts"] == 1 and 0 < goodput["ettr"] < 1, goodput
    assert goodput["lost_s"] >= 5 and goodput["restarting_s"] > 0 and goodput["checkpoint_s"] > 0, goodput
    assert abs(goodput["training_s"] + goodput["startup_s"] + goodput["restarting_s"] + goodput["lost_s"]
               + goodput["checkpoint_s"] - goodput["total_s"]) < 1e-6, goodput
    assert any(line.startswith("dsf: the job took ") and "ETTR" in line for line in output.splitlines())
    error = [line for line in output.splitlines() if line.startswith("dsf: error: --max-restarts")]
    assert error == [f"dsf: error: --max-restarts: cannot restart: every node is left out (localhost: the site of "
                     f"2 failures); fix the nodes, remove {out / 'blocklist.json'}, and dsf launch --resume"], error
