"""Throughput of dsframework's tensor parallelism against DeepSpeed's AutoTP training, tp=2 on 2 ranks.

    .venv/bin/python bench/tp_vs_autotp.py                        # tiny-llama, 30 steps, A B A B A B
    .venv/bin/python bench/tp_vs_autotp.py --model tiny-gpt2 --repeats 5 --json
    .venv/bin/python bench/tp_vs_autotp.py --model small-qwen3 --zero-stage 1   # from transformers' Qwen3 plan

Both variants train the same model for the same steps on 2 CPU ranks (gloo, one thread each):

  A  ours    `deepspeed --num_gpus 2 dsf train launch/examples/tiny.yaml --set parallel.tp=2 ...`:
             Megatron-style column/row/vocab-parallel layers (dsframework/models/tensor_parallel.py).
  B  AutoTP  this file under the same launcher (`--worker autotp`): the dense model handed to
             `deepspeed.initialize` with `"tensor_parallel": {"autotp_size": 2}` added to the very
             DeepSpeed JSON dsf builds (build_ds_config), then a plain forward/backward/step loop.

What is the same: run config (tiny.yaml + the overrides below), tokenizer (trained once here and
passed to both as model.tokenizer), packed blocks of the built-in `counting` task, batches
(BlockSampler at dp=1: both tensor ranks read the same blocks, as AutoTP requires), weight init
(build_model, same seed), fp32, ZeRO-0 (or --zero-stage 1), AdamW, lr schedule, clipping, and per-step timing: rank 0
times each step including one all-reduce of the loss, as `dsf train` does at logging.every=1.

Steady-state tokens/s of one run = tokens / seconds over the steps after --warmup (the per-step
times summed, not a mean of per-step rates). Each variant runs --repeats times, alternating, and
the table gives the median run, the min-max spread, and the ratio ours / AutoTP of the medians.
Exit code 2, with one line saying why, when AutoTP cannot train here or did not shard the model.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsframework.ports import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY_YAML = REPO / "launch" / "examples" / "tiny.yaml"
TP = 2  # both variants; the machine has 2 cores, one rank each


# --- the shared run -----------------------------------------------------------------------------

def run_overrides(args: argparse.Namespace, tokenizer_dir: Path, output_dir: Path) -> list[str]:
    """`--set` overrides of tiny.yaml both variants train with: fast and exactly reproducible."""
    return [f"model.name={args.model}", f"model.tokenizer={tokenizer_dir}", "data.dataset=counting",
            "data.num_examples=2000", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}",
            f"train.global_batch={args.global_batch}", "train.micro_batch=null", "train.grad_accum=null",
            "train.lr=3e-3", "train.warmup_steps=2", "train.precision=fp32",
            f"parallel.tp={TP}", f"parallel.zero_stage={args.zero_stage}",
            "logging.every=1", "logging.eval_every=0", "logging.progress=false",
            "checkpoint.every=0", "checkpoint.save_final=false", f"output_dir={output_dir}",
            *([f"model.overrides.vocab_size={args.vocab}"] if args.vocab else [])]


def save_tokenizer(directory: Path) -> None:
    """Train the task's tokenizer once, so both variants get the same vocabulary (and model)."""
    from dsframework.config import load_run_config
    from dsframework.data import load_texts, train_tokenizer

    run = load_run_config(TINY_YAML, ["data.dataset=counting", "data.num_examples=2000"])
    train_tokenizer(load_texts(run.data), run.data).save_pretrained(str(directory))


# --- launching ----------------------------------------------------------------------------------


