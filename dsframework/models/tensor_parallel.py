"""Tensor parallelism for Hugging Face causal LMs: swap dense layers for their Megatron shards.

    model = build_model(source, config, seed=42)                 # the dense model, every rank
    tp_model = TensorParallelCausalLM(shard_model(model, group=tp_group), group=tp_group)  # 1/tp of the weights
    out = tp_model(input_ids=ids, labels=ids)                    # out.loss: models/loss.py's, vocab-parallel

The plan is data: models/plans.py reads the architecture's `base_model_tp_plan` (transformers'
own, for 116 causal-LM types; GPT-2's is written there) and each style becomes a Megatron layer:

| transformers style                 | dsframework layer                                          |
|------------------------------------|------------------------------------------------------------|
| colwise                            | ColumnParallelLinear (output features split)               |
| colwise_gather_output              | ColumnParallelLinear(gather_output=True)                   |
| packed_colwise                     | ColumnParallelLinear, each fused part split (`dense_index`)|
| rowwise / rowwise_split_input      | RowParallelLinear (input split here / already split)       |
| embedding_rowwise                  | VocabParallelEmbedding                                     |
| replicated_with_grad_allreduce     | replicated; gradients summed over the tensor group         |

Attention heads and key/value heads are split across ranks (transformers' attention reshapes by
-1 heads, so it runs on this rank's heads). The input embedding is always vocab-parallel and the
head emits this rank's vocab slice into models/loss.py's vocab-parallel loss: the full logits are
never gathered (the plan's own `lm_head: colwise_gather_output` would gather them).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence, cast

import torch
from torch import nn

from dsframework.errors import UserError, divide
from dsframework.models.hf import causal_lm_class, is_tied, module_path
from dsframework.models.logits import processed_head
from dsframework.models.loss import causal_lm_loss, chunked_causal_lm_loss, vocab_parallel_token_loss
from dsframework.models.plans import STYLES, WORKING_LAYOUTS, architecture_plan, check_architecture, pattern_regex
from dsframework.parallel.tensor import (
    ColumnParallelLinear,
    LayoutOnlyGroup,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    shard_index,
    tensor_parallel_rank,
    tensor_parallel_size,
)
from dsframework.types import HFConfig


def _dense_weight(module: nn.Module, path: str, style: str) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight as [out, in], bias, transposed?) of a Linear, or of a transformers Conv1D ([in, out])."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return module.weight.t(), module.bias, True
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    raise UserError("parallel.tp", path, f"is a {type(module).__name__}, which the style {style!r} cannot split",
                    f"use {WORKING_LAYOUTS}")


def _split_linear(module: nn.Module, path: str, kind: str, style: str, *, group: Any, parts: int) -> nn.Module:
    """The Megatron layer for one plan entry: column (output rows split; packed: each fused part
    split; gathered: its output all-gathered back) or row (input columns split, output summed)."""
    weight, bias, transposed = _dense_weight(module, path, style)
    if kind.startswith(("column", "packed")):
        index = None
        if kind == "packed_column":
            tp, rank = tensor_parallel_size(group), tensor_parallel_rank(group)
            part = divide(weight.shape[0], parts, what=f"{path}'s fused output vs its {parts} parts")
            index = shard_index([part] * parts, rank=rank, tp=tp, what=f"{path}'s fused parts")
        layer = ColumnParallelLinear.from_dense_weight(weight, bias, group=group, out_index=index,
                                                       gather_output=kind == "column_gather")
    else:
        layer = RowParallelLinear.from_dense_weight(weight, bias, group=group, input_is_parallel=kind == "row")
    if transposed:
        # export writes the Conv1D's [in, out] back; metadata on the Parameter, as Megatron's: not in torch's stubs
        setattr(layer.weight, "dense_transposed", True)
    return layer


def _vocab_embedding(module: nn.Embedding, *, group: Any) -> VocabParallelEmbedding:
    """The embedding split by vocabulary; a scaled embedding (Gemma 3's `embed_scale`) keeps its scale."""
    sharded = VocabParallelEmbedding.from_dense(module, group=group)
    scale = getattr(module, "embed_scale", None)
    if scale is not None:
        # host: a float becomes a host buffer, which moves with the module; a tensor keeps its device
        sharded.register_buffer("embed_scale", torch.as_tensor(scale).detach().clone(), persistent=False)
    return sharded


def _all_reduce_gradients(module: nn.Module, *, group: Any) -> None:
    """Sum `module`'s parameter gradients over the tensor group (a norm that sees only this rank's
    heads: its gradient is partial). A hook on the gradient before it accumulates, so gradient
    accumulation and DeepSpeed's own hooks see the summed gradient once; installed at the first
    forward, on whichever Parameter objects the module holds by then (construction replaces them)."""
    def sum_over_tensor_ranks(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    def install(mod: nn.Module, args: Any) -> None:
        for param in mod.parameters(recurse=False):
            if param.requires_grad and not getattr(param, "grad_summed_over_tensor_ranks", False):
                param.register_hook(sum_over_tensor_ranks)
                setattr(param, "grad_summed_over_tensor_ranks", True)

    if tensor_parallel_size(group) > 1:
        module.register_forward_pre_hook(install)
    for param in module.parameters(recurse=False):
        setattr(param, "replicated_grad_allreduce", True)


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _apply_plan(base: nn.Module, plan: Any, *, group: Any) -> None:
    """Every module a plan pattern matches becomes its style's layer (patterns that match nothing,
    e.g. an optional projection this config lacks, are skipped, as transformers does)."""
    paths = [path for path, _ in base.named_modules()]
    for pattern, style in plan.tp:
        kind, regex = STYLES[style], pattern_regex(pattern)
        for path in (p for p in paths if regex.match(p)):
            module = base.get_submodule(path)
            if kind == "grad_allreduce":
                _all_reduce_gradients(module, group=group)
            elif kind == "vocab_embedding":
                # the style transformers' plans give the token embedding: an nn.Embedding
                _set_submodule(base, path, _vocab_embedding(cast(nn.Embedding, module), group=group))
            elif kind != "replicated":
                _set_submodule(base, path, _split_linear(module, path, kind, style, group=group,
                                                         parts=plan.parts_of(pattern)))


def _shard_embeddings(model: Any, *, group: Any, tied: bool) -> None:
    """The input embedding split by vocabulary (whether or not the plan lists it: same function,
    1/tp of the memory), and the head vocab-parallel: tied to it, or split from its own weight."""
    base, embedding, head = model.base_model, model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, VocabParallelEmbedding):
        if not isinstance(embedding, nn.Embedding):
            raise UserError("parallel.tp", tensor_parallel_size(group), f"cannot split {model.config.model_type}'s "
                            f"input embedding ({type(embedding).__name__})", f"use {WORKING_LAYOUTS}")
        embedding = _vocab_embedding(embedding, group=group)
        _set_submodule(base, module_path(base, model.get_input_embeddings()), embedding)
    if head is None or not isinstance(head, nn.Linear):
        raise UserError("parallel.tp", tensor_parallel_size(group), f"cannot split {model.config.model_type}'s "
                        f"output head ({type(head).__name__})", f"use {WORKING_LAYOUTS}")
    head_name = next(name for name, child in model.named_children() if child is head)
    setattr(model, head_name, VocabParallelLMHead.tied_to(embedding) if tied
            else VocabParallelLMHead.from_dense(head, group=group))


def _gpt2_attention_sizes(model: Any, group: Any) -> None:
    """GPT2Attention splits c_attn's output by `split_size` and reshapes by `num_heads`: this rank's."""
    tp = tensor_parallel_size(group)
    for block in model.transformer.h:
        attn = block.attn
        attn.split_size, attn.embed_dim = attn.split_size // tp, attn.embed_dim // tp
        attn.num_heads //= tp


AFTER_SHARD = {"gpt2": _gpt2_attention_sizes}  # model type -> what its modules keep besides weights


class TensorParallelOutput(dict):
    """`.loss` and `.logits` (this rank's vocab slice), like a transformers model output."""

    __getattr__ = dict.__getitem__


class TensorParallelCausalLM(nn.Module):
    """A causal LM whose layers are tensor-parallel shards; forward(input_ids, labels) -> loss."""

    def __init__(self, model: Any, *, group: Any):
        super().__init__()
        self.model, self.group = model, group
        self.config = model.config
        self.loss_chunk_tokens: int | None = None  # models/loss.py use_chunked_loss: the loss in chunks

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None, **kwargs: Any):
        """`.loss` (models/loss.py's, with `shift_labels` the targets already shifted and
        `num_items_in_batch` the count it divides by) and `.logits` (None when chunked)."""
        hidden = self.model.base_model(input_ids=input_ids, **{"use_cache": False, **kwargs}).last_hidden_state
        token_loss = vocab_parallel_token_loss(group=self.group, vocab_size=self.config.vocab_size)
        head = processed_head(self.model)  # this rank's vocab slice, post-processed as the model's forward does
        if labels is None and shift_labels is None:
            return TensorParallelOutput(loss=None, logits=head(hidden))
        if self.loss_chunk_tokens:
            return TensorParallelOutput(loss=chunked_causal_lm_loss(
                head, hidden, labels, shifted=shift_labels, chunk_tokens=self.loss_chunk_tokens,
                token_loss=token_loss, over=num_items_in_batch), logits=None)
        logits = head(hidden)
        return TensorParallelOutput(loss=causal_lm_loss(logits, labels, shifted=shift_labels, token_loss=token_loss,
                                                        over=num_items_in_batch), logits=logits)


