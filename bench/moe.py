"""A mixture of experts at ep 1, 2 and 4 on 4 CPU ranks: model-state memory per rank (measured and
planned) and tokens/s of `dsf train`, beside raw DeepSpeed AutoEP driven by hand from the same JSON.

    .venv/bin/python bench/moe.py              # the README's table (21 min on 2 cores)
    .venv/bin/python bench/moe.py --smoke      # a small model, ep 1 and 2, one launch each (~3 min)
    .venv/bin/python bench/moe.py --json       # the same figures for machines

The model is Qwen3-MoE shaped (MODEL below: 8 layers, hidden 512, 16 experts of ffn 1024, top 2:
208M parameters with the counting task's tokenizer, 31.5M of them active per token), random init.
At each ep it trains at ZeRO-1 (the stage DeepSeek-V3 trains its experts with), --steps steps of
--global-batch x --seq-len tokens, micro-batch --micro-batch per rank:

  dsf  `deepspeed --num_gpus 4 $(which dsf) train tiny.yaml --set model.name=<config> --set
       parallel.ep=E ...` (ep 1: the experts are plain weights under ZeRO, as before parallel.ep);
  raw  this file's `--worker`: `deepspeed.initialize(config=ds_config.json)`, the JSON dsf builds for
       that run (`dsconfig.build_ds_config`: its `expert_parallel` section at ep > 1), on the same
       model (dsframework.models.build.build_model, same seed) and a forward / backward / step loop over
       the same blocks (bench/compare.py's raw way). At ep > 1 it applies dsf's one shim first
       (`models/autoep_compat.py`): DeepSpeed 0.19.8's AutoEP does not start on transformers 5.24
       without it.

Model states: the raw worker counts the bytes of parameters, gradients (the most held, just before
the update) and optimizer states every rank holds in its first step (distinct storages, as
tests/distributed/workers/model_states.py counts them); the busiest rank is shown. Planned:
`planner.memory.stage_memories` for that layout. Tokens/s: rank 0's wall clock over the steps after
--warmup-steps-excluded (dsf's from its metrics windows; see bench/compare.py). Launches run in turn
(dsf ep1, raw ep1, dsf ep2, ...), --repeats times; the table shows medians, and dsf / raw of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.compare (the shared job, launches and clock); the tests' byte counts

from bench.compare import (  # noqa: E402
    BIN, TINY_YAML, add_worker_arguments, check_timed_steps, dsf_record, fail, launch, plain_loop, rank_inputs,
    save_tokenizer, write_record,
)

WORLD = 4
MODEL = {"model_type": "qwen3_moe", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1024, "moe_intermediate_size": 1024,
         "num_experts": 16, "num_experts_per_tok": 2, "max_position_embeddings": 1024, "tie_word_embeddings": False,
         "vocab_size": 8192}  # (the bench trains with the counting tokenizer's vocabulary)
SMOKE_MODEL = {**MODEL, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
               "intermediate_size": 256, "moe_intermediate_size": 256, "num_experts": 8}


def run_overrides(args: argparse.Namespace, *, ep: int, model: Path, tokenizer: Path, output_dir: Path) -> list[str]:
    """The `--set` overrides of tiny.yaml both ways train with at `ep`."""
    return [f"model.name={model}", f"model.tokenizer={tokenizer}", "data.dataset=counting",
            "data.num_examples=4000", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}",
            f"train.global_batch={args.global_batch}", f"train.micro_batch={args.micro_batch}",
            "train.grad_accum=null", "train.warmup_steps=2", "train.precision=fp32",
            f"parallel.zero_stage={args.zero_stage}", f"parallel.ep={ep}", f"logging.every={args.log_every}",
            "logging.eval_every=0", "logging.progress=false", "checkpoint.every=0", "checkpoint.save_final=false",
            f"output_dir={output_dir}"]


def run_config(overrides: list[str]):
    from dsframework.config import load_run_config

    return load_run_config(TINY_YAML, overrides)


def planned_model_states(overrides: list[str]) -> float:
    """The planner's parameter + gradient + optimizer bytes on the busiest rank of this run."""
    from dsframework.data import load_tokenizer
    from dsframework.dsconfig import resolve_batch
    from dsframework.layout import ParallelDims
    from dsframework.models.build import resolve_model
    from dsframework.planner.memory import Workload, Layout, stage_memories
    from dsframework.planner.model import describe_model

    run = run_config(overrides)
    config = resolve_model(run.model).config_for(load_tokenizer(run.model.tokenizer))
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=WORLD)
    layout = Layout(ParallelDims(world=WORLD, zero_stage=run.parallel.zero_stage, ep=run.parallel.ep),
                    micro_batch=batch.micro_batch, grad_accum=batch.grad_accum)
    memory = stage_memories(describe_model(config, name="bench-moe"), layout,
                            Workload(seq_len=run.data.seq_len, global_batch=batch.global_batch, precision="fp32"))[0]
    return memory.params + memory.grads + memory.optimizer