def launch(script_and_args: list[str]) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus 2 <script> <args>` with one thread per rank; output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(TP), "--master_port", str(free_port()), *script_and_args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


def last_error(proc: subprocess.CompletedProcess) -> str:
    """The last line that looks like an exception in a failed launch's output."""
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line.strip() for line in lines if re.search(r"(Error|Exception|Assertion)\b.*:", line)]
    return (errors or [line.strip() for line in lines if line.strip()] or ["no output"])[-1][:300]


def run_ours(args: argparse.Namespace, work: Path, tokenizer_dir: Path, index: int) -> dict:
    """Variant A: `dsf train` at tp=2; steps from its metrics.jsonl, layout from its banner."""
    out = work / f"ours{index}"
    sets = [a for o in run_overrides(args, tokenizer_dir, out) for a in ("--set", o)]
    proc = launch([str(BIN / "dsf"), "train", str(TINY_YAML), *sets])
    if proc.returncode:
        sys.exit(f"dsf train failed (exit {proc.returncode}): {last_error(proc)}")
    banner = re.search(r"world (\d+) = tp (\d+) x pp (\d+) x cp (\d+) x dp (\d+)", proc.stdout)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return {"steps": steps, "layout": banner.group(0) if banner else "?",
            "tp": int(banner.group(2)) if banner else 0}


def run_autotp(args: argparse.Namespace, work: Path, tokenizer_dir: Path, index: int) -> dict:
    """Variant B: this file's AutoTP worker under the launcher; it writes its record as JSON."""
    out = work / f"autotp{index}"
    sets = [a for o in run_overrides(args, tokenizer_dir, out) for a in ("--set", o)]
    cmd = [str(Path(__file__).resolve()), "--worker", "autotp", "--out", str(out / "record.json"), *sets]
    proc = launch(cmd)
    if proc.returncode:
        print(f"AutoTP cannot train {args.model} here: `deepspeed --num_gpus {TP} {' '.join(cmd[:3])} ...` "
              f"exited {proc.returncode}: {last_error(proc)}", file=sys.stderr)
        sys.exit(2)
    return json.loads((out / "record.json").read_text())


# --- the AutoTP worker (one per rank, under the launcher) ---------------------------------------

def sharding_report(dense: dict[str, tuple], model) -> dict:
    """Which weights AutoTP sharded on this rank: name -> [dense shape, local shape]."""
    local = {name: tuple(p.shape) for name, p in model.named_parameters()}
    sharded = {n: [list(dense[n]), list(s)] for n, s in local.items() if n in dense and s != dense[n]}
    return {"sharded": sharded, "replicated": sorted(n for n in local if n in dense and n not in sharded),
            "renamed": sorted(set(local) ^ set(dense))}


def autotp_worker(overrides: list[str], out: Path) -> None:
    """Train the run config's model with DeepSpeed AutoTP at tp=2, dp=1; rank 0 writes `out`."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from dsframework.config import load_run_config
    from dsframework.data import BlockSampler, load_texts, load_tokenizer, store_cache_dir, token_stores
    from dsframework.dsconfig import build_ds_config, resolve_batch
    from dsframework.train.world import init_distributed, shutdown_distributed
    from dsframework.models.build import build_model, resolve_model

    run = load_run_config(TINY_YAML, overrides)
    rank, world = init_distributed()  # pins the JIT build tools, unlinks DeepSpeed's /dev/shm buffers
    assert world == TP, f"run under `deepspeed --num_gpus {TP}` (world is {world})"
    tokenizer = load_tokenizer(run.model.tokenizer)
    train_blocks, _ = token_stores(load_texts(run.data), tokenizer, run.data, cache_dir=store_cache_dir())
    source = resolve_model(run.model)
    model = build_model(source, source.config_for(tokenizer), seed=run.train.seed)
    dense = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # Every rank is one tensor rank of the same replica: dp=1, and AutoTP requires both to see
    # the same batch (it checks the first one), so both read data-parallel rank 0's blocks.
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=1)
    ds_config = build_ds_config(run.train, run.parallel, dp_size=1)
    ds_config["tensor_parallel"] = {"autotp_size": TP}
    # DeepSpeed checks the batch triple before AutoTP has made its groups, against the whole world
    # as data parallel (8 != 8 * 1 * 2); like DeepSpeed's own AutoTP tests, give micro-batch and
    # accumulation only (its train_batch_size then reads 16, which only its sample counter uses).
    del ds_config["train_batch_size"]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    sampler = BlockSampler(len(train_blocks), micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                           dp_size=1, dp_rank=0, seed=run.data.seed)
    tokens_per_step = batch.global_batch * run.data.seq_len
    steps = []
    for step in range(run.train.steps):
        start = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64)
        for indices in sampler.micro_batches(step * batch.global_batch):
            input_ids = train_blocks[indices]
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        loss_value = total / batch.grad_accum
        dist.all_reduce(loss_value)  # what dsf train does on every logged step (mean over ranks)
        steps.append({"step": step + 1, "loss": loss_value.item() / world,
                      "tokens_per_s": tokens_per_step / (time.perf_counter() - start)})
    report = sharding_report(dense, engine.module)
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"steps": steps, "sharding": report, "tp": TP,
                                   "layout": f"world {world} = autotp {TP} x dp {world // TP}"}))
    shutdown_distributed()


# --- the table ----------------------------------------------------------------------------------

def steady_tokens_per_s(steps: list[dict], warmup: int) -> float:
    """Tokens / seconds over the steps after `warmup` (seconds per step = tokens / its rate)."""
    rates = [s["tokens_per_s"] for s in steps if "tokens_per_s" in s and s["step"] > warmup]
    assert rates, f"no steps after warmup={warmup}"
    return len(rates) / sum(1.0 / r for r in rates)  # every step moves the same number of tokens


def summarize(runs: dict[str, list[dict]], warmup: int) -> dict:
    figures = {}
    for variant, records in runs.items():
        rates = [steady_tokens_per_s(r["steps"], warmup) for r in records]
        losses = [s["loss"] for s in records[0]["steps"] if "loss" in s]
        figures[variant] = {"median_tokens_per_s": statistics.median(rates), "min": min(rates),
                            "max": max(rates), "runs": rates, "layout": records[0]["layout"],
                            "loss_first": losses[0], "loss_last": losses[-1]}
    figures["ratio_ours_over_autotp"] = (figures["ours"]["median_tokens_per_s"]
                                         / figures["autotp"]["median_tokens_per_s"])
    ours, autotp = ({s["step"]: s["loss"] for s in runs[v][0]["steps"] if "loss" in s} for v in ("ours", "autotp"))
    figures["loss_max_relative_difference"] = max(abs(ours[k] - autotp[k]) / abs(autotp[k]) for k in autotp)
    return figures


def markdown(figures: dict, args: argparse.Namespace) -> str:
    rows = ["| variant | layout | tokens/s (median) | spread (min-max) | loss step 1 | "
            f"loss step {args.steps} |", "|---|---|---:|---:|---:|---:|"]
    for variant, name in (("ours", "dsframework TP (Megatron-style)"), ("autotp", "DeepSpeed AutoTP")):
        f = figures[variant]
        rows.append(f"| {name} | {f['layout']} | {f['median_tokens_per_s']:,.0f} | "
                    f"{f['min']:,.0f}-{f['max']:,.0f} | {f['loss_first']:.4f} | {f['loss_last']:.4f} |")
    rows.append(f"\nratio ours / AutoTP (medians): **{figures['ratio_ours_over_autotp']:.2f}x**; losses differ by "
                f"{figures['loss_max_relative_difference']:.1e} at most (relative, per step)  "
                f"({args.model}, ZeRO-{args.zero_stage}, {args.steps} steps of {args.global_batch} x {args.seq_len} "
                "tokens, fp32, "
                f"{args.repeats} runs each, first {args.warmup} steps of each run not timed)")
    return "\n".join(rows)


def check_tensor_parallel(ours: dict, autotp: dict) -> str:
    """One line saying both ran at tp=2 (AutoTP really sharded its linears); exit 2 if not."""
    sharded = autotp["sharding"]["sharded"]
    if ours["tp"] != TP or not sharded:
        print(f"not a tp={TP} comparison: dsf ran `{ours['layout']}`, AutoTP sharded {len(sharded)} weights",
              file=sys.stderr)
        sys.exit(2)
    examples = [n for n in sharded if ".0.self_attn.q_proj" in n or n.startswith("lm_head")] or list(sharded)[:1]
    shown = "; ".join(f"{n} {sharded[n][0]} -> {sharded[n][1]}" for n in examples)
    return (f"tp check: dsf ran `{ours['layout']}`; AutoTP sharded {len(sharded)} weights on rank 0 ({shown}) "
            f"and kept whole: {', '.join(autotp['sharding']['replicated'])}")


# --- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llama",
                        choices=["tiny-llama", "small-llama", "tiny-gpt2", "small-qwen3"],
                        help="a preset; small-llama (hidden 256, 4 layers) shows where the math starts to count; "
                             "small-qwen3 shards from transformers' Qwen3 plan (q_norm/k_norm: gradients summed)")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1], help="both variants' ZeRO stage")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the timing")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, help="the model's vocabulary (default: the task tokenizer's 15 tokens); "
                        "a real one (small-qwen3's 8192) is where a vocab-parallel head differs from a gathered one")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating A B A B")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, not a table")
    parser.add_argument("--worker", choices=["autotp"], help=argparse.SUPPRESS)  # set by this file
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], dest="overrides", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the launcher's
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker == "autotp":
        autotp_worker(args.overrides, args.out)
        from dsframework.launching.supervise import exit_process

        exit_process(0)  # as dsf train ends: torch's teardown can abort a finished rank (see its docstring)
    with tempfile.TemporaryDirectory(prefix="tp_vs_autotp_") as tmp:
        work = Path(tmp)
        save_tokenizer(work / "tokenizer")
        runs: dict[str, list[dict]] = {"ours": [], "autotp": []}
        for index in range(args.repeats):  # alternate, so drift in the machine hits both alike
            runs["ours"].append(run_ours(args, work, work / "tokenizer", index))
            runs["autotp"].append(run_autotp(args, work, work / "tokenizer", index))
            print(f"repeat {index + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    check = check_tensor_parallel(runs["ours"][0], runs["autotp"][0])
    figures = summarize(runs, args.warmup)
    if args.json:
        figures["tp_check"] = check
        print(json.dumps(figures, indent=2))
    else:
        print(check + "\n\n" + markdown(figures, args))


if __name__ == "__main__":
    main()
