"""Step time of a layout: compute at a fraction of peak, plus the communication left exposed.

    t = step_time(desc, layout, job, cluster)
    t.total, t.compute, t.tp_comm, t.cp_comm, t.dp_comm, t.pp_bubble, t.pp_comm, t.offload
    tokens_per_s = job.global_batch * job.seq_len / t.total

Every constant and overlap assumption is named below, in one place. Ring collectives over n ranks
move 2 (n-1)/n of the buffer per rank for an all-reduce and (n-1)/n for a reduce-scatter or an
all-gather, plus a fixed latency; an all-to-all moves (n-1)/n of its buffer; a group that spans
nodes runs at the inter-node bandwidth. The grid's order is tensor (innermost), context, data,
pipe, so a group of tensor ranks sits on one node first, then the context group (tp x cp ranks).
Context parallelism (Ulysses) does four all-to-alls per layer forward (q, k, v in, the output
back) and four backward, none overlapped; ZeRO-3 with hpZ gathers the forward's weights across
the whole ZeRO group and the backward's from the secondary partition inside the hpZ group.
ZeRO's knobs (Layout.knobs, chosen by planner/knobs.py) are priced as DeepSpeed uses them: a
gradient reduce or weight all-gather runs in ceil(elements / bucket) collectives, each paying the
latency; ZeRO-3 never gathers its persistent tensors (fewer bytes, fewer fetches); and its
prefetch hides the gathers behind compute in proportion to how much of the next layer the prefetch
bucket covers (ZERO3_GATHER_OVERLAP when it covers a whole layer).
Fixed costs (operator dispatch, ZeRO-3's module hooks and fetches) come from the cluster
profile; on a GPU the host runs ahead of the device, so only what exceeds the compute shows.
Checked against measured tokens/s of every layout on CPU ranks by bench/plan_vs_measured.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dsframework.planner.cluster import Cluster
from dsframework.planner.memory import Workload, Layout, StageShape, layer_gathered, stage_shapes, ulysses_kv_heads
from dsframework.planner.model import ModelDesc
from dsframework.runtime_facts import STAGE0_ALLREDUCE_BUCKET

# (Achieved / peak FLOP/s is the cluster's `matmul_efficiency`: a preset's default, or measured.)
REPLICATED_FRACTION = 0.15  # of a layer's time that tensor parallelism does not split (norms,
#                             residual adds, rotary, the loss: every tensor rank does all of it)
RECOMPUTE_FACTOR = 4 / 3  # full checkpointing runs the forward twice: 4 passes instead of 3
DP_OVERLAP = 0.5  # share of ZeRO's gradient reduction hidden behind the backward pass
ZERO3_GATHER_OVERLAP = 0.5  # share of ZeRO-3's parameter all-gathers hidden by prefetching a whole layer
TP_OVERLAP = 0.0  # Megatron TP all-reduces sit on the critical path
CP_OVERLAP = 0.0  # Ulysses' all-to-alls too: attention waits for them, the next linear for the result
EP_OVERLAP = 0.0  # and expert parallelism's: the experts wait for their tokens, the residual for the result
CPU_ADAM_PARAMS_PER_S = 1.0e9  # DeepSpeedCPUAdam, parameters updated per second per rank
OPS_PER_LAYER = 90  # operator calls of one decoder layer's forward + backward, one micro-batch
OPS_PER_STEP = 200  # the engine's per-step calls: clipping, optimizer, schedule, bookkeeping
ZERO3_OPS_PER_FETCH = 20  # ZeRO-3's hook bookkeeping around each parameter fetch or release
ULYSSES_OPS_PER_LAYER = 40  # Ulysses' rearranges, contiguous copies and all-to-all calls, one layer
ZERO3_OPS_PER_MODULE_PASS = 150  # ZeRO-3's Python hooks on every module, forward and backward
# (DeepSpeed's parameter coordinator; what makes ZeRO-3 slow for small models)
# The fixed cost of one operator call and of one small collective come from the cluster
# profile (`op_overhead_s`, `collective_latency_s`): `dsf calibrate` measures both.


@dataclass(frozen=True)
class StepTime:
    compute: float
    tp_comm: float
    dp_comm: float
    pp_bubble: float
    pp_comm: float
    offload: float
    overhead: float = 0.0  # operator calls and ZeRO-3 fetch bookkeeping, independent of size
    cp_comm: float = 0.0  # Ulysses' all-to-alls
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (tokens to their experts' ranks and back)

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.cp_comm + self.dp_comm + self.pp_bubble + self.pp_comm
                + self.offload + self.overhead + self.ep_comm)


def _ring(bytes_: float, ranks: int, bandwidth: float, *, all_reduce: bool, latency: float) -> float:
    if ranks <= 1:
        return 0.0
    factor = 2 * (ranks - 1) / ranks if all_reduce else (ranks - 1) / ranks
    return factor * bytes_ / bandwidth + latency


def _all_to_all(bytes_: float, ranks: int, bandwidth: float, *, latency: float) -> float:
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * bytes_ / bandwidth + latency


def _buckets(elements: float, bucket: int) -> int:
    """Collectives a reduce or all-gather of `elements` runs in with buckets of `bucket` elements."""
    return max(1, math.ceil(elements / max(bucket, 1)))


def _bandwidth(cluster: Cluster, group_span: int) -> float:
    """Ranks `group_span` apart in the grid: within a node if the whole span fits in one."""
    return cluster.intra_node_bandwidth if group_span <= cluster.gpus_per_node else cluster.inter_node_bandwidth


def zero3_gather_overlap(desc: ModelDesc, layout: Layout) -> float:
    """Share of ZeRO-3's all-gathers hidden behind compute: ZERO3_GATHER_OVERLAP scaled by how much
    of the next layer's gathered weights the prefetch covers (all of it: the full share), the prefetch
    being the bucket, or less where max_live_parameters stops it."""
    layer = layer_gathered(desc, tp=layout.dims.tp, threshold=layout.knobs.persistence_threshold)
    if layer == 0:
        return ZERO3_GATHER_OVERLAP
    knobs = layout.knobs
    ahead = min(knobs.prefetch_bucket, max(knobs.max_live_parameters - layer, 0))  # the live limit stops prefetch
    return ZERO3_GATHER_OVERLAP * min(1.0, ahead / layer)


@dataclass(frozen=True)
class _Step:
    """What every part of a step's time reads: the busiest stage, micro-batches, tokens, bytes."""

    busiest: StageShape
    micro_batches: int
    local_tokens: float  # one micro-batch's tokens on a rank (seq_len / cp of each sequence)
    activation_bytes: float  # one micro-batch's hidden states on a rank
    w: int  # parameter bytes
    lat: float  # one collective's latency
    recompute: bool


