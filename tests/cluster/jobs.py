"""Helpers of the cluster tests: the environment of a shell on node0, the `dsf launch` line, and the
job's processes on every node.

    cmd = dsf_launch_cmd(workdir, "pdsh")                 # dsf launch TINY --hostfile workdir/hostfile ...
    code, output, seconds = run_on(cluster, 0, cmd, cwd=workdir, timeout=180, log=workdir / "job.log")
    assert not job_processes(cluster)                     # nothing of the job left on any node
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.cluster.nodes import Cluster
from tests.distributed.launcher import BIN, TINY_YAML, rank_env, run_overrides

# 4 ranks = 2 nodes x 2 slots; 5 short steps of the tiny model, cut from a long schedule
# (train.stop_after) so that every run here - the launchers', the preempted one, the resumed one -
# is a prefix of the one single-node reference run (REFERENCE_STEPS steps of the same schedule).
STEPS, REFERENCE_STEPS = 5, 16  # (16: a SIGTERM sent once step 1 is logged lands well before the end)
# (run_overrides' BASE_OVERRIDES keep them eager: the preempted job trains "until stopped", which
# train.compile=auto would compile at step 4, and a SIGTERM waits for the compiled step.)
OVERRIDES = ["train.steps=100000", "train.warmup_steps=2", f"train.stop_after={STEPS}"]
UNTIL_STOPPED = ["train.stop_after=null"]  # trains until killed or preempted
RANKS_PER_NODE = 2
HOSTFILE = "".join(f"node{k} slots={RANKS_PER_NODE}\n" for k in range(2))
# What the ranks need on every node, forwarded by `dsf launch` (its defaults forward GLOO_SOCKET_IFNAME,
# OMP_NUM_THREADS and TOKENIZERS_PARALLELISM through .deepspeed_env; MKL_NUM_THREADS goes by --env).
NODE_ENV = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}
# mpirun refuses root without these. Nothing else is needed here: each node has one interface besides
# lo, and deepspeed's runner passes `--mca btl_tcp_if_include eth0`. A node with several interfaces
# would also want OMPI_MCA_oob_tcp_if_include (and btl_tcp_if_include) set to the nodes' network.
OMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def node_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    """The environment of a shell on node0: the test's, one thread per rank, the venv first on PATH."""
    env = {**rank_env(), **NODE_ENV, **OMPI_ENV, **extra}
    env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CONF", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "WORLD_SIZE", "PDSH_RCMD_TYPE"):
        env.pop(key, None)
    return env


def launch_args(output_dir: Path, overrides: list[str] = ()) -> list[str]:
    return [str(TINY_YAML), *[a for o in run_overrides(output_dir, [*OVERRIDES, *overrides]) for a in ("--set", o)]]


def dsf_launch_cmd(workdir: Path, launcher: str, *, output_dir: Path | None = None, overrides: list[str] = (),
                   flags: list[str] = ()) -> list[str]:
    """`dsf launch TINY --hostfile H --launcher L --env MKL_NUM_THREADS=1 ...`, hostfile in `workdir`."""
    hostfile = workdir / "hostfile"
    hostfile.write_text(HOSTFILE)
    return [str(BIN / "dsf"), "launch", *launch_args(output_dir or workdir / "out", overrides),
            "--hostfile", str(hostfile), "--launcher", launcher, "--env", "MKL_NUM_THREADS=1", *flags]


def job_processes(cluster: Cluster) -> dict[str, list[tuple[int, str]]]:
    """node -> the training job's processes still alive there (launchers, ranks, pdsh, mpirun)."""
    words = ("deepspeed", "dsframework", "dsf train", "dsf launch", "/dsf ", "pdsh", "mpirun", "orted",
             "srun", "slurmstepd")
    return {cluster.names[k]: procs for k in range(cluster.count) if (procs := cluster.processes(k, *words))}


def run_on(cluster: Cluster, node: int, cmd: list[str], *, cwd: Path, timeout: float, env: dict | None = None,
           log: Path) -> tuple[int, str, float]:
    """(exit code, output, seconds) of `cmd` on `node`; on a timeout its session is killed, code None."""
    started = time.monotonic()
    proc = cluster.popen(node, cmd, log=log, cwd=cwd, env=env or node_env(cluster))
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, 9)
        proc.wait()
    return code, log.read_text(), time.monotonic() - started


def sweep(cluster: Cluster) -> None:
    """Kill what a failed test left of a job on any node (sshd, the holders and SLURM stay)."""
    for k in range(cluster.count):
        for pid, _ in cluster.processes(k, "deepspeed", "dsframework", "/dsf ", "pdsh", "mpirun", "orted"):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
