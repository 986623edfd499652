"""Tensor parallelism for Hugging Face causal LMs: swap dense layers for their Megatron shards.

    model = build_model(source, config, seed=42)                 # the dense model, every rank
    tp_model = TensorParallelCausalLM(shard_model(model, group=tp_group), group=tp_group)  # 1/tp of the weights
    out = tp_model(input_ids=ids, labels=ids)                    # out.loss: models/loss.py's, vocab-parallel

Plans (which module becomes which shard):

| architecture            | column-parallel                      | row-parallel       | vocab-parallel          |
|-------------------------|--------------------------------------|--------------------|-------------------------|
| llama, mistral, qwen2   | q/k/v_proj, gate/up_proj             | o_proj, down_proj  | embed_tokens, lm_head   |
| gpt2                    | c_attn (split per head into q, k, v), c_fc | attn/mlp c_proj | wte, lm_head (tied)  |

Attention heads and key/value heads are split across ranks (grouped-query attention keeps its
heads-per-kv-head ratio). Norms and GPT-2's position embedding stay replicated. The loss never
gathers the full logits: the head emits this rank's vocab slice into models/loss.py's causal LM
loss with its vocab-parallel per-token loss.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from dsframework.errors import UserError, divide
from dsframework.models.families import SUPPORTED, family_of
from dsframework.models.hf import causal_lm_class
from dsframework.models.loss import causal_lm_loss, chunked_causal_lm_loss, vocab_parallel_token_loss
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


def _llama_plan(model: Any, group: Any) -> None:
    config = model.config
    tp = tensor_parallel_size(group)
    divide(config.num_attention_heads, tp, what="parallel.tp vs num_attention_heads")
    divide(config.num_key_value_heads, tp, what="parallel.tp vs num_key_value_heads")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear.from_dense(getattr(attn, name), group=group))
        attn.o_proj = RowParallelLinear.from_dense(attn.o_proj, group=group)
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, ColumnParallelLinear.from_dense(getattr(mlp, name), group=group))
        mlp.down_proj = RowParallelLinear.from_dense(mlp.down_proj, group=group)
    embedding = VocabParallelEmbedding.from_dense(model.model.embed_tokens, group=group)
    model.model.embed_tokens = embedding
    if config.tie_word_embeddings:
        model.lm_head = VocabParallelLMHead.tied_to(embedding)
    else:
        model.lm_head = VocabParallelLMHead.from_dense(model.lm_head, group=group)


def _gpt2_plan(model: Any, group: Any) -> None:
    config = model.config
    tp, rank = tensor_parallel_size(group), tensor_parallel_rank(group)
    heads, hidden = config.n_head, config.n_embd
    head_dim = divide(hidden, heads, what="n_embd vs n_head")
    divide(heads, tp, what="parallel.tp vs num_attention_heads")
    # c_attn's output is [q | k | v], each `heads` heads wide: this rank takes its heads of each.
    qkv_rows = shard_index([heads] * 3, rank=rank, tp=tp, unit=head_dim, what="n_head")
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear.from_dense_weight(  # Conv1D weights are [in, out]
            attn.c_attn.weight.t(), attn.c_attn.bias, group=group, out_index=qkv_rows)
        attn.c_proj = RowParallelLinear.from_dense_weight(attn.c_proj.weight.t(), attn.c_proj.bias, group=group)
        attn.split_size = hidden // tp  # GPT2Attention splits the fused output into q, k, v by this
        attn.embed_dim, attn.num_heads = hidden // tp, heads // tp
        mlp.c_fc = ColumnParallelLinear.from_dense_weight(mlp.c_fc.weight.t(), mlp.c_fc.bias, group=group)
        mlp.c_proj = RowParallelLinear.from_dense_weight(mlp.c_proj.weight.t(), mlp.c_proj.bias, group=group)
        for layer in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj):
            layer.weight.dense_transposed = True  # transformers stores a Conv1D weight as [in, out]
    embedding = VocabParallelEmbedding.from_dense(model.transformer.wte, group=group)
    model.transformer.wte = embedding
    model.lm_head = VocabParallelLMHead.tied_to(embedding)


PLANS = {"llama": _llama_plan, "gpt2": _gpt2_plan}  # family (models/families.py) -> plan


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
        if labels is None and shift_labels is None:
            return TensorParallelOutput(loss=None, logits=self.model.lm_head(hidden))
        if self.loss_chunk_tokens:
            return TensorParallelOutput(loss=chunked_causal_lm_loss(
                self.model.lm_head, hidden, labels, shifted=shift_labels, chunk_tokens=self.loss_chunk_tokens,
                token_loss=token_loss, over=num_items_in_batch), logits=None)
        logits = self.model.lm_head(hidden)
        return TensorParallelOutput(loss=causal_lm_loss(logits, labels, shifted=shift_labels, token_loss=token_loss,
                                                        over=num_items_in_batch), logits=logits)


def shard_model(model: Any, *, group: Any) -> Any:
    """Swap `model`'s dense layers for this rank's shards, in place (the plan above); returns it.

    The result keeps transformers' module tree and names, so the pipeline can cut it into
    stages (tp x pp); `TensorParallelCausalLM` wraps it for the loss instead (tp x dp).
    """
    plan = PLANS.get(family_of(model.config.model_type))
    if plan is None:
        raise UserError("parallel.tp", tensor_parallel_size(group), f"has no plan for {model.config.model_type!r}",
                        f"use tp=1 (ZeRO) or a supported architecture: {', '.join(SUPPORTED)}")
    plan(model, group)
    return model


# --- merging shards back (dsf export) ------------------------------------------------------------

def shard_layouts(config: Any, tp: int) -> list[dict[str, tuple[int, torch.Tensor, bool]]]:
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
    filled = torch.zeros(size, dtype=torch.bool)
    for layout, part in zip(layouts, parts):
        index = layout[name][1]
        kept = (index >= 0).nonzero().flatten()
        dense.index_copy_(dim, index[kept], part.index_select(dim, kept))
        filled[index[kept]] = True
    if not filled.all():
        raise ValueError(f"{name}: the shards cover {int(filled.sum())} of {size} slices")
    return dense.t().contiguous() if transposed else dense