def step_time(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster) -> StepTime:
    """Seconds per optimizer step (see the module docstring for the model)."""
    dims, w = layout.dims, job.param_bytes
    stages = stage_shapes(desc, dims.tp, dims.pp, layout.knobs.persistence_threshold)
    local_tokens = layout.micro_batch * job.seq_len / dims.cp
    step = _Step(busiest=max(stages, key=lambda s: s.params), micro_batches=layout.grad_accum,
                 local_tokens=local_tokens, activation_bytes=local_tokens * desc.hidden * w, w=w,
                 lat=cluster.collective_latency_s, recompute=layout.activation_checkpointing == "full")
    compute = _compute(desc, layout, job, cluster)
    bubble, pp_comm = _pipeline(layout, cluster, step, compute)
    return StepTime(compute=compute, tp_comm=_tp_comm(layout, cluster, step),
                    dp_comm=_dp_comm(desc, layout, cluster, step), pp_bubble=bubble, pp_comm=pp_comm,
                    offload=_offload(layout, cluster, step), overhead=_overhead(desc, layout, cluster, step, compute),
                    cp_comm=_cp_comm(desc, layout, cluster, step), ep_comm=_ep_comm(desc, layout, cluster, step))


def _compute(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster) -> float:
    """The model's flops on each rank's share of the tokens, at the cluster's matmul efficiency."""
    tokens_per_rank = job.global_batch * job.seq_len / (layout.dims.dp * layout.dims.cp)  # each rank's share
    per_token = desc.flops_per_token(job.seq_len)
    unsplit = desc.unsplit_flops_per_token() if layout.dims.tp > 1 else 0.0  # matrices each tensor rank runs whole
    flops = (per_token - unsplit) * tokens_per_rank / (layout.dims.tp * layout.dims.pp)
    if layout.dims.tp > 1:  # the part every tensor rank repeats in full
        flops *= (1 - REPLICATED_FRACTION) + REPLICATED_FRACTION * layout.dims.tp
    flops += unsplit * tokens_per_rank / layout.dims.pp
    if layout.activation_checkpointing == "full":
        flops *= RECOMPUTE_FACTOR
    return flops / (cluster.flops(job.precision) * cluster.matmul_efficiency)


