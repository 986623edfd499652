"""The causal LM loss, in one place: label shifting, the ignore index, the per-token loss (plain,
vocab-parallel, chunked) and the reduction. Every head of dsf calls it: a transformers model's
chunked forward (`use_chunked_loss`), the tensor-parallel head (models/tensor_parallel.py), the
pipeline's last stage (models/pipeline.py) and a context-parallel shard (models/sequence_loss.py).

    loss = causal_lm_loss(logits, labels)          # == model(input_ids, labels=labels).loss: token t
    #    predicts label t+1, mean over the labels != IGNORE_INDEX (transformers' loss), fp32
    loss = causal_lm_loss(shard_logits, shifted=shard_targets, over=predicted)  # a sum over a given count:
    #    a context-parallel shard's share of its micro-batch's mean
    loss = causal_lm_loss(logits_slice, labels, token_loss=vocab_parallel_token_loss(group=g, vocab_size=V))
    loss = chunked_causal_lm_loss(processed_head(model), hidden, labels, chunk_tokens=512)  # same, no whole logits
    use_chunked_loss(model, chunk_tokens=512)   # from now on model(input_ids, labels=...).loss is chunked

The chunked loss: the final hidden states are cut into chunks of `chunk_tokens` tokens (batch and
sequence flattened). Each chunk runs the head and the per-token loss under `torch.utils.checkpoint`
(non-reentrant), which keeps only the chunk's hidden states and labels for backward: in the
forward each chunk's logits are freed once its loss is summed, and in the backward each chunk's
logits are recomputed, differentiated and freed before the next. One chunk's fp32 logits and
their gradient exist at a time (chunk_tokens x vocab x 8 bytes), instead of the micro-batch's
logits, their fp32 copy and its gradient. The price is one more head matmul forward per token
(the recompute): 2 h V flops per token on top of the 6 h V the head costs.

The head is the model's head followed by what the model's forward does to its logits after it
(Gemma's softcapping, Granite's and Cohere's scaling: models/logits.py's `processed_head`, found
from the model's own forward), so the chunked loss is the model's. The head is called as a
module, once per chunk: ZeRO-3 gathers its weight through its own hooks (and prefetches it for
the next chunk), a tensor-parallel head emits its vocab slice into
`token_loss` (parallel/tensor.py's vocab_parallel_cross_entropy), and all chunks' gradients reach
the weight in one accumulation (autograd sums a leaf's gradients before its hook runs), so
DeepSpeed reduces it once.

Why not DeepSpeed's `TiledFusedLogitsLoss` (runtime/sequence_parallel/ulysses_sp.py): it runs
each chunk's backward inside the forward with an incoming gradient fixed at 1 (or 1 / shards),
and scales only the hidden states' gradient by the gradient that really arrives. The head's
weight gradient then ignores every factor applied after the loss: DeepSpeed's own
`engine.backward` divides the loss by gradient_accumulation_steps and fp16 multiplies it by the
loss scale, so with grad_accum > 1 the head's gradient comes out grad_accum times too large. The
recompute costs a little compute and is right under every factor.
"""
from __future__ import annotations

import types
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dsframework.layout import chunked_loss_problem
from dsframework.models.logits import logit_postprocess, processed_head, router_loss
from dsframework.parallel.tensor import vocab_parallel_cross_entropy

IGNORE_INDEX = -100  # transformers' label for "no loss here"; data/store.py writes it, the losses skip it

TokenLoss = Callable[..., torch.Tensor]  # (logits, targets, reduction="none" | "sum") -> fp32 loss per token, or summed


# --- labels -------------------------------------------------------------------------------------

def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts: the next token's, IGNORE_INDEX at the end (as transformers does)."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def trained_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many of `targets` (labels already shifted) train a prediction: those != IGNORE_INDEX."""
    return (targets != IGNORE_INDEX).sum()


def _targets(labels: torch.Tensor | None, shifted: torch.Tensor | None) -> torch.Tensor:
    """The targets of each position: `labels` shifted, or `shifted` as given (a context-parallel
    shard's, whose last token predicts the next shard's first)."""
    if shifted is not None:
        return shifted
    assert labels is not None, "a causal LM loss needs labels or shifted targets"
    return shift_labels(labels)


# --- the per-token loss -----------------------------------------------------------------------------

def plain_token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Cross entropy per token in fp32 (transformers upcasts the logits the same way); 0 where
    the target is IGNORE_INDEX. `logits` [tokens, vocab], `targets` [tokens]. reduction="sum"
    sums as torch's kernel does, so the mean is transformers' to the last bit."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def vocab_parallel_token_loss(*, group: Any, vocab_size: int) -> TokenLoss:
    """The per-token loss from this rank's vocab slice of the logits (parallel/tensor.py's
    vocab_parallel_cross_entropy over `group`): the full logits are never gathered."""
    per_token = partial(vocab_parallel_cross_entropy, group=group, vocab_size=vocab_size, ignore_index=IGNORE_INDEX)

    def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        losses = per_token(logits, targets)
        return losses.sum() if reduction == "sum" else losses

    return token_loss


