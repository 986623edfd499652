"""Worker (run under the deepspeed launcher): build a model for a layout the way `dsf train` does
(no engine, no training) and write this rank's peak resident memory.

    deepspeed --num_gpus 4 construct_memory.py OUT_DIR TINY_JSON BIG_JSON --tp 2 --pp 2 [--zero3] [--dense]
    # -> OUT_DIR/rank<r>-<config stem>.json: {"vm_hwm": bytes, "held": bytes kept, "largest": bytes, ...}

Each CONFIG_JSON is built in turn in this one process (and dropped before the next). VmHWM is the
process's peak resident set, read from /proc/self/status, which never falls: a tiny config built
first gives the process baseline (imports, process group, one small model), and a big one after
it the peak its construction adds. --dense builds the way dsframework did before sharded
construction (the whole dense model on every rank, then the shard cut from it), for the
comparison figures.
"""
import argparse
import json
import sys
from pathlib import Path

import torch


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build_and_measure(source, dims, topology, grid, zero3, rank: int, *, dense: bool) -> dict:
    """Build `source`'s model for this rank's part of the layout; this rank's record (the model is
    dropped on return)."""
    from dsframework.models.build import build_model
    from dsframework.models.construct import build_for_layout, empty_model
    from dsframework.models.tensor_parallel import shard_model
    from dsframework.models.pipeline import build_pipeline_module

    config = source.config
    before = vm_hwm()
    if dense:
        model = build_model(source, config, seed=1)
        if dims.tp_enabled:
            model = shard_model(model, group=grid.get_slice_parallel_group())
        parameters = None
    else:
        built = build_for_layout(source, config, seed=1,
                                 tp_group=grid.get_slice_parallel_group() if dims.tp_enabled else None,
                                 pipeline=(dims.pp, topology.get_coord(rank).pipe) if dims.pp_enabled else None,
                                 zero3_ds_config=zero3, mpu=grid if dims.tp_enabled else None)
        model, parameters = built.model, built.report.parameters
    if dims.pp_enabled:
        model = build_pipeline_module(model, num_stages=dims.pp, topology=topology)
    peak = vm_hwm()
    local = [p for p in model.parameters() if p.device.type != "meta"]
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in local)
    dense_shapes = [p.numel() for p in empty_model(config).parameters()]  # meta: no memory
    return {"rank": rank, "world": dims.world, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "zero3": zero3 is not None,
            "dense": dense, "baseline_before_build": before, "vm_hwm": peak,
            "held": held * 4, "materialized": None if parameters is None else parameters * 4,
            "partitioned": all(hasattr(p, "ds_tensor") for p in local) if zero3 is not None else None,
            "largest": max(dense_shapes) * 4, "total": sum(dense_shapes) * 4}


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero3", action="store_true")
    parser.add_argument("--dense", action="store_true")
    args, _ = parser.parse_known_args(argv)  # the launcher adds --local_rank

    import deepspeed  # noqa: F401 - imported on every path, so the baseline holds it too
    from dsframework.config import ModelSpec, ParallelSpec, TrainSpec
    from dsframework.dsconfig import build_ds_config
    from dsframework.layout import ParallelDims
    from dsframework.models.build import resolve_model
    from dsframework.parallel.topology import build_grid, build_topology
    from dsframework.train.world import init_distributed, shutdown_distributed

    rank, world = init_distributed()
    dims = ParallelDims(world=world, tp=args.tp, pp=args.pp)
    topology = build_topology(dims)
    grid = build_grid(dims)
    zero3 = None
    if args.zero3:
        zero3 = build_ds_config(TrainSpec(global_batch=dims.dp, micro_batch=1, grad_accum=1),
                                ParallelSpec(zero_stage=3, tp=dims.tp), dp_size=dims.dp)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for config_path in args.configs:
        source = resolve_model(ModelSpec(name=config_path))
        record = build_and_measure(source, dims, topology, grid, zero3, rank, dense=args.dense)
        (out / f"rank{rank}-{Path(config_path).stem}.json").write_text(json.dumps(record))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    from dsframework.launching.supervise import exit_process

    exit_process(0)
