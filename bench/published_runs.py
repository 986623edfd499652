"""dsf plan against published training runs: does its speed model hold where the field measured?

    .venv/bin/python bench/published_runs.py               # the table (markdown), ~30 s
    .venv/bin/python bench/published_runs.py --only ptdp   # rows whose name starts with ptdp
    .venv/bin/python bench/published_runs.py --json        # one JSON object per row
    .venv/bin/python bench/published_runs.py --readme      # the compact table of README.md

For each row of bench/published_runs_data.py (Megatron-LM PTD-P's Table 1 and Table 2, torchtitan's
H100 / A100 / H200 benchmarks, each with its source): the model built from the row's shape (a GPT-2
config for Megatron's GPT: learned positions, LayerNorm, GELU MLP of 4h, eager attention as Megatron
2021 ran it - its fused softmax keeps the s x s scores; a Llama config for torchtitan's), the row's
GPU preset and GPU count, and the layout it ran, pinned: tp, pp, cp, dp, micro-batch, recomputation
(full; torchtitan's selective checkpointing: dsf's none if it fits, else full), ZeRO-3 for FSDP and
ZeRO-3 rows, ZeRO-0 (ZeRO-1 in a pipeline) for Megatron's data parallelism. dsf's step time at that
layout gives the predicted throughput, counted by the row's own formula (TFLOP/s per GPU by PTD-P's
eq. (3) for Megatron's rows, tokens/s per GPU for torchtitan's), and its ratio to the published one.

Where the published system did what dsf cannot (FP8 linears, async TP, the interleaved 1F1B schedule,
selective checkpointing, ring attention; listed per row), the prediction is for what dsf would run
(bf16, its own schedule) and the row says so: those rows are not in the "comparable" count. Where dsf
refuses the layout (cp with pp), the row says so and has no prediction.

Then, unpinned (`dsf plan` free to choose tp, pp, cp, ZeRO stage, micro-batch, checkpointing): dsf's
first choice, and the published layout's predicted speed over it (goal: >= 0.9, or the first choice's
advantage named: the step part where it gains most).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from published_runs_data import RUNS, PublishedRun  # noqa: E402

from dsframework.layout import ParallelDims, layout_problem  # noqa: E402
from dsframework.planner import explain  # noqa: E402
from dsframework.planner.cluster import cluster_preset  # noqa: E402
from dsframework.planner.memory import Layout, Workload  # noqa: E402
from dsframework.planner.model import ModelDesc, describe_model  # noqa: E402
from dsframework.planner.search import Candidate, evaluate, search  # noqa: E402
from dsframework.runtime_facts import sequence_parallel_auto  # noqa: E402

GOAL = 0.15  # every comparable row within 15% of the published throughput
RANK_GOAL = 0.9  # the published layout at >= 90% of dsf's first choice's predicted speed
PARTS = tuple(part for part, _ in explain.PARTS)  # the step's parts, as `dsf plan` splits it
_DESCS: dict[tuple, ModelDesc] = {}


def describe(run: PublishedRun) -> ModelDesc:
    """The row's model, counted as dsf counts it (one per shape)."""
    import transformers

    key = (run.hidden, run.ffn, run.layers, run.heads, run.kv_heads, run.vocab, run.seq_len)
    if key not in _DESCS:
        if run.name.startswith("ptdp"):  # Megatron's GPT: GPT-2's architecture, eager (materialised) attention
            config = transformers.GPT2Config(n_embd=run.hidden, n_head=run.heads, n_layer=run.layers,
                                             vocab_size=run.vocab, n_positions=run.seq_len, n_inner=run.ffn)
            desc = dataclasses.replace(describe_model(config, name=run.name), eager_attention=True)
        else:
            config = transformers.LlamaConfig(hidden_size=run.hidden, intermediate_size=run.ffn,
                                              num_hidden_layers=run.layers, num_attention_heads=run.heads,
                                              num_key_value_heads=run.kv_heads, vocab_size=run.vocab,
                                              max_position_embeddings=run.seq_len, tie_word_embeddings=False)
            desc = describe_model(config, name=run.name)
        _DESCS[key] = desc
    return _DESCS[key]


def published_flops(run: PublishedRun) -> float:
    """FLOPs of one step by the source's own formula (PTD-P eq. (3)); 0 for a tokens/s row."""
    if run.flop_formula != "ptdp_eq3":
        return 0.0
    b, s, n_layers, h, v = run.global_batch, run.seq_len, run.layers, run.hidden, run.vocab
    return 96 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))


