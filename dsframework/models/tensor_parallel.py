"""Tensor parallelism for Hugging Face causal LMs: swap dense layers for their Megatron shards.

    model = build_model(source, config, seed=42)                 # the dense model, every rank
    tp_model = apply_tensor_parallel(model, group=tp_group)      # same function, 1/tp of the weights
    out = tp_model(input_ids=ids, labels=ids)                    # out.loss: vocab-parallel CE

Plans (which module becomes which shard):

| architecture            | column-parallel                      | row-parallel       | vocab-parallel          |
|-------------------------|--------------------------------------|--------------------|-------------------------|
| llama, mistral, qwen2   | q/k/v_proj, gate/up_proj             | o_proj, down_proj  | embed_tokens, lm_head   |
| gpt2                    | c_attn (split per head into q, k, v), c_fc | attn/mlp c_proj | wte, lm_head (tied)  |

Attention heads and key/value heads are split across ranks (grouped-query attention keeps its
heads-per-kv-head ratio). Norms and GPT-2's position embedding stay replicated. The loss never
gathers the full logits: the head emits this rank's vocab slice into `vocab_parallel_cross_entropy`.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from dsframework.errors import UserError, divide
from dsframework.models.families import SUPPORTED, family_of
from dsframework.models.hf import causal_lm_class
from dsframework.models.loss import chunked_causal_lm_loss
from dsframework.parallel.tensor import (
    ColumnParallelLinear,
    LayoutOnlyGroup,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    shard_index,
    tensor_parallel_rank,
    tensor_parallel_size,
    vocab_parallel_cross_entropy,
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


def vocab_parallel_causal_lm_loss(logits_shard: torch.Tensor, labels: torch.Tensor, *, group: Any,
                                  vocab_size: int) -> torch.Tensor:
    """transformers' causal LM loss (token t predicts label t+1, mean over labels != -100) from
    this rank's vocab slice of the logits; the full logits are never gathered."""
    shift_labels = labels[..., 1:].contiguous()
    per_token = vocab_parallel_cross_entropy(logits_shard[..., :-1, :].contiguous(), shift_labels,
                                             group=group, vocab_size=vocab_size)
    return per_token.sum() / (shift_labels != -100).sum().clamp(min=1)


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
                shift_labels: torch.Tensor | None = None, **kwargs: Any):
        hidden = self.model.base_model(input_ids=input_ids, **{"use_cache": False, **kwargs}).last_hidden_state
        if self.loss_chunk_tokens and (labels is not None or shift_labels is not None):
            token_loss = partial(vocab_parallel_cross_entropy, group=self.group, vocab_size=self.config.vocab_size)
            return TensorParallelOutput(loss=chunked_causal_lm_loss(
                self.model.lm_head, hidden, labels, shifted=shift_labels, chunk_tokens=self.loss_chunk_tokens,
                token_loss=token_loss), logits=None)
        logits = self.model.lm_head(hidden)
        if shift_labels is not None:  # (a context-parallel shard's labels, already shifted)
            per_token = vocab_parallel_cross_entropy(logits, shift_labels, group=self.group,
                                                     vocab_size=self.config.vocab_size)
            return TensorParallelOutput(loss=per_token.sum() / (shift_labels != -100).sum().clamp(min=1),
                                        logits=logits)
        loss = None
        if labels is not None:
            loss = vocab_parallel_causal_lm_loss(logits, labels, group=self.group,
                                                 vocab_size=self.config.vocab_size)
        return TensorParallelOutput(loss=loss, logits=logits)


def shard_model(model: Any, *, group: Any) -> Any:
    """Swap `model`'s dense layers for this rank's shards, in place (the plan above); returns it.

    The result keeps transformers' module tree and names, so the pipeline can cut it into
    stages (tp x pp); `apply_tensor_parallel` wraps it for the loss instead (tp x dp).
    """
    plan = PLANS.get(family_of(model.config.model_type))
    if plan is None:
        raise UserError("parallel.tp", tensor_parallel_size(group), f"has no plan for {model.config.model_type!r}",
                        f"use tp=1 (ZeRO) or a supported architecture: {', '.join(SUPPORTED)}")
    plan(model, group)
    return model


def apply_tensor_parallel(model: Any, *, group: Any) -> TensorParallelCausalLM:
    """Shard `model` (a dense transformers causal LM, identical on every rank) across `group`."""
    return TensorParallelCausalLM(shard_model(model, group=group), group=group)


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


def _tied_copies(config: Any) -> set[str]:
    """Parameter names that are a second name of another parameter (tied weights)."""
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    unique = {name for name, _ in model.named_parameters()}
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique


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


def merge_tensor_parallel_shards(shards: Sequence[Mapping[str, torch.Tensor]], config: Any) -> dict[str, torch.Tensor]:
    """The dense state dict (transformers names and shapes) from the tp ranks' state dicts.

        dense = merge_tensor_parallel_shards([rank0_state, rank1_state], config)
        model.load_state_dict(dense)

    Each tensor is merged by `merge_tensor_parallel_tensor` (slices back where `dense_index`
    says; replicated tensors taken from rank 0, equal on every rank). A tied copy (lm_head.weight
    of a tied model) that some rank's state lacks is left out: the embedding carries it, and the
    exported model ties them again.
    """
    layouts = shard_layouts(config, len(shards))
    everywhere = set.intersection(*(set(shard) for shard in shards))
    merged: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        if name not in everywhere:
            if name in _tied_copies(config):
                continue
            raise ValueError(f"{name}: missing from the state of a tensor rank")
        merged[name] = merge_tensor_parallel_tensor(name, [shard[name] for shard in shards], layouts)
    return merged
