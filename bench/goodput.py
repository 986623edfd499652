"""Effective training time (ETTR) of a job that fails, restarted by `dsf launch --max-restarts` vs
the same failures handled by hand, on the tests' namespaced nodes (2 nodes x 2 CPU ranks, pdsh).

    .venv/bin/python bench/goodput.py              # checkpoint every 10 and every 40 steps (~6 min, root)
    .venv/bin/python bench/goodput.py --json       # the figures for machines
    .venv/bin/python bench/goodput.py --stall      # the stall per checkpoint, sync vs decoupled (one node, ~3 min)

Each job trains tiny.yaml's model (tests/cluster's run, tp 1 x dp 4, ZeRO-2) for --steps steps with
`--max-restarts 2` and `faults.hang_timeout=10`, and gets two failures:
  1. past step --fail-at[0] (35), rank 3's trainer (node1) is killed (SIGKILL);
  2. past step --fail-at[1] (75) of the restarted attempt, rank 0's trainer (node0) is stopped
     (SIGSTOP): a hang, which the heartbeat catches after 10 s.
(Steps that no interval divides: every 10 loses ~5 steps a failure, every 40 ~35.)
One failure per node: both nodes stay (a node is left out at its second failure).

Automatic: the job's own count (protocol/goodput.py, goodput.json): wall time, start-up, each
restart's time (failure to the first new step), time lost redoing steps since the last checkpoint,
time checkpointing (rank 0's seconds per save, checkpoint_times.jsonl), training, ETTR = training / wall.
By hand: the same timeline with each restart replaced by what a person does: the job stops (a dead
rank: as fast as dsf's own stop, which only names the node; a hang: at the collective's timeout,
HANG_BY_HAND_S = 30 min, DeepSpeed's and torch's default), a person reacts (REACTION_S = 5 min),
and the restart then takes as long as it took here; ETTR = training / that wall time.
The checkpoint stall is the trainer's seconds per checkpoint (DeepSpeed's own writer, synchronous).

--stall (no namespaced nodes, no failures): the same model size class trained twice on this node
(`deepspeed --num_gpus 2 dsf train`, STALL_MODEL, a checkpoint every --stall-every steps), with
checkpoint.writer=sync and =decoupled (DeepSpeed's background writer). The stall per checkpoint is
what the trainer waited for it (checkpoint_times.jsonl): sync, the whole save; decoupled, handing
the state to the writer + the wait for it inside the next optimizer step + the commit. Reported:
the first checkpoint (decoupled: it also waits for the writer process to start), the mid-run ones'
mean, the last (the run waits for it to be on disk, decoupled too), the steps' median tokens/s
(the writer's process shares the CPUs), and the ratios sync / decoupled.
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


# About 58M parameters (a checkpoint of ~0.9 GB with Adam's states): large enough that writing it
# takes seconds on this machine, small enough that a step on 2 CPU ranks takes about one.
STALL_MODEL = ("{vocab_size: 32000, hidden_size: 512, intermediate_size: 1408, num_hidden_layers: 8, "
               "num_attention_heads: 8, num_key_value_heads: 8}")
STALL_TRAIN = ["parallel.zero_stage=1", "train.global_batch=8", "train.micro_batch=4", "data.seq_len=32",
               "data.num_examples=2000", "train.precision=fp32", "train.warmup_steps=0", "checkpoint.save_final=true",
               "logging.every=1", "logging.eval_every=0", "logging.progress=false", "train.compile=false"]


def stall_run(work: Path, writer: str, *, steps: int, every: int) -> dict:
    """One `deepspeed --num_gpus 2 dsf train` on this node with checkpoint.writer=`writer`: each
    checkpoint's stall (step -> seconds, checkpoint_times.jsonl) and each step's tokens/s."""
    import subprocess

    from dsframework.ports import free_port

    port = free_port()
    out = work / writer
    sets = [arg for o in [f"model.overrides={STALL_MODEL}", *STALL_TRAIN, f"train.steps={steps}",
                          f"checkpoint.every={every}", f"checkpoint.writer={writer}", f"output_dir={out}"]
            for arg in ("--set", o)]
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))  # this checkout's dsframework, in every rank and writer process
    log = work / f"{writer}.log"
    with log.open("w") as sink:
        code = subprocess.run([str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
                               str(bin_dir / "dsf"), "train", str(REPO / "launch/examples/tiny.yaml"), *sets],
                              stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    if code != 0:
        raise SystemExit(f"the {writer} run failed ({code}):\n{log.read_text()[-3000:]}")
    times = (out / "checkpoint_times.jsonl").read_text().splitlines()
    stalls = {r["step"]: r["seconds"] for r in map(json.loads, times)}
    rates = [r["tokens_per_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "tokens_per_s" in r]
    return {"writer": writer, "stalls": stalls, "tokens_per_s": rates}


def stall_summary(run: dict) -> dict:
    """A stall_run's figures: the first checkpoint's stall, the mean of the ones between the first and
    the last, the last's, and the steps' median tokens/s."""
    import statistics

    ordered = [run["stalls"][step] for step in sorted(run["stalls"])]
    middle = ordered[1:-1]
    return {"writer": run["writer"], "checkpoints": len(ordered), "first_s": ordered[0],
            "mid_s": statistics.mean(middle) if middle else float("nan"), "last_s": ordered[-1],
            "tokens_per_s": statistics.median(run["tokens_per_s"])}


def stall_table(summaries: list[dict]) -> str:
    """A row per writer, then the ratios of the first row's figures to each other row's."""
    lines = ["| writer | checkpoints | first stall s | mid-run stall s (mean) | last stall s "
             "| tokens/s (median step) |",
             "|---|" + "---:|" * 5]
    for r in summaries:
        lines.append(f"| {r['writer']} | {r['checkpoints']} | {r['first_s']:.3f} | {r['mid_s']:.3f} "
                     f"| {r['last_s']:.3f} | {r['tokens_per_s']:.0f} |")
    base = summaries[0]
    for r in summaries[1:]:
        ratio = {key: base[key] / r[key] if r[key] else float("inf")
                 for key in ("first_s", "mid_s", "last_s", "tokens_per_s")}
        lines.append(f"| {base['writer']} / {r['writer']} | | {ratio['first_s']:.1f}x | {ratio['mid_s']:.1f}x "
                     f"| {ratio['last_s']:.1f}x | {ratio['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def stall_main(args: argparse.Namespace) -> None:
    """--stall: sync, then decoupled, on this node (module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="dsf-stall-"))
    runs = []
    for writer in ("sync", "decoupled"):
        started = time.monotonic()
        runs.append(stall_run(work, writer, steps=args.stall_steps, every=args.stall_every))
        print(f"checkpoint.writer={writer}: {time.monotonic() - started:.0f} s ({work / writer})", file=sys.stderr)
    print(json.dumps(runs, indent=1) if args.json else stall_table([stall_summary(r) for r in runs]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--fail-at", type=int, nargs=2, default=[35, 75], help="the steps past which each fails")
    parser.add_argument("--every", type=int, nargs="+", default=[10, 40], help="checkpoint intervals to compare")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--stall", action="store_true", help="the stall per checkpoint, sync vs decoupled writer, "
                        "on this node (no namespaced nodes)")
    parser.add_argument("--stall-steps", type=int, default=12)
    parser.add_argument("--stall-every", type=int, default=2)
    args = parser.parse_args()
    if args.stall:
        return stall_main(args)
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