def pinned(run: PublishedRun, desc: ModelDesc, job: Workload, cluster) -> tuple[Candidate | None, str]:
    """The row's layout as dsf would run it, priced (None and why when dsf refuses it)."""
    zero = 3 if run.zero_stage_or_fsdp in ("fsdp", "zero3") else 0
    if run.pp > 1 and zero > 1:
        zero = 1  # DeepSpeed's pipeline engine takes ZeRO 0-1 (the row says FSDP under pp differs)
    dims = ParallelDims(world=run.gpus, tp=run.tp, pp=run.pp, cp=run.cp, zero_stage=zero)
    problem = layout_problem(dims, num_heads=desc.heads, num_kv_heads=desc.kv_heads, num_layers=desc.layers,
                             seq_len=run.seq_len, ranks_per_node=cluster.gpus_per_node)
    if problem is not None:
        return None, f"dsf refuses it: {problem}"
    per_replica = run.global_batch // dims.dp
    divisors = [m for m in (1, 2, 4, 8, 16, 32) if per_replica % m == 0]
    checkpointing = ("full",) if run.recompute == "full" else ("none", "full")
    # parallel.sequence_parallel as the published run had it (dsf runs either), where auto's rule allows it
    sequence_parallel = run.sequence_parallel and sequence_parallel_auto(tp=run.tp, cp=run.cp, seq_len=run.seq_len,
                                                                         experts=desc.experts)

    def best(micros: list[int]) -> Candidate:
        priced = [evaluate(desc, Layout(dims, micro_batch=m, grad_accum=per_replica // m, activation_checkpointing=c,
                                        sequence_parallel=sequence_parallel), job, cluster)
                  for m in micros for c in checkpointing]
        fitting = [c for c in priced if c.fits]
        return max(fitting, key=lambda c: c.tokens_per_s) if fitting else min(priced, key=lambda c: c.over)

    chosen = best([run.micro_batch] if run.micro_batch else divisors)
    if chosen.fits:
        return chosen, ""
    why = ""
    if run.micro_batch:  # what dsf would run instead: the same batch in smaller micro-batches, accumulated
        smaller = best([m for m in divisors if m < run.micro_batch])
        if smaller.fits:
            return smaller, (f"micro-batch {run.micro_batch} needs {chosen.over:.2f} x the memory in dsf's model"
                             f"{why}; dsf runs {smaller.layout.micro_batch} x {smaller.layout.grad_accum}")
        chosen = min((chosen, smaller), key=lambda c: c.over)
    return chosen, (f"does not fit dsf's memory model: {chosen.over:.2f} x the memory at micro-batch "
                    f"{chosen.layout.micro_batch}{why}")


def advantage(first: Candidate, published: Candidate) -> str:
    """The step part where dsf's first choice gains most over the published layout, in one line."""
    gains = {part: getattr(published.time, part) - getattr(first.time, part) for part in PARTS}
    part = max(gains, key=lambda p: gains[p])
    return (f"{part.replace('_', ' ')} {getattr(published.time, part):.2f} s -> {getattr(first.time, part):.2f} s "
            f"per step ({first.layout.dims}, micro-batch {first.layout.micro_batch}, "
            f"checkpointing {first.layout.activation_checkpointing})")


