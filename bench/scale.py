"""The largest Llama this machine trains on 4 CPU ranks (tp 2 x pp 2, ZeRO-1): each rank's peak
memory as the planner predicts it, as measured, and what a dense build would have needed.

    .venv/bin/python bench/scale.py                          # search, measure, train 3 steps
    .venv/bin/python bench/scale.py --plan-only              # the search alone (planner, no launch)
    .venv/bin/python bench/scale.py --hidden 1280 --layers 20   # a shape of your choosing
    .venv/bin/python bench/scale.py --params-target 300e6    # the family's largest up to 300M
    .venv/bin/python bench/scale.py --dry-run                # ~20M parameters, same code path, ~1 min
    .venv/bin/python bench/scale.py --json                   # the figures for machines

1. Baseline: this file's worker (below) trains a tiny Llama (hidden 64, 2 layers) at the same
   layout and settings; each rank's peak resident memory (VmHWM, /proc/self/status) is the
   process's cost: Python, torch, DeepSpeed, gloo, the data.
2. Search (pure: the planner, no launch): the family hidden h = 256, 512, ... with
   head_dim 64 (h/64 heads, h/128 key/value heads), intermediate 2.75 h rounded up to 256,
   vocab 32000, untied head, and an even number of layers between h/128 and h/32 (h/64 is the
   usual shape; the range lets the depth fill the memory the width step leaves). The largest by
   parameters whose four ranks fit in --ram-share of this machine's MemTotal: for every rank,
   the planner's bytes for its pipeline stage (`stage_memories`: parameters, gradients, optimizer
   states, activations, buffers; on CPU ranks the "device" is this RAM) with `dsf plan`'s 10%
   headroom, or its build share (`build_bytes_per_rank`), whichever is larger, plus the measured
   baseline of that rank; plus 0.6 GiB for the launcher processes and this script. (Without the
   headroom, 85% picked 680M parameters, whose ranks had grown up to 11% past their prediction by
   the second step, when, with a test suite running beside them, the OOM killer took one.)
3. Train it: `dsf train` (dsframework.train.engine.train, called by the worker with the run config
   `dsf train launch/examples/tiny.yaml --set ...` would read) on `deepspeed --num_gpus 4`, 3 steps
   of 8 x 64 tokens (micro-batch 2, 4 micro-batches through the 2-stage pipeline), fp32. The worker
   reads each rank's VmHWM before construction, right after it (`build_for_layout`: meta model,
   tensor shards, this stage's modules materialised), after `prepare` (deepspeed.initialize too),
   and at the end of training.
4. The table, per rank: the planner's build share and training peak; measured growth over the
   baseline (big run's VmHWM minus the tiny run's, same rank, same phase); the ratio; and the
   dense build, what dsf did before sharded construction: every rank builds the whole fp32 model
   (4 bytes x all parameters) before it cuts its part. Then the three losses (finite, or the
   script fails), seconds per step, and the four ranks' sum against this machine's RAM.

Before the big launch the script checks MemAvailable against the predicted sum and stops, naming
both, when other processes hold what the run needs. Logs of both launches are kept under --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from dsframework.ports import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY_YAML = REPO / "launch" / "examples" / "tiny.yaml"
TP, PP, WORLD, ZERO = 2, 2, 4, 1
STEPS, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = 3, 64, 8, 2
VOCAB = 32000
GiB = 2**30
BASELINE_GUESS = 0.6 * GiB  # per rank, for --plan-only (a real run measures it first)
LAUNCHERS = 0.6 * GiB  # the deepspeed runner, its per-node launcher and this script (measured ~0.55 GB)
DRY_RUN_TARGET = 25e6  # --dry-run: the family's largest up to 25M parameters (hidden 256)


# --- the model family and the planner's figures (pure) -------------------------------------------

def llama_fields(hidden: int, layers: int) -> dict:
    """The family's config.json for a width and depth."""
    heads = hidden // 64
    return {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": hidden,
            "intermediate_size": math.ceil(2.75 * hidden / 256) * 256, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(heads // 2, 1),
            "max_position_embeddings": 512, "tie_word_embeddings": False}


def rough_params(fields: dict) -> float:
    """Parameters of a family member, to within a few percent (attention with GQA, MLP, embeddings)."""
    h, f = fields["hidden_size"], fields["intermediate_size"]
    kv = h * fields["num_key_value_heads"] // fields["num_attention_heads"]
    return fields["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * f) + 2 * fields["vocab_size"] * h


def family(max_hidden: int = 8192) -> list[tuple[int, int]]:
    """(hidden, layers) of the search: hidden in steps of 256, layers even in [h/128, h/32]."""
    return [(h, layers) for h in range(256, max_hidden + 1, 256)
            for layers in range(max(2, h // 128), h // 32 + 1, 2)]


def predict(fields: dict) -> dict:
    """The planner's figures for this layout: per pipeline stage the training bytes per rank
    (its breakdown) and the build share, and the dense build's bytes."""
    from transformers import LlamaConfig

    from dsframework.layout import ParallelDims
    from dsframework.planner.memory import Workload, Layout, build_bytes_per_rank, stage_memories
    from dsframework.planner.model import describe_model

    desc = describe_model(LlamaConfig(**fields), name="scale")
    layout = Layout(ParallelDims(world=WORLD, tp=TP, pp=PP, zero_stage=ZERO), micro_batch=MICRO_BATCH,
                    grad_accum=GLOBAL_BATCH // (MICRO_BATCH * WORLD // (TP * PP)))
    job = Workload(seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, precision="fp32")
    return {"params": desc.total_params, "dense_build": 4 * desc.total_params,
            "build": build_bytes_per_rank(desc, layout),
            "stages": [dict(m.as_dict(), params_elements=m.parts["params_elements"])
                       for m in stage_memories(desc, layout, job)]}


def stage_of(rank: int) -> int:
    """The pipeline stage of a rank: DeepSpeed's topology puts pipe outermost (axes pipe, data, model)."""
    return rank // (WORLD // PP)


def predicted_ranks(prediction: dict, baseline: list[float], *, headroom: float = 0.0) -> list[float]:
    """Each rank's predicted resident peak: baseline + the larger of its stage's training bytes
    (times 1 + headroom) and its build share."""
    return [baseline[r] + max(prediction["stages"][stage_of(r)]["total"] * (1 + headroom), prediction["build"])
            for r in range(WORLD)]


def need(prediction: dict, baseline: list[float]) -> float:
    """What the run needs of this machine's RAM, as the fit rule counts it: the ranks' predicted
    peaks with dsf plan's headroom (MEMORY_HEADROOM, 10%: the planner's 5% accuracy and the
    allocator), plus the launcher processes."""
    from dsframework.planner.fit import MEMORY_HEADROOM

    return sum(predicted_ranks(prediction, baseline, headroom=MEMORY_HEADROOM)) + LAUNCHERS


def search(budget: float, baseline: list[float], *, params_target: float | None = None) -> tuple[dict, dict]:
    """The family's largest config (by parameters) that `need`s at most `budget` bytes (and, with
    params_target, has at most that many parameters)."""
    best = None
    for hidden, layers in family():
        fields = llama_fields(hidden, layers)
        if params_target is not None and rough_params(fields) > 1.5 * params_target:
            continue  # (the planner builds each config on the meta device: skip the hopeless ones)
        prediction = predict(fields)
        if params_target is not None and prediction["params"] > params_target:
            continue
        if need(prediction, baseline) > budget:
            continue
        if best is None or prediction["params"] > best[1]["params"]:
            best = (fields, prediction)
    if best is None:
        sys.exit(f"no config of the family fits in {budget / GiB:.1f} GiB" +
                 (f" with at most {params_target:,.0f} parameters" if params_target else ""))
    return best


def meminfo(key: str) -> int:
    """A /proc/meminfo figure in bytes (MemTotal, MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/meminfo")


# --- launching ----------------------------------------------------------------------------------


def run_overrides(config_json: Path, output_dir: Path) -> list[str]:
    """The `--set` overrides of tiny.yaml both launches train with."""
    accum = GLOBAL_BATCH // (MICRO_BATCH * WORLD // (TP * PP))
    return [f"model.name={config_json}", f"model.overrides.vocab_size={VOCAB}", "data.dataset=counting",
            "data.num_examples=2000", f"data.seq_len={SEQ_LEN}", f"train.steps={STEPS}",
            f"train.global_batch={GLOBAL_BATCH}", f"train.micro_batch={MICRO_BATCH}", f"train.grad_accum={accum}",
            "train.lr=3e-4", "train.warmup_steps=1", "train.precision=fp32", f"parallel.tp={TP}",
            f"parallel.pp={PP}", f"parallel.zero_stage={ZERO}", "logging.every=1", "logging.eval_every=0",
            "logging.progress=false", "checkpoint.every=0", "checkpoint.save_final=false",
            f"output_dir={output_dir}"]


def launch(name: str, fields: dict, work: Path) -> tuple[list[dict], list[float], float]:
    """Train `fields` with the worker on 4 ranks; (per-rank records, the 3 losses, wall seconds)."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    config_json = out / "config.json"
    config_json.write_text(json.dumps(fields, indent=1))
    sets = [a for o in run_overrides(config_json, out / "run") for a in ("--set", o)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    env.pop("RANK", None)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(WORLD), "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "--worker", str(out), *sets]
    log = out / "log.txt"
    start = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=3600).returncode
    wall = time.perf_counter() - start
    if code != 0:
        lines = log.read_text(errors="replace").splitlines()
        errors = [line.strip() for line in lines if re.search(r"(Error|Exception|Killed|killed)\b", line)]
        last = (errors or [line.strip() for line in lines if line.strip()] or ["no output"])[-1][:300]
        sys.exit(f"{name} launch failed (exit {code}): {last}\n  log: {log}")
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line]
    losses = [m["loss"] for m in metrics if "loss" in m]
    if len(losses) != STEPS or not all(math.isfinite(x) for x in losses):
        sys.exit(f"{name}: expected {STEPS} finite losses, got {losses}\n  log: {log}")
    seconds = [GLOBAL_BATCH * SEQ_LEN / m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
    for record in records:
        record["step_s"] = seconds
    return records, losses, wall


# --- the worker (one per rank, under the deepspeed launcher) -------------------------------------

def vm_hwm() -> int:
    """This process's peak resident set so far, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(out: Path, overrides: list[str]) -> None:
    """`dsf train` (dsframework.train.engine.train) with VmHWM read around construction and prepare;
    writes out/rank<r>.json."""
    from dsframework.config import load_run_config

    run = load_run_config(TINY_YAML, overrides)
    import torch

    from dsframework.parallel.topology import build_topology
    from dsframework.train import engine, setup
    from dsframework.train.world import shutdown_distributed

    torch.set_num_threads(1)
    marks: dict = {}
    build_for_layout, prepare = setup.build_for_layout, engine.prepare

    def timed_build(*args, **kwargs):
        marks["before_build"], start = vm_hwm(), time.perf_counter()
        built = build_for_layout(*args, **kwargs)
        marks["built"], marks["build_s"] = vm_hwm(), time.perf_counter() - start
        return built

    def marked_prepare(*args, **kwargs):
        session = prepare(*args, **kwargs)
        marks["prepared"] = vm_hwm()
        coord = build_topology(session.dims).get_coord(session.rank)
        marks.update(rank=session.rank, stage=coord.pipe, tp_rank=coord.model,
                     materialized=session.built.parameters, total_params=session.num_parameters)
        return session

    setup.build_for_layout, engine.prepare = timed_build, marked_prepare  # the bench patches, dsf does not
    start = time.perf_counter()
    engine.train(run, overwrite=True)
    marks["end"], marks["train_s"] = vm_hwm(), time.perf_counter() - start
    (out / f"rank{marks['rank']}.json").write_text(json.dumps(marks))
    shutdown_distributed()


# --- the table ----------------------------------------------------------------------------------

def figures(fields: dict, prediction: dict, big: list[dict], tiny: list[dict], losses: list[float],
            walls: dict[str, float]) -> dict:
    ranks = []
    for b, t in zip(big, tiny):
        stage = prediction["stages"][b["stage"]]
        ranks.append({"rank": b["rank"], "stage": b["stage"], "tp_rank": b["tp_rank"],
                      "materialized_elements": b["materialized"],
                      "planner_stage_elements": stage["params_elements"],
                      "planner_build": prediction["build"], "measured_build": b["built"] - t["built"],
                      "planner_train": stage["total"], "measured_train": b["end"] - t["end"],
                      "measured_prepared": b["prepared"] - t["prepared"],
                      "vm_hwm_end": b["end"], "baseline_end": t["end"],
                      "dense_build": prediction["dense_build"], "build_s": b["build_s"]})
    return {"model": fields, "params": prediction["params"], "planner_stages": prediction["stages"],
            "ranks": ranks, "losses": losses, "step_s": big[0]["step_s"], "wall_s": walls,
            "mem_total": meminfo("MemTotal"),
            "layout": f"tp {TP} x pp {PP} x dp {WORLD // (TP * PP)}, ZeRO-{ZERO}, fp32, "
                      f"{STEPS} steps of {GLOBAL_BATCH} x {SEQ_LEN} tokens, micro-batch {MICRO_BATCH}"}


def markdown(f: dict) -> str:
    g = lambda x: f"{x / GiB:.2f}"  # noqa: E731
    m = f["model"]
    rows = [f"Llama {f['params'] / 1e6:,.0f}M: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
            f"{m['num_attention_heads']} heads ({m['num_key_value_heads']} kv), intermediate "
            f"{m['intermediate_size']}, vocab {m['vocab_size']}; {f['layout']}", "",
            "| rank | stage | tp | build: planner | build: measured | after initialize: measured | train peak: planner "
            "| train peak: measured | measured / planner | dense build | dense / measured build |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in f["ranks"]:
        rows.append(f"| {r['rank']} | {r['stage']} | {r['tp_rank']} | {g(r['planner_build'])} | "
                    f"{g(r['measured_build'])} | {g(r['measured_prepared'])} | {g(r['planner_train'])} | "
                    f"{g(r['measured_train'])} | "
                    f"{r['measured_train'] / r['planner_train']:.2f} | {g(r['dense_build'])} | "
                    f"{r['dense_build'] / r['measured_build']:.1f}x |")
    total_measured = sum(r["vm_hwm_end"] for r in f["ranks"])
    total_predicted = sum(r["baseline_end"] + max(r["planner_train"], r["planner_build"]) for r in f["ranks"])
    built = sum(r["measured_build"] for r in f["ranks"])
    dense = sum(r["dense_build"] for r in f["ranks"])
    stage_lines = [f"stage {i}: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in s.items()
                                               if k not in ("total", "params_elements"))
                   for i, s in enumerate(f["planner_stages"])]
    rows += ["", "GiB per rank; measured = VmHWM less the same rank's in the tiny-model launch (baseline "
             f"{', '.join(g(r['baseline_end']) for r in f['ranks'])} GiB at the end). Build: after "
             "build_for_layout (planner: 4 B x (stage share + largest tensor)); after initialize: after "
             "prepare (deepspeed.initialize too); train peak: at the end of training (planner: stage_memories total). Dense build: 4 B x every parameter, on every rank.",
             "planner breakdown (GiB): " + "; ".join(stage_lines),
             "materialized elements per rank: " + ", ".join(f"{r['materialized_elements']:,}" for r in f["ranks"])
             + " (planner's stage share: " + ", ".join(f"{r['planner_stage_elements']:,}" for r in f["ranks"]) + ")",
             f"losses: {', '.join(f'{x:.4f}' for x in f['losses'])} (finite); seconds per step: "
             f"{', '.join(f'{s:.1f}' for s in f['step_s'])}; construction {max(r['build_s'] for r in f['ranks']):.1f} s",
             f"4 ranks' peaks, baselines included: {g(total_measured)} GiB measured, {g(total_predicted)} GiB "
             f"predicted, of {g(f['mem_total'])} GiB RAM; construction alone: {g(built)} GiB grown over the "
             f"baselines, where the dense build needs {g(dense)} GiB",
             "wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in f["wall_s"].items())]
    return "\n".join(rows)


# --- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, help="train this width (with --layers) instead of searching")
    parser.add_argument("--layers", type=int, help="with --hidden")
    parser.add_argument("--params-target", type=float, help="the family's largest with at most this many parameters")
    parser.add_argument("--ram-share", type=float, default=0.85, help="of MemTotal the 4 ranks' predicted peaks may take")
    parser.add_argument("--plan-only", action="store_true", help="print the search's choice and stop (no launch)")
    parser.add_argument("--dry-run", action="store_true", help=f"--params-target {DRY_RUN_TARGET:.0e}: the same "
                        "code path on a ~20M model, about a minute")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, not the table")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_scale", help="logs and records")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set by this file: the record dir
    parser.add_argument("--set", action="append", default=[], dest="overrides", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the launcher's
    args = parser.parse_args(argv)
    if (args.hidden is None) != (args.layers is None):
        parser.error("--hidden and --layers go together")
    if args.dry_run:
        args.params_target = DRY_RUN_TARGET
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.overrides)
        from dsframework.launching.supervise import exit_process

        exit_process(0)  # as dsf train ends: torch's teardown can abort a finished rank (see its docstring)
    budget = args.ram_share * meminfo("MemTotal")
    work = args.out.resolve()
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    walls = {}
    if args.plan_only:
        baseline = [BASELINE_GUESS] * WORLD
        say(f"baseline assumed {BASELINE_GUESS / GiB:.1f} GiB per rank (a run measures it)")
    else:
        tiny, _, walls["baseline launch"] = launch("baseline", llama_fields(64, 2) | {"num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "intermediate_size": 128}, work)
        baseline = [r["end"] for r in sorted(tiny, key=lambda r: r["rank"])]
        say(f"baseline (tiny model) VmHWM per rank: {', '.join(f'{b / GiB:.2f}' for b in baseline)} GiB")
    if args.hidden:
        fields = llama_fields(args.hidden, args.layers)
        prediction = predict(fields)
    else:
        fields, prediction = search(budget, baseline, params_target=args.params_target)
    needed = need(prediction, baseline)
    say(f"chosen: hidden {fields['hidden_size']}, {fields['num_hidden_layers']} layers, "
        f"{prediction['params']:,} parameters; predicted peak per rank "
        f"{', '.join(f'{x / GiB:.2f}' for x in predicted_ranks(prediction, baseline))} GiB (baselines included); "
        f"with 10% headroom and the launchers {needed / GiB:.2f} GiB of {budget / GiB:.2f} GiB "
        f"({args.ram_share:.0%} of MemTotal)")
    if args.plan_only:
        return
    available = meminfo("MemAvailable")
    if needed > available:
        sys.exit(f"MemAvailable is {available / GiB:.1f} GiB and the run needs {needed / GiB:.1f} GiB: "
                 "other processes hold memory; wait for them, or pass a smaller --params-target")
    big, losses, walls["model launch"] = launch("model", fields, work)
    big.sort(key=lambda r: r["rank"])
    result = figures(fields, prediction, big, sorted(tiny, key=lambda r: r["rank"]), losses, walls)
    (work / "figures.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1) if args.json else markdown(result))


if __name__ == "__main__":
    main()
