"""Megatron-style tensor parallelism: mappings, parallel linear layers, vocab-parallel embedding,
LM head and cross entropy.

Every layer is built from its dense twin, so a tensor-parallel model computes the same function
as the dense model it came from (up to fp32 rounding):

    group = grid.get_slice_parallel_group()        # the tensor-parallel ProcessGroup (mpu)
    up = ColumnParallelLinear.from_dense(mlp.up_proj, group=group)       # out dim sharded
    down = RowParallelLinear.from_dense(mlp.down_proj, group=group)      # in dim sharded
    y = down(F.silu(up(x)))                        # one all-reduce forward, one backward

    embed = VocabParallelEmbedding.from_dense(model.embed_tokens, group=group)  # vocab padded
    head = VocabParallelLMHead.tied_to(embed)      # or .from_dense(model.lm_head, group=group)
    logits_shard = head(hidden)                    # [..., padded_vocab / tp], never gathered
    loss = vocab_parallel_cross_entropy(logits_shard, labels, group=group,
                                        vocab_size=embed.num_embeddings)  # per token

Fused projections (GPT-2's `c_attn` is a transformers Conv1D whose weight is [in, out] and whose
output is [q | k | v]) are split per head with an explicit index of the output rows a rank owns:

    index = shard_index([n_head, n_head, n_head], unit=head_dim, rank=rank, tp=tp,
                        what="n_head")
    qkv = ColumnParallelLinear.from_dense_weight(c_attn.weight.t(), c_attn.bias, group=group,
                                                 out_index=index)

Three layers of code: private collectives that return early when the group has one rank; one
`torch.autograd.Function` per communication pattern; public wrappers whose docstrings say what
runs forward and backward. `group=None` is allowed only where there is no world to guess from
(torch.distributed not initialized, or one rank): every layer is then its dense twin. Under
torch.distributed, pass the group (`torch.distributed.group.WORLD` for all ranks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsframework.errors import divide
from dsframework.runtime_facts import padded_vocab

ProcessGroup = dist.ProcessGroup

__all__ = [
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLMHead",
    "vocab_parallel_cross_entropy", "shard_index", "tensor_parallel_rank", "tensor_parallel_size",
    "LayoutOnlyGroup", "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "SequenceParallelBlock",
]


# ---------------------------------------------------------------------------------------------
# Private collectives: each returns early when the group has one rank.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayoutOnlyGroup:
    """Stands in for a tensor-parallel group of `size` ranks, seen from `rank`, with no process
    group behind it: layers built with it hold rank `rank`'s shards, and their parameters'
    `dense_index` says where those rows sit in the dense tensor. Any collective on it fails.

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        shard_model(model, group=LayoutOnlyGroup(size=2, rank=1))   # rank 1's layout, no weights
    """

    size: int
    rank: int


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _checked(group: ProcessGroup | None) -> ProcessGroup | None:
    """`group`, unless it is None in a world of several ranks: a tensor-parallel layer or mapping
    never silently shards over the whole world (Megatron's
    get_tensor_model_parallel_group_if_none asks the same)."""
    if group is None and _initialized() and dist.get_world_size() > 1:
        raise ValueError("tensor parallelism got group=None in a world of "
                         f"{dist.get_world_size()} ranks: pass the tensor-parallel group "
                         "(grid.get_slice_parallel_group()), or torch.distributed.group.WORLD for all ranks")
    return group


def tensor_parallel_size(group: ProcessGroup | LayoutOnlyGroup | None) -> int:
    """Ranks in `group` (1 when torch.distributed is not initialized)."""
    if isinstance(group, LayoutOnlyGroup):
        return group.size
    return dist.get_world_size(_checked(group)) if _initialized() else 1


def tensor_parallel_rank(group: ProcessGroup | LayoutOnlyGroup | None) -> int:
    """This process's rank inside `group` (0 when torch.distributed is not initialized)."""
    if isinstance(group, LayoutOnlyGroup):
        return group.rank
    return dist.get_rank(_checked(group)) if _initialized() else 0