def worker(overrides: list[str], ds_json: Path, record_path: Path, *, excluded: int) -> None:
    """raw: deepspeed.initialize on the JSON file and a plain loop; the first step's model-state bytes
    of each rank and rank 0's tokens/s go to the record."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from dsframework.jit import pin_build_tools, release_shm_buffers
    from dsframework.models.autoep_compat import bridge_output_capture_registry
    from tests.distributed.workers.model_states import grad_bytes, optimizer_bytes, param_bytes

    pin_build_tools()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    release_shm_buffers()
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = json.loads(ds_json.read_text())
    run, batch, blocks, model = rank_inputs(overrides, ds_config)
    if "expert_parallel" in ds_config:
        bridge_output_capture_registry()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=str(ds_json))
    grads, step_fn = [0], engine.optimizer.step

    def measured_step(*a, **k):  # the first update only: the gradients as reduced, just before it
        grads[0] = grad_bytes(engine)
        engine.optimizer.step = step_fn
        return step_fn(*a, **k)

    engine.optimizer.step = measured_step
    states = [None]

    def after_step(step: int) -> None:
        if step == 1:
            states[0] = param_bytes(engine.module) + grads[0] + optimizer_bytes(engine)

    clock, final_loss = plain_loop(engine, run, batch, blocks, excluded=excluded, after_step=after_step)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, states[0])
    if rank == 0:
        write_record(record_path, {"tokens_per_s": clock.tokens_per_s(excluded, run.train.steps),
                                   "final_loss": final_loss, "model_states": per_rank})
    dist.barrier()
    dist.destroy_process_group()


def one_launch(way: str, args: argparse.Namespace, *, out: Path, overrides: list[str], ds_json: Path) -> dict:
    """One launch of `way` (dsf or raw); its record (tokens_per_s, final_loss, raw: model_states)."""
    sets = [a for o in overrides for a in ("--set", o)]
    if way == "dsf":
        cmd = [str(BIN / "dsf"), "train", str(TINY_YAML), *sets, "--overwrite"]
    else:
        cmd = [str(Path(__file__).resolve()), "--worker", "--ds-config", str(ds_json), "--record",
               str(out / "record.json"), "--warmup-steps-excluded", str(args.warmup_steps_excluded), *sets]
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").unlink(missing_ok=True)
    code, wall = launch(cmd, out / "launch.log", world=WORLD)
    if code:
        fail(way, code, out / "launch.log", label=" ".join(cmd[:3]))
    record = dsf_record(out, args) if way == "dsf" else json.loads((out / "record.json").read_text())
    return {**record, "launch_s": wall}


def bench(args: argparse.Namespace, work: Path) -> list[dict]:
    """Every ep's row: launches in turn, then medians."""
    from dsframework.dsconfig import build_ds_config
    from dsframework.models.build import resolve_model
    from dsframework.models.experts import expert_layout

    save_tokenizer(work / "tokenizer")
    model = work / "model.json"
    model.write_text(json.dumps(SMOKE_MODEL if args.smoke else MODEL, indent=1))
    runs: dict[int, dict[str, list[dict]]] = {ep: {"dsf": [], "raw": []} for ep in args.ep}
    for index in range(args.repeats):
        for ep in args.ep:
            for way in ("dsf", "raw"):
                out = work / f"ep{ep}" / f"{way}{index}"
                overrides = run_overrides(args, ep=ep, model=model, tokenizer=work / "tokenizer", output_dir=out)
                run = run_config(overrides)
                ds_json = work / f"ep{ep}" / "ds_config.json"
                ds_json.parent.mkdir(exist_ok=True)
                ds_json.write_text(json.dumps(build_ds_config(run.train, run.parallel, dp_size=WORLD), indent=1))
                runs[ep][way].append(one_launch(way, args, out=out, overrides=overrides, ds_json=ds_json))
                print(f"ep {ep} {way} {index + 1}/{args.repeats}: {runs[ep][way][-1]['tokens_per_s']:,.0f} tokens/s",
                      file=sys.stderr, flush=True)
    experts = expert_layout(resolve_model(run_config(overrides).model).config).experts
    return [row_of(ep, runs[ep], planned=planned_model_states(run_overrides(
        args, ep=ep, model=model, tokenizer=work / "tokenizer", output_dir=work)), experts=experts) for ep in args.ep]


