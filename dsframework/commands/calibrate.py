"""`dsf calibrate`: measure this machine and write a cluster profile that `dsf plan --cluster` reads.

    profile = calibrate(ranks=2)          # {"name": "calibrated-cpu", "peak_flops": {...}, ...}
    Path("cpu.json").write_text(json.dumps(profile, indent=2))
    # dsf plan --model tiny-llama --cluster cpu.json --gpus-per-node 2 ...

What is measured, each the median of a few repeats (ranks that share cores are measured
sharing them, so a lucky moment alone on a core must not count):
- matmul FLOP/s per rank, fp32 and bf16, measured in all `ranks` processes at once with the
  threads one rank of `dsf train` gets (all cores / ranks on CPU), so that ranks sharing cores
  are measured sharing them; the slowest rank's figure; on a GPU, on its device;
- all-reduce bus bandwidth across `ranks` local processes through deepspeed.comm (the path the
  engine uses): 2 (n-1)/n x bytes / seconds, what the planner's ring model divides by;
- host-to-device copy bandwidth (a plain memory copy on CPU);
- the matmul efficiency: the FLOP/s a Llama decoder layer (hidden 256) reaches forward and
  backward, over the matmul peak - what a training step gets of the peak;
- the fixed cost of one small operator call (an add of 16 numbers) and of one small collective
  (an all-reduce of 4 bytes): what dominates the step of a small model;
- memory: each rank's share of the node's RAM on CPU (the device's own memory on a GPU).
One node is all this machine can see, so the inter-node bandwidth is the intra-node figure.
"""
from __future__ import annotations

import os
import statistics
from typing import Any

from dsframework.planner.model import describe_model
from dsframework.ports import free_port
from dsframework.train.throughput import _seconds, matmul_flops
from dsframework.train.world import init_distributed
from dsframework.types import accelerator

ALLREDUCE_BYTES = 16 * 2 ** 20
LAYER_PASSES = 10


def copy_bandwidth(nbytes: int = 256 * 2 ** 20) -> float:
    """Bytes/s of a host -> device copy (a host memory copy on CPU)."""
    import torch

    # host: the copy's source, pinned where a GPU reads it (as offload's buffers are)
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory() if torch.cuda.is_available() else torch.empty(
        nbytes, dtype=torch.uint8)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def run():
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()

    return nbytes / _seconds(run)


def _rank_worker(rank: int, world: int, port: int, nbytes: int, queue: Any) -> None:
    """One rank: matmul FLOP/s (all ranks at once), then the all-reduce bandwidth."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    threads = max(1, (os.cpu_count() or 1) // world)
    init_distributed()  # as dsf train: the same build tools, device per rank, shm buffers released
    import deepspeed.comm as dist

    dist.barrier()
    flops = {precision: matmul_flops(precision, threads=threads) for precision in ("fp32", "bf16")}
    dist.barrier()  # every rank busy in the layer too, as in the matmuls
    efficiency = layer_flops() / flops["fp32"]
    dist.barrier()
    torch.set_num_threads(1)
    tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=accelerator().current_device_name())

    def run():
        dist.all_reduce(tensor)
        accelerator().synchronize()
        dist.barrier()

    seconds = _seconds(run)
    bus = 2 * (world - 1) / world * nbytes / seconds if world > 1 else float("inf")
    small = torch.ones(1, dtype=torch.float32, device=tensor.device)

    def small_collectives():
        for _ in range(100):
            dist.all_reduce(small)
        accelerator().synchronize()

    latency = _seconds(small_collectives) / 100
    queue.put({"rank": rank, "flops": flops, "bandwidth": bus, "latency": latency, "op": op_overhead(),
               "efficiency": efficiency})
    dist.barrier()
    dist.destroy_process_group()


def layer_flops(*, hidden: int = 256, seq_len: int = 128, micro_batch: int = 4) -> float:
    """FLOP/s of a Llama decoder layer's forward + backward in fp32 (counted as the planner does)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 128, num_hidden_layers=1, vocab_size=8)
    config._attn_implementation = "sdpa"
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where matmul_flops measured the peak
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device)
    rotary = LlamaRotaryEmbedding(config=config).to(device)
    x = torch.randn(micro_batch, seq_len, hidden, requires_grad=True, device=device)
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    cos_sin = rotary(x, positions)

    def run():
        for _ in range(LAYER_PASSES):  # long enough to span many scheduler slices
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            out = out[0] if isinstance(out, tuple) else out
            out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()  # the device's time, not the host's queueing

    desc = describe_model(config)
    per_token = 3 * (2 * desc.layer_sharded + 4 * seq_len * hidden)  # one layer, as flops_per_token counts
    return LAYER_PASSES * per_token * micro_batch * seq_len / _seconds(run)


def op_overhead() -> float:
    """Seconds of one tiny operator call on this process's device (dispatch and launch)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(16, device=device)

    def run():
        for _ in range(1000):
            x.add(1.0)
        if device == "cuda":
            torch.cuda.synchronize()

    return _seconds(run) / 1000


def measure_ranks(ranks: int, *, nbytes: int = ALLREDUCE_BYTES) -> dict[str, Any]:
    """Matmul FLOP/s per precision (the slowest rank's), all-reduce bus bandwidth (inf for one
    rank), small-collective latency and operator overhead, measured in `ranks` local processes."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import start_processes  # what torch.multiprocessing re-exports

    queue = mp.get_context("spawn").SimpleQueue()
    start_processes(_rank_worker, args=(ranks, free_port(), nbytes, queue), nprocs=ranks, join=True,
                    start_method="spawn")
    reports = [queue.get() for _ in range(ranks)]
    return {"peak_flops": {p: min(r["flops"][p] for r in reports) for p in reports[0]["flops"]},
            "intra_node_bandwidth": min(r["bandwidth"] for r in reports),
            "collective_latency_s": max(r["latency"] for r in reports),
            "op_overhead_s": max(r["op"] for r in reports),
            "matmul_efficiency": min(1.0, statistics.median(r["efficiency"] for r in reports))}


def _node_memory_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def calibrate(*, ranks: int, name: str = "calibrated") -> dict[str, Any]:
    """The cluster profile of this machine run as `ranks` ranks (see the module docstring)."""
    import torch

    on_gpu = torch.cuda.is_available()
    measured = measure_ranks(ranks)
    node_memory = _node_memory_bytes()
    memory = torch.cuda.get_device_properties(0).total_memory if on_gpu else node_memory / ranks
    if measured["intra_node_bandwidth"] == float("inf"):  # one rank: nothing to all-reduce
        measured["intra_node_bandwidth"] = copy_bandwidth()
    cores = None if on_gpu else os.cpu_count()
    return {"name": f"{name}-{'gpu' if on_gpu else 'cpu'}", "nodes": 1, "gpus_per_node": ranks, "cores_per_node": cores,
            "memory_per_gpu": memory, **measured, "inter_node_bandwidth": measured["intra_node_bandwidth"],
            "cpu_memory_per_node": node_memory, "host_to_device_bandwidth": copy_bandwidth()}