def _tp_comm(layout: Layout, cluster: Cluster, step: _Step) -> float:
    """Tensor parallel: 2 all-reduces forward, 2 backward per layer and micro-batch (+2 recompute),
    and 4 more for the vocab-parallel embedding and loss."""
    tp_calls = ((4 + 2 * step.recompute) * step.busiest.layers + 4) * step.micro_batches
    return (1 - TP_OVERLAP) * tp_calls * _ring(step.activation_bytes, layout.dims.tp,
                                               _bandwidth(cluster, layout.dims.tp), all_reduce=True,
                                               latency=step.lat)


def _cp_comm(desc: ModelDesc, layout: Layout, cluster: Cluster, step: _Step) -> float:
    """Context parallel (Ulysses): per layer, q, k, v and the output each cross the context group
    once forward (again with recompute) and their gradients once backward."""
    if layout.dims.cp <= 1:
        return 0.0
    dims, lat, recompute = layout.dims, step.lat, step.recompute
    kv = ulysses_kv_heads(desc, tp=dims.tp, cp=dims.cp) * desc.head_dim
    cp_bw = _bandwidth(cluster, dims.tp * dims.cp)
    per_pass = sum(_all_to_all(step.local_tokens * width * step.w, dims.cp, cp_bw, latency=lat)
                   for width in (desc.hidden / dims.tp, kv, kv, desc.hidden / dims.tp))
    forwards = 1 + recompute  # each forward also all-gathers the position ids (small)
    layers = step.busiest.layers
    return (1 - CP_OVERLAP) * ((2 + recompute) * per_pass + forwards * lat) * layers * step.micro_batches


def _ep_comm(desc: ModelDesc, layout: Layout, cluster: Cluster, step: _Step) -> float:
    """Expert parallelism (DeepSpeed AutoEP): per MoE layer, each token's top_k copies go to their
    experts' ranks and come back (two all-to-alls) forward, again with recompute, and their
    gradients twice backward, over the ep group (consecutive ranks: a node's links while ep fits one)."""
    ep = layout.dims.ep
    if ep <= 1:
        return 0.0
    routed_bytes = step.local_tokens * desc.top_k * desc.hidden * step.w
    one = _all_to_all(routed_bytes, ep, _bandwidth(cluster, ep), latency=step.lat)
    return (1 - EP_OVERLAP) * 2 * (2 + step.recompute) * one * step.busiest.layers * step.micro_batches


def _dp_comm(desc: ModelDesc, layout: Layout, cluster: Cluster, step: _Step) -> float:
    """Data parallel: ZeRO's group is data x context; its ranks sit tp apart (tensor ranks are
    innermost), and an hpZ group is zero_hpz consecutive ranks. One latency per bucket: bigger
    buckets, fewer collectives."""
    dims, knobs, busiest, lat, micro_batches = layout.dims, layout.knobs, step.busiest, step.lat, step.micro_batches
    d = dims.zero_ranks
    dp_bw = _bandwidth(cluster, d * dims.tp)
    # with ep, a rank holds 1/ep of the routed experts (whose ZeRO group is d / ep: the same bytes each)
    held = busiest.params - desc.routed_params + desc.routed_params // dims.ep if dims.ep > 1 else busiest.params
    grad_bytes = held * step.w
    reduce_lat = lat * _buckets(held, knobs.reduce_bucket)
    if dims.zero_stage == 0:  # one all-reduce, bucketed behind the backward pass
        reduce = _ring(grad_bytes, d, dp_bw, all_reduce=True, latency=lat * _buckets(held,
                                                                                     STAGE0_ALLREDUCE_BUCKET))
        gather = 0.0
    elif dims.zero_stage in (1, 2):  # gradients reduced to their owners, updated params gathered after
        reduce = _ring(grad_bytes, d, dp_bw, all_reduce=False, latency=reduce_lat)
        if dims.zero_stage == 2:  # reduce-scattered at every micro-batch
            reduce *= micro_batches
        gather = _ring(grad_bytes, d, dp_bw, all_reduce=False,
                       latency=lat * _buckets(held, knobs.allgather_bucket))
    else:  # ZeRO-3: gather the non-persistent parameters for forward and backward of every micro-batch
        reduce = micro_batches * _ring(grad_bytes, d, dp_bw, all_reduce=False, latency=reduce_lat)
        gathered_bytes = (held - busiest.persistent) * step.w  # persistent tensors are never gathered
        forward = _ring(gathered_bytes, d, dp_bw, all_reduce=False, latency=lat)
        if dims.zero_hpz > 1:  # backward's from the secondary partition, inside the hpZ group
            backward = _ring(gathered_bytes, dims.zero_hpz, _bandwidth(cluster, dims.zero_hpz),
                             all_reduce=False, latency=lat)
        else:
            backward = forward
        gather = (1 - zero3_gather_overlap(desc, layout)) * micro_batches * (forward + backward)
    return (1 - DP_OVERLAP) * reduce + gather