def row_of(ep: int, runs: dict[str, list[dict]], *, planned: float, experts: int) -> dict:
    """One ep's figures from its launches (medians; the busiest rank's measured bytes)."""
    dsf, raw = (statistics.median(r["tokens_per_s"] for r in runs[way]) for way in ("dsf", "raw"))
    measured = max(max(r["model_states"]) for r in runs["raw"])
    return {"ep": ep, "experts_per_rank": experts // ep, "measured_bytes": measured, "planned_bytes": planned,
            "dsf_tokens_per_s": dsf, "raw_tokens_per_s": raw, "dsf_over_raw": dsf / raw,
            "dsf_spread": [min(r["tokens_per_s"] for r in runs["dsf"]), max(r["tokens_per_s"] for r in runs["dsf"])],
            "raw_spread": [min(r["tokens_per_s"] for r in runs["raw"]), max(r["tokens_per_s"] for r in runs["raw"])],
            "final_loss": {"dsf": runs["dsf"][-1]["final_loss"], "raw": runs["raw"][-1]["final_loss"]}}


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    """The README's table, and a line on the memory saved and dsf's overhead."""
    head = ("| ep | experts per rank | model states per rank, measured | planned | planned / measured "
            "| dsf tokens/s | raw AutoEP tokens/s | dsf / raw | last loss dsf / raw |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    lines = [f"| {r['ep']} | {r['experts_per_rank']} | {r['measured_bytes'] / 2**20:,.0f} MiB "
             f"| {r['planned_bytes'] / 2**20:,.0f} MiB | {r['planned_bytes'] / r['measured_bytes']:.3f} "
             f"| {r['dsf_tokens_per_s']:,.0f} | {r['raw_tokens_per_s']:,.0f} | {r['dsf_over_raw']:.3f} "
             f"| {r['final_loss']['dsf']:.4f} / {r['final_loss']['raw']:.4f} |" for r in rows]
    first, last = rows[0], rows[-1]
    worst = min(r["dsf_over_raw"] for r in rows)
    return "\n".join([head, *lines, "", f"ep {last['ep']} holds {last['measured_bytes'] / first['measured_bytes']:.2f}"
                      f" of ep {first['ep']}'s model-state bytes per rank; dsf's overhead over raw AutoEP: at most "
                      f"{(1 - worst) * 100:.1f}% (goal <= 2%); {WORLD} CPU ranks, ZeRO-{args.zero_stage}, "
                      f"{args.steps} steps ({args.warmup_steps_excluded} untimed) of {args.global_batch} x "
                      f"{args.seq_len} tokens, median of {args.repeats} launches"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ep", default="1,2,4", help="expert-parallel sizes, comma separated")
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps-excluded", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="SMOKE_MODEL, ep 1 and 2, 6 steps, one launch each")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, not a table")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_moe", help="logs of every launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by this file
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.ep, args.steps, args.warmup_steps_excluded, args.repeats, args.seq_len = "1,2", 6, 2, 1, 64
    args.ep = [int(e) for e in str(args.ep).split(",")]
    check_timed_steps(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.overrides, args.ds_config, args.record, excluded=args.warmup_steps_excluded)
        from dsframework.launching.supervise import exit_process

        exit_process(0)  # as dsf train ends: torch's teardown can abort a finished rank
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = bench(args, work)
    print(json.dumps({"settings": vars(args) | {"out": str(work), "world": WORLD}, "rows": rows}, indent=2)
          if args.json else markdown(rows, args))


if __name__ == "__main__":
    main()
