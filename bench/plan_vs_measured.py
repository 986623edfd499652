"""Does the planner pick the fastest layout? Its ranking against measured tokens/s on CPU ranks.

    .venv/bin/python bench/plan_vs_measured.py                 # small-llama, 4 ranks, ~5-8 min
    .venv/bin/python bench/plan_vs_measured.py --profile cpu4.json --json
    .venv/bin/python bench/plan_vs_measured.py --axes hpz    # leave out context parallel layouts

1. Calibrates this machine (`dsf calibrate --ranks 4`) unless --profile is given.
2. Plans the job on that profile and takes every (tp, pp, cp, ZeRO stage, hpZ) the rules allow,
   each with the micro-batch the planner prefers for it (no offload, no checkpointing: what
   changes the speed of a model this small is the layout). --axes chooses which of the newer
   axes take part (default: hpz,cp; at 4 ranks hpZ is ZeRO-3 with groups of 2, cp is 2 or 4).
3. Trains each with `deepspeed --num_gpus 4 dsf train` for --steps steps and takes the median
   tokens/s of the steps after --warmup.
4. Prints predicted and measured tokens/s side by side, the Spearman rank correlation, and how
   the planner's first choice measures against the measured best (target: >= 0.9 of it, and
   Spearman >= 0.7).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))

from tests.distributed.launcher import free_port, rank_env  # noqa: E402  (the tests' launcher helpers)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (average ranks for ties)."""
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / norm if norm else 0.0


def layouts_to_measure(plan, axes: set[str] = frozenset({"hpz", "cp"})) -> list:
    """The planner's favourite candidate of each (tp, pp, cp, zero_stage, zero_hpz), no offload,
    no checkpointing; cp > 1 only with "cp" in `axes`, hpZ only with "hpz"."""
    chosen = {}
    for c in plan.fitting:  # ranked fastest first
        lay = c.layout
        if lay.offload_optimizer or lay.activation_checkpointing != "none":
            continue
        if (lay.dims.cp > 1 and "cp" not in axes) or (lay.dims.zero_hpz > 1 and "hpz" not in axes):
            continue
        chosen.setdefault((lay.dims.tp, lay.dims.pp, lay.dims.cp, lay.dims.zero_stage, lay.dims.zero_hpz), c)
    return sorted(chosen.values(), key=lambda c: -c.tokens_per_s)


def measure(candidate, args, work: Path) -> float:
    lay = candidate.layout
    out = work / f"tp{lay.dims.tp}_pp{lay.dims.pp}_cp{lay.dims.cp}_z{lay.dims.zero_stage}_hpz{lay.dims.zero_hpz}_mb{lay.micro_batch}"
    sets = [f"model.name={args.model}", "model.overrides.vocab_size=512", "data.dataset=counting",
            "data.num_examples=3000", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}",
            f"train.global_batch={args.global_batch}", f"train.micro_batch={lay.micro_batch}",
            "train.grad_accum=null", "train.precision=fp32", "train.warmup_steps=1",
            f"parallel.tp={lay.dims.tp}", f"parallel.pp={lay.dims.pp}", f"parallel.cp={lay.dims.cp}",
            f"parallel.zero_stage={lay.dims.zero_stage}", f"parallel.zero_hpz={lay.dims.zero_hpz}",
            "logging.every=1", "logging.eval_every=0", "logging.progress=false", "checkpoint.every=0",
            "checkpoint.save_final=false", f"output_dir={out}"]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(args.ranks), "--master_port", str(free_port()),
           str(BIN / "dsf"), "train", str(REPO / "launch" / "examples" / "tiny.yaml"),
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=rank_env(), cwd=REPO, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rates = [json.loads(line)["tokens_per_s"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if line and "tokens_per_s" in line and json.loads(line)["step"] > args.warmup]
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--profile", type=Path, help="a dsf calibrate profile (default: calibrate now)")
    parser.add_argument("--axes", default="hpz,cp",
                        help="newer axes to include, comma-separated: hpz, cp (empty: tp x pp x ZeRO only)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dsframework.commands.calibrate import calibrate
    from dsframework.config import ModelSpec
    from dsframework.models.build import resolve_model
    from dsframework.planner.cluster import Cluster
    from dsframework.planner.memory import Workload
    from dsframework.planner.model import describe_model
    from dsframework.planner.search import search

    profile = json.loads(args.profile.read_text()) if args.profile else calibrate(ranks=args.ranks)
    cluster = Cluster.from_dict({**profile, "nodes": 1, "gpus_per_node": args.ranks})
    source = resolve_model(ModelSpec(name=args.model, overrides={"vocab_size": 512}))
    desc = describe_model(source.config, name=args.model)
    plan = search(desc, cluster, Workload(seq_len=args.seq_len, global_batch=args.global_batch, precision="fp32"))
    chosen = layouts_to_measure(plan, {a.strip() for a in args.axes.split(",") if a.strip()})
    with tempfile.TemporaryDirectory(prefix="dsf-plan-bench-") as tmp:
        measured = [measure(c, args, Path(tmp)) for c in chosen]
    predicted = [c.tokens_per_s for c in chosen]
    rho = spearman(predicted, measured)
    best_measured = max(measured)
    first_choice = measured[0] / best_measured  # chosen[0] is the planner's first choice
    rows = [{"tp": c.layout.dims.tp, "pp": c.layout.dims.pp, "cp": c.layout.dims.cp, "dp": c.layout.dims.dp,
             "zero_stage": c.layout.dims.zero_stage, "zero_hpz": c.layout.dims.zero_hpz,
             "micro_batch": c.layout.micro_batch, "grad_accum": c.layout.grad_accum,
             "predicted_tokens_per_s": p, "measured_tokens_per_s": m} for c, p, m in zip(chosen, predicted, measured)]
    if args.json:
        print(json.dumps({"rows": rows, "spearman": rho, "first_choice_vs_best": first_choice,
                          "profile": profile}, indent=1))
        return
    print(f"{args.model} on {args.ranks} CPU ranks, seq {args.seq_len}, global batch {args.global_batch}, fp32; "
          f"profile {profile['name']} (fp32 {profile['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s per rank, "
          f"all-reduce {profile['intra_node_bandwidth'] / 1e9:.2f} GB/s)\n")
    print("| planner rank | tp | pp | cp | dp | ZeRO | micro x accum | predicted tokens/s | measured tokens/s | "
          "measured rank |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    order = sorted(range(len(measured)), key=lambda i: -measured[i])
    for i, row in enumerate(rows):
        zero = f"{row['zero_stage']} hpZ{row['zero_hpz']}" if row["zero_hpz"] > 1 else str(row["zero_stage"])
        print(f"| {i + 1} | {row['tp']} | {row['pp']} | {row['cp']} | {row['dp']} | {zero} | "
              f"{row['micro_batch']}x{row['grad_accum']} | {row['predicted_tokens_per_s']:,.0f} | "
              f"{row['measured_tokens_per_s']:,.0f} | {order.index(i) + 1} |")
    print(f"\nSpearman rank correlation: {rho:.2f} (target >= 0.7)")
    print(f"planner's first choice measures {first_choice:.2f} of the measured best (target >= 0.90)")


if __name__ == "__main__":
    main()
