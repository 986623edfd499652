"""Facts about what the run does that the planner must count the same way: one copy of each.

    ZERO_REDUCE_BUCKET                   # elements; dsconfig.py writes it, planner/memory.py counts it
    Knobs.of(run.parallel.zero_knobs)    # the ZeRO knobs a run writes: its own, else these defaults
    padded_vocab(50257, tp=2)            # 50432: rows the vocab-parallel embedding holds, all ranks
    partition_balanced([5, 1, 1, 5], 2)  # [0, 2, 4]: DeepSpeed's pipeline stage boundaries

Pure (no torch, no torch.distributed, no disk), so the planner imports it. Each fact has one
home here and its users import it: the ZeRO settings `dsconfig.py` writes into the DeepSpeed JSON
and `planner/memory.py` turns into buffer bytes; the vocabulary padding of
`parallel/tensor.py`'s VocabParallelEmbedding / LMHead and the planner's embedding and logits
rows; and the stage boundaries of `models/pipeline.py` (which rank materialises which layers)
and the planner's stage shapes. `partition_balanced` is DeepSpeed's own algorithm
(deepspeed.runtime.utils.partition_balanced, which PipelineModule runs), rewritten vectorised so
planning thousands of layouts stays fast; tests/unit/test_planner_facts.py pins it to
DeepSpeed's output on random and real weights.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

# --- ZeRO settings dsf writes into the DeepSpeed JSON (elements) ------------------------------------
ZERO_REDUCE_BUCKET = 50_000_000          # zero_optimization.reduce_bucket_size (stages 1-3)
ZERO_ALLGATHER_BUCKET = 50_000_000       # zero_optimization.allgather_bucket_size (stages 1-2)
ZERO3_PREFETCH_BUCKET = 50_000_000       # zero_optimization.stage3_prefetch_bucket_size
ZERO3_PERSISTENCE_THRESHOLD = 100_000    # stage3_param_persistence_threshold: smaller tensors stay whole
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters (written only when the plan
#                                           chooses one: it caps how far ahead ZeRO-3 prefetches)
STAGE0_ALLREDUCE_BUCKET = 500_000_000    # DeepSpeed's default allreduce_bucket_size (stage 0; not written)


# --- gradient accumulation dtype ---------------------------------------------------------------

def grad_accum_dtype(precision: str, zero_stage: int) -> str | None:
    """DeepSpeed's data_types.grad_accum_dtype dsconfig.py writes (None: not written, DeepSpeed's
    default, the model's dtype), and the gradient bytes planner/memory.py counts for it.

        grad_accum_dtype("bf16", 1)   # "fp32": bf16 gradients accumulate across micro-batches in fp32
        grad_accum_dtype("bf16", 0)   # None: DeepSpeed 0.19 refuses bf16 + fp32 accumulation without ZeRO

    bf16 runs at ZeRO 1-3 accumulate in fp32; what DeepSpeed 0.19.8 allocates for it (read in its
    engine, bf16_optimizer.py and zero/stage*.py; deepspeed.initialize accepts each stage):
    stage 1 (no offload): BF16_Optimizer, a whole-model fp32 gradient buffer beside the bf16 grads,
    all-reduced in fp32; stage 1 with offload: DeepSpeedZeroOptimizer's per-parameter fp32
    `grad_accum` (whole); stage 2: the bf16 gradient partition plus an fp32 copy of it (the compact
    partition buffer; reduced in bf16); stage 3: the gradient partition itself in fp32 (reduced in
    bf16, accumulated in fp32). Stage 0 is left at DeepSpeed's default: engine.py's
    _do_optimizer_sanity_check raises NotImplementedError("unsupported mix of model_dtype=bfloat16
    and grad_accum_dtype=float32") without ZeRO (pipeline or not). fp32 and fp16 runs: not written."""
    return "fp32" if precision == "bf16" and zero_stage >= 1 else None


# --- the chunked loss (models/loss.py) -----------------------------------------------------------
LOSS_CHUNK_LOGITS = 2**26  # fp32 logits elements of one loss chunk (256 MiB): the chunk's tokens x vocab rows
LOSS_CHUNK_MULTIPLE = 512  # a default chunk's tokens are a multiple of this: the head's matmul M stays tile-aligned


def loss_chunk_tokens(vocab_rows: int, *, chunk_tokens: int | None = None) -> int:
    """Tokens per loss chunk for a head of `vocab_rows` rows on this rank (train.loss_chunk_tokens
    when given, as given): as many as keep one chunk's fp32 logits to LOSS_CHUNK_LOGITS elements,
    rounded down to a multiple of LOSS_CHUNK_MULTIPLE (512), at least 512: whole 128/256-row tiles
    for the GPU's matmul (523 at a 128k vocabulary would leave an 11-row tail in every chunk)."""
    fit = LOSS_CHUNK_LOGITS // max(vocab_rows, 1)
    return chunk_tokens or max(LOSS_CHUNK_MULTIPLE, fit // LOSS_CHUNK_MULTIPLE * LOSS_CHUNK_MULTIPLE)


def loss_is_chunked(setting: bool | str, *, tokens: int, vocab_rows: int, chunk_tokens: int | None = None) -> bool:
    """Whether a micro-batch of `tokens` tokens computes its loss in chunks (train.chunked_loss):
    true / false as set; auto when its tokens span more than one chunk."""
    if setting == "auto":
        return tokens > loss_chunk_tokens(vocab_rows, chunk_tokens=chunk_tokens)
    return bool(setting)


def loss_chunking(setting: bool | str, *, vocab: int, tp: int, pp: int, cp: int, micro_batch: int, seq_len: int,
                  chunk_tokens: int | None = None) -> int | None:
    """Tokens per chunk of a rank's causal LM loss, or None for the whole logits: the one decision
    the training loop makes and the planner counts (train.chunked_loss / loss_chunk_tokens).

        loss_chunking("auto", vocab=128256, tp=1, pp=1, cp=1, micro_batch=4, seq_len=2048)  # 512

    With a pipeline the last stage gets its logits from its head layer and keeps the whole logits
    (true is refused before the run starts: models/loss.py check_chunked_loss_layout); else the
    rank's micro_batch x seq_len / cp tokens against its padded_vocab / tp vocabulary rows, at
    most the micro-batch's tokens per chunk (never more tokens than there are)."""
    if pp > 1:
        return None
    rows = padded_vocab(vocab, tp=tp) // tp
    tokens = micro_batch * seq_len // cp
    if not loss_is_chunked(setting, tokens=tokens, vocab_rows=rows, chunk_tokens=chunk_tokens):
        return None
    return min(tokens, loss_chunk_tokens(rows, chunk_tokens=chunk_tokens))


# --- vocabulary padding --------------------------------------------------------------------------

def sequence_parallel_auto(*, tp: int, cp: int, seq_len: int, experts: int = 0) -> bool:
    """parallel.sequence_parallel=auto: on with tp > 1 where tp x cp divides the sequence, for a dense
    model (a mixture of experts' blocks, left whole by the tp plans, would route a slice of the
    tokens: models/tensor_parallel.sequence_parallel_problem). The planner counts what the run does."""
    return tp > 1 and seq_len % (tp * cp) == 0 and not experts


VOCAB_MULTIPLE = 128  # Megatron's make_vocab_size_divisible_by: each rank's vocab slice a multiple of 128 rows


def padded_vocab(num_embeddings: int, *, tp: int, multiple: int | None = None) -> int:
    """Rows of the vocab-parallel embedding / head over all tensor ranks: `num_embeddings` padded
    with zero rows to a multiple of `multiple` (default VOCAB_MULTIPLE) x tp at tp > 1, so each
    rank's slice of the logits is a whole number of GEMM tiles (Megatron's rule: 50257 -> 50432 at
    tp 2); each rank holds this / tp of them. The padding never reaches the loss, and `dsf export`
    drops it."""
    if tp == 1:
        return num_embeddings
    step = (multiple or VOCAB_MULTIPLE) * tp
    return -(-num_embeddings // step) * step


@dataclass(frozen=True)
class Knobs:
    """DeepSpeed's ZeRO settings that trade memory for fewer, larger or earlier collectives, in
    elements (the run config's parallel.zero_knobs; planner/knobs.py chooses them from the memory a
    plan leaves free). The one source of dsf's defaults: the values dsconfig writes without a choice
    (Knobs.of a run's zero_knobs) and the planner counts.

        Knobs()                                          # dsf's defaults
        Knobs(persistence_threshold=4_194_304)           # tensors <= 4.2M elements stay whole
        Knobs.of(run.parallel.zero_knobs)                # a run config's, None -> the default
    """

    persistence_threshold: int = ZERO3_PERSISTENCE_THRESHOLD  # ZeRO-3: tensors this small are never partitioned
    prefetch_bucket: int = ZERO3_PREFETCH_BUCKET  # ZeRO-3: elements gathered ahead of the module that needs them
    max_live_parameters: int = ZERO3_MAX_LIVE_PARAMETERS  # ZeRO-3: gathered elements beyond which prefetch stops
    reduce_bucket: int = ZERO_REDUCE_BUCKET  # ZeRO 1-3: gradient elements per reduce(-scatter)
    allgather_bucket: int = ZERO_ALLGATHER_BUCKET  # ZeRO 1-2: updated-weight elements per all-gather

    @classmethod
    def of(cls, spec: object) -> "Knobs":
        """From a config.ZeroKnobsSpec (or anything with its fields); a field left None keeps the default."""
        default = cls()
        fields = {name: getattr(spec, name, None) if getattr(spec, name, None) is not None
                  else getattr(default, name) for name in cls.__dataclass_fields__}
        return cls(**cast("dict[str, int]", fields))  # None was replaced by the default

    def changed(self, zero_stage: int) -> dict[str, int]:
        """The knobs that differ from the defaults and that `zero_stage` uses, as parallel.zero_knobs
        fields: what a run config needs to say."""
        used = {0: (), 1: ("reduce_bucket", "allgather_bucket"), 2: ("reduce_bucket", "allgather_bucket"),
                3: ("persistence_threshold", "prefetch_bucket", "max_live_parameters", "reduce_bucket")}[zero_stage]
        default = Knobs()
        return {name: getattr(self, name) for name in used if getattr(self, name) != getattr(default, name)}


DEFAULT_KNOBS = Knobs()


# --- pipeline stage boundaries ---------------------------------------------------------------------

def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's partition_uniform: `num_parts` + 1 boundaries, the first parts one larger."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: list[int] | list[float], num_parts: int) -> list[int]:
    """DeepSpeed's partition_balanced (deepspeed.runtime.utils, what PipelineModule runs for
    partition_method 'parameters' and 'type:...'): the linear-partition dynamic programme that
    minimises the heaviest part minus the lightest, ties going to the last split point, as
    DeepSpeed breaks them. Same result; the inner loop over split points is a numpy row."""
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    return balanced_partitions(weights, num_parts)(num_parts)


def balanced_partitions(weights: list[int] | list[float], max_parts: int) -> Callable[[int], list[int]]:
    """partition_balanced's table, computed once for every part count up to `max_parts` (< the
    weights): the returned function gives the bounds for one of them. Column j of the programme
    depends only on the columns before it, so one table serves every smaller count (the planner
    asks for each pipeline size of one model).

        bounds = balanced_partitions(weights, 64)
        bounds(8) == partition_balanced(weights, 8)
    """
    n, m = len(weights), max_parts
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(np.asarray(weights, dtype=np.float64))
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=np.int64)
    dp_max[0, 0] = 0.0  # (DeepSpeed leaves dp_min[0, 0] at inf; so does this)
    rows = np.arange(n + 1)
    for j in range(1, m + 1):
        i = rows[j:, None]                      # prefixes with at least j items
        k = rows[None, :n]                      # the last part is items k..i-1
        seg = prefix[i] - prefix[k]
        hi = np.maximum(dp_max[:n, j - 1][None, :], seg)
        lo = np.minimum(dp_min[:n, j - 1][None, :], seg)
        cost = np.where(k < i, hi - lo, np.nan)  # k >= i: not a split of this prefix
        # DeepSpeed keeps the last k whose cost is <= every earlier one: the last minimum
        # (a cost of inf only where nothing finite exists, which j <= i rules out).
        best = np.nanmin(cost, axis=1)
        last = n - 1 - np.argmax((cost == best[:, None])[:, ::-1], axis=1)
        position[j:, j] = last
        dp_max[j:, j] = hi[np.arange(len(last)), last]
        dp_min[j:, j] = lo[np.arange(len(last)), last]

    def bounds(num_parts: int) -> list[int]:
        parts = [n]
        for j in range(num_parts, 0, -1):
            parts.append(int(position[parts[-1], j]))
        return parts[::-1]
    return bounds


__all__ = ["grad_accum_dtype", "ZERO_REDUCE_BUCKET", "ZERO_ALLGATHER_BUCKET", "ZERO3_PREFETCH_BUCKET", "ZERO3_PERSISTENCE_THRESHOLD",
           "ZERO3_MAX_LIVE_PARAMETERS", "STAGE0_ALLREDUCE_BUCKET", "padded_vocab", "partition_uniform", "partition_balanced",
           "balanced_partitions", "Knobs", "DEFAULT_KNOBS"]
