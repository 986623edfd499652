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
prefetch hides the gathers behind compute in proportion to how much of the next sub-module's
largest tensor it covers (ZERO3_GATHER_OVERLAP when it covers all of it, as DeepSpeed's always does
while max_live_parameters leaves room).
Fixed costs (operator dispatch, ZeRO-3's module hooks and fetches) come from the cluster
profile; on a GPU the host runs ahead of the device, so only what exceeds the compute shows.
Checked against measured tokens/s of every layout on CPU ranks by bench/plan_vs_measured.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dsframework.planner.cluster import Cluster
from dsframework.planner.memory import (Workload, Layout, StageShape, gathered_tensors, stage_shapes,
                                       ulysses_kv_heads)
from dsframework.planner.desc import ModelDesc
from dsframework.runtime_facts import STAGE0_ALLREDUCE_BUCKET

# Compute. A matmul runs at the cluster's `matmul_efficiency` (a large GEMM's achieved / peak FLOP/s,
# a preset's figure or `dsf calibrate`'s) times what its shape leaves of it: its output is cut into
# `gemm_tile` x `gemm_tile` blocks run `sm_count` at a time (a partial last block, a partial last wave
# do no useful work), and a GEMM moves its operands through HBM, so a thin one is bandwidth-bound
# (roofline). Memory-bound work (norms, residual adds, rotary, the activation function, the loss's
# softmax) moves bytes at `hbm_bandwidth` x HBM_EFFICIENCY. Without sequence parallelism (dsf's
# tensor parallelism today) the norms and residual adds run whole on every tensor rank.
RECOMPUTE_FACTOR = 4 / 3  # full checkpointing runs the forward twice: 4 passes instead of 3
SELECTIVE_RECOMPUTE_FACTOR = 4 / 3  # selective: the attention core's forward twice, the rest once
HBM_EFFICIENCY = 0.8  # elementwise kernels' achieved / datasheet HBM bandwidth (STREAM-like copies: 80-90%)
ATTENTION_EFFICIENCY = 0.7  # flash attention's FLOP/s (forward + backward) over a large GEMM's: FlashAttention-2
#                             reaches 50-73% of A100 peak forward and backward (Dao 2023, Fig. 4-6)
CAUSAL_ATTENTION_WORK = 0.5  # a causal flash kernel skips the masked half of QK^T and AV (CPU's sdpa: not)
NORM_ELEMENTS = 2  # per norm and token: read and write `hidden` elements
RESIDUAL_ELEMENTS = 3  # per residual add: read two, write one
ACTIVATION_ELEMENTS_GATED = 3  # act(gate) * up: read 2 ffn, write 1 ffn (of a tensor rank's share)
ACTIVATION_ELEMENTS = 2  # act(fc): read and write ffn
ROTARY_ELEMENTS = 2  # per query and key element: read and write
BACKWARD_BYTES = 2  # elementwise backward moves about twice the forward's bytes (inputs, grads in and out)
LOSS_BYTES_PER_LOGIT = 16  # the loss over a logit: bf16 write, fp32 softmax read/write, its gradient (~4 x 4 B)
EAGER_SCORE_PASSES = 4  # eager attention's s x s scores, forward: QK^T written, softmax read and written, AV read
DROPOUT_SCORE_PASSES = 2  # ... and attention dropout's mask applied (read, write)
DP_OVERLAP = 0.5  # share of ZeRO's gradient reduction hidden behind the backward pass
ZERO3_GATHER_OVERLAP = 0.5  # share of ZeRO-3's parameter all-gathers hidden by prefetching, one sub-module ahead
TP_OVERLAP = 0.0  # Megatron TP all-reduces sit on the critical path
CP_OVERLAP = 0.0  # Ulysses' all-to-alls too: attention waits for them, the next linear for the result
EP_OVERLAP = 0.0  # and expert parallelism's: the experts wait for their tokens, the residual for the result
CPU_ADAM_PARAMS_PER_S = 1.0e9  # DeepSpeedCPUAdam, parameters updated per second per rank
OPS_PER_LAYER = 90  # operator calls of one decoder layer's forward + backward, one micro-batch
OPS_PER_STEP = 200  # the engine's per-step calls: clipping, optimizer, schedule, bookkeeping
ZERO3_OPS_PER_FETCH = 20  # ZeRO-3's hook bookkeeping around each parameter fetch or release
SELECTIVE_OPS_PER_LAYER = 3  # selective recompute's extra calls a layer: the core's forward, checkpoint's hooks
ULYSSES_OPS_PER_LAYER = 40  # Ulysses' rearranges, contiguous copies and all-to-all calls, one layer
ZERO3_OPS_PER_MODULE_PASS = 150  # ZeRO-3's Python hooks on every module, forward and backward
# (DeepSpeed's parameter coordinator; what makes ZeRO-3 slow for small models)
# The fixed cost of one operator call and of one small collective come from the cluster
# profile (`op_overhead_s`, `collective_latency_s`): `dsf calibrate` measures both.


@dataclass(frozen=True)
class StepTime:
    compute: float  # matmuls and attention
    tp_comm: float
    dp_comm: float
    pp_bubble: float
    pp_comm: float
    offload: float
    overhead: float = 0.0  # operator calls and ZeRO-3 fetch bookkeeping, independent of size
    cp_comm: float = 0.0  # Ulysses' all-to-alls
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (tokens to their experts' ranks and back)
    memory_bound: float = 0.0  # norms, residual adds, rotary, the activation function, the loss: bytes at HBM speed

    @property
    def total(self) -> float:
        return (self.compute + self.memory_bound + self.tp_comm + self.cp_comm + self.dp_comm + self.pp_bubble
                + self.pp_comm + self.offload + self.overhead + self.ep_comm)


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
    of what comes next the prefetch covers. DeepSpeed prefetches at every sub-module's fetch, along
    the recorded trace, tensors until their elements pass the bucket (or the room max_live_parameters
    leaves), and always at least the next one whatever its size (partitioned_param_coordinator's
    `while ... numel_prefetching < max_params_to_prefetch`): the bucket needs to cover the next
    sub-module's largest tensor, not a whole layer, for its gather to run under this one's compute.
    A bucket of 0 prefetches nothing."""
    shares = gathered_tensors(desc, tp=layout.dims.tp, threshold=layout.knobs.persistence_threshold)
    if not shares:
        return ZERO3_GATHER_OVERLAP
    knobs, layer, largest = layout.knobs, sum(shares), max(shares)
    room = max(knobs.max_live_parameters - layer, 0)  # the live limit stops prefetch
    ahead = max(min(knobs.prefetch_bucket, room), largest) if knobs.prefetch_bucket > 0 and room > 0 else 0
    return ZERO3_GATHER_OVERLAP * min(1.0, ahead / largest)


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
    compute, memory_bound = _compute(desc, layout, job, cluster), _memory_bound(desc, layout, job, cluster)
    bubble, pp_comm = _pipeline(layout, cluster, step, compute + memory_bound)
    return StepTime(compute=compute, memory_bound=memory_bound, tp_comm=_tp_comm(layout, cluster, step),
                    dp_comm=_dp_comm(desc, layout, cluster, step, compute + memory_bound), pp_bubble=bubble,
                    pp_comm=pp_comm,
                    offload=_offload(layout, cluster, step), overhead=_overhead(desc, layout, cluster, step, compute),
                    cp_comm=_cp_comm(desc, layout, cluster, step), ep_comm=_ep_comm(desc, layout, cluster, step))


def _compute(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster) -> float:
    """Seconds of matmuls and attention on the busiest rank: the model's FLOPs on its share of the
    tokens, each matmul at `matmul_efficiency` x what its shape leaves (`shape_efficiency`), attention
    at ATTENTION_EFFICIENCY of that (and half its work when causal kernels skip the masked half)."""
    dims = layout.dims
    tokens_per_rank = job.global_batch * job.seq_len / (dims.dp * dims.cp)  # each rank's share
    attention = 3.0 * 4 * desc.layers * job.seq_len * desc.hidden  # of flops_per_token: QK^T and AV
    unsplit = desc.unsplit_flops_per_token() if dims.tp > 1 else 0.0  # matrices each tensor rank runs whole
    matmul = (desc.flops_per_token(job.seq_len) - attention - unsplit) / dims.tp + unsplit
    recompute = RECOMPUTE_FACTOR if layout.activation_checkpointing == "full" else 1.0
    # selective recomputes the attention core's forward (Q K^T and A V: 4 b s^2 h a layer) once more
    core_again = SELECTIVE_RECOMPUTE_FACTOR if layout.activation_checkpointing == "selective" else 1.0
    peak = cluster.flops(job.precision) * cluster.matmul_efficiency
    local_tokens = layout.micro_batch * job.seq_len / dims.cp
    matmul_s = matmul / (peak * shape_efficiency(desc, local_tokens, dims.tp, cluster, job))
    flash = not (cluster.is_cpu or desc.eager_attention)  # eager: the whole QK^T and AV, as batched GEMMs
    causal, kernel = (CAUSAL_ATTENTION_WORK, ATTENTION_EFFICIENCY) if flash else (1.0, 1.0)
    attention_s = attention / dims.tp * causal / (peak * kernel)
    return recompute * (matmul_s + core_again * attention_s) * tokens_per_rank / dims.pp


def layer_gemms(desc: ModelDesc, tp: int) -> list[tuple[float, float]]:
    """(K, N) of a decoder layer's forward matmuls on one tensor rank, [tokens x K] @ [K x N]:
    q|k|v, the attention output, the MLP's up (and gate), its down projection."""
    qkv = (desc.heads + 2 * desc.kv_heads) * desc.head_dim / tp
    up = (2 if desc.gated_mlp else 1) * desc.ffn / tp
    return [(desc.hidden, qkv), (desc.heads * desc.head_dim / tp, desc.hidden), (desc.hidden, up),
            (desc.ffn / tp, desc.hidden)]


def shape_efficiency(desc: ModelDesc, tokens: float, tp: int, cluster: Cluster, job: Workload) -> float:
    """Of `matmul_efficiency`, what a decoder layer's matmuls reach for `tokens` rows (a micro-batch's
    on one rank) at `tp`, forward and backward: each GEMM's output quantised to tiles and waves, and
    bounded by the bytes it moves (the roofline); FLOP-weighted over the layer's GEMMs."""
    flops = seconds = 0.0  # seconds x the peak FLOP/s: FLOPs at 100%
    peak, element_bytes = cluster.matmul_efficiency, job.param_bytes
    flops_per_byte = cluster.flops(job.precision) / (cluster.hbm_bandwidth * HBM_EFFICIENCY)
    for k, n in layer_gemms(desc, tp):
        # forward Y[m,n] = X[m,k] W[k,n]; backward dX[m,k] = dY W^T and dW[k,n] = X^T dY
        for rows, cols, inner in ((tokens, n, k), (tokens, k, n), (k, n, tokens)):
            work = 2.0 * rows * cols * inner
            moved = element_bytes * (rows * inner + inner * cols + rows * cols)
            compute = work / (peak * _tile_waves(rows, cols, cluster))
            memory = moved * flops_per_byte
            flops, seconds = flops + work, seconds + max(compute, memory)
    return flops / (seconds * peak) if seconds else 1.0


def _tile_waves(rows: float, cols: float, cluster: Cluster) -> float:
    """Useful share of a GEMM's blocks: its [rows x cols] output cut into gemm_tile-square blocks, run
    sm_count at a time; 1 where the cluster has no tiles (CPU ranks)."""
    tile, units = cluster.gemm_tile, cluster.sm_count
    if tile <= 1 or units <= 1:
        return 1.0
    blocks = math.ceil(rows / tile) * math.ceil(cols / tile)
    return rows * cols / (math.ceil(blocks / units) * units * tile * tile)


def _memory_bound(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster) -> float:
    """Seconds of the elementwise work of the busiest rank: per token and layer the norms and residual
    adds (whole on every tensor rank), rotary on queries and keys and the MLP's activation (a tensor
    rank's share), forward (again with recompute) and backward; the loss over the vocabulary's logits
    (a tensor rank's share) on the last stage."""
    dims, w = layout.dims, job.param_bytes
    whole = desc.layer_norms * NORM_ELEMENTS * desc.hidden + 2 * RESIDUAL_ELEMENTS * desc.hidden
    if layout.sequence_parallel:  # each tensor rank norms and adds its own slice of the tokens
        whole /= dims.tp
    activation = ACTIVATION_ELEMENTS_GATED if desc.gated_mlp else ACTIVATION_ELEMENTS
    split = (activation * desc.ffn + ROTARY_ELEMENTS * (desc.heads + desc.kv_heads) * desc.head_dim) / dims.tp
    forwards = 1 + (layout.activation_checkpointing == "full")
    if desc.eager_attention:  # the scores are materialised: heads / tp x the sequence per token (cp or not)
        passes = EAGER_SCORE_PASSES + (DROPOUT_SCORE_PASSES if desc.dropout else 0)
        split += passes * desc.heads / dims.tp * job.seq_len
    per_token_layer = (whole + split) * w * (forwards + BACKWARD_BYTES)
    tokens_per_rank = job.global_batch * job.seq_len / (dims.dp * dims.cp)
    layers = math.ceil(desc.layers / dims.pp)
    loss = desc.vocab / dims.tp * LOSS_BYTES_PER_LOGIT
    return tokens_per_rank * (per_token_layer * layers + loss) / (cluster.hbm_bandwidth * HBM_EFFICIENCY)


def _tp_comm(layout: Layout, cluster: Cluster, step: _Step) -> float:
    """Tensor parallel: 2 all-reduces forward, 2 backward per layer and micro-batch (+2 recompute),
    and 4 more for the vocab-parallel embedding and loss. Sequence parallelism turns each into an
    all-gather and a reduce-scatter (the same bytes), and gathers the blocks' inputs again in the
    backward (one all-reduce's worth a layer; not with full recompute, which gathers them anyway)."""
    regather = 1 if layout.sequence_parallel and layout.activation_checkpointing != "full" else 0
    tp_calls = ((4 + regather + 2 * step.recompute) * step.busiest.layers + 4) * step.micro_batches
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


def _dp_comm(desc: ModelDesc, layout: Layout, cluster: Cluster, step: _Step, compute: float) -> float:
    """Data parallel: ZeRO's group is data x context; its ranks sit tp apart (tensor ranks are
    innermost), and an hpZ group is zero_hpz consecutive ranks. One latency per bucket: bigger
    buckets, fewer collectives. What overlaps (DP_OVERLAP of the gradient reduction, ZeRO-3's
    prefetched share of its gathers) hides behind compute, never more than the compute itself: at
    scale, with few sequences per rank, ZeRO-3's gathers are mostly exposed. The pipeline engine
    reduces after its schedule: nothing overlaps there."""
    dims, knobs, busiest, lat, micro_batches = layout.dims, layout.knobs, step.busiest, step.lat, step.micro_batches
    d = dims.zero_ranks
    dp_bw = _bandwidth(cluster, d * dims.tp)
    # with ep, a rank holds 1/ep of the routed experts (whose ZeRO group is d / ep: the same bytes each)
    held = busiest.params - desc.routed_params + desc.routed_params // dims.ep if dims.ep > 1 else busiest.params
    grad_bytes = held * step.w
    reduce_lat = lat * _buckets(held, knobs.reduce_bucket)
    hidden_share = 0.0 if dims.pp_enabled else DP_OVERLAP
    if dims.zero_stage == 0:  # one all-reduce, bucketed behind the backward pass
        reduce = _ring(grad_bytes, d, dp_bw, all_reduce=True, latency=lat * _buckets(held,
                                                                                     STAGE0_ALLREDUCE_BUCKET))
        gather = hidden_gather = 0.0
    elif dims.zero_stage in (1, 2):  # gradients reduced to their owners, updated params gathered after
        reduce = _ring(grad_bytes, d, dp_bw, all_reduce=False, latency=reduce_lat)
        if dims.zero_stage == 2:  # reduce-scattered at every micro-batch
            reduce *= micro_batches
        gather = _ring(grad_bytes, d, dp_bw, all_reduce=False,
                       latency=lat * _buckets(held, knobs.allgather_bucket))
        hidden_gather = 0.0  # after the optimizer step: nothing left to hide it behind
    else:  # ZeRO-3: gather the non-persistent parameters for every forward (recompute too) and backward
        reduce = micro_batches * _ring(grad_bytes, d, dp_bw, all_reduce=False, latency=reduce_lat)
        gathered_bytes = (held - busiest.persistent) * step.w  # persistent tensors are never gathered
        forward = _ring(gathered_bytes, d, dp_bw, all_reduce=False, latency=lat)
        if dims.zero_hpz > 1:  # backward's from the secondary partition, inside the hpZ group
            backward = _ring(gathered_bytes, dims.zero_hpz, _bandwidth(cluster, dims.zero_hpz),
                             all_reduce=False, latency=lat)
        else:
            backward = forward
        gather = micro_batches * ((1 + step.recompute) * forward + backward)
        hidden_gather = zero3_gather_overlap(desc, layout) * gather
    return reduce + gather - min(hidden_share * reduce + hidden_gather, compute)


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
    selective = layout.activation_checkpointing == "selective"  # the core again, and checkpoint's own calls
    passes = 1 + (layout.activation_checkpointing == "full") / 3 + selective * SELECTIVE_OPS_PER_LAYER / OPS_PER_LAYER
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
