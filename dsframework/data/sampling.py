"""Which rows each data-parallel rank reads, as a pure function of the samples consumed.

    sampler = BlockSampler(len(store), micro_batch=4, grad_accum=2, dp_size=2, dp_rank=0, seed=1234)
    for indices in sampler.micro_batches(consumed_samples=0):   # this rank's share of one step
        input_ids = store[indices]
"""
from __future__ import annotations

from typing import Any


class BlockSampler:
    """Which blocks each data-parallel rank reads, as a pure function of the samples consumed.

    Sample i of the run is block perm_{i // n}[i % n], perm_e a seeded permutation per epoch.
    A step takes the next `global_batch` samples; rank r reads the r-th contiguous slice of them,
    in `grad_accum` micro-batches, so the ranks' shards are disjoint and cover the global batch.
    """

    def __init__(self, num_blocks: int, *, micro_batch: int, grad_accum: int, dp_size: int,
                 dp_rank: int, seed: int):
        assert 0 <= dp_rank < dp_size and num_blocks > 0
        self.num_blocks, self.micro_batch, self.grad_accum = num_blocks, micro_batch, grad_accum
        self.dp_size, self.dp_rank, self.seed = dp_size, dp_rank, seed
        self._perms: dict[int, Any] = {}

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def _perm(self, epoch: int) -> Any:
        """The epoch's order, drawn on the CPU once per epoch and kept as a numpy array of 4 bytes a
        block (a Python list would take ~40: 160 MB for the 4M blocks of 10^9 tokens)."""
        import numpy as np
        import torch

        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_blocks, generator=generator).numpy()
            self._perms = {epoch: order.astype(np.int32 if self.num_blocks < 2**31 else np.int64)}
        return self._perms[epoch]

    def global_indices(self, consumed_samples: int) -> list[int]:
        """The block indices of the step that starts after `consumed_samples` samples."""
        return [int(self._perm(i // self.num_blocks)[i % self.num_blocks])
                for i in range(consumed_samples, consumed_samples + self.global_batch)]

    def micro_batches(self, consumed_samples: int) -> list[list[int]]:
        """This rank's `grad_accum` micro-batches of block indices for one step."""
        indices = self.global_indices(consumed_samples)
        per_rank = self.micro_batch * self.grad_accum
        mine = indices[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return [mine[k * self.micro_batch:(k + 1) * self.micro_batch] for k in range(self.grad_accum)]


def eval_shard(num_blocks: int, *, micro_batch: int, dp_size: int, dp_rank: int) -> list[list[int]]:
    """This rank's eval micro-batches: the same count on every rank (ZeRO-3 needs each rank to
    run every forward), blocks beyond a multiple of micro_batch * dp_size left out."""
    micro = min(micro_batch, max(1, num_blocks // dp_size))
    usable = num_blocks - num_blocks % (micro * dp_size)
    mine = list(range(dp_rank, usable, dp_size))
    return [mine[k:k + micro] for k in range(0, len(mine), micro)]
