"""Context parallelism (DeepSpeed Ulysses): the rank grid with a sequence axis.

    grid = ContextParallelGrid(topology=build_topology(ParallelDims(world=4, cp=2)))   # mpu
    grid.get_sequence_parallel_group()        # the cp ranks that share one sequence
    grid.get_sequence_data_parallel_group()   # data x context: what ZeRO shards and reduces over
    deepspeed.initialize(..., mpu=grid)
"""
from __future__ import annotations

from deepspeed import comm as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid


class ContextParallelGrid(PipelineParallelGrid):
    """DeepSpeed's grid over a topology with axes (pipe, data, seq, model), plus the two groups
    DeepSpeed's engine and ZeRO ask an mpu for when `sequence_parallel_size` > 1: the sequence
    group (Ulysses' all-to-alls) and the sequence-data group (ZeRO's partitions and the gradient
    reduction, which DeepSpeed divides by its size / cp = the data-parallel replicas).

    The model-parallel group DeepSpeed reads (gradient norm, checkpoint file names) is the tensor
    group alone: the context ranks of a replica hold the same weights, so counting them would add
    every tensor-parallel gradient cp times."""

    def __init__(self, topology) -> None:
        super().__init__(topology=topology)
        self.sequence_parallel_size = topology.get_dim("seq")
        rank = self.global_rank
        self.seq_proc_group = self.seq_data_proc_group = None
        for ranks in topology.get_axis_comm_lists("seq"):
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                self.seq_proc_group = group
        coords = {(c.pipe, c.model) for c in (topology.get_coord(r) for r in range(topology.world_size()))}
        for pipe, model in sorted(coords):
            ranks = sorted(topology.filter_match(pipe=pipe, model=model))
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                self.seq_data_proc_group, self.seq_data_ranks = group, ranks
        assert self.seq_proc_group is not None and self.seq_data_proc_group is not None

    def _is_grid_valid(self) -> bool:
        ranks = 1
        for axis in self._topo.get_axis_names():
            ranks *= self._topo.get_dim(axis)
        return ranks == dist.get_world_size()

    # --- what DeepSpeed's groups module asks an mpu for with sequence parallelism -----------------
    def get_sequence_parallel_group(self):
        return self.seq_proc_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence_parallel_size

    def get_sequence_parallel_rank(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).seq

    def get_sequence_data_parallel_group(self):
        return self.seq_data_proc_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self.seq_data_ranks)

    def get_sequence_data_parallel_rank(self) -> int:
        return self.seq_data_ranks.index(self.global_rank)

    # --- the model-parallel group is the tensor group (see the class docstring) -------------------
    def get_model_parallel_group(self):
        return self.slice_proc_group

    def get_model_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_model_parallel_rank(self) -> int:
        return self.get_slice_parallel_rank()