def _pipeline(layout: Layout, cluster: Cluster, step: _Step, compute: float) -> tuple[float, float]:
    """(bubble, send/receive): (p - 1) idle micro-batch slots of the 1F1B schedule, and activations
    sent across stages."""
    dims = layout.dims
    bubble = compute * (dims.pp - 1) / step.micro_batches if dims.pp > 1 else 0.0
    cores = cluster.cores_per_node  # set for CPU ranks only (cluster.is_cpu)
    if cores is not None and cluster.gpus_per_node > cores:
        # CPU ranks sharing cores: in the bubble the busy ranks get the idle ones' share.
        bubble /= cluster.gpus_per_node / cores
    pp_comm = 0.0
    if dims.pp > 1:
        pp_bw = _bandwidth(cluster, dims.tp * dims.dp * 2)
        pp_comm = 2 * step.micro_batches * (step.activation_bytes / dims.tp / pp_bw + step.lat)
    return bubble, pp_comm


def _offload(layout: Layout, cluster: Cluster, step: _Step) -> float:
    """The optimizer step on the CPU, gradients down and parameters up over PCIe."""
    offload = 0.0
    partition = step.busiest.params / layout.dims.zero_ranks
    if layout.offload_optimizer:
        offload += partition / CPU_ADAM_PARAMS_PER_S + 2 * partition * 4 / cluster.host_to_device_bandwidth
    if layout.offload_param:
        offload += 2 * step.micro_batches * partition * step.w / cluster.host_to_device_bandwidth
    return offload


def _overhead(desc: ModelDesc, layout: Layout, cluster: Cluster, step: _Step, compute: float) -> float:
    """Fixed costs: every operator call of every layer and micro-batch; under ZeRO-3 each layer's
    non-persistent tensors are fetched (a small all-gather and its hooks) forward and backward."""
    dims, layers, micro_batches = layout.dims, step.busiest.layers, step.micro_batches
    passes = 1 + (layout.activation_checkpointing == "full") / 3
    calls = OPS_PER_LAYER * passes * layers * micro_batches + OPS_PER_STEP
    overhead = calls * cluster.op_overhead_s
    if dims.zero_stage == 3:  # hooks on every module with parameters (+ the layer itself)
        modules = len(desc.layer_tensors) + 1
        overhead += (2 * modules * layers * micro_batches * ZERO3_OPS_PER_MODULE_PASS
                     * cluster.op_overhead_s)
    if dims.zero_stage == 3 and dims.zero_ranks > 1:
        threshold = layout.knobs.persistence_threshold
        fetched = sum(1 for n in desc.shares(dims.tp).layer if n > threshold)
        fetches = 2 * fetched * layers * micro_batches
        overhead += fetches * (step.lat + ZERO3_OPS_PER_FETCH * cluster.op_overhead_s)
    if dims.cp > 1:  # Ulysses' reshapes and copies around its 8 all-to-alls (and the position gather)
        overhead += ULYSSES_OPS_PER_LAYER * passes * layers * micro_batches * cluster.op_overhead_s
    if not cluster.is_cpu:  # a GPU: the host issues work while the device computes
        overhead = max(0.0, overhead - compute)
    return overhead