def _reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum of `x` over the group, in a new tensor (the input is left as it was)."""
    if tensor_parallel_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split_along_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous slice of the last dimension."""
    tp = tensor_parallel_size(group)
    if tp == 1:
        return x
    part = divide(x.size(-1), tp, what="last dimension of a tensor split over tensor-parallel ranks")
    start = tensor_parallel_rank(group) * part
    return x[..., start:start + part].contiguous()


def _gather_along_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The ranks' tensors concatenated along the last dimension, in rank order."""
    tp = tensor_parallel_size(group)
    if tp == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


# Sequence parallelism: the sequence dimension of [batch, seq, hidden] split over the group.
SEQ_DIM = 1
# torch 2.13 names them *_single (and warns at the old names); the GPU image's torch 2.11 has the old ones only
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The ranks' sequence slices concatenated in rank order: [b, s/tp, h] -> [b, s, h]."""
    tp = tensor_parallel_size(group)
    if tp == 1:
        return x
    local = x.movedim(SEQ_DIM, 0).contiguous()  # one contiguous block per rank (a view when batch is 1)
    out = local.new_empty((tp * local.size(0), *local.shape[1:]))
    _ALL_GATHER(out, local, group=group)
    return out.movedim(0, SEQ_DIM)


def _reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum over the group, of which each rank keeps its sequence slice: [b, s, h] -> [b, s/tp, h]."""
    tp = tensor_parallel_size(group)
    if tp == 1:
        return x
    whole = x.movedim(SEQ_DIM, 0).contiguous()
    part = divide(whole.size(0), tp, what="sequence length split over tensor-parallel ranks (sequence parallel)")
    out = whole.new_empty((part, *whole.shape[1:]))
    _REDUCE_SCATTER(out, whole, group=group)
    return out.movedim(0, SEQ_DIM).contiguous()


def _split_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous slice of the sequence of a replicated tensor."""
    tp = tensor_parallel_size(group)
    if tp == 1:
        return x
    part = divide(x.size(SEQ_DIM), tp, what="sequence length split over tensor-parallel ranks (sequence parallel)")
    return x.narrow(SEQ_DIM, tensor_parallel_rank(group) * part, part).contiguous()


# ---------------------------------------------------------------------------------------------
# One autograd.Function per pattern.
# ---------------------------------------------------------------------------------------------

