"""Effective training time (ETTR) of a job that fails, restarted by `dsf launch --max-restarts` vs
the same failures handled by hand, on the tests' namespaced nodes (2 nodes x 2 CPU ranks, pdsh).

    .venv/bin/python bench/goodput.py              # checkpoint every 10 and every 40 steps (~6 min, root)
    .venv/bin/python bench/goodput.py --json       # the figures for machines

Each job trains tiny.yaml's model (tests/cluster's run, tp 1 x dp 4, ZeRO-2) for --steps steps with
`--max-restarts 2` and `faults.hang_timeout=10`, and gets two failures:
  1. past step --fail-at[0] (35), rank 3's trainer (node1) is killed (SIGKILL);
  2. past step --fail-at[1] (75) of the restarted attempt, rank 0's trainer (node0) is stopped
     (SIGSTOP): a hang, which the heartbeat catches after 10 s.
(Steps that no interval divides: every 10 loses ~5 steps a failure, every 40 ~35.)
One failure per node: both nodes stay (a node is left out at its second failure).

Automatic: the job's own count (launching/goodput.py, goodput.json): wall time, start-up, each
restart's time (failure to the first new step), time lost redoing steps since the last checkpoint,
time checkpointing (rank 0's seconds per save, checkpoint_times.jsonl), training, ETTR = training / wall.
By hand: the same timeline with each restart replaced by what a person does: the job stops (a dead
rank: as fast as dsf's own stop, which only names the node; a hang: at the collective's timeout,
HANG_BY_HAND_S = 30 min, DeepSpeed's and torch's default), a person reacts (REACTION_S = 5 min),
and the restart then takes as long as it took here; ETTR = training / that wall time.
The checkpoint stall is the trainer's seconds per checkpoint (DeepSpeed's own writer, synchronous).
Per failure: what one failure cost, dsf (restarting + steps redone) vs by hand (the same, plus the
reaction, plus the collective's timeout for the hang), averaged over the job's failures.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.cluster: the namespaced nodes and their job helpers

REACTION_S = 300.0
HANG_BY_HAND_S = 1800.0
HANG_TIMEOUT = 10


def by_hand(goodput: dict, hangs: int) -> dict:
    """The same job's wall time and ETTR with each restart handled by a person (module docstring):
    the automatic detection of a hang (hang_timeout) becomes the collective's timeout, and each
    restart waits REACTION_S more."""
    restarts = goodput["restarts"]
    total = (goodput["total_s"] + restarts * REACTION_S + hangs * (HANG_BY_HAND_S - HANG_TIMEOUT))
    return {"total_s": total, "ettr": goodput["training_s"] / total}


def table(rows: list[dict]) -> str:
    head = ("| checkpoint every | steps | restarts | wall s | training s | start-up s | restarting s | redone s "
            "| checkpointing s | stall per checkpoint s | per failure s: dsf / by hand | ETTR dsf | ETTR by hand |")
    lines = [head, "|" + "---:|" * 13]
    for r in rows:
        g = r["goodput"]
        failures = max(g["restarts"], 1)
        dsf = (g["restarting_s"] + g["lost_s"]) / failures
        hand = dsf + (r["by_hand"]["total_s"] - g["total_s"]) / failures
        lines.append(f"| {r['every']} | {r['steps']} | {g['restarts']} | {g['total_s']:.0f} | {g['training_s']:.0f} "
                     f"| {g['startup_s']:.0f} | {g['restarting_s']:.0f} | {g['lost_s']:.0f} | {g['checkpoint_s']:.1f} "
                     f"| {r['stall_s']:.2f} | {dsf:.0f} / {hand:.0f} | {g['ettr']:.3f} | {r['by_hand']['ettr']:.3f} |")
    return "\n".join(lines)


def one_job(cluster, work: Path, *, steps: int, every: int, fail_at: list[int]) -> dict:
    """Run one job with its two failures; its goodput.json, checkpoints and by-hand figures."""
    from tests.cluster.jobs import dsf_launch_cmd, node_env
    from tests.cluster.nodes import wait_until
    from tests.cluster.test_failures import trainers
    from tests.distributed.launcher import last_logged_step

    out = work / "out"
    overrides = [f"train.stop_after={steps}", f"checkpoint.every={every}", f"faults.hang_timeout={HANG_TIMEOUT}"]
    job = cluster.popen(0, dsf_launch_cmd(work, "pdsh", overrides=overrides, flags=["--max-restarts", "2"]),
                        log=work / "job.log", cwd=work, env=node_env(cluster))
    try:
        for node, rank, sig, step in ((1, 3, signal.SIGKILL, fail_at[0]), (0, 0, signal.SIGSTOP, fail_at[1])):
            wait_until(lambda: job.poll() is None and last_logged_step(out / "metrics.jsonl") >= step, timeout=600,
                       what=f"step {step}", every=0.2)
            os.kill(trainers(cluster, node)[rank], sig)
        code = job.wait(timeout=900)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    if code != 0:
        raise SystemExit(f"the job failed ({code}):\n{(work / 'job.log').read_text()[-3000:]}")
    goodput = json.loads((out / "goodput.json").read_text())
    saved = len((out / "checkpoint_times.jsonl").read_text().splitlines())
    return {"every": every, "steps": steps, "goodput": goodput, "by_hand": by_hand(goodput, hangs=1),
            "stall_s": goodput["checkpoint_s"] / max(saved, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--fail-at", type=int, nargs=2, default=[35, 75], help="the steps past which each fails")
    parser.add_argument("--every", type=int, nargs="+", default=[10, 40], help="checkpoint intervals to compare")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from tests.cluster.nodes import Cluster, missing

    if why := missing("pdsh"):
        raise SystemExit(f"bench/goodput.py needs the namespaced nodes: {why}")
    root = Path(tempfile.mkdtemp(prefix="dsf-goodput-"))
    cluster = Cluster(root, nodes=2)
    cluster.start()
    rows = []
    try:
        for every in args.every:
            work = root / f"every{every}"
            work.mkdir()
            started = time.monotonic()
            rows.append(one_job(cluster, work, steps=args.steps, every=every, fail_at=args.fail_at))
            print(f"checkpoint every {every}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    finally:
        cluster.stop()
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
