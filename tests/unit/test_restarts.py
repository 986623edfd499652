"""What `dsf launch --max-restarts` decides without starting anything (launching/restarts.py,
launching/replan.py): which launchers can restart, the layout re-planned for a smaller world, the
refusals in one line, and when the loop stops. The runs themselves: tests/distributed/test_restarts.py
(one node) and tests/cluster/test_failures.py (a node lost)."""
from __future__ import annotations

from collections import OrderedDict

import pytest

from dsframework.config import load_run_config
from dsframework.errors import UserError
from dsframework.launching.launchers import LAUNCHERS
from dsframework.launching.replan import replan
from dsframework.launching.restarts import RestartState, _why_stop, check_can_restart, steps_lost
from dsframework.layout import ParallelDims
from tests.distributed.launcher import TINY_YAML


def run_at(*overrides: str):
    return load_run_config(TINY_YAML, ["train.global_batch=32", "train.micro_batch=4", "train.grad_accum=null",
                                       *overrides])


def test_pdsh_and_slurm_restart():
    check_can_restart(LAUNCHERS["pdsh"](), 3)
    check_can_restart(LAUNCHERS["slurm"](), 3)
    for name, why in (("openmpi", "does not say which node failed"), ("mvapich", "does not say which node failed"),
                      ("no_ssh", "starts one node per command")):
        check_can_restart(LAUNCHERS[name](), 0)
        with pytest.raises(UserError, match=rf"^--max-restarts=2: --launcher {name} {why}.*; use --launcher pdsh"):
            check_can_restart(LAUNCHERS[name](), 2)


def test_srun_output_names_the_node_that_failed_first():
    """srun --label: each task names its node first; srun's own lines say which tasks ended and how.
    The node whose rank was killed is blamed with its rank watcher's line, not the node srun
    stopped after it."""
    from dsframework.launching.watch import NodeLines, SrunLines

    nodes = NodeLines(["node0", "node1"])
    lines = SrunLines(nodes)
    ended = [lines.add(line) for line in (
        "1: dsf-node: node1", " 0: dsf-node: node0", "0: step 5 loss 3.2", "1: [rank 3] step 5",
        "1: dsf: rank 3 (pid 77) was killed by SIGKILL at step 6", "unlabelled noise",
        "srun: error: node1: task 1: Exited with exit code 137", "srun: error: node0: task 0: Killed")]
    assert ended[:6] == [None] * 6 and ended[6:] == [("node1", 137), ("node0", 1)]
    failure = nodes.blame({"node1": 137, "node0": 1})
    assert (failure.host, failure.code) == ("node1", 137) and "rank 3 (pid 77) was killed by SIGKILL" in failure.cause
    assert lines.add("srun: error: Node failure on node0") == ("node0", 1)
    assert lines.add("srun: error: node7: task 3: Exited with exit code 1") is None  # not a node of this job


def test_the_node_of_the_killed_rank_is_blamed_when_srun_reports_only_its_peer():
    """srun stopped the step when node0's ranks exited on the closed connection, before node1's
    launcher had ended: only node0 is reported, yet node1's rank watcher saw rank 3 die (CI saw
    node0 blamed twice and left out, the healthy node)."""
    from dsframework.launching.watch import NodeLines, SrunLines

    nodes = NodeLines(["node0", "node1"])
    lines = SrunLines(nodes)
    peer_lost = ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:215. "
                 "This is typically caused by a remote worker crashing.")
    ended = [lines.add(line) for line in (
        "0: dsf-node: node0", "1: dsf-node: node1",
        "1: dsf: rank 3 (local rank 1 on node1, pid 12445) was killed by SIGKILL", f"0: {peer_lost}",
        "srun: error: node0: task 0: Exited with exit code 1")]
    assert ended[-1] == ("node0", 1)
    failure = nodes.blame({"node0": 1})
    assert failure.host == "node1" and "rank 3" in failure.cause, failure
    both = NodeLines(["node0", "node1"])  # both failed with an exception: the one that lost its peer tells less
    for line in (f"node0: {peer_lost}", "node1: ValueError: bad shard"):
        both.add(line)
    assert both.blame({"node0": 1, "node1": 1}).host == "node1"


def test_a_labelled_srun_step_names_each_node_first():
    from dsframework.launching.launchers import srun_command

    argv = srun_command(["deepspeed", "x"], OrderedDict(node0=[0, 1], node1=[0, 1]), labelled=True)
    assert "--label" in argv and argv[-1].startswith('echo "dsf-node: $SLURMD_NODENAME"; trap')
    assert "--label" not in srun_command(["deepspeed", "x"], OrderedDict(node0=[0, 1]))


def test_the_same_world_keeps_the_layout():
    run = run_at("parallel.tp=2", "parallel.zero_stage=1")
    was = ParallelDims.of(run.parallel, world=4)
    assert replan(run, OrderedDict(node0=[0, 1], node1=[0, 1]), cluster_name=None, was=was) == ([], was)


