"""ZeRO's knobs from the memory a plan leaves free: a rule a user can read, and its reasons.

    fit = check_fit(desc, layout, job, cluster)
    choice = choose_knobs(desc, layout, job, free=free_bytes(fit.memory.total, cluster))
    choice.knobs            # Knobs(persistence_threshold=..., prefetch_bucket=..., ...) in elements
    choice.why              # one line per knob: the value and why
    layout = replace(layout, knobs=choice.knobs)   # memory_per_rank / step_time count and price them
    largest_micro_batch(desc, layout, job, cluster, per_replica=16)   # the largest that fits, or None

The rule. `free` is the device memory the plan leaves on its busiest rank within the fit rule
(usable memory / (1 + MEMORY_HEADROOM) - predicted total). The knobs may take KNOB_SHARE of it,
split evenly over the knobs the ZeRO stage uses (the rest stays free, for what the model does not
count). Each knob starts at dsf's default (runtime_facts) and grows while its extra bytes fit its
share; with nothing free, every knob keeps its default:

- persistence threshold (ZeRO-3): the largest tensor size whose tensors, kept whole on every rank
  (w bytes x their elements, beside their partition), fit; persistent tensors are never gathered,
  so each one persisted saves two all-gathers per micro-batch (forward and backward);
- prefetch bucket (ZeRO-3): k whole layers of gathered weights, the largest k <= MAX_PREFETCH_LAYERS
  whose gathered elements fit (a layer covered by the prefetch is gathered while the previous one
  computes), never below the default;
  max live parameters = one layer + the prefetch: the gathered working set the plan counted, which
  DeepSpeed's prefetch then never exceeds;
- reduce bucket (ZeRO 1-3) and all-gather bucket (ZeRO 1-2): as many more elements as fit, in
  whole millions (fewer collectives, each paying the latency once), never beyond what a rank has
  to reduce or gather, nor MAX_BUCKET.

Micro-batch: `dsf plan` searches every micro-batch and keeps the fastest; `dsf config --auto-knobs`
takes `largest_micro_batch`. Pure (no torch, no disk), like the rest of the planner.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from dsframework.planner.cluster import Cluster, GiB
from dsframework.planner.fit import MEMORY_HEADROOM, check_fit, usable_gpu_memory
from dsframework.planner.memory import (DEFAULT_KNOBS, Workload, Knobs, Layout, _padded_vocab_rows, layer_gathered,
                                        stage_shapes, trained, zero3_gathered)
from dsframework.planner.desc import ModelDesc

KNOB_SHARE = 0.5  # of the memory the plan leaves free, what the knobs may take together
ROUND = 1_000_000  # buckets in whole millions of elements: readable, and even (DeepSpeed's all-gather
#                    bucket must be a multiple of 2)
MAX_BUCKET = 1_000_000_000  # elements: beyond this a bucket saves no latency worth its memory
MAX_PREFETCH_LAYERS = 2  # prefetching further ahead hides no more (one layer ahead already overlaps
#                          a layer's compute; the second absorbs jitter): the memory stays free


@dataclass(frozen=True)
class KnobChoice:
    """The chosen knobs, the free bytes they were chosen from, what they add, and why (one line each)."""

    knobs: Knobs
    free: float
    extra: float
    why: tuple[str, ...]


def free_bytes(total: float, cluster: Cluster) -> float:
    """Device bytes a rank whose predicted total is `total` has left within the fit rule."""
    return usable_gpu_memory(cluster) / (1 + MEMORY_HEADROOM) - total


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def _persistence(desc: ModelDesc, layout: Layout, w: int, budget: float) -> tuple[int, float, str]:
    """(threshold, extra bytes, reason): the largest tensor size whose tensors, kept whole, fit."""
    default = DEFAULT_KNOBS.persistence_threshold
    base = stage_shapes(desc, layout.dims.tp, layout.dims.pp, default)[0].persistent
    rows = _padded_vocab_rows(desc.vocab, layout.dims.tp)  # the embedding's and a head's tensor, one tensor rank
    sizes = sorted({rows * desc.hidden, desc.position_params} | set(desc.shares(layout.dims.tp).layer))
    best, extra = default, 0.0
    if layout.dims.zero_ranks > 1:  # (one rank: nothing is partitioned, so nothing to keep whole)
        for size in (s for s in sizes if s > default):
            cost = w * (stage_shapes(desc, layout.dims.tp, layout.dims.pp, size)[0].persistent - base)
            if cost > budget:
                break
            best, extra = size, cost
    per_layer = desc.shares(layout.dims.tp).layer
    gathered = sum(n > best for n in per_layer)
    if best == default:
        return best, 0.0, (f"persistence threshold {best:,} (default: the next tensor size would not fit)"
                           if layout.dims.zero_ranks > 1 else f"persistence threshold {best:,} (default: one rank)")
    return best, extra, (f"persistence threshold {best:,}: tensors of <= {best:,} elements stay whole on every "
                         f"rank (+{_gib(extra)}) and are never gathered; {gathered} of {len(per_layer)} tensors "
                         f"per layer still are")


def _prefetch(desc: ModelDesc, layout: Layout, w: int, budget: float) -> tuple[int, int, float, str]:
    """(prefetch bucket, max live parameters, extra bytes, reason): k whole layers that fit."""
    shape = stage_shapes(desc, layout.dims.tp, layout.dims.pp, layout.knobs.persistence_threshold)[0]
    layer = layer_gathered(desc, tp=layout.dims.tp, threshold=layout.knobs.persistence_threshold)
    default = DEFAULT_KNOBS.prefetch_bucket
    if layer == 0:
        return default, DEFAULT_KNOBS.max_live_parameters, 0.0, "prefetch bucket: default (nothing is gathered)"
    before = zero3_gathered(desc, shape, replace(layout, knobs=replace(layout.knobs, prefetch_bucket=default)))
    ahead = before - 2 * layer  # what the default prefetch already holds
    k = min(int((budget / w + ahead) // layer), shape.layers, MAX_PREFETCH_LAYERS)
    prefetch = max(default, k * layer)
    max_live = layer + prefetch
    after = zero3_gathered(desc, shape, replace(layout, knobs=replace(layout.knobs, prefetch_bucket=prefetch,
                                                                      max_live_parameters=max_live)))
    extra = w * (after - before)
    layers = f"{prefetch / layer:.2g} layers" if prefetch == default else f"{k} layer{'s' * (k != 1)}"
    return prefetch, max_live, extra, (f"prefetch bucket {prefetch:,} ({layers} of {layer:,} gathered elements"
                                       f"{', default' if prefetch == default else ''}, +{_gib(extra)}); max live "
                                       f"parameters {max_live:,} = one layer + the prefetch")


def _bucket(name: str, default: int, elements: float, w: int, budget: float, *, whole: bool) -> tuple[int, float, str]:
    """(bucket, extra bytes, reason): `default` plus the whole millions that fit, up to what there
    is to move (`elements`). `whole`: allocated whole (ZeRO-3's reduce bucket), else min(bucket, elements)."""
    needed = min(-(-int(elements) // ROUND) * ROUND, MAX_BUCKET)  # a larger bucket never fills
    grown = default + int(max(budget, 0) / w // ROUND) * ROUND
    bucket = max(default, min(grown, needed))
    extra = w * ((bucket - default) if whole else (min(bucket, elements) - min(default, elements)))
    runs = lambda b: -(-int(elements) // b)  # noqa: E731 - collectives per pass
    if bucket == default:
        why = (f"default (it already holds all {int(elements):,} elements)" if needed <= default
               else "default (no room for another million elements)")
        return bucket, 0.0, f"{name} {bucket:,}: {why}"
    return bucket, extra, (f"{name} {bucket:,} (+{_gib(extra)}): {runs(bucket)} collective(s) per pass "
                           f"instead of {runs(default)}")


def choose_knobs(desc: ModelDesc, layout: Layout, job: Workload, *, free: float) -> KnobChoice:
    """The knobs of `layout` from `free` bytes (see the module docstring for the rule)."""
    z, w = layout.dims.zero_stage, job.param_bytes
    if z == 0:
        return KnobChoice(DEFAULT_KNOBS, free, 0.0, ("ZeRO-0: no ZeRO buckets to choose",))
    if free <= 0:
        return KnobChoice(DEFAULT_KNOBS, free, 0.0, ("no memory left free: DeepSpeed's defaults",))
    count = 3 if z == 3 else 2
    budget = KNOB_SHARE * free / count
    why = [f"{_gib(free)} free per rank; the knobs may take {KNOB_SHARE:.0%} of it, {_gib(budget)} each"]
    shapes = stage_shapes(desc, layout.dims.tp, layout.dims.pp)
    moved = max(trained(desc, s, job).elements for s in shapes)  # the busiest stage's gradients
    knobs, extra = DEFAULT_KNOBS, 0.0
    if z == 3:
        threshold, cost, line = _persistence(desc, layout, w, budget)
        knobs, extra = replace(knobs, persistence_threshold=threshold), extra + cost
        why.append(line)
        layout = replace(layout, knobs=knobs)
        prefetch, max_live, cost, line = _prefetch(desc, layout, w, budget)
        knobs, extra = replace(knobs, prefetch_bucket=prefetch, max_live_parameters=max_live), extra + cost
        why.append(line)
    reduce, cost, line = _bucket("reduce bucket", DEFAULT_KNOBS.reduce_bucket, moved, w, budget, whole=z == 3)
    knobs, extra = replace(knobs, reduce_bucket=reduce), extra + cost
    why.append(line)
    if z in (1, 2):
        gather, cost, line = _bucket("all-gather bucket", DEFAULT_KNOBS.allgather_bucket, moved, w, budget,
                                     whole=False)
        knobs, extra = replace(knobs, allgather_bucket=gather), extra + cost
        why.append(line)
    return KnobChoice(knobs, free, extra, tuple(why))


def with_knobs(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster):
    """(layout with its chosen knobs, its Fit, the KnobChoice), or the layout as it is (and None)
    when it does not fit at dsf's defaults."""
    fit = check_fit(desc, layout, job, cluster)
    if not fit.fits:
        return layout, fit, None
    choice = choose_knobs(desc, layout, job, free=free_bytes(fit.memory.total, cluster))
    if choice.knobs == layout.knobs:
        return layout, fit, choice
    tuned = replace(layout, knobs=choice.knobs)
    return tuned, check_fit(desc, tuned, job, cluster), choice


def largest_micro_batch(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster, *,
                        per_replica: int) -> int | None:
    """The largest micro-batch dividing `per_replica` (sequences per data-parallel replica and step)
    at which `layout` fits at dsf's default knobs, or None when none does."""
    for micro in sorted((m for m in range(1, per_replica + 1) if per_replica % m == 0), reverse=True):
        trial = replace(layout, micro_batch=micro, grad_accum=per_replica // micro, knobs=DEFAULT_KNOBS)
        if check_fit(desc, trial, job, cluster).fits:
            return micro
    return None


__all__ = ["KnobChoice", "KNOB_SHARE", "choose_knobs", "free_bytes", "largest_micro_batch", "with_knobs"]