# --- the reduction ------------------------------------------------------------------------------

def reduce_loss(total: torch.Tensor, targets: torch.Tensor, *, over: Any = None) -> torch.Tensor:
    """The summed per-token loss `total` as the loss to report or backpropagate: the mean over the
    trained `targets` (at least 1), or `total / over` for a count given from outside (a context
    group's whole sequence, a supervised global batch's trained tokens)."""
    if over is None:
        over = trained_tokens(targets).clamp(min=1)
    return total / (over.to(total.device) if torch.is_tensor(over) else over)


# --- the losses ---------------------------------------------------------------------------------

def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None = None, *, shifted: torch.Tensor | None = None,
                   token_loss: TokenLoss = plain_token_loss, over: Any = None) -> torch.Tensor:
    """transformers' causal LM loss from whole logits [..., vocab (or this rank's slice)]: token t
    predicts label t+1 (or `shifted`'s target t), reduced by `reduce_loss`."""
    targets = _targets(labels, shifted).to(logits.device)
    total = token_loss(logits.flatten(0, -2), targets.flatten(), reduction="sum")
    return reduce_loss(total, targets, over=over)


def chunked_loss_sum(head: Any, hidden: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int,
                     token_loss: TokenLoss = plain_token_loss) -> torch.Tensor:
    """Sum over tokens of token_loss(head(hidden), targets), `chunk_tokens` tokens at a time.
    `hidden` [..., h] and `targets` [...] (already shifted) agree on every dimension but the last."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

    def chunk_sum(chunk_hidden: torch.Tensor, chunk_targets: torch.Tensor) -> torch.Tensor:
        return token_loss(head(chunk_hidden), chunk_targets).sum()

    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_targets.numel(), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(chunk_sum, flat_hidden[part], flat_targets[part], use_reentrant=False)
        else:  # evaluation: nothing is kept for a backward anyway
            total = total + chunk_sum(flat_hidden[part], flat_targets[part])
    return total


def chunked_causal_lm_loss(head: Any, hidden: torch.Tensor, labels: torch.Tensor | None = None, *, chunk_tokens: int,
                           token_loss: TokenLoss = plain_token_loss,
                           shifted: torch.Tensor | None = None, over: Any = None) -> torch.Tensor:
    """`causal_lm_loss(head(hidden), ...)` without the whole logits: the head and the per-token loss
    run `chunk_tokens` tokens at a time (`chunked_loss_sum`)."""
    targets = _targets(labels, shifted).to(hidden.device)
    total = chunked_loss_sum(head, hidden, targets, chunk_tokens=chunk_tokens, token_loss=token_loss)
    return reduce_loss(total, targets, over=over)


def check_chunked_loss_layout(setting: bool | str, *, pp: int) -> None:
    """UserError before the run starts when `chunked_loss_problem` has one."""
    problem = chunked_loss_problem(setting, pp=pp)
    if problem is not None:
        raise problem


def causal_lm_of(model: Any) -> Any:
    """The transformers causal LM inside `model` (a peft model's base model; else `model`)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def use_chunked_loss(model: Any, *, chunk_tokens: int) -> Any:
    """Make `model(input_ids, labels=...)` (or `shift_labels=...`) compute its loss in chunks;
    returns `model`. A dsf TensorParallelCausalLM chunks its vocab-parallel loss; a transformers
    causal LM (or the one inside a peft model) gets a forward that runs its decoder
    (`base_model`) and `chunked_causal_lm_loss` over its output embeddings followed by what its
    forward does to the logits (models/logits.py, probed here: a model dsf cannot follow is refused
    before it trains), plus a mixture of experts' load-balancing loss as its forward adds it
    (models/logits.py `router_loss`): the state dict, the hooks and every other call stay as they
    were. Without labels the model's own forward runs.
    `num_items_in_batch` (transformers' name) divides the summed loss instead of the mean's count."""
    if hasattr(model, "loss_chunk_tokens"):  # a dsf TensorParallelCausalLM: it chunks its own loss
        model.loss_chunk_tokens = chunk_tokens
        return model
    lm = causal_lm_of(model)
    logit_postprocess(lm)  # the probe: a UserError now rather than at the first step
    own_forward = lm.forward

    def forward(self: Any, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None and shift_labels is None:
            return own_forward(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        over = kwargs.pop("num_items_in_batch", None)
        decoded = self.base_model(input_ids=input_ids, **{"use_cache": False, **kwargs})
        loss = chunked_causal_lm_loss(processed_head(self), decoded.last_hidden_state, labels, shifted=shift_labels,
                                      chunk_tokens=chunk_tokens, over=over)
        extra = router_loss(self, decoded, attention_mask=kwargs.get("attention_mask"))
        return CausalLMOutputWithPast(loss=loss if extra is None else loss + extra.to(loss.device))

    lm.forward = types.MethodType(forward, lm)
    return model
