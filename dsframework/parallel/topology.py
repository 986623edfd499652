"""The rank grid of a layout on DeepSpeed's own topology classes (the layout itself: dsframework/layout.py).

    topo = build_topology(ParallelDims(world=8, tp=2, pp=2))   # PipeModelDataParallelTopology
    topo.get_coord(rank=3)                             # ProcessCoord(pipe=0, data=1, model=1)
    grid = build_grid(dims)                            # needs torch.distributed: the mpu for
                                                       # deepspeed.initialize(mpu=grid)

Tensor-parallel ranks are adjacent (the 'model' axis is innermost), so a tensor-parallel group
sits on one node; context-parallel ranks come next; then data, then pipe.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology, ProcessTopology

from dsframework.layout import ParallelDims
from dsframework.parallel.context import ContextParallelGrid


def build_topology(dims: ParallelDims):
    """DeepSpeed's topology for `dims`: PipeModelDataParallelTopology (axes pipe, data, model), or
    with context parallelism a ProcessTopology with a 'seq' axis between data and model."""
    if dims.cp_enabled:
        return ProcessTopology(axes=["pipe", "data", "seq", "model"], dims=[dims.pp, dims.dp, dims.cp, dims.tp])
    return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)


def build_grid(dims: ParallelDims):
    """DeepSpeed's PipelineParallelGrid over the topology: the `mpu` for deepspeed.initialize,
    with the tensor-parallel group as its 'slice' group (with cp > 1: `ContextParallelGrid`).
    Needs torch.distributed initialised."""
    if dims.cp_enabled:
        return ContextParallelGrid(topology=build_topology(dims))
    return PipelineParallelGrid(topology=build_topology(dims))
