"""Context parallelism (DeepSpeed Ulysses): the rank grid with a sequence axis, the attention
that gathers the sequence, and the gradient's scale (the loss over a rank's sequence shard is
models/sequence_loss.py's).

    grid = ContextParallelGrid(topology=build_topology(ParallelDims(world=4, cp=2)))   # the mpu
    use_ulysses_attention(model, grid, micro_batch=4, seq_len=4096)  # before deepspeed.initialize
    engine, *_ = deepspeed.initialize(model=model, ..., mpu=grid)
    zero_gradient_scale(cp=2, zero_stage=3)            # what models/sequence_loss.py scales the loss by

How the pieces fit (DeepSpeed 0.19's "Arctic Long Sequence Training" components):
- Each rank of a context group runs the model on its own seq_len/cp tokens with their global
  position ids (rotary and learned positions see where they are). In every attention,
  `UlyssesSPAttentionHF` all-to-alls q, k and v so each rank holds the whole sequence for
  heads/cp of the heads, runs the model's own attention (sdpa, causal), and all-to-alls the
  result back: everything outside attention only ever holds seq_len/cp tokens.
- The loss of a micro-batch is the mean over all of its predicted tokens: each rank contributes
  (sum of its tokens' losses) / (tokens the whole sequence predicts), and backward flows through
  the all-to-alls to the other ranks' activations. DeepSpeed sums the gradients over the context
  ranks and averages over the data-parallel replicas (it divides by its sequence-data group size
  / cp; ZeRO-3's reduce-scatter path by the whole group, which `zero_gradient_scale` makes up
  for), so the step is exactly that of one process seeing the whole sequence.
"""
from __future__ import annotations

import itertools
from typing import Any, cast

import torch
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


# --- attention -----------------------------------------------------------------------------------

def _ulysses_class():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class AnyBatchUlysses(UlyssesSPAttentionHF):
        """DeepSpeed's Ulysses attention, taking the micro-batch size from each call (evaluation's
        last micro-batch may be smaller than training's; DeepSpeed fixes it at construction)."""

        def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
            if query.shape[0] != self.batch_size:
                self.batch_size = query.shape[0]
                self.required_query_shape = torch.Size([self.local_seq_length, *query.shape[:2], query.shape[-1]])
                self.required_key_value_shape = torch.Size([self.local_seq_length, *key.shape[:2], key.shape[-1]])
                self.required_context_shape = torch.Size([self.global_seq_length, self.batch_size,
                                                          self.required_context_shape[-1]])
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)

    return AnyBatchUlysses


def use_ulysses_attention(model: Any, grid: ContextParallelGrid, *, micro_batch: int, seq_len: int,
                          tp: int = 1, core: str = "sdpa") -> str:
    """Route `model`'s attention through DeepSpeed's Ulysses all-to-alls over the grid's context
    group; returns the attention implementation's name. The wrapper around sdpa is registered in
    transformers' AttentionInterface under a name of its own ("dsf_ulysses_<n>", one per call),
    and only this model's config names it: sdpa's entry stays as it was, so another model in
    the process runs plain sdpa. (DeepSpeed's `register_with_transformers` replaces sdpa's entry
    instead, for the whole process.) The name has no mask function registered, so transformers
    builds no mask for the local shard (sdpa's causal flag covers the whole sequence after the
    all-to-all; eager needs a 4D mask of the full sequence, which DeepSpeed refuses), and none of
    these models' code paths asks for "sdpa" by name. With tensor parallelism each rank holds
    heads / tp. `core`: the registered attention run between the all-to-alls (sdpa, or
    models/recompute.py's selective wrapper of it: the all-to-alls stay outside the recompute)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    core_fn = ALL_ATTENTION_FUNCTIONS[core]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    cp = grid.get_sequence_parallel_world_size()
    attention = _ulysses_class()(
        attn=core_fn, batch_size=micro_batch, attn_head_count=heads // tp,
        attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // heads,
        kv_head_count=kv_heads // tp, num_hidden_layers=config.num_hidden_layers,
        process_group=cast(dist.ProcessGroup, grid.get_sequence_parallel_group()), seq_length_is_variable=False,
        local_seq_length=seq_len // cp, global_seq_length=seq_len)
    setattr(attention, "core_attn_implementation", "sdpa")  # as DeepSpeed's register sets it (typed None there)

    def ulysses(module, query, key, value, attention_mask, *args, **kwargs):
        # The model built no mask for the local shard (see above); sdpa's causal flag covers the
        # whole sequence after the all-to-all (and a full 4D mask would cost O(seq_len^2)).
        output, weights = attention(module, query, key, value, None, *args, **kwargs)
        # [batch, local tokens, heads * head_dim] -> [batch, local tokens, heads, head_dim], the shape
        # transformers' attention functions return (GPT-2 merges the last two dims itself).
        return output.view(*output.shape[:2], -1, query.shape[-1]), weights

    name = f"dsf_ulysses_{next(_ULYSSES_NAMES)}"
    AttentionInterface.register(name, ulysses)
    config._attn_implementation = name
    return name


_ULYSSES_NAMES = itertools.count()  # one registry name per use_ulysses_attention call


# --- the gradient's scale ------------------------------------------------------------------------

def zero_gradient_scale(*, cp: int, zero_stage: int) -> float:
    """What the backpropagated loss is multiplied by so that DeepSpeed's reduced gradients are
    those of the mean loss.

    ZeRO 0-2 (and ZeRO-3's all-reduce path) divide the summed gradients by the data x context
    ranks / cp, as Ulysses needs. ZeRO-3's default reduce-scatter path (`reduce_scatter: true`,
    `__avg_scatter_grads` -> `reduce_scatter_coalesced` in DeepSpeed 0.19) averages over all
    data x context ranks instead, which leaves every gradient cp times too small: invisible to
    Adam (scale-invariant) until clipping or eps differ, then the run drifts. The JSON pins
    `reduce_scatter: true` with cp (dsconfig) so this factor always applies; the equality with the
    whole-sequence reference (tests/distributed/test_context_parallel.py) pins the behaviour."""
    return float(cp) if zero_stage == 3 and cp > 1 else 1.0