def test_a_smaller_world_keeps_tp_the_global_batch_and_the_zero_stage():
    run = run_at("parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1")
    was = ParallelDims.of(run.parallel, world=4)
    overrides, dims = replan(run, OrderedDict(node0=[0, 1]), cluster_name=None, was=was)
    assert (dims.world, dims.tp, dims.pp * dims.cp * dims.dp, dims.zero_stage) == (2, 2, 1, 1), dims
    assert "train.global_batch=32" in overrides and "train.micro_batch=4" in overrides
    assert f"parallel.tp={dims.tp}" in overrides and "train.grad_accum=null" in overrides
    again = load_run_config(TINY_YAML, ["train.global_batch=32", "train.micro_batch=4", "train.grad_accum=null",
                                        "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", *overrides])
    assert ParallelDims.of(again.parallel, world=2) == dims


def test_a_pinned_tp_that_no_longer_fits_stops_the_restart_in_one_line():
    run = run_at("parallel.tp=2", "parallel.zero_stage=1")
    was = ParallelDims.of(run.parallel, world=4)
    with pytest.raises(UserError) as info:
        replan(run, OrderedDict(node0=[0], node1=[0], node2=[0]), cluster_name=None, was=was)
    assert str(info.value).startswith("parallel.tp=2: does not fit the 3 ranks left on node0 (1), node1 (1), "
                                      "node2 (1)") and "\n" not in str(info.value)


def test_a_world_that_cannot_hold_the_model_stops_the_restart_in_one_line():
    run = run_at("model.name=llama-70b", "parallel.zero_stage=3")
    was = ParallelDims.of(run.parallel, world=4)
    with pytest.raises(UserError, match=r"^--max-restarts: cannot restart: the 2 ranks left on node0 \(2\) hold the "
                                        r"model at no layout with ZeRO-3 and global batch 32; bring nodes back"):
        replan(run, OrderedDict(node0=[0, 1]), cluster_name="a100-40gb", was=was)


def test_when_the_loop_stops(tmp_path):
    state = RestartState(tmp_path)
    assert _why_stop(state, 2) is None
    state.restarts = 2
    assert _why_stop(state, 2) == "the restart budget is spent (--max-restarts 2)"
    state.restarts, state.no_progress = 1, 2
    assert _why_stop(state, 5) == "2 restarts in a row saved no new checkpoint"


def test_the_blocklist_lasts_the_job_and_steps_lost(tmp_path):
    state = RestartState.begin(tmp_path, resume=False)
    state.block("node1", "ssh: connection refused")
    assert RestartState.begin(tmp_path, resume=True).blocked == {"node1": "ssh: connection refused"}
    assert RestartState.begin(tmp_path, resume=False).blocked == {} and not (tmp_path / "blocklist.json").exists()
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 14)))
    assert steps_lost(tmp_path, "global_step10") == 3 and steps_lost(tmp_path, None) == 13


def test_where_the_wall_time_went(tmp_path):
    """Goodput from a timeline of two attempts: start-up until the first step, restarting from the
    failure to the next first step, steps redone from the last checkpoint to the failure, the
    trainer's checkpoint seconds, the rest training; ETTR = training / total."""
    from dsframework.protocol.goodput import Attempt, Timeline

    (tmp_path / "checkpoint_times.jsonl").write_text('{"step": 5, "seconds": 1.5, "time": 130}\n'
                                                     '{"step": 10, "seconds": 2.5, "time": 190}\n'
                                                     '{"step": 100, "seconds": 9, "time": 50}\n')  # an older job
    timeline = Timeline(tmp_path)
    timeline.begun = 100.0
    timeline.attempts = [Attempt(started=100.0, resumes=0, first_step=110.0, last_checkpoint=150.0, ended=170.0,
                                 failed=True),
                         Attempt(started=172.0, resumes=5, first_step=185.0, last_checkpoint=None, ended=300.0)]
    goodput = timeline.goodput()
    assert (goodput.total_s, goodput.startup_s, goodput.restarting_s, goodput.lost_s, goodput.checkpoint_s) == \
        (200.0, 10.0, 15.0, 20.0, 4.0)
    assert goodput.training_s == 151.0 and goodput.ettr == pytest.approx(0.755) and goodput.restarts == 1
    assert goodput.per_restart == [{"restarting_s": 15.0, "lost_s": 20.0}]
    assert goodput.line() == ("dsf: the job took 200 s: training 151 s (ETTR 0.755), start-up 10 s, 1 restart(s) "
                              "15 s, lost (steps redone) 20 s, checkpointing 4 s")


@pytest.mark.distributed  # runs bash (no ranks): launch/slurm.sbatch's arguments, first run and requeued
@pytest.mark.parametrize("restarts, want", [("0", "run.yaml --set a=1 --overwrite"),
                                           ("2", "run.yaml --set a=1 --resume")])
def test_a_requeued_sbatch_job_resumes_instead_of_starting_over(tmp_path, restarts, want):
    import os
    import subprocess

    from tests.distributed.launcher import REPO

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dsf").write_text('#!/bin/sh\necho "$@"\n')
    (fake / "scontrol").write_text("#!/bin/sh\necho node0\n")
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "BIN": str(fake), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node0", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": restarts,
           "GPUS_PER_NODE": "2", "HOSTFILE": str(tmp_path / "hostfile")}
    out = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), "run.yaml", "--set", "a=1", "--overwrite"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"launch {want} --hostfile {tmp_path / 'hostfile'} --launcher slurm"), out.stdout
