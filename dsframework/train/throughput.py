"""Model FLOPs utilisation: the model's training FLOP/s against the hardware's peak.

    meter = FlopsMeter.for_run(run, config, world=4)   # on every rank at start (may measure: collective)
    meter.report(tokens_per_s=51_200.0)  # {"tflops_per_rank": 38.1, "mfu": 0.385}
    meter.peak_source                    # "h100-80gb preset (NVIDIA H100 80GB HBM3)", "cpu.json", ...

Model FLOPs are the planner's count per token (forward + backward, attention included, and no
recomputation: MFU, not HFU) times the tokens per second of the whole job, shared over its ranks.
The peak per rank comes from `logging.cluster` (a preset or a `dsf calibrate` profile), else the
GPU's preset found by its name, else a short matmul that every rank runs at once at start-up (what
`dsf calibrate` measures, smaller: about 0.2 s).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from dsframework.planner.cluster import cluster_preset, load_cluster, local_gpu_preset
from dsframework.planner.model import describe_model
from dsframework.train.world import mean_over_ranks
from dsframework.types import HFConfig

MATMUL_SIZE = 1024  # dsf calibrate's matmul (commands/calibrate.py)
REPEATS = 5
PEAK_MATMUL_SIZE = 512


def _seconds(fn, repeats: int = REPEATS) -> float:
    """Median seconds of `fn()` after one warm-up call (allocations, kernels, JIT)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(dtype_name: str, *, size: int = MATMUL_SIZE, threads: int | None = None) -> float:
    """Peak FLOP/s of one size x size matmul at `dtype_name` on this process's device."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    # A generator of its own: measured after a resume's restore, the run's random state must not move
    # (a dropout mask would differ from the straight run's)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)

    def run():
        for _ in range(4):
            _ = a @ b  # timed: the product itself is not needed
        if device == "cuda":
            torch.cuda.synchronize()

    return 4 * 2 * size ** 3 / _seconds(run)


def _measured_peak(precision: str) -> float:
    """The matmul FLOP/s of this rank while every rank measures too (their mean)."""
    import torch.distributed as dist

    value = matmul_flops(precision, size=PEAK_MATMUL_SIZE)
    if dist.is_initialized():
        value = mean_over_ranks(value)
    return value


def peak_flops_per_rank(cluster: str | None, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one rank at `precision`, where the figure comes from)."""
    if cluster:
        return load_cluster(cluster, field="logging.cluster").flops(precision), cluster
    found = local_gpu_preset()
    if found is not None:
        preset, device = found
        return cluster_preset(preset).flops(precision), f"{preset} preset ({device})"
    return _measured_peak(precision), "matmul measured at start"


@dataclass(frozen=True)
class FlopsMeter:
    """Turns tokens/s into model TFLOP/s per rank and MFU."""

    flops_per_token: float
    world: int
    peak_per_rank: float
    peak_source: str

    @classmethod
    def for_run(cls, run: Any, config: HFConfig, *, world: int) -> "FlopsMeter":
        peak, source = peak_flops_per_rank(run.logging.cluster, run.train.precision)
        per_token = describe_model(config, name=run.model.name).flops_per_token(run.data.seq_len)
        return cls(per_token, world, peak, source)

    def report(self, *, tokens_per_s: float) -> dict[str, float]:
        achieved = tokens_per_s * self.flops_per_token / self.world
        return {"tflops_per_rank": achieved / 1e12, "mfu": achieved / self.peak_per_rank}