def _identity(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x


def _mapping(name: str, forward: Callable, backward: Callable) -> type:
    """An autograd.Function: `forward(x, group)` forward, `backward(grad, group)` backward."""
    def run_forward(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def run_backward(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(run_forward),
                                                   "backward": staticmethod(run_backward)})


_CopyToTensorParallelRegion = _mapping("_CopyToTensorParallelRegion", _identity, _reduce)
_ReduceFromTensorParallelRegion = _mapping("_ReduceFromTensorParallelRegion", _reduce, _identity)
_ScatterToTensorParallelRegion = _mapping("_ScatterToTensorParallelRegion", _split_along_last_dim,
                                          _gather_along_last_dim)
_GatherFromTensorParallelRegion = _mapping("_GatherFromTensorParallelRegion", _gather_along_last_dim,
                                           _split_along_last_dim)
_ScatterToSequenceParallelRegion = _mapping("_ScatterToSequenceParallelRegion", _split_sequence, _gather_sequence)
# The consumers' gradients are partial sums (column-parallel layers): reduce-scattered back
_GatherFromSequenceParallelRegion = _mapping("_GatherFromSequenceParallelRegion", _gather_sequence,
                                             _reduce_scatter_sequence)
# The consumer's gradient is whole on every rank (after the vocab-parallel head's all-reduce): sliced back
_GatherSequenceToReplicatedRegion = _mapping("_GatherSequenceToReplicatedRegion", _gather_sequence, _split_sequence)
_ReduceScatterToSequenceParallelRegion = _mapping("_ReduceScatterToSequenceParallelRegion", _reduce_scatter_sequence,
                                                  _gather_sequence)


class _ColumnParallelMatmul(torch.autograd.Function):
    """y = x W^T + b on a replicated input; backward sums the input gradient over the group while
    the weight gradient's matmul runs (Megatron's async input-gradient all-reduce): the reduction
    is issued first, as an async op, and waited for only before the gradients are returned."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, reduce_input_grad):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.reduce = group, bias is not None, reduce_input_grad
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = pending = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight)
            if ctx.reduce and tensor_parallel_size(ctx.group) > 1:
                pending = dist.all_reduce(grad_input, group=ctx.group, async_op=True)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad.reshape(-1, grad.size(-1)).t().matmul(x.reshape(-1, x.size(-1)))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.size(-1)).sum(dim=0)
        if pending is not None:
            pending.wait()
        return grad_input, grad_weight, grad_bias, None, None


# ---------------------------------------------------------------------------------------------
# Public mappings.
# ---------------------------------------------------------------------------------------------

def copy_to_tensor_parallel_region(x: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input.

    forward: identity (copy), backward: all-reduce (sum) of the gradient over `group`.
    """
    _checked(group)
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing the ranks' partial results.

    forward: all-reduce (sum) over `group`, backward: identity.
    """
    _checked(group)
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's contiguous slice of the last dimension of a replicated tensor.

    forward: split along the last dimension, backward: all-gather along the last dimension.
    """
    _checked(group)
    return _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate the ranks' slices along the last dimension, in rank order.

    forward: all-gather along the last dimension, backward: split (keep this rank's slice).
    """
    _checked(group)
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's slice of the sequence (dim 1).

    forward: split along the sequence, backward: all-gather along the sequence.
    """
    _checked(group)
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, *, group: ProcessGroup | None,
                                         partial_grads: bool = True) -> torch.Tensor:
    """The whole sequence from the ranks' slices. `partial_grads`: its consumers' gradients are
    partial sums over the group (column-parallel layers); else they are whole on every rank (the
    vocab-parallel head, whose own input all-reduce made them so).

    forward: all-gather along the sequence, backward: reduce-scatter along the sequence (or, without
    partial_grads, keep this rank's slice).
    """
    _checked(group)
    if partial_grads:
        return _GatherFromSequenceParallelRegion.apply(x, group)
    return _GatherSequenceToReplicatedRegion.apply(x, group)


class _Regathered:
    """What the backward keeps of a gathered sequence: this rank's slice, gathered again when first
    unpacked (once for all the block's matmuls that saved it) and dropped with them."""

    def __init__(self, part: torch.Tensor, group: ProcessGroup | None) -> None:
        self.part, self.group, self.whole = part, group, None

    def whole_sequence(self) -> torch.Tensor:
        if self.whole is None:
            with torch.no_grad():
                self.whole = _gather_sequence(self.part, self.group)
        return self.whole


class SequenceParallelBlock:
    """The input of a block whose column-parallel layers need the whole sequence (an attention,
    an MLP), gathered from the ranks' slices; with `regather`, the backward keeps only this rank's
    slice of it and gathers it again (Korthikanti et al. 2022: the layer stores sbh(34/t + ...)).

        block = SequenceParallelBlock(group, regather=True)
        whole = block.enter(hidden_slice)      # the block's forward pre-hook: its new input
        ...                                    # the block runs; its matmuls save `whole`
        block.leave()                          # its forward hook

    Not under torch's checkpoint (full activation checkpointing): its own saved-tensor hooks would
    stand in front of the checkpoint's, which recomputes the block (and the gather) anyway.
    """

    def __init__(self, group: ProcessGroup | None, *, regather: bool) -> None:
        self.group, self.regather = group, regather
        self.hooks: list = []

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        whole = gather_from_sequence_parallel_region(hidden, group=self.group)
        if self.regather and torch.is_grad_enabled() and tensor_parallel_size(self.group) > 1:
            kept = _Regathered(hidden.detach(), self.group)
            ptr, shape = whole.data_ptr(), whole.shape

            def pack(saved: torch.Tensor) -> Any:
                return kept if saved.data_ptr() == ptr and saved.shape == shape else saved

            def unpack(saved: Any) -> torch.Tensor:
                return saved.whole_sequence() if isinstance(saved, _Regathered) else saved

            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            hooks.__enter__()
            self.hooks.append(hooks)
        return whole

    def leave(self) -> None:
        if self.hooks:
            self.hooks.pop().__exit__(None, None, None)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a tensor-parallel region into the sequence-parallel one: sum the ranks' partial
    results and keep this rank's slice of the sequence.

    forward: reduce-scatter along the sequence, backward: all-gather along the sequence.
    """
    _checked(group)
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


# ---------------------------------------------------------------------------------------------
# Sharding helpers.
# ---------------------------------------------------------------------------------------------

def shard_index(sections: Sequence[int], *, rank: int, tp: int, unit: int = 1,
                what: str = "fused output size") -> torch.Tensor:
    """Indices of the rows of a fused dimension that `rank` owns: its contiguous share of each section.

    `sections` are counted in `unit`s (heads, with `unit=head_dim`), so a split never cuts a head:
        shard_index([12, 12, 12], unit=64, rank=1, tp=4, what="n_head")   # GPT-2 c_attn q|k|v
        -> rows 192..383 of q, then the same heads' rows of k (960..1151) and v (1728..1919)
    """
    index, offset = [], 0
    for size in sections:
        part = divide(size, tp, what=what) * unit
        index.append(torch.arange(offset + rank * part, offset + (rank + 1) * part))  # host: dense_index
        offset += size * unit
    return torch.cat(index) if index else torch.empty(0, dtype=torch.long)  # host: dense_index


def _contiguous_index(size: int, *, rank: int, tp: int, what: str) -> torch.Tensor:
    part = divide(size, tp, what=what)
    return torch.arange(rank * part, (rank + 1) * part)  # host: dense_index (layout metadata, kept on the CPU)


def _check_index(index: torch.Tensor, *, size: int, part: int, what: str) -> torch.Tensor:
    index = torch.as_tensor(index, dtype=torch.long).flatten()  # host: dense_index
    if index.numel() != part:
        raise ValueError(f"{what} has {index.numel()} entries; this rank owns {part} rows")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= size):
        raise ValueError(f"{what} must lie in [0, {size}); got [{int(index.min())}, {int(index.max())}]")
    return index


def _mark_tensor_parallel(param: nn.Parameter, *, partition_dim: int,
                          dense_index: torch.Tensor) -> nn.Parameter:
    """Tag a sharded parameter the way DeepSpeed/Megatron read it (gradient-norm accounting), and
    with `dense_index`: for each of its slices along `partition_dim`, that slice's index in the
    dense tensor (-1: vocab padding). Merging shards back (export) needs nothing else."""
    # metadata on the Parameter, as Megatron sets it (setattr: not in torch's stubs)
    setattr(param, "tensor_model_parallel", True)
    setattr(param, "partition_dim", partition_dim)
    setattr(param, "partition_stride", 1)
    setattr(param, "dense_index", dense_index.detach().to("cpu", torch.long))
    return param


def dense_index_of(param: nn.Parameter) -> torch.Tensor:
    """The `dense_index` `_mark_tensor_parallel` set on a sharded parameter."""
    return getattr(param, "dense_index")


def _vocab_index(start: int, end: int, num_embeddings: int) -> torch.Tensor:
    """Dense rows [start, end) of a padded vocabulary; rows past `num_embeddings` are -1."""
    index = torch.arange(start, end)  # host: dense_index
    return index.masked_fill(index >= num_embeddings, -1)


def _linear_init_(weight: torch.Tensor, bias: torch.Tensor | None, *, fan_in: int) -> None:
    """nn.Linear's default distribution, with the dense layer's fan_in (not the shard's)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


# ---------------------------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows (and b) split over the ranks of `group`.

    Weight shard: [out_features / tp, in_features]. Input: replicated [..., in_features].
    Output: this rank's [..., out_features / tp], or all of it with `gather_output=True`.
    forward: local matmul (, all-gather); backward: all-reduce the input gradient, overlapped with
    the weight gradient's matmul.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: ProcessGroup | None, gather_output: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        tp = tensor_parallel_size(group)
        self.out_features_per_rank = divide(out_features, tp, what="ColumnParallelLinear out_features")
        rows = _contiguous_index(out_features, rank=tensor_parallel_rank(group), tp=tp,
                                 what="ColumnParallelLinear out_features")
        self.weight = _mark_tensor_parallel(nn.Parameter(torch.empty(
            self.out_features_per_rank, in_features, device=device, dtype=dtype)),
            partition_dim=0, dense_index=rows)
        self.bias = _mark_tensor_parallel(nn.Parameter(torch.empty(
            self.out_features_per_rank, device=device, dtype=dtype)), partition_dim=0,
            dense_index=rows) if bias else None
        if self.weight.device.type != "meta":
            _linear_init_(self.weight, self.bias, fan_in=in_features)

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, group: ProcessGroup | None,
                   gather_output: bool = False) -> "ColumnParallelLinear":
        """This rank's contiguous share of `linear`'s output rows."""
        return cls.from_dense_weight(linear.weight, linear.bias, group=group, gather_output=gather_output)

    @classmethod
    def from_dense_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                          group: ProcessGroup | None, gather_output: bool = False,
                          out_index: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """From a dense [out, in] weight (a Conv1D's `.weight.t()`) and [out] bias.

        `out_index`: the output rows this rank owns (see `shard_index`), for fused projections;
        default: the contiguous share. A custom index cannot be gathered back in dense order, so
        it requires `gather_output=False`.
        """
        out_features, in_features = weight.shape
        tp, rank = tensor_parallel_size(group), tensor_parallel_rank(group)
        layer = cls(in_features, out_features, bias is not None, group=group, gather_output=gather_output,
                    device="meta", dtype=weight.dtype)
        if out_index is None:
            out_index = _contiguous_index(out_features, rank=rank, tp=tp,
                                          what="ColumnParallelLinear out_features")
        elif gather_output:
            raise ValueError("ColumnParallelLinear: out_index needs gather_output=False "
                             "(the gathered output would not be in the dense order)")
        rows = _check_index(out_index, size=out_features, part=layer.out_features_per_rank,
                            what="ColumnParallelLinear out_index")
        index = rows.to(weight.device)
        with torch.no_grad():
            layer.weight = _mark_tensor_parallel(nn.Parameter(
                weight.detach().index_select(0, index).clone(), requires_grad=weight.requires_grad),
                partition_dim=0, dense_index=rows)
            if bias is not None:
                layer.bias = _mark_tensor_parallel(nn.Parameter(
                    bias.detach().index_select(0, index.to(bias.device)).clone(),
                    requires_grad=bias.requires_grad), partition_dim=0, dense_index=rows)
        return layer

    # The input was all-gathered from the ranks' slices of the sequence (its block's gather, whose
    # backward reduce-scatters the summed input gradients): not all-reduced here
    sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ColumnParallelMatmul.apply(x, self.weight, self.bias, _checked(self.group), not self.sequence_parallel)
        return gather_from_tensor_parallel_region(y, group=self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_rank} per rank), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split over the ranks of `group`; b replicated.

    Weight shard: [out_features, in_features / tp]; bias: [out_features], added once after the
    reduce. Input: this rank's [..., in_features / tp] (`input_is_parallel=True`, e.g. the output
    of a ColumnParallelLinear), or the replicated [..., in_features], split here.
    Output: replicated [..., out_features].
    forward: (split x,) local matmul, all-reduce; backward: identity (, all-gather the input grad).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: ProcessGroup | None, input_is_parallel: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        tp = tensor_parallel_size(group)
        self.in_features_per_rank = divide(in_features, tp, what="RowParallelLinear in_features")
        columns = _contiguous_index(in_features, rank=tensor_parallel_rank(group), tp=tp,
                                    what="RowParallelLinear in_features")
        self.weight = _mark_tensor_parallel(nn.Parameter(torch.empty(
            out_features, self.in_features_per_rank, device=device, dtype=dtype)), partition_dim=1,
            dense_index=columns)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            _linear_init_(self.weight, self.bias, fan_in=in_features)

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, group: ProcessGroup | None,
                   input_is_parallel: bool = True) -> "RowParallelLinear":
        """This rank's contiguous share of `linear`'s input columns; the whole bias."""
        return cls.from_dense_weight(linear.weight, linear.bias, group=group,
                                     input_is_parallel=input_is_parallel)

    @classmethod
    def from_dense_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                          group: ProcessGroup | None, input_is_parallel: bool = True,
                          in_index: torch.Tensor | None = None) -> "RowParallelLinear":
        """From a dense [out, in] weight (a Conv1D's `.weight.t()`) and [out] bias.

        `in_index`: the input columns this rank owns, matching the layout of the parallel input;
        default: the contiguous share. A custom index requires `input_is_parallel=True`.
        """
        out_features, in_features = weight.shape
        tp, rank = tensor_parallel_size(group), tensor_parallel_rank(group)
        layer = cls(in_features, out_features, bias is not None, group=group,
                    input_is_parallel=input_is_parallel, device="meta", dtype=weight.dtype)
        if in_index is None:
            in_index = _contiguous_index(in_features, rank=rank, tp=tp, what="RowParallelLinear in_features")
        elif not input_is_parallel:
            raise ValueError("RowParallelLinear: in_index needs input_is_parallel=True "
                             "(a replicated input is split into contiguous slices)")
        columns = _check_index(in_index, size=in_features, part=layer.in_features_per_rank,
                               what="RowParallelLinear in_index")
        index = columns.to(weight.device)
        with torch.no_grad():
            layer.weight = _mark_tensor_parallel(nn.Parameter(
                weight.detach().index_select(1, index).clone(), requires_grad=weight.requires_grad),
                partition_dim=1, dense_index=columns)
            if bias is not None:
                layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return layer

    sequence_parallel = False  # the output is this rank's slice of the sequence: reduce-scattered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, group=self.group)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), group=self.group)
        else:
            y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), group=self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_rank} per rank), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")


