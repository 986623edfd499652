"""How long `dsf plan` takes: real-size models up to 1T parameters on up to 512 nodes x 8 GPUs.

    .venv/bin/python bench/plan_speed.py            # a markdown table; target: 1T on 4096 GPUs < 2 s

Times the planner itself (model description + search over every layout + ranking), the median of
--repeats runs, in one process with nothing else: what `dsf plan` adds to Python's start-up. The
model is described twice: counted on the meta-device model (planner/model.py, what any architecture
takes) and from its config alone (planner/analytic.py, what `dsf plan` does for these Llamas).
"""
from __future__ import annotations

import argparse
import statistics
import time

from transformers import LlamaConfig

from dsframework.config import ModelSpec
from dsframework.models.build import resolve_model
from dsframework.planner.analytic import analytic_desc
from dsframework.planner.cluster import cluster_preset
from dsframework.planner.count import clear_cache
from dsframework.planner.memory import Workload, stage_shapes
from dsframework.planner.model import describe_model
from dsframework.planner.search import search

# A 1.2T-parameter Llama-shaped model (128 layers, hidden 25600, GQA 160/8 heads).
ONE_T = LlamaConfig(vocab_size=128256, hidden_size=25600, intermediate_size=102400, num_hidden_layers=128,
                    num_attention_heads=160, num_key_value_heads=8)
CASES = [  # (label, config, nodes, seq_len, global batch)
    ("llama-7b", None, 1, 4096, 256),
    ("llama-70b", None, 64, 4096, 1024),
    ("1T", ONE_T, 512, 4096, 4096),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for label, config, nodes, seq_len, batch in CASES:
        config = config or resolve_model(ModelSpec(name=label)).config
        times: dict[str, list[float]] = {"meta": [], "config": []}
        for _ in range(args.repeats):
            for how, describe in (("meta", describe_model), ("config", analytic_desc)):
                stage_shapes.cache_clear()  # every run from scratch, as a fresh `dsf plan` would be
                clear_cache()  # (the counts on the meta-device model too)
                start = time.perf_counter()
                desc = describe(config, name=label)
                assert desc is not None  # (analytic.py takes every Llama here)
                plan = search(desc, cluster_preset("h100-80gb", nodes=nodes, gpus_per_node=8),
                              Workload(seq_len=seq_len, global_batch=batch, precision="bf16"))
                times[how].append(time.perf_counter() - start)
        rows.append((label, f"{desc.total_params / 1e9:,.1f} B", f"{nodes} x 8", len(plan.candidates),
                     len(plan.fitting), statistics.median(times["meta"]), statistics.median(times["config"])))
    print("| model | parameters | GPUs | layouts | fit | plan time (s, median) | from its config alone (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, params, gpus, n, fit, seconds, alone in rows:
        print(f"| {label} | {params} | {gpus} | {n:,} | {fit:,} | {seconds:.3f} | {alone:.3f} |")
    worst = rows[-1][-2]
    print(f"\n1T on 512 x 8 GPUs: {worst:.3f} s ({'within' if worst < 2 else 'OVER'} the 2 s target)")


if __name__ == "__main__":
    main()
