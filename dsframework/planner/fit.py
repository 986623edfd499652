"""Will one given run fit? The planner's memory model and fit rule, for a layout already chosen.

    layout = run_layout(run.parallel, dims, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                        sequence_parallel=run.sequence_parallel)
    job = run_job(run, global_batch=batch.global_batch)   # or Workload(seq_len=512, global_batch=32, precision="bf16")
    fit = check_fit(describe_model(config), layout, job, cluster)
    fit.fits, fit.need / GiB, fit.available / GiB      # busiest rank (with headroom) vs usable per rank
    fit.host_need / GiB, fit.host_available / GiB      # a node's RAM to build, offload or export
    check_fit(desc, layout, Workload(..., trainable_params=count.trainable,
                                     trainable_persistent=count.persistent), cluster)
    #   a LoRA run: count = models.lora.count_lora_parameters(config, run.model.lora)

`dsf plan` asks it of every layout it searches (`search.evaluate`); `dsf launch` of the one layout
the run config names, before any node starts, and `dsf train`'s pre-flight on every rank, through
planner/run_fit.py's `fit_run` (which counts the model: torch), so a run `dsf plan` calls fitting
passes at launch and at train. Pure, no torch: `dsf plan`'s second run imports none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsframework.layout import ParallelDims
from dsframework.planner.cluster import Cluster, GiB
from dsframework.planner.memory import (EXPORT_SHARD_BYTES, HostMemory, Knobs, Layout, Memory, Workload,
                                        host_memory_per_node, memory_per_rank)
from dsframework.planner.desc import ModelDesc

MEMORY_HEADROOM = 0.10  # allocator fragmentation and what the model does not count
RESERVED_PER_GPU = 1.0 * GiB  # CUDA context, NCCL and library workspaces (0 on CPU ranks: Cluster.is_cpu)
HOST_MEMORY_SHARE = 0.80  # of a node's RAM that building, offloaded states or export may take


def usable_gpu_memory(cluster: Cluster) -> float:
    reserved = 0.0 if cluster.is_cpu else RESERVED_PER_GPU
    return cluster.memory_per_gpu - reserved


@dataclass(frozen=True)
class Fit:
    """Bytes one rank needs and has; host bytes one node needs (build, offload, export) and has."""

    memory: Memory
    need: float            # the busiest rank, plus MEMORY_HEADROOM
    available: float       # usable per rank (the device's memory less what CUDA itself takes)
    host: HostMemory       # a node's host memory in each phase
    host_available: float  # HOST_MEMORY_SHARE of a node's RAM

    @property
    def host_need(self) -> float:
        """The node's host memory at its peak phase."""
        return self.host.peak

    @property
    def host_fits(self) -> bool:
        return self.host_need <= self.host_available

    @property
    def fits(self) -> bool:
        return self.need <= self.available and self.host_fits

    @property
    def why_not(self) -> str:
        """'predicted 113.0 GiB per rank > 11.7 GiB available', 'predicted 150.2 GiB of host memory
        per node to build the model > 99.8 GiB available', or '' when it fits."""
        if self.need > self.available:
            return f"predicted {self.need / GiB:.1f} GiB per rank > {self.available / GiB:.1f} GiB available"
        return self.host_why_not

    @property
    def host_why_not(self) -> str:
        """why_not's host part alone: 'predicted 150.2 GiB of host memory per node to build the model > ...'."""
        if self.host_fits:
            return ""
        return (f"predicted {self.host_need / GiB:.1f} GiB of host memory per node {self.host.phase} > "
                f"{self.host_available / GiB:.1f} GiB available")


def run_layout(parallel: Any, dims: ParallelDims, *, micro_batch: int, grad_accum: int,
               sequence_parallel: bool = False) -> Layout:
    """The planner's Layout of a run config's `parallel` section at `dims` (its ParallelDims.of;
    nvme offload counts as offloaded; its zero_knobs, where set, replace dsf's defaults), with the
    run's `sequence_parallel` (RunConfig.sequence_parallel: auto resolved)."""
    return Layout(dims, offload_optimizer=parallel.offload_optimizer != "none",
                  offload_param=parallel.offload_param != "none", micro_batch=micro_batch,
                  grad_accum=grad_accum, activation_checkpointing=parallel.activation_checkpointing,
                  knobs=Knobs.of(getattr(parallel, "zero_knobs", None)), sequence_parallel=sequence_parallel)


def run_job(run: Any, *, global_batch: int) -> Workload:
    """The planner's Workload of a run config: its sequence length, precision and loss chunking
    (train.chunked_loss, train.loss_chunk_tokens) at `global_batch` sequences a step."""
    return Workload(seq_len=run.data.seq_len, global_batch=global_batch, precision=run.train.precision,
               chunked_loss=run.train.chunked_loss, loss_chunk_tokens=run.train.loss_chunk_tokens)


def check_fit(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster, *,
              export_shard_bytes: float = EXPORT_SHARD_BYTES) -> Fit:
    """Memory of `layout` against `cluster`: the busiest rank plus headroom within the usable
    device memory, and a node's host memory (its ranks building their shares and holding their
    offloaded states; or `dsf export`) within its share of host RAM."""
    memory = memory_per_rank(desc, layout, job)
    ranks_per_node = min(cluster.gpus_per_node, cluster.world)
    host = host_memory_per_node(desc, layout, memory, ranks_per_node=ranks_per_node,
                                export_shard_bytes=export_shard_bytes)
    return Fit(memory, need=memory.total * (1 + MEMORY_HEADROOM), available=usable_gpu_memory(cluster),
               host=host, host_available=cluster.cpu_memory_per_node * HOST_MEMORY_SHARE)