def _vocab_layout(num_embeddings: int, *, group: ProcessGroup | None,
                  padding_to_multiple: int | None) -> tuple[int, int, int]:
    """(padded vocab size, first row, end row) of this rank's contiguous vocab range."""
    tp, rank = tensor_parallel_size(group), tensor_parallel_rank(group)
    padded = padded_vocab(num_embeddings, tp=tp, multiple=padding_to_multiple)  # the planner counts the same
    part = divide(padded, tp, what="padded vocab size")
    return padded, rank * part, (rank + 1) * part


def _vocab_shard(weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of `weight`, with the rows past its end (vocab padding) zero."""
    shard = weight.new_zeros(end - start, weight.size(1))
    stop = min(end, weight.size(0))
    if stop > start:
        shard[: stop - start] = weight.detach()[start:stop]
    return shard


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its vocabulary split over the ranks of `group` (Megatron).

    The vocabulary is padded with zero rows to a multiple of `padding_to_multiple` (default 128)
    x tp at tp > 1 (runtime_facts.padded_vocab); rank r holds rows [vocab_start, vocab_end). Token
    ids outside a rank's range give zeros there, and the all-reduce sums the one rank that holds
    each id. Ids must lie in [0, num_embeddings), so padding rows are never selected.
    forward: masked local lookup, all-reduce; backward: identity (each rank's rows get their grads).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: ProcessGroup | None,
                 padding_to_multiple: int | None = None, padding_idx: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.padded_num_embeddings, self.vocab_start, self.vocab_end = _vocab_layout(
            num_embeddings, group=group, padding_to_multiple=padding_to_multiple)
        self.weight = _mark_tensor_parallel(nn.Parameter(torch.empty(
            self.vocab_end - self.vocab_start, embedding_dim, device=device, dtype=dtype)), partition_dim=0,
            dense_index=_vocab_index(self.vocab_start, self.vocab_end, num_embeddings))
        if self.weight.device.type != "meta":
            with torch.no_grad():  # nn.Embedding's N(0, 1); padding rows and padding_idx zero
                self.weight.normal_()
                self.weight[max(0, num_embeddings - self.vocab_start):] = 0
                if self._local_padding_idx is not None:
                    self.weight[self._local_padding_idx] = 0

    @property
    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            return self.padding_idx - self.vocab_start
        return None

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *, group: ProcessGroup | None,
                   padding_to_multiple: int | None = None) -> "VocabParallelEmbedding":
        """This rank's vocab range of `embedding` (its padding_idx kept; zero padding rows)."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports neither max_norm, scale_grad_by_freq "
                             "nor sparse embeddings")
        return cls.from_dense_weight(embedding.weight, group=group, padding_to_multiple=padding_to_multiple,
                                     padding_idx=embedding.padding_idx)

    @classmethod
    def from_dense_weight(cls, weight: torch.Tensor, *, group: ProcessGroup | None,
                          padding_to_multiple: int | None = None,
                          padding_idx: int | None = None) -> "VocabParallelEmbedding":
        """From a dense [vocab, dim] weight."""
        layer = cls(weight.size(0), weight.size(1), group=group, padding_to_multiple=padding_to_multiple,
                    padding_idx=padding_idx, device="meta", dtype=weight.dtype)
        layer.weight = _mark_tensor_parallel(nn.Parameter(
            _vocab_shard(weight, layer.vocab_start, layer.vocab_end), requires_grad=weight.requires_grad),
            partition_dim=0, dense_index=dense_index_of(layer.weight))
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tensor_parallel_size(self.group) == 1:
            return self._scaled(F.embedding(input_ids, self.weight, self._local_padding_idx))
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self._scaled(reduce_from_tensor_parallel_region(out, group=self.group))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """Times `embed_scale` when the dense embedding had one (Gemma's scaled word embeddings
        multiply their lookup by sqrt(hidden), as a buffer in the weight's dtype)."""
        scale = getattr(self, "embed_scale", None)
        return out if scale is None else out * scale.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}), {self.embedding_dim}, "
                f"rows [{self.vocab_start}, {self.vocab_end})"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))


