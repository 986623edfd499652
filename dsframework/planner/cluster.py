"""What the planner needs to know about the machines: GPUs, memory, FLOP/s and links.

    cluster = cluster_preset("h100-80gb", nodes=4, gpus_per_node=8)
    cluster.world                      # 32
    cluster.peak_flops["bf16"]         # 989e12 (dense, per GPU)
    cluster = Cluster.from_dict(json.loads(Path("cpu.json").read_text()))   # `dsf calibrate` output

Presets are the vendors' dense (no sparsity) peak FLOP/s and the usual link speeds; what a job
really gets is lower, which the speed model's efficiency factors account for. `cpu-local` is a
placeholder for this kind of machine until `dsf calibrate` measures it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dsframework.errors import UserError, did_you_mean

GiB = 1024 ** 3
GB = 1e9
MATMUL_EFFICIENCY = 0.75  # a large GEMM's achieved / peak FLOP/s on a GPU; the default of
#                           Cluster.matmul_efficiency, which each preset sets and `dsf calibrate` measures


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical accelerators. Memory in bytes, bandwidth in bytes/s (per direction,
    per GPU: what one rank can push to its peers), FLOP/s per GPU."""

    name: str
    nodes: int
    gpus_per_node: int
    memory_per_gpu: float
    peak_flops: dict[str, float] = field(default_factory=dict)  # "fp32", "bf16", "fp16"
    intra_node_bandwidth: float = 100 * GB
    inter_node_bandwidth: float = 25 * GB
    cpu_memory_per_node: float = 512 * GiB
    host_to_device_bandwidth: float = 25 * GB  # PCIe: what CPU offload pays per GPU
    op_overhead_s: float = 8e-6  # fixed cost of one kernel / operator call (launch, dispatch)
    collective_latency_s: float = 30e-6  # fixed cost of one small collective (NCCL in a node)
    matmul_efficiency: float = MATMUL_EFFICIENCY  # a large GEMM's achieved / peak FLOP/s (planner/speed.py
    #                                               prices each GEMM's shape and the memory-bound work on top)
    hbm_bandwidth: float = 2.0e12  # device memory bytes/s (datasheet); a CPU profile: its memory copy rate
    gemm_tile: int = 1  # a GEMM's output block per SM (128 on NVIDIA GPUs' cuBLAS kernels); 1: no quantisation
    sm_count: int = 1  # blocks that run at once (streaming multiprocessors); 1: no wave quantisation
    cores_per_node: int | None = None  # set for CPU ranks only (cpu-local, `dsf calibrate` on a CPU):
    #                                    when ranks outnumber cores, idle ranks lend theirs

    @property
    def is_cpu(self) -> bool:
        """CPU ranks rather than accelerators: no CUDA context to reserve, the host does the
        work itself (no launch overlap). One test for the planner's fit and speed models."""
        return self.cores_per_node is not None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def flops(self, precision: str) -> float:
        """Peak FLOP/s per GPU at `precision` (fp16 falls back to bf16's figure and back)."""
        for key in (precision, {"fp16": "bf16", "bf16": "fp16"}.get(precision, precision)):
            if key in self.peak_flops:
                return self.peak_flops[key]
        raise UserError("cluster.peak_flops", sorted(self.peak_flops), f"has no figure for {precision}",
                        f"add peak_flops.{precision} to the cluster profile")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "cluster profile") -> "Cluster":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(origin, unknown[0], "is not a cluster field", did_you_mean(unknown[0], known))
        missing = [k for k in ("name", "memory_per_gpu", "peak_flops") if k not in data]
        if missing:
            raise UserError(origin, missing[0], "is missing", f"add {missing[0]} (see `dsf calibrate`)")
        data = {"nodes": 1, "gpus_per_node": 1, **data}
        return cls(**data)


# Dense peak FLOP/s (no sparsity), HBM bytes/s and SMs from NVIDIA's datasheets (A100: "NVIDIA A100
# Tensor Core GPU" datasheet; H100/H200: the H100 and H200 SXM datasheets; B200: the DGX/HGX B200 datasheet,
# per GPU = the 8-GPU figure / 8). Links are what NCCL reaches, not the wire rate: intra-node the
# all-reduce bus bandwidth nccl-tests reports on the DGX of that generation (NVLink 3 / NVSwitch: ~230-240
# GB/s of 300 per direction; NVLink 4: ~450 of 450 with NVLink SHARP; NVLink 5: 900 per direction, taken
# at 800 until measured), inter-node one 200 Gb/s (A100: HDR, Selene's 8 per node) or 400 Gb/s (NDR) NIC
# per GPU at ~90%. matmul_efficiency: a large bf16 GEMM's achieved / peak (cuBLAS, 8192^3: A100 ~0.8 of
# 312; H100 SXM ~0.75 of 989; H200 ~790 of 989, its higher memory bandwidth and power; B200 estimated).
_A100 = dict(peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
             intra_node_bandwidth=235 * GB, inter_node_bandwidth=22.5 * GB, cpu_memory_per_node=1024 * GiB,
             host_to_device_bandwidth=25 * GB, matmul_efficiency=0.7, gemm_tile=128, sm_count=108)