def shard_model(model: Any, *, group: Any) -> Any:
    """Swap `model`'s dense layers for this rank's shards, in place, as its architecture's plan says
    (models/plans.py); returns it. UserError (one line) for an architecture or style that cannot.

    The result keeps transformers' module tree and names, so the pipeline can cut it into
    stages (tp x pp); `TensorParallelCausalLM` wraps it for the loss instead (tp x dp).
    """
    tp = tensor_parallel_size(group)
    plan = check_architecture(model.config, tp=tp) if tp > 1 else architecture_plan(model.config)
    if plan.tp_problem:
        check_architecture(model.config, tp=2)  # raises, naming the problem
    tied = is_tied(model)  # (before the plan splits the embedding away from the head)
    _apply_plan(model.base_model, plan, group=group)
    _shard_embeddings(model, group=group, tied=tied)
    if model.config.model_type in AFTER_SHARD:
        AFTER_SHARD[model.config.model_type](model, group)
    return model


# --- merging shards back (dsf export) ------------------------------------------------------------

def shard_layouts(config: HFConfig, tp: int) -> list[dict[str, tuple[int, torch.Tensor, bool]]]:
    """Per tensor rank, {transformers parameter name: (partition dim, dense index, transposed)}
    of every sharded parameter, found by running the plan on a weightless (meta) model; names
    missing from a rank's dict are replicated. transposed: the dense tensor is stored [in, out]."""
    layouts = []
    for rank in range(tp):
        with torch.device("meta"):
            model = causal_lm_class(config)(config)
        shard_model(model, group=LayoutOnlyGroup(size=tp, rank=rank))
        layouts.append({name: (param.partition_dim, param.dense_index,
                               getattr(param, "dense_transposed", False))
                        for name, param in model.named_parameters(remove_duplicate=False)
                        if getattr(param, "tensor_model_parallel", False)})
    return layouts