class VocabParallelLMHead(nn.Module):
    """hidden -> this rank's vocab slice of the logits, [..., padded_vocab / tp], never gathered.

    Same vocab layout as VocabParallelEmbedding (padding, rank ranges), so its output goes straight
    into `vocab_parallel_cross_entropy`; padded columns hold logit 0 (or the bias' 0) and are
    ignored there. `tied_to(embedding)` shares the embedding's weight shard (GPT-2, tied Llama).
    forward: copy hidden, local matmul; backward: all-reduce of the hidden-state gradient.
    """

    def __init__(self, embedding: VocabParallelEmbedding, bias: torch.Tensor | None = None):
        super().__init__()
        self.group = embedding.group
        self.num_embeddings = embedding.num_embeddings
        self.vocab_start, self.vocab_end = embedding.vocab_start, embedding.vocab_end
        self.weight = embedding.weight  # shared Parameter when tied
        self.bias = bias

    @classmethod
    def tied_to(cls, embedding: VocabParallelEmbedding) -> "VocabParallelLMHead":
        """A head whose weight is `embedding`'s own weight shard (tie_word_embeddings)."""
        return cls(embedding)

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, group: ProcessGroup | None,
                   padding_to_multiple: int | None = None) -> "VocabParallelLMHead":
        """This rank's vocab rows of an untied `lm_head` ([vocab, hidden] weight, optional bias)."""
        shard = VocabParallelEmbedding.from_dense_weight(linear.weight, group=group,
                                                         padding_to_multiple=padding_to_multiple)
        bias = None
        if linear.bias is not None:
            bias = _mark_tensor_parallel(nn.Parameter(
                _vocab_shard(linear.bias.unsqueeze(1), shard.vocab_start, shard.vocab_end).squeeze(1),
                requires_grad=linear.bias.requires_grad), partition_dim=0, dense_index=dense_index_of(shard.weight))
        return cls(shard, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tensor_parallel_region(hidden, group=self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"vocab rows [{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings}"


# ---------------------------------------------------------------------------------------------
# Vocab-parallel cross entropy (Megatron's cross_entropy.py).
# ---------------------------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index):
        part = logits.size(-1)
        start = tensor_parallel_rank(group) * part
        # fp32 working copy; columns past the real vocabulary (padding) never count.
        x = logits.detach().to(torch.float32, copy=True)
        real = min(max(vocab_size - start, 0), part)
        if real < part:
            x[..., real:] = float("-inf")

        logits_max = x.amax(dim=-1)
        if tensor_parallel_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        x -= logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        not_here = (target < start) | (target >= start + part) | ignored
        local_target = (target - start).masked_fill(not_here, 0)
        predicted = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_here, 0.0)
        exp = x.exp_()
        # One all-reduce for both sums (the target's logit lives on one rank; the exp sums on all).
        predicted, sum_exp = _reduce(torch.stack([predicted, exp.sum(dim=-1)]), group).unbind(0)
        loss = (sum_exp.log() - predicted).masked_fill(ignored, 0.0)

        exp /= sum_exp.unsqueeze(-1)  # softmax over the whole (real) vocabulary
        ctx.save_for_backward(exp, not_here, local_target, ignored)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, not_here, local_target, ignored = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - one_hot(target); updated in place (Megatron)
        flat = grad.view(-1, grad.size(-1))
        rows = torch.arange(flat.size(0), device=flat.device)
        flat[rows, local_target.view(-1)] -= (~not_here).view(-1).to(flat.dtype)
        grad *= grad_loss.unsqueeze(-1).to(grad.dtype)
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *,
                                 group: ProcessGroup | None, vocab_size: int,
                                 ignore_index: int) -> torch.Tensor:
    """Per-token cross entropy (no reduction) from this rank's vocab slice of the logits.

    `logits_shard`: [..., padded_vocab / tp], rank r holding columns [r*part, (r+1)*part) (the
    layout of VocabParallelEmbedding / VocabParallelLMHead); columns >= `vocab_size` are padding
    and never count. `target`: [...] ids in [0, vocab_size) or `ignore_index` (loss 0, no grad;
    models/loss.py's IGNORE_INDEX, which `vocab_parallel_token_loss` passes).
    Returns fp32 losses of shape `target.shape`; the full logits are never gathered.
    forward: all-reduce max, all-reduce target logit, all-reduce sum of exp;
    backward: local (softmax - one_hot), no communication.
    The backward reuses the saved softmax in place, so run it once per forward.
    """
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits_shard {tuple(logits_shard.shape)} and target {tuple(target.shape)} "
                         "must agree on every dimension but the last")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, vocab_size, ignore_index)