_HOPPER = dict(peak_flops={"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
               intra_node_bandwidth=450 * GB, inter_node_bandwidth=45 * GB, cpu_memory_per_node=2048 * GiB,
               host_to_device_bandwidth=55 * GB, gemm_tile=128, sm_count=132)
_GPU_PRESETS: dict[str, dict[str, Any]] = {
    "a100-40gb": dict(memory_per_gpu=40 * GiB, hbm_bandwidth=1.555e12, **_A100),
    "a100-80gb": dict(memory_per_gpu=80 * GiB, hbm_bandwidth=2.039e12, **_A100),
    "h100-80gb": dict(memory_per_gpu=80 * GiB, hbm_bandwidth=3.35e12, matmul_efficiency=0.75, **_HOPPER),
    "h200-141gb": dict(memory_per_gpu=141 * GB, hbm_bandwidth=4.8e12, matmul_efficiency=0.8, **_HOPPER),
    "b200-180gb": dict(memory_per_gpu=180 * GB, hbm_bandwidth=8.0e12, matmul_efficiency=0.7,
                       peak_flops={"fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
                       intra_node_bandwidth=800 * GB, inter_node_bandwidth=45 * GB, cpu_memory_per_node=2048 * GiB,
                       host_to_device_bandwidth=55 * GB, gemm_tile=128, sm_count=148),
    # This kind of machine (2 cores, 24 GiB), one CPU rank per core; `dsf calibrate` measures it.
    "cpu-local": dict(memory_per_gpu=10 * GiB, peak_flops={"fp32": 50e9, "bf16": 100e9},
                      intra_node_bandwidth=2 * GB, inter_node_bandwidth=1 * GB,
                      cpu_memory_per_node=24 * GiB, host_to_device_bandwidth=10 * GB, hbm_bandwidth=10 * GB,
                      op_overhead_s=20e-6, collective_latency_s=200e-6, matmul_efficiency=0.8,
                      cores_per_node=2),
}
CLUSTER_PRESETS = tuple(_GPU_PRESETS)


def cluster_preset(name: str, *, nodes: int = 1, gpus_per_node: int = 8) -> Cluster:
    """A preset GPU type on `nodes` x `gpus_per_node`."""
    if name not in _GPU_PRESETS:
        raise UserError("--cluster", name, "is not a cluster preset or profile file",
                        did_you_mean(name, CLUSTER_PRESETS) + " (or a file written by dsf calibrate)")
    return Cluster(name=name, nodes=nodes, gpus_per_node=gpus_per_node, **_GPU_PRESETS[name])


# Substrings of torch.cuda.get_device_name() -> preset ("a100": 40 or 80 GB by the card's memory).
_GPU_NAMES = (("B200", "b200-180gb"), ("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100", "a100"))


def local_gpu_preset() -> tuple[str, str] | None:
    """(preset, device name) for this node's GPU when dsf has a preset for it, else None.

        local_gpu_preset()   # ("h200-141gb", "NVIDIA H200") on an H200; None on a CPU-only node
    """
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, preset in _GPU_NAMES:
        if key in name:
            if preset == "a100":
                preset = "a100-80gb" if torch.cuda.get_device_properties(0).total_memory > 60 * GiB else "a100-40gb"
            return preset, name
    return None


def local_cluster(*, nodes: int, ranks_per_node: int) -> tuple[Cluster, str]:
    """This machine as a planner Cluster, and a phrase saying so: the local GPU's memory when CUDA
    is there, else the `cpu-local` preset with host RAM / ranks per node for each rank; either way
    this node's RAM as its host memory (what `dsf launch` checks here, and `dsf train` on each rank).

        cluster, source = local_cluster(nodes=1, ranks_per_node=2)
        source   # "cpu-local: this node's 23.5 GiB RAM / 2 ranks"
    """
    import torch

    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        preset, _ = local_gpu_preset() or ("h100-80gb", props.name)  # a GPU without a preset: Hopper's rates
        cluster = replace(cluster_preset(preset, nodes=nodes, gpus_per_node=ranks_per_node),
                          name="local-gpu", memory_per_gpu=float(props.total_memory), cpu_memory_per_node=ram)
        return cluster, f"this node's {props.name}, {props.total_memory / GiB:.1f} GiB"
    cluster = replace(cluster_preset("cpu-local", nodes=nodes, gpus_per_node=ranks_per_node),
                      memory_per_gpu=ram / ranks_per_node, cpu_memory_per_node=ram)
    ranks = f"{ranks_per_node} rank" + ("s" if ranks_per_node > 1 else "")
    return cluster, f"cpu-local: this node's {ram / GiB:.1f} GiB RAM / {ranks}"


def resize(cluster: Cluster, *, nodes: int | None = None, gpus_per_node: int | None = None) -> Cluster:
    """The same machines, a different count."""
    return replace(cluster, nodes=nodes or cluster.nodes, gpus_per_node=gpus_per_node or cluster.gpus_per_node)


def load_cluster(name: str, *, nodes: int = 1, gpus_per_node: int = 1, field: str = "--cluster") -> Cluster:
    """A preset name, or a profile file written by `dsf calibrate` (JSON), at that size."""
    if name in CLUSTER_PRESETS or not Path(name).suffix:
        return cluster_preset(name, nodes=nodes, gpus_per_node=gpus_per_node)
    path = Path(name)
    if not path.is_file():
        raise UserError(field, name, "is neither a preset nor a file", "pass a preset or a dsf calibrate profile")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(field, name, f"is not valid JSON ({err.msg} at line {err.lineno})",
                        "write it again with dsf calibrate") from None
    except UnicodeDecodeError:
        raise UserError(field, name, "is not a text file (not UTF-8)", "pass a profile written by dsf calibrate") from None
    return resize(Cluster.from_dict(data, origin=f"{field} {name}"), nodes=nodes, gpus_per_node=gpus_per_node)