def merge_tensor_parallel_tensor(name: str, parts: Sequence[torch.Tensor],
                                 layouts: Sequence[Mapping[str, tuple[int, torch.Tensor, bool]]]) -> torch.Tensor:
    """One dense tensor (transformers name and shape) from the tp ranks' parts of it, in rank order.

        layouts = shard_layouts(config, tp)                          # once per export
        dense = merge_tensor_parallel_tensor(name, [part_of_rank0, part_of_rank1], layouts)

    A sharded parameter's slices go back where `dense_index` says (vocab padding dropped, GPT-2's
    fused q|k|v rows re-interleaved; Conv1D weights transposed back to [in, out]); a replicated
    tensor is rank 0's and must be equal on every rank. Only these parts are held, so an export
    merges one parameter at a time.
    """
    first = parts[0]
    if name not in layouts[0]:
        for rank, part in enumerate(parts[1:], start=1):
            if not torch.equal(part, first):
                raise ValueError(f"{name}: the replicated tensor differs between tensor ranks 0 and {rank}")
        return first
    dim, _, transposed = layouts[0][name]
    size = 1 + max(int(layout[name][1].max()) for layout in layouts)
    shape = list(first.shape)
    shape[dim] = size
    dense = first.new_empty(shape)
    filled = torch.zeros(size, dtype=torch.bool)  # host: export merges host tensors
    for layout, part in zip(layouts, parts):
        index = layout[name][1]
        kept = (index >= 0).nonzero().flatten()
        dense.index_copy_(dim, index[kept], part.index_select(dim, kept))
        filled[index[kept]] = True
    if not filled.all():
        raise ValueError(f"{name}: the shards cover {int(filled.sum())} of {size} slices")
    return dense.t().contiguous() if transposed else dense