def row(run: PublishedRun, *, unpinned: bool) -> dict:
    """Prediction, ratio and ranking of one published run."""
    desc, cluster = describe(run), cluster_preset(run.gpu, nodes=max(1, run.gpus // 8), gpus_per_node=min(8, run.gpus))
    precision = "fp16" if run.precision == "fp16" else "bf16"  # fp8: dsf trains bf16
    job = Workload(seq_len=run.seq_len, global_batch=run.global_batch, precision=precision)
    out = {"name": run.name, "gpus": run.gpus, "layout": f"tp{run.tp} pp{run.pp} cp{run.cp} dp{run.dp}",
           "differs": run.deepspeed_differs, "source": run.source}
    candidate, why = pinned(run, desc, job, cluster)
    out["why"] = why
    if candidate is None or not candidate.fits:
        return out
    if why:  # dsf runs another micro-batch than the published one: not the same run
        out["differs"] = "; ".join(filter(None, (run.deepspeed_differs, why)))
    seconds = candidate.time.total
    if run.flop_formula == "ptdp_eq3":
        out.update(unit="TFLOP/s/GPU", published=run.published_tflops_per_gpu,
                   predicted=published_flops(run) / (seconds * run.gpus) / 1e12)
    else:
        out.update(unit="tokens/s/GPU", published=run.published_tokens_per_s_per_gpu,
                   predicted=run.global_batch * run.seq_len / (seconds * run.gpus))
    out["ratio"] = out["predicted"] / out["published"]
    out["parts"] = {part: round(getattr(candidate.time, part), 3) for part in PARTS}
    if unpinned:
        first = search(desc, cluster, job, suggest=False).best
        if first is not None:
            out["speed_vs_first"] = first.time.total / seconds
            out["first"] = f"{first.layout.dims} z{first.layout.dims.zero_stage} mb{first.layout.micro_batch}"
            if out["speed_vs_first"] < RANK_GOAL:
                out["advantage"] = advantage(first, candidate)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| run | GPUs | layout | published | dsf | ratio | published layout / dsf's first | differs |",
             "|---|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        if "ratio" not in r:
            lines.append(f"| {r['name']} | {r['gpus']} | {r['layout']} | | | | {r['why']} | {r['differs']} |")
            continue
        rank = f"{r['speed_vs_first']:.2f} ({r['first']})" if "speed_vs_first" in r else ""
        if "advantage" in r:
            rank += f"; first gains in {r['advantage']}"
        lines.append(f"| {r['name']} | {r['gpus']} | {r['layout']} | {r['published']:g} {r['unit']} | "
                     f"{r['predicted']:.1f} | {r['ratio']:.2f} | {rank} | {r['differs'] or '-'} |")
    return "\n".join(lines)


SHORT = (("scatter/gather", "scatter/gather"), ("interleaved", "interleaved 1F1B"), ("FP8", "FP8"),
         ("async TP", "async TP"), ("selective activation", "selective AC"), ("ring-attention", "ring attention"),
         ("under pipeline", "FSDP under pp"), ("cp together with pp", "cp with pp"),
         ("micro-batch", "smaller micro-batch"))


def readme_table(rows: list[dict]) -> str:
    """The compact table the README shows: ratio per row, what the published run did that dsf does not."""
    lines = ["| run | GPUs | layout | published | dsf | ratio | how dsf's run differs from the published one |",
             "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        unit = "TFLOP/s" if r.get("unit", "").startswith("TFLOP") else "tok/s"
        differs = ", ".join(short for key, short in SHORT if key in (r["differs"] or ""))
        if "ratio" not in r:
            why = "dsf refuses the layout" if r["why"].startswith("dsf refuses") else "does not fit dsf"
            lines.append(f"| {r['name']} | {r['gpus']} | {r['layout']} | | | | {why}; {differs or '-'} |")
            continue
        lines.append(f"| {r['name']} | {r['gpus']} | {r['layout']} | {r['published']:g} {unit} | "
                     f"{r['predicted']:.0f} | {r['ratio']:.2f} | {differs or '-'} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    comparable = [r for r in rows if "ratio" in r and not r["differs"]]
    within = [r for r in comparable if abs(r["ratio"] - 1) <= GOAL]
    ranked = [r for r in rows if "speed_vs_first" in r]
    near = [r for r in ranked if r["speed_vs_first"] >= RANK_GOAL or "advantage" in r]
    worst = max(comparable, key=lambda r: abs(r["ratio"] - 1)) if comparable else None
    unpriced = [r["name"] for r in rows if "ratio" not in r and not r["differs"]]
    return (f"comparable rows (nothing dsf cannot run): {len(within)} of {len(comparable)} within {GOAL:.0%}"
            + (f" (worst {worst['name']}: {worst['ratio']:.2f})" if worst else "")
            + (f", and {len(unpriced)} dsf cannot run as published ({', '.join(unpriced)})" if unpriced else "")
            + f"; published layout >= {RANK_GOAL:.0%} of dsf's first choice: "
            f"{sum(r['speed_vs_first'] >= RANK_GOAL for r in ranked)} of {len(ranked)}"
            f" (the rest with the first choice's gain named: {len(near)} of {len(ranked)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rows whose name starts with this")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--readme", action="store_true", help="the compact table README.md shows")
    parser.add_argument("--no-unpinned", action="store_true", help="skip the unpinned search (faster)")
    args = parser.parse_args(argv)
    started = time.time()
    rows = [row(run, unpinned=not args.no_unpinned) for run in RUNS if run.name.startswith(args.only)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    elif args.readme:
        print(readme_table(rows))
        print()
        print(summary(rows))
    else:
        print(table(rows))
        print()
        print(summary(rows) + f" [{time.time() - started:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
