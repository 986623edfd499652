"""The loss of a context-parallel rank (parallel/context.py): its shard of each sequence (tokens,
global positions, labels) and its share of the micro-batch's mean loss.

    shard = SequenceShard.of(input_ids, grid,          # this rank's tokens, positions and labels
                             predicted=SequenceShard.count(host_ids))  # counted before the ids left the host
    loss, mean = sequence_shard_loss(engine, shard, grid=grid, vocab_size=V,
                                     gradient_scale=zero_gradient_scale(cp=2, zero_stage=3))
    engine.backward(loss)                              # `mean`: the micro-batch's loss, every rank

Each rank contributes (sum of its tokens' losses) / (tokens the whole sequence predicts); backward
flows through Ulysses' all-to-alls to the other ranks' activations (parallel/context.py says how
DeepSpeed's reduction then makes the step that of one process seeing the whole sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from deepspeed import comm as dist

from dsframework.models.loss import (
    causal_lm_loss,
    plain_token_loss,
    shift_labels,
    trained_tokens,
    vocab_parallel_token_loss,
)
from dsframework.types import Engine, Grid

if TYPE_CHECKING:
    from dsframework.parallel.context import ContextParallelGrid


@dataclass(frozen=True)
class SequenceShard:
    """This rank's slice of a micro-batch: its tokens, their global positions, and the label of
    each (the next token; models/loss.py's IGNORE_INDEX after the last token of the sequence)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    predicted: int  # tokens with a label in the whole micro-batch, all shards together

    @staticmethod
    def count(input_ids: torch.Tensor) -> int:
        """The `predicted` of whole sequences [batch, seq_len]: count it on the host copy of the ids
        (train/step.py to_device), where reading it back waits for no device."""
        return int(trained_tokens(shift_labels(input_ids)))

    @classmethod
    def of(cls, input_ids: torch.Tensor, grid: Grid, *, predicted: int | None = None) -> "SequenceShard":
        """Cut whole sequences [batch, seq_len] (every rank of a context group holds the same);
        `predicted`: `count` of their host copy (None: counted here, a host sync if they are on a GPU)."""
        cp_grid = cast("ContextParallelGrid", grid)  # cp > 1: build_grid's grid, with a sequence group
        cp, rank = cp_grid.get_sequence_parallel_world_size(), cp_grid.get_sequence_parallel_rank()
        batch, seq_len = input_ids.shape
        local = seq_len // cp
        labels = shift_labels(input_ids)
        positions = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
        mine = slice(rank * local, (rank + 1) * local)
        return cls(input_ids[:, mine].contiguous(), positions[:, mine].contiguous(), labels[:, mine].contiguous(),
                   predicted=int(trained_tokens(labels)) if predicted is None else predicted)


def sequence_shard_loss(engine: Engine, shard: SequenceShard, *, grid: Grid, tensor_group: Any = None,
                        vocab_size: int, gradient_scale: float = 1.0,
                        chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's share of the micro-batch loss, to backpropagate, times `gradient_scale`
    (`zero_gradient_scale`); the micro-batch's mean loss, detached, the same on every rank of the
    context group). The loss is models/loss.py's over the shard's targets (already shifted: its
    last token predicts the next shard's first), summed and divided by the tokens the whole
    micro-batch predicts; `chunked`: the model computes it in chunks (models/loss.py). Either way
    the logits are the model's, processed as its forward processes them after its head (softcapping,
    scaling): whole, they come from that forward (or the tensor-parallel head, which applies
    models/logits.py's post-processing to its vocab slice); chunked, from use_chunked_loss's head
    (models/logits.py's `processed_head`). This function never calls a head itself."""
    if chunked:  # the model's own (chunked) loss, handed the count to divide by as transformers names it
        share = engine(input_ids=shard.input_ids, position_ids=shard.position_ids, shift_labels=shard.labels,
                       num_items_in_batch=shard.predicted).loss
    else:
        logits = engine(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
        token_loss = (plain_token_loss if tensor_group is None  # vocab-parallel: the full vocabulary is never gathered
                      else vocab_parallel_token_loss(group=tensor_group, vocab_size=vocab_size))
        share = causal_lm_loss(logits, shifted=shard.labels, token_loss=token_loss, over=shard.predicted)
    mean = share.detach().clone()
    dist.all_reduce(mean, group=cast("ContextParallelGrid", grid).get_sequence_parallel_group())  # build_grid's, cp > 1
    return share * gradient_scale if gradient_scale != 1.0 else share, mean
