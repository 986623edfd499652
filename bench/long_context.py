"""How long a sequence can a rank train at? Context parallelism (cp = 1, 2, 4 on 4 CPU ranks)
against the planner's prediction, for a tiny Llama under an activation budget per rank.

    .venv/bin/python bench/long_context.py                    # budget 64 MiB a rank, ~3-5 min
    .venv/bin/python bench/long_context.py --budget-mib 32 --json
    .venv/bin/python bench/long_context.py --dry-run          # tiny budget, seconds (the test)

What "trains at" means here: a real training step on 4 ranks (dsf's engine pieces: the model,
`deepspeed.initialize` with the run's ZeRO-1 JSON and DeepSpeed Ulysses over the cp ranks,
`step.micro_batch_loss`, backward, optimizer step, finite loss) whose activation memory - the
bytes autograd saves for backward on the busiest rank, counted as the planner's tests count them
(distinct storages, parameters excluded) - stays within --budget-mib. A CPU has no device memory
to run out of; the budget plays the device's activation headroom, so the search is exact and
takes minutes rather than the hours a 24 GiB host would need at quadratic attention cost.

For each cp the bench doubles seq_len (multiples of 256 x cp) until the step no longer fits,
then bisects to 256 x cp; the planner's prediction is the longest seq_len (same grain) whose
`memory_per_rank(...).activations` fits the same budget. Both are printed with their ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 2**20
RANKS = 4
MODEL = "tiny-llama"
VOCAB = 512


def planner_longest(cp: int, budget: float, grain: int, limit: int) -> int:
    """The longest multiple of `grain` (<= limit) whose predicted activations fit `budget`."""
    from dsframework.config import ModelSpec
    from dsframework.models.build import resolve_model
    from dsframework.layout import ParallelDims
    from dsframework.planner.memory import Workload, Layout, memory_per_rank
    from dsframework.planner.model import describe_model

    config = resolve_model(ModelSpec(name=MODEL)).config
    config.vocab_size = VOCAB
    desc = describe_model(config, name=MODEL)

    def fits(seq_len: int) -> bool:
        layout = Layout(ParallelDims(world=RANKS, cp=cp, zero_stage=1), micro_batch=1)
        return memory_per_rank(desc, layout, Workload(seq_len=seq_len, global_batch=RANKS // cp, precision="fp32")
                               ).activations <= budget

    return _longest(fits, grain, limit)


def _longest(fits, grain: int, limit: int) -> int:
    """Doubling then bisection over multiples of `grain`: the largest that fits (0 if none)."""
    if not fits(grain):
        return 0
    low = grain
    while low * 2 <= limit and fits(low * 2):
        low *= 2
    high = min(low * 2, limit + grain)
    while high - low > grain:
        mid = (low + high) // 2 // grain * grain
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# --- the worker (one per rank, under the deepspeed launcher) -------------------------------------

def worker(out: Path, cp: int, budget: float, grain: int, limit: int) -> None:
    """Build the tiny Llama once, then train one step per candidate seq_len (Ulysses re-shaped for
    each); rank 0 writes every step's measured bytes (max over ranks), loss and seconds."""
    import time

    import deepspeed
    import torch
    import torch.distributed as dist

    from dsframework.config import ModelSpec, build_run_config
    from dsframework.dsconfig import build_ds_config
    from dsframework.train.step import WHOLE, LossSetup, micro_batch_loss
    from dsframework.models.build import build_model, resolve_model
    from dsframework.parallel.context import use_ulysses_attention
    from dsframework.layout import ParallelDims
    from dsframework.parallel.topology import build_grid
    from dsframework.launching.supervise import exit_process
    from dsframework.train.world import init_distributed, shutdown_distributed
    from tests.saved_tensors import saved_bytes

    rank, world = init_distributed()
    torch.set_num_threads(1)
    run = build_run_config({}, [f"parallel.cp={cp}", "parallel.zero_stage=1", "train.micro_batch=1",
                                "train.grad_accum=1", "train.lr=1e-3"])
    dims = ParallelDims.of(run.parallel, world=world)
    grid = build_grid(dims) if dims.cp_enabled else None
    source = resolve_model(ModelSpec(name=MODEL))
    source.config.vocab_size = VOCAB
    model = build_model(source, source.config, seed=1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=build_ds_config(run.train, run.parallel, dp_size=dims.dp), mpu=grid)
    loss_setup = WHOLE if grid is None else LossSetup.context_parallel(grid, dims, vocab_size=VOCAB, chunked=False)
    records = []

    def fits(seq_len: int) -> bool:
        if grid is not None:
            use_ulysses_attention(model, grid, micro_batch=1, seq_len=seq_len)
        input_ids = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
        start = time.perf_counter()
        box = {}
        measured, _ = saved_bytes(engine.module, lambda: box.update(zip(("loss", "value"),
                                                                         micro_batch_loss(engine, input_ids, loss_setup))))
        engine.backward(box["loss"])
        engine.step()
        most = torch.tensor([float(measured)], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        value = box["value"].item()
        records.append({"seq_len": seq_len, "saved_bytes": most.item(), "loss": value,
                        "seconds": time.perf_counter() - start})
        return most.item() <= budget and value == value  # finite loss

    longest = _longest(fits, grain, limit)
    if rank == 0:
        (out / f"cp{cp}.json").write_text(json.dumps({"longest": longest, "steps": records}))
    shutdown_distributed()
    exit_process(0)


def measure(cp: int, budget: float, grain: int, limit: int, work: Path) -> dict:
    """Launch the worker on 4 ranks for one cp; its record."""
    import subprocess

    from deepspeed.launcher.runner import encode_world_info

    from tests.distributed.launcher import free_port, rank_env

    world_info = encode_world_info({"localhost": list(range(RANKS))})
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(Path(__file__).resolve()),
           "--worker", str(work), "--cp", str(cp), "--budget-mib", str(budget / MiB), "--grain", str(grain),
           "--limit", str(limit)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=rank_env(), cwd=REPO, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"cp={cp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((work / f"cp{cp}.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=64.0, help="activation bytes a rank may hold")
    parser.add_argument("--limit", type=int, default=1 << 17, help="longest seq_len tried")
    parser.add_argument("--cps", default="1,2,4", help="context-parallel sizes to measure")
    parser.add_argument("--dry-run", action="store_true", help="a 4 MiB budget: seconds, for the test")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grain", type=int, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)  # (the launcher adds --local_rank)
    budget = (4.0 if args.dry_run else args.budget_mib) * MiB
    if args.worker:
        worker(args.worker, args.cp, budget, args.grain, args.limit)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (int(c) for c in args.cps.split(",")):
            grain = 256 * cp
            record = measure(cp, budget, grain, args.limit, Path(tmp))
            predicted = planner_longest(cp, budget, grain, args.limit)
            at = next((s for s in record["steps"] if s["seq_len"] == record["longest"]), None)
            rows.append({"cp": cp, "longest": record["longest"], "predicted": predicted,
                         "saved_mib": at["saved_bytes"] / MiB if at else 0.0, "loss": at["loss"] if at else None,
                         "step_s": at["seconds"] if at else None, "steps": record["steps"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"tiny Llama ({MODEL}, vocab {VOCAB}), {RANKS} CPU ranks, ZeRO-1, micro-batch 1, fp32; "
          f"activation budget {budget / MiB:g} MiB a rank\n")
    print("| cp | longest seq_len trained | planner's longest | measured / planner | saved MiB at it | step s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["longest"] / r["predicted"] if r["predicted"] else float("nan")
        print(f"| {r['cp']} | {r['longest']:,} | {r['predicted']:,} | {ratio:.2f} | {r['saved_mib']:.1f} | "
              f"{r['step_s']:.2f} |" if r["step_s"] is not None else f"| {r['cp']} | 0 | {r['predicted']:,} | - | - | - |")
    base = rows[0]["longest"] or 1
    print("\nlongest vs cp=" + str(rows[0]["cp"]) + ": " + ", ".join(f"cp {r['cp']}: {r['longest'] / base:.2f}x"
                                                             for r in rows))


if __name__ == "__main__":
    main()
