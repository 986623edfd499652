"""Each launcher trains the tiny model across two real nodes (namespaces on this machine, see
nodes.py), started the way a user starts it on a cluster's first node:

    node0$ dsf launch tiny.yaml --hostfile H --launcher pdsh       # H: node0 slots=2 / node1 slots=2
    node0$ dsf launch tiny.yaml --hostfile H --launcher openmpi
    node0$ GPUS_PER_NODE=2 sbatch --gpus-per-node=0 launch/slurm.sbatch tiny.yaml --set ...

2 nodes x 2 CPU ranks; the per-step losses (metrics.jsonl in a shared output_dir) must equal one
node's `deepspeed --num_gpus 4` run of the same config within 1e-5 relative. gloo talks over each
node's eth0 (GLOO_SOCKET_IFNAME, forwarded by dsf launch through .deepspeed_env / srun's env).
"""
from __future__ import annotations

import re

import pytest

from tests.cluster.jobs import STEPS, dsf_launch_cmd, job_processes, node_env, run_on
from tests.cluster.nodes import missing, wait_until
from tests.distributed.launcher import BIN, REPO, assert_close, losses

# A watchdog over every test of the module (fixtures included): a hang fails, the tear-down still runs.
pytestmark = pytest.mark.timeout(600)
TIMEOUT = 240  # a training of 5 steps takes ~20-40 s here; a hang fails, it does not block


def assert_matches(got: dict[int, float], reference: dict[int, float], *, rtol: float, what: str) -> None:
    """`got` holds steps 1..N once each and equals the reference's first N steps."""
    assert sorted(got) == list(range(1, len(got) + 1)) and got, f"{what}: steps {sorted(got)}"
    assert_close(got, {s: reference[s] for s in got}, rtol=rtol, what=what)


def _train(cluster, tmp_path, launcher: str) -> tuple[str, dict[int, float]]:
    code, output, seconds = run_on(cluster, 0, dsf_launch_cmd(tmp_path, launcher), cwd=tmp_path, timeout=TIMEOUT,
                                   log=tmp_path / "job.log")
    print(f"{launcher}: exit {code} in {seconds:.1f} s")
    assert code == 0, f"dsf launch --launcher {launcher} on node0 exited {code}:\n{output[-5000:]}"
    assert not job_processes(cluster), "the job left processes behind"
    return output, losses(tmp_path / "out")


def test_pdsh_trains_across_two_nodes(clean, reference, tmp_path):
    if why := missing("pdsh"):
        pytest.skip(why)
    output, got = _train(clean, tmp_path, "pdsh")
    assert re.search(r"^node1: ", output, re.M), "pdsh ran ranks on node1"
    assert "GLOO_SOCKET_IFNAME=eth0" in (tmp_path / ".deepspeed_env").read_text()
    assert len(got) == STEPS
    assert_matches(got, reference, rtol=1e-5, what="pdsh, 2 nodes x 2 ranks vs 1 node x 4 ranks")


def test_openmpi_trains_across_two_nodes(clean, reference, tmp_path):
    if why := missing("openmpi"):
        pytest.skip(why)
    _, got = _train(clean, tmp_path, "openmpi")
    assert len(got) == STEPS
    assert_matches(got, reference, rtol=1e-5, what="openmpi, 2 nodes x 2 ranks vs 1 node x 4 ranks")


def sbatch(cluster, workdir, args: list[str], *, env_extra: dict | None = None) -> str:
    """`sbatch launch/slurm.sbatch ARGS` typed on node0 from `workdir`; the job id."""
    env = {**node_env(cluster), **cluster.slurm_env(), "GPUS_PER_NODE": "2", "BIN": str(BIN),
           "HOSTFILE": str(workdir / "hostfile"), **(env_extra or {})}
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={workdir}/slurm-%j.out",
           str(REPO / "launch" / "slurm.sbatch"), *args]
    proc = cluster.run(0, cmd, cwd=workdir, env=env, timeout=30)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}{proc.stdout}"
    return proc.stdout.strip().split(";")[0]


def job_state(cluster, job: str) -> str:
    env = {**node_env(cluster), **cluster.slurm_env()}
    out = cluster.run(0, ["scontrol", "-o", "show", "job", job], env=env, timeout=15).stdout
    match = re.search(r"JobState=(\S+)", out)
    return match.group(1) if match else "GONE"


def wait_job(cluster, job: str, *, timeout: float) -> str:
    """The job's final state (COMPLETED, FAILED, CANCELLED, ...)."""
    active = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")
    return wait_until(lambda: (s := job_state(cluster, job)) not in active and s, timeout=timeout,
                      what=f"SLURM job {job} to end", every=0.5)
