"""Bytes per rank of a layout: parameters, gradients, optimizer states, activations, buffers;
and the host memory a node needs to build the model, hold what is offloaded, and export it.

    layout = Layout(ParallelDims(world=16, tp=2, zero_stage=3), micro_batch=2, grad_accum=4)   # dp 8
    mem = memory_per_rank(desc, layout, Workload(seq_len=4096, global_batch=64, precision="bf16"))
    mem.total / 2**30                  # GiB on the busiest rank
    mem.cpu_per_rank                   # offloaded bytes in host memory, per rank
    host = host_memory_per_node(desc, layout, mem, ranks_per_node=8)
    host.build, host.offload, host.export, host.peak   # bytes of one node's RAM
    lora = Workload(seq_len=4096, global_batch=64, trainable_params=103_546_880)  # LoRA: the adapters alone train
    Layout(ParallelDims(world=8, zero_stage=3), knobs=Knobs(persistence_threshold=4_194_304))  # ZeRO's knobs (parallel.zero_knobs)
    Workload(seq_len=4096, global_batch=64, chunked_loss=True)   # the loss over chunks (train.chunked_loss; "auto")

Model states follow what DeepSpeed (0.19) really allocates, which is more than the ZeRO paper's
2 + 2 + 12 bytes per parameter in places (checked against live engines in
tests/distributed/test_planner_memory.py). P is this rank's parameters after tensor and pipeline
splitting, w the parameter bytes (4 fp32, 2 bf16/fp16), d the data-parallel size:

    stage  params            grads                          optimizer (AdamW)
    0      w P               w P  (+4 P fp32 accumulators    8 P fp32 (m, v); bf16: BF16_Optimizer's
                                   with bf16)                 12 P / d (fp32 master + m + v, split
                                                              over d); fp16: 12 P
    1      w P               w P while accumulating          12 P / d: fp32 master partition (a copy
                             (grad_accum > 1), else w P / d    even in fp32 training) + m + v
    2      w P               w P / d                         12 P / d
    3      w P / d + the     w P / d                         12 P / d
           persistent ones
           (<= the threshold,
           kept whole)
           + w P / N with hpZ

ZeRO-3's persistent tensors are those of at most `Layout.knobs.persistence_threshold` elements
(DeepSpeed's stage3_param_persistence_threshold, 1e5 unless chosen): each is whole on every rank
beside its partition, and never gathered.

d is the ranks ZeRO shards over: data x context parallel (`ParallelDims.zero_ranks`; the context ranks
of a replica hold the same weights, DeepSpeed's sequence-data-parallel group). ZeRO++ hpZ
(`zero_hpz` = N) keeps a secondary copy of the weight partitions inside each group of N ranks,
w P / N bytes, so backward's all-gathers stay inside the group; gradients and optimizer states
stay sharded over all d.

A LoRA run (`Workload.trainable_params`, the adapters' elements T, from models/lora.py
`count_lora_parameters`) adds T parameters beside the frozen base, and only they train: the
parameters are w (P + T) as above (the frozen base whole at stages 0-2, where DeepSpeed's
optimizer flattens and partitions only the trainable ones; partitioned at stage 3, the adapter
tensors of <= 1e5 elements persistent, `Workload.trainable_persistent`), while gradients, optimizer
states, their offload and the gradient-sized buffers count T instead of P.

bf16 runs at ZeRO 1-3 accumulate gradients in fp32 (DeepSpeed's data_types.grad_accum_dtype,
`runtime_facts.grad_accum_dtype`, which dsconfig.py writes): the grads above become, at stage 1,
w P + 4 P (BF16_Optimizer's whole fp32 gradient buffer beside the bf16 grads; offloaded, the
per-parameter fp32 grad_accum: the same bytes), at stage 2 (w + 4) P / d (an fp32 copy of the
partition), at stage 3 4 P / d (the partition itself in fp32). At stage 1 BF16_Optimizer replaces
ZeRO-1's buckets with the engine's fp32 all-reduce bucket (min(5e8, P) x 4 bytes).

Offloading the optimizer moves its 12 P / d and an fp32 gradient partition (4 P / d) to host
memory (ZeRO-2 then keeps no gradient partition on the device; ZeRO-3 keeps its w P / d one);
offloading parameters (ZeRO-3) moves the w P / d parameter partition there too.

Host memory per node (`host_memory_per_node`), in the phases of a run:
- build: every rank materialises only its share, in fp32, on the host before DeepSpeed moves it
  to the device: its tensor shard of its pipeline stage's parameters (P above, the busiest
  stage), / d more under ZeRO-3 (partitioned at construction, zero.Init), plus one dense tensor
  in flight (whole while its shard is cut or it is read from a checkpoint; the largest is
  counted, typically the vocab x hidden embedding): 4 (P [/ d] + largest) bytes, times the ranks
  of a node;
- offload: the offloaded states above, times the ranks of a node. Build and offload are counted
  together: a node's ranks are not in lockstep, one may allocate its offloaded states while
  another still builds;
- export: `dsf export` streams on one host: one output shard (EXPORT_SHARD_BYTES, or the whole
  fp32 model when smaller, or the largest tensor when that is larger) plus one input tensor
  group (the largest tensor's shards, fp32).
The node's figure is the largest of build + offload and export.

Activations (bytes saved for backward, per micro-batch) follow Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (2022), section 4: per layer
s b h (34 + 5 a s / h) bytes for GPT with fp16 activations and dropout, and
s b h (10 + 24 / t + 5 a s / (h t)) with tensor parallelism t (no sequence parallelism). Their
34 = 10 (the layer's replicated inputs: two LayerNorm inputs, QKV and MLP inputs at 2 bytes, two
dropout masks at 1 byte) + 24 (the t-split part: Q, K, V, attention output, MLP 4h input,
GeLU input, ...), and 5 a s / h is the attention score matrix, its softmax and dropout mask.
Here the same bookkeeping is redone for the kernels these models run: PyTorch's
scaled_dot_product_attention (flash/memory-efficient) stores no s x s matrix, only Q, K, V, the
output and a log-sum-exp per head, so the 5 a s / h term is gone unless attention dropout forces
the math kernel; and the layers are transformers' own. Per layer, in elements of b s:

    norms (each RMSNorm: 3 h, its input upcast to fp32, normalized, scaled, + 1 rsqrt in fp32;
           each LayerNorm: 2 h, input and output, + 2 fp32 mean and rstd; layer_norms of them:
           2 pre-norms, Gemma's 4, OLMo 2's 2 post-norms; a parallel residual's two norms of one
           input, GPT-NeoX's, keep that input once: h less)
    + [attention + MLP + q/k norms + lse a] / t, where
      attention: Q q + K kv + V kv + out q (separate projections, rotary applied), or, fused
                 q|k|v (GPT-2, Phi-3, GPT-NeoX), the fused output's views and sdpa's contiguous
                 copies: 2 (q + 2 kv)
      MLP:       gated (SwiGLU, GeGLU): gate, up, act(gate), their product: 3 f; else act's
                 input f; + what the activation keeps (below)
      q/k norms: their fp32 inputs and normalized outputs, (q + kv) (4 + w) bytes, + an rsqrt per head
    (+ 2 h bytes of dropout masks, + 5 a s / t with attention dropout, as in Korthikanti; with
    eager attention, Gemma 2's, the softmax's a s / t, and tanh's a s / t with capped scores)

These features are read from the config and the layer's own modules (planner/model.py), so every
architecture is counted the same way: Llama's 2 RMSNorms, SwiGLU and GQA give
2 x (3 h + 1) + [Q h + K kv + V kv + out h + lse a + MLP 4 f] / t; GPT-2's 2 LayerNorms, gelu_new
and fused QKV give 2 x (2 h + 2) + [6 h + lse a + MLP 5 f] / t.

The MLP's count depends on its activation function (`ACTIVATION_SAVED`, tensors of width f it
keeps besides its output): SwiGLU keeps gate, up, act(gate) and their product (3 f) + the
activation's (silu: 1); GPT-2's MLP keeps the activation's output (f) + the activation's
(gelu_new: 4, the 5 f above; gelu_pytorch_tanh: 1).

Context parallelism (DeepSpeed Ulysses, cp ranks per sequence): each rank holds seq_len / cp
tokens outside attention, so every per-token term above is per token of its shard. Attention
all-to-alls q, k, v to the whole sequence for heads / cp heads, the same elements per shard token,
except that k and v of kv / tp < cp heads are repeated to one head per rank (cp heads' worth per
token); the output comes back through an all-to-all, so the copy o_proj keeps is a second tensor
beside sdpa's (+ h per token). The all-to-alls' send and receive buffers of one layer are a buffer.
Measured in tests/unit/test_planner_context.py (a fake process group of cp ranks in one process).

With full activation checkpointing a layer keeps only its input (h elements; Korthikanti's 2 s b h
bytes); its full activations exist again, one layer at a time, during the backward recompute
(counted as a buffer). Selective recomputation (Korthikanti section 4.2: s b h (34 + 5 a s / h)
-> 34 s b h) recomputes the attention core, softmax(Q K^T) V (models/recompute.py): a layer keeps
everything above but what the core's kernel saved (`attention_core_bytes`: sdpa's log-sum-exp,
a / t fp32 per token, and with attention dropout the math kernel's 5 a s / t s x s term); q, k, v
stay (the recompute's inputs) and the output stays (o_proj's input). The flash kernels' core saves
little, so selective saves most where the s x s term exists; one layer's core output, lse (and
scores) is recomputed at a time (a buffer). The first and last stages also
keep the embedding's token ids, the final norm's inputs and the fp32 logits the loss reads (b s V
/ t x 4 bytes). Under 1F1B, stage i holds min(pp - i, grad_accum) micro-batches in flight.
With a chunked loss (`Workload.chunked_loss`: True, or "auto" when the rank's b s / cp tokens span more
than one chunk, `runtime_facts.loss_is_chunked`, as the training loop decides) the last stage keeps
no logits: each chunk's are recomputed in the backward from the final norm's output, which is
already counted; one chunk's fp32 logits and their fp32 gradient exist at a time, a buffer of
c x V / t x (4 + 4) bytes for c = `runtime_facts.loss_chunk_tokens` tokens (fewer when the
micro-batch has fewer).

Buffers: ZeRO's communication buckets in the sizes of `Layout.knobs` (what dsconfig.py writes;
dsf's defaults from runtime_facts: reduce 5e7 elements, all-gather 5e7 at stages 1-2; min(bucket,
what the rank moves) at stages 1-2, the reduce bucket whole at stage 3, where DeepSpeed allocates
it at start), ZeRO-3's gathered working set (`zero3_gathered`: two layers' non-persistent tensors
plus what it prefetched ahead, the prefetch bucket capped by max_live_parameters and by the stage's
gathered elements), the fp32 gradient partition made at the optimizer step, DeepSpeed's
5e8-element all-reduce bucket at stage 0, the logits and their gradient (or one loss chunk's),
pipeline send/receive buffers, and the recompute working set.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from dsframework.layout import ParallelDims
from dsframework.planner.desc import ModelDesc
from dsframework.runtime_facts import (
    DEFAULT_KNOBS,
    STAGE0_ALLREDUCE_BUCKET,
    ZERO3_PERSISTENCE_THRESHOLD,
    Knobs,
    balanced_partitions,
    grad_accum_dtype,
    loss_chunking,
    padded_vocab,
    partition_balanced,
)

ADAM_STATE_BYTES = 8  # fp32 exp_avg + exp_avg_sq
MASTER_BYTES = 4  # fp32 master copy of the parameters
BUILD_BYTES = 4  # parameters are materialised in fp32, then cast and moved by DeepSpeed
EXPORT_SHARD_BYTES = 50 * 10**9  # save_pretrained's max_shard_size default ("50GB", transformers 5)


@dataclass(frozen=True)
class Workload:
    """What is trained: tokens per sequence, sequences per step, arithmetic precision."""

    seq_len: int
    global_batch: int
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    # LoRA: the adapters' elements, the only ones that train. They are held beside the model's own
    # parameters, which are frozen (held, no gradients or optimizer states). None: every parameter trains.
    trainable_params: int | None = None
    trainable_persistent: int = 0  # of those, elements in tensors ZeRO-3 keeps whole (<= 1e5 elements)
    # The causal LM loss over chunks of tokens (train.chunked_loss: True, False or "auto";
    # train.loss_chunk_tokens): the last stage then holds one chunk's logits at a time.
    chunked_loss: bool | str = "auto"
    loss_chunk_tokens: int | None = None

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Layout:
    """One way to run the job: the rank grid and ZeRO (`dims`, the ParallelDims dsf train checks),
    and what only the plan chooses: offload, the batch split, checkpointing and ZeRO's knobs."""

    dims: ParallelDims
    offload_optimizer: bool = False
    offload_param: bool = False
    micro_batch: int = 1
    grad_accum: int = 1
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    knobs: Knobs = DEFAULT_KNOBS  # ZeRO's buckets and ZeRO-3's persistence / prefetch settings
    sequence_parallel: bool = False  # tp > 1: norms, residuals and their activations split over the tensor ranks


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank (the busiest one), and what it puts in host memory."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    cpu_params: float = 0.0  # offloaded to host memory (ZeRO-Offload / ZeRO-Infinity to CPU)
    cpu_grads: float = 0.0
    cpu_optimizer: float = 0.0
    stage: int = 0  # the pipeline stage this is (the busiest)
    parts: dict = field(default_factory=dict, compare=False)  # details: elements per rank etc.

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def cpu_per_rank(self) -> float:
        return self.cpu_params + self.cpu_grads + self.cpu_optimizer

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "total": self.total}


# --- parameters per stage -------------------------------------------------------------------------

@dataclass(frozen=True)
class StageShape:
    """Parameters (elements, on one tensor rank) and layers of one pipeline stage."""

    params: int
    persistent: int  # tensors small enough that ZeRO-3 keeps them whole (<= threshold)
    layers: int
    first: bool
    last: bool


def _padded_vocab_rows(vocab: int, tp: int) -> int:
    """Rows of the embedding (and an untied or vocab-parallel head) one tensor rank holds."""
    return padded_vocab(vocab, tp=tp) // tp


def _items(desc: ModelDesc, tp: int, threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> list[tuple[int, int, str]]:
    """The pipeline's layer list as (elements per tensor rank, persistent elements, kind), counted
    on the model sharded for one tensor rank (ModelDesc.shares); a tensor is persistent when its
    elements on this tensor rank are <= `threshold` (DeepSpeed compares the tensor it partitions,
    ds_numel)."""
    return [(sum(sizes), sum(n for n in sizes if n <= threshold), kind) for sizes, kind in desc.shares(tp).items]


@lru_cache(maxsize=64)
def _balanced_bounds(desc: ModelDesc, tp: int) -> Callable[[int], list[int]]:
    """partition_balanced's stage bounds of the pipeline's items at every pipeline size (one table
    per model and tensor-parallel size: the search asks for many pipeline sizes)."""
    items = _items(desc, tp)
    return balanced_partitions([n for n, _, _ in items], len(items) - 1)


@lru_cache(maxsize=4096)
def stage_shapes(desc: ModelDesc, tp: int, pp: int,
                 threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> tuple[StageShape, ...]:
    """Each pipeline stage's parameters (per tensor rank), balanced by parameters as
    `partition_method=parameters` does, and those in tensors of <= `threshold` elements (ZeRO-3's
    persistent ones). A tied head on its own stage holds a copy of the embedding; with one stage
    the tie costs nothing."""
    items = _items(desc, tp, threshold)
    if desc.tied and pp == 1:
        items[-1] = (0, 0, "head")
    if 1 < pp < len(items):  # (the elements of each item are the same at any threshold)
        bounds = _balanced_bounds(desc, tp)(pp)
    else:
        bounds = partition_balanced([n for n, _, _ in items], pp)
    shapes = []
    for s in range(pp):
        chunk = items[bounds[s]:bounds[s + 1]]
        shapes.append(StageShape(params=sum(n for n, _, _ in chunk), persistent=sum(p for _, p, _ in chunk),
                                 layers=sum(kind == "layer" for _, _, kind in chunk),
                                 first=s == 0, last=s == pp - 1))
    return tuple(shapes)


# --- activations ----------------------------------------------------------------------------------

def _rms_norm_bytes(h: int, w: int) -> int:
    """Per token: transformers' RMSNorm saves its input upcast to fp32 (the same tensor in fp32
    training), the normalized values cast back to w bytes, the scaled output (the next
    linear's input), and one fp32 rsqrt."""
    return h * (4 + w + w) + 4


# What transformers' activation functions (ACT2FN) save for backward besides their output, in
# tensors of the MLP's width (measured with saved-tensor hooks; test_planner_context.py re-measures
# every entry): gelu_new is written out in elementwise ops (x, x^3, tanh, ...), gelu_pytorch_tanh
# and silu are one fused op that keeps its input, relu and tanh keep only their output (which the
# next matmul keeps anyway). An activation not listed is counted as keeping its input.
ACTIVATION_SAVED = {"gelu_new": 4, "gelu_fast": 7, "quick_gelu": 2, "gelu_10": 2, "gelu": 1,
                    "gelu_pytorch_tanh": 1, "silu": 1, "swish": 1, "mish": 1, "relu2": 1,
                    "relu": 0, "tanh": 0, "sigmoid": 0}


def activation_saved(name: str) -> int:
    """Tensors of the MLP's width `name` keeps for backward besides its output (ACTIVATION_SAVED)."""
    return ACTIVATION_SAVED.get(name, 1)


def ulysses_kv_heads(desc: ModelDesc, *, tp: int, cp: int) -> int:
    """Key/value heads a rank's attention sees per token of its shard after Ulysses' all-to-all:
    kv/tp when cp divides them; cp when cp is a multiple (DeepSpeed repeats each kv head so every
    rank gets one, over the whole sequence)."""
    kv = desc.kv_heads // tp
    return kv if cp <= 1 or kv % cp == 0 else cp


def layer_activation_bytes(desc: ModelDesc, *, micro_batch: int, seq_len: int, tp: int, precision: str,
                           cp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one decoder layer saves for backward on one rank, one micro-batch (see the module
    docstring). `seq_len` is the whole sequence; with context parallelism each rank holds
    seq_len / cp of its tokens, and in attention (after Ulysses' all-to-all) q, k, v, the output
    and the log-sum-exp of the whole sequence for heads / cp heads: the same elements per token of
    its shard, k and v at `ulysses_kv_heads`, and the output saved twice (sdpa's, and the
    all-to-all's result, which o_proj keeps). With sequence parallelism the norms (their outputs, the
    blocks' inputs, kept as this rank's slice and gathered again in the backward) and the residual
    dropout's masks are a tensor rank's share too: Korthikanti et al.'s sbh(34/t + 5as/ht)."""
    bs = micro_batch * seq_len / cp  # this rank's tokens
    h, f, a, hd = desc.hidden, desc.ffn, desc.heads, desc.head_dim
    q = a * hd  # the queries' (and the attention output's) width
    kv = ulysses_kv_heads(desc, tp=tp, cp=cp) * hd * tp  # per token, before the / tp below
    w = 4 if precision == "fp32" else 2
    norms = desc.layer_norms * _norm_bytes(desc, h, w) - (h * w if desc.norms_share_input else 0)
    if desc.fused_qkv:
        # q, k, v views of the fused output and sdpa's contiguous copies (its output, o_proj's
        # input, among them); under Ulysses q, k, v arrive contiguous from the all-to-all and the
        # output is kept twice
        attention = 2 * (q + 2 * kv) if cp <= 1 else q + 2 * kv + 2 * q
    else:  # q, k, v (after rotary), out (+ its all-to-all copy)
        attention = q + kv + kv + q + (q if cp > 1 else 0)
    # MLP: gate, up, act(gate), their product, or act's input; + what the activation keeps
    mlp = ((3 if desc.gated_mlp else 1) + activation_saved(desc.activation)) * f
    qk_norms = (q + kv) * (4 + w) + (a + kv // hd) * 4 if desc.qk_norm else 0  # fp32 input, normalized; rsqrt
    split = (attention + mlp) * w + qk_norms + a * 4  # + the lse in fp32
    extra = 0.0
    masks = 2 * h if desc.dropout > 0 else 0  # the residual dropouts' masks (1 byte)
    if desc.dropout > 0:  # attention dropout forces the s x s math kernel
        extra = 5 * a * seq_len / tp * w / 2
    elif desc.eager_attention:  # eager attention keeps the softmax's s x s output (+ tanh's, capped)
        extra = (1 + desc.attn_softcapping) * a * seq_len / tp * w
    whole = (norms + masks) / (tp if sequence_parallel else 1)
    return bs * (whole + split / tp + extra)


def attention_core_bytes(desc: ModelDesc, *, micro_batch: int, seq_len: int, tp: int, precision: str,
                         cp: int = 1) -> float:
    """Bytes of one layer's `layer_activation_bytes` that selective recomputation frees: what the
    attention core's kernel saves beyond its inputs, the fp32 log-sum-exp per head (heads / tp) and,
    with attention dropout (the math kernel), the 5 a s / t s x s term (Korthikanti's). Eager
    attention is not offered selective (models/recompute.py), so its scores are not counted here."""
    bs = micro_batch * seq_len / cp
    w = 4 if precision == "fp32" else 2
    scores = 5 * desc.heads * seq_len / tp * w / 2 if desc.dropout > 0 else 0.0
    return bs * (desc.heads * 4 / tp + scores)


def kept_per_layer(desc: ModelDesc, layout: Layout, job: Workload, layer_act: float) -> float:
    """Bytes a layer keeps for backward per micro-batch under the layout's activation checkpointing:
    all of `layer_act` (none), all but its attention core's (selective), its input (full)."""
    dims = layout.dims
    if layout.activation_checkpointing == "full":  # (with sequence parallelism, this rank's slice of it)
        split = dims.tp if layout.sequence_parallel else 1
        return layout.micro_batch * job.seq_len / dims.cp / split * desc.hidden * job.param_bytes
    if layout.activation_checkpointing == "selective":
        return layer_act - attention_core_bytes(desc, micro_batch=layout.micro_batch, seq_len=job.seq_len,
                                                tp=dims.tp, precision=job.precision, cp=dims.cp)
    return layer_act


def _norm_bytes(desc: ModelDesc, h: int, w: int) -> int:
    """Per token, one norm of the layer: RMSNorm's (_rms_norm_bytes) or LayerNorm's input and
    output and its fp32 mean and rstd."""
    return _rms_norm_bytes(h, w) if desc.norm == "rms" else 2 * h * w + 2 * 4


def ulysses_buffer_bytes(desc: ModelDesc, *, micro_batch: int, seq_len: int, tp: int, precision: str,
                         cp: int) -> float:
    """Ulysses' all-to-all working set in one layer: the contiguous send copy and the received
    tensor of q, k, v (forward) or their gradients (backward), plus the output's pair; one layer
    at a time."""
    if cp <= 1:
        return 0.0
    bs = micro_batch * seq_len / cp
    w = 4 if precision == "fp32" else 2
    kv = ulysses_kv_heads(desc, tp=tp, cp=cp) * desc.head_dim
    return 2 * bs * (2 * desc.hidden / tp + 2 * kv) * w


def loss_chunk(desc: ModelDesc, layout: Layout, job: Workload) -> int | None:
    """Tokens whose logits the last stage holds at once when its loss is chunked (Workload.chunked_loss,
    decided as the training loop decides it: runtime_facts.loss_chunking), else None: the whole
    micro-batch's logits exist together."""
    return loss_chunking(job.chunked_loss, vocab=desc.vocab, tp=layout.dims.tp, pp=layout.dims.pp, cp=layout.dims.cp,
                         micro_batch=layout.micro_batch, seq_len=job.seq_len, chunk_tokens=job.loss_chunk_tokens)


def _edge_activation_bytes(desc: ModelDesc, shape: StageShape, *, micro_batch: int, seq_len: int, tp: int,
                           precision: str, cp: int = 1, chunked: bool = False,
                           sequence_parallel: bool = False) -> float:
    """The first stage's token ids; the last stage's final norm and fp32 logits for the loss
    (for this rank's seq_len / cp tokens). A `chunked` loss keeps no logits: each chunk's are
    recomputed in the backward from the final norm's output, already counted here. With sequence
    parallelism the final norm runs on this rank's tokens, and the head keeps its output gathered."""
    bs = micro_batch * seq_len / cp
    w = 4 if precision == "fp32" else 2
    total = 0.0
    if shape.first:
        total += bs * 8 * (2 if desc.position_params else 1)  # int64 ids (learned positions: and theirs)
    if shape.last:
        h = desc.hidden
        norm = _norm_bytes(desc, h, w)
        if sequence_parallel:
            norm = (norm - h * w) / tp + h * w
        logits = 0 if chunked else _padded_vocab_rows(desc.vocab, tp) * 4 * (1 + desc.logit_softcapping)
        total += bs * (norm + logits + 8)  # logits fp32, labels
    return total


# --- the breakdown --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trained:
    """Elements of one rank's stage that train (T), and the adapters held beside its model's own
    parameters (A, of which `persistent` ZeRO-3 keeps whole): T = P, A = 0 in full fine-tuning;
    T = A = the adapters in a LoRA run."""

    elements: float
    added: float
    persistent: float


def trained(desc: ModelDesc, shape: StageShape, job: Workload) -> Trained:
    """`Trained` of `shape`: a LoRA run's adapters (`Workload.trainable_params`) in proportion to the
    stage's share of the model (all of them at tp = pp = 1, where LoRA runs)."""
    if job.trainable_params is None:
        return Trained(elements=shape.params, added=0.0, persistent=0.0)
    share = shape.params / desc.total_params
    return Trained(elements=job.trainable_params * share, added=job.trainable_params * share,
                   persistent=job.trainable_persistent * share)


def _model_states(desc: ModelDesc, shape: StageShape, layout: Layout, job: Workload,
                  train: Trained) -> dict[str, float]:
    """Bytes of params, grads, optimizer (on the device) and cpu_* (offloaded) for one rank.
    ZeRO partitions over data x context ranks (`ParallelDims.zero_ranks`); hpZ adds its secondary
    partition of the weights, w P / zero_hpz (`hpz_secondary`, counted in params). Parameters
    count the stage's and any adapters (P + A); gradients and optimizer states what trains (T).
    With expert parallelism (ep > 1, tp = pp = 1, the whole model on the stage) the `routed`
    experts' parameters are a rank's 1/ep of them, which ZeRO partitions over its expert-data group
    (zero_ranks / ep ranks: DeepSpeed AutoEP's), and the rest as before."""
    ep, routed = layout.dims.ep, desc.routed_params
    if ep > 1 and routed and job.trainable_params is None:
        kept, kept_at_ep = _persistent_experts(desc, layout.knobs.persistence_threshold, ep)
        dense = _states(shape.params - routed, shape.params - routed, shape.persistent - kept, layout, job,
                        zero_ranks=layout.dims.zero_ranks)
        experts = _states(routed // ep, routed // ep, kept_at_ep, layout, job, zero_ranks=layout.dims.zero_ranks // ep)
        return {key: dense[key] + experts[key] for key in dense}
    return _states(shape.params + train.added, train.elements, shape.persistent + train.persistent, layout, job,
                   zero_ranks=layout.dims.zero_ranks)


def _persistent_experts(desc: ModelDesc, threshold: int, ep: int) -> tuple[int, int]:
    """(routed-expert elements ZeRO-3 keeps whole in transformers' layout, in AutoEP's at `ep`).
    transformers holds a layer's experts as gate_up_proj (2 m elements) and down_proj (m); AutoEP as
    w1, w3 and w2 of m / ep each on a rank (m: `expert_matrix`)."""
    m = desc.expert_matrix
    if not m:
        return 0, 0
    layers = desc.routed_params // (3 * m)
    whole = layers * (2 * m * (2 * m <= threshold) + m * (m <= threshold))
    return whole, layers * 3 * (m // ep) * (m // ep <= threshold)


def _states(P: float, T: float, persistent: float, layout: Layout, job: Workload, *,
            zero_ranks: int) -> dict[str, float]:
    """`_model_states` of P parameters (T of them trained, `persistent` kept whole by ZeRO-3) that
    ZeRO partitions over `zero_ranks` ranks."""
    d, w, z = zero_ranks, job.param_bytes, layout.dims.zero_stage
    if z == 3:  # the partition, plus gathered copies of the persistent ones (one rank: the same)
        params = w * P / d + (w * persistent if d > 1 else 0)
    else:
        params = w * P
    hpz_secondary = w * P / layout.dims.zero_hpz if z == 3 and layout.dims.zero_hpz > 1 else 0.0
    params += hpz_secondary
    if z == 0:
        grads = w * T + (4 * T if job.precision == "bf16" else 0)
    elif z == 1:
        grads = w * T if layout.grad_accum > 1 else w * T / d
    else:
        grads = w * T / d
    if grad_accum_dtype(job.precision, z):  # bf16 gradients accumulated in fp32 (runtime_facts)
        grads = {1: w * T + 4 * T, 2: (w + 4) * T / d, 3: 4 * T / d}[z]
    if z == 0:
        optimizer = {"fp32": ADAM_STATE_BYTES * T, "bf16": (MASTER_BYTES + ADAM_STATE_BYTES) * T / d,
                     "fp16": (MASTER_BYTES + ADAM_STATE_BYTES) * T}[job.precision]
    else:
        optimizer = (MASTER_BYTES + ADAM_STATE_BYTES) * T / d
    states = {"params": params, "grads": grads, "optimizer": optimizer,
              "cpu_params": 0.0, "cpu_grads": 0.0, "cpu_optimizer": 0.0, "hpz_secondary": hpz_secondary}
    if layout.offload_optimizer:
        states["cpu_optimizer"], states["optimizer"] = optimizer, 0.0
        if z >= 2:  # the fp32 gradient partition lives in host memory; ZeRO-2 copies reduced
            states["cpu_grads"] = 4 * T / d  # buckets straight into it, ZeRO-3 keeps its own
            states["grads"] = 0.0 if z == 2 else states["grads"]  # device partition as well
    if layout.offload_param:
        states["cpu_params"] = w * P / d
        states["params"] = (w * persistent if d > 1 else 0) + hpz_secondary
    return states


@lru_cache(maxsize=4096)  # (asked for by every layout the search costs)
def gathered_tensors(desc: ModelDesc, *, tp: int, threshold: int) -> tuple[int, ...]:
    """Elements of each tensor of one decoder layer (on one tensor rank) ZeRO-3 all-gathers: those
    above the persistence `threshold` (the persistent ones are never gathered)."""
    return tuple(k for k in desc.shares(tp).layer if k > threshold)


def layer_gathered(desc: ModelDesc, *, tp: int, threshold: int) -> int:
    """Elements of one decoder layer (on one tensor rank) ZeRO-3 all-gathers."""
    return sum(gathered_tensors(desc, tp=tp, threshold=threshold))


def zero3_gathered(desc: ModelDesc, shape: StageShape, layout: Layout) -> float:
    """Elements ZeRO-3 holds gathered at once: two layers (the one computing and the one being
    released, or backward's pair) plus what it prefetched ahead: the prefetch bucket, capped by the
    live-parameter limit (prefetch stops when max_live_parameters are gathered) and by what the
    stage has to gather."""
    knobs = layout.knobs
    layer = layer_gathered(desc, tp=layout.dims.tp, threshold=knobs.persistence_threshold)
    ahead = min(knobs.prefetch_bucket, max(knobs.max_live_parameters - layer, 0), shape.params - shape.persistent)
    return 2 * layer + max(ahead, 0)


def _buffers(desc: ModelDesc, shape: StageShape, layout: Layout, job: Workload, layer_act: float,
             train: Trained) -> float:
    """Gradient-sized buffers (reduce and all-reduce buckets, the all-gather of updated weights,
    the fp32 gradient partition) follow what trains (T); ZeRO-3's gathered layers, the weights.
    Bucket sizes are the layout's knobs; ZeRO-3 allocates its reduce bucket whole at start
    (contiguous gradients), stages 1-2 only as much as there is to reduce."""
    T, d, w, z = train.elements, layout.dims.zero_ranks, job.param_bytes, layout.dims.zero_stage
    knobs = layout.knobs
    bs = layout.micro_batch * job.seq_len / layout.dims.cp  # this rank's tokens
    total = 0.0
    if z == 0 and d > 1:
        total += min(STAGE0_ALLREDUCE_BUCKET, T) * w
    if z == 1 and grad_accum_dtype(job.precision, z) and not layout.offload_optimizer:
        # BF16_Optimizer: its fp32 gradients (counted in grads) all-reduced in 5e8-element flat buckets
        total += min(STAGE0_ALLREDUCE_BUCKET, T) * 4 if d > 1 else 0.0
    elif z in (1, 2):
        total += min(knobs.reduce_bucket, T) * w + min(knobs.allgather_bucket, T) * w + 4 * T / d
    if z == 3:
        total += knobs.reduce_bucket * w + zero3_gathered(desc, shape, layout) * w + 4 * T / d
    if shape.last:
        rows = _padded_vocab_rows(desc.vocab, layout.dims.tp)
        chunk = loss_chunk(desc, layout, job)
        if chunk is None:  # the logits (w bytes) and their fp32 gradient in the backward
            total += bs * rows * (w + 4)
        else:  # one chunk's fp32 logits and their fp32 gradient at a time
            total += chunk * rows * (4 + 4)
    if layout.dims.pp > 1:
        total += 2 * bs * desc.hidden * w
    total += ulysses_buffer_bytes(desc, micro_batch=layout.micro_batch, seq_len=job.seq_len, tp=layout.dims.tp,
                                  precision=job.precision, cp=layout.dims.cp)
    if layout.activation_checkpointing == "full" and shape.layers:
        total += layer_act  # one layer recomputed at a time
    if layout.activation_checkpointing == "selective" and shape.layers:  # one core: its output, lse (scores)
        bs, q = layout.micro_batch * job.seq_len / layout.dims.cp, desc.heads * desc.head_dim / layout.dims.tp
        total += bs * q * w + attention_core_bytes(desc, micro_batch=layout.micro_batch, seq_len=job.seq_len,
                                                   tp=layout.dims.tp, precision=job.precision, cp=layout.dims.cp)
    return total


def stage_memories(desc: ModelDesc, layout: Layout, job: Workload, *, distinct: bool = False) -> list[Memory]:
    """The memory of a rank of each pipeline stage (one entry without a pipeline). With `distinct`,
    only the first stage of each shape: a later stage of the same shape holds no more micro-batches
    in flight (1F1B: min(pp - index, grad_accum)), so never more memory (what memory_per_rank needs)."""
    dims = layout.dims
    layer_act = layer_activation_bytes(desc, micro_batch=layout.micro_batch, seq_len=job.seq_len, tp=dims.tp,
                                       precision=job.precision, cp=dims.cp, sequence_parallel=layout.sequence_parallel)
    kept = kept_per_layer(desc, layout, job, layer_act)
    memories = []
    chunk = loss_chunk(desc, layout, job)
    stages = (_distinct_stages if distinct else _all_stages)(desc, dims.tp, dims.pp, layout.knobs.persistence_threshold)
    for index, shape in stages:
        in_flight = min(dims.pp - index, layout.grad_accum) if dims.pp > 1 else 1
        edge = _edge_activation_bytes(desc, shape, micro_batch=layout.micro_batch, seq_len=job.seq_len,
                                      tp=dims.tp, precision=job.precision, cp=dims.cp, chunked=chunk is not None,
                                      sequence_parallel=layout.sequence_parallel)
        train = trained(desc, shape, job)
        states = _model_states(desc, shape, layout, job, train)
        hpz = states.pop("hpz_secondary")
        memories.append(Memory(**states, activations=in_flight * (shape.layers * kept + edge),
                               buffers=_buffers(desc, shape, layout, job, layer_act, train), stage=index,
                               parts={"params_elements": shape.params, "layers": shape.layers,
                                      "trainable_elements": train.elements, "hpz_secondary": hpz,
                                      "persistent_elements": shape.persistent, "loss_chunk_tokens": chunk}))
    return memories


def _all_stages(desc: ModelDesc, tp: int, pp: int, threshold: int) -> list[tuple[int, StageShape]]:
    return list(enumerate(stage_shapes(desc, tp, pp, threshold)))


@lru_cache(maxsize=4096)  # (asked for by every layout the search costs)
def _distinct_stages(desc: ModelDesc, tp: int, pp: int, threshold: int) -> tuple[tuple[int, StageShape], ...]:
    """(index, shape) of the first stage of each shape."""
    first: dict[StageShape, int] = {}
    for index, shape in enumerate(stage_shapes(desc, tp, pp, threshold)):
        first.setdefault(shape, index)
    return tuple((index, shape) for shape, index in first.items())


def memory_per_rank(desc: ModelDesc, layout: Layout, job: Workload) -> Memory:
    """The busiest stage's rank: the one whose total is largest (the first such stage)."""
    return max(stage_memories(desc, layout, job, distinct=True), key=lambda memory: memory.total)


@lru_cache(maxsize=4096)  # (asked for by every layout the search costs)
def _busiest_stage_params(desc: ModelDesc, tp: int, pp: int) -> int:
    return max(shape.params for shape in stage_shapes(desc, tp, pp))


# --- host memory per node -------------------------------------------------------------------------

@dataclass(frozen=True)
class HostMemory:
    """Bytes of one node's host memory in each phase of a run (see the module docstring)."""

    build: float    # its ranks' shares, built in fp32, + one dense tensor each in flight
    offload: float  # its ranks' offloaded states while training (Memory.cpu_per_rank each)
    export: float   # `dsf export` on one host: one output shard + one input tensor group

    @property
    def train(self) -> float:
        return self.build + self.offload

    @property
    def peak(self) -> float:
        return max(self.train, self.export)

    @property
    def phase(self) -> str:
        """What the peak is for, as a phrase: 'to build the model', 'to export the model', ..."""
        if self.export > self.train:
            return "to export the model (dsf export, one host)"
        return "to build the model and hold its offloaded states" if self.offload else "to build the model"

    def as_dict(self) -> dict[str, float]:
        return {"build": self.build, "offload": self.offload, "export": self.export, "peak": self.peak}


def largest_tensor(desc: ModelDesc) -> int:
    """Elements of the model's largest single dense tensor (typically the vocab x hidden embedding)."""
    return max(desc.embedding_params, desc.head_params, desc.position_params, *(n for n, _ in desc.layer_tensors))


def build_bytes_per_rank(desc: ModelDesc, layout: Layout) -> float:
    """Host bytes a rank peaks at while it builds or loads its share (busiest stage, fp32)."""
    share = _busiest_stage_params(desc, layout.dims.tp, layout.dims.pp)
    if layout.dims.zero_stage == 3:
        share = share / layout.dims.zero_ranks
    return BUILD_BYTES * (share + largest_tensor(desc))


def export_bytes(desc: ModelDesc, *, shard_bytes: float = EXPORT_SHARD_BYTES) -> float:
    """Host bytes of a streaming `dsf export`: one fp32 output shard plus one input tensor group."""
    largest = 4 * largest_tensor(desc)
    shard = max(min(shard_bytes, 4 * desc.total_params), largest)  # a tensor never spans shards
    return shard + largest


def host_memory_per_node(desc: ModelDesc, layout: Layout, memory: Memory, *, ranks_per_node: int,
                         export_shard_bytes: float = EXPORT_SHARD_BYTES) -> HostMemory:
    """One node's host memory for `layout`: `memory` is memory_per_rank's (its offloaded bytes)."""
    return HostMemory(build=ranks_per_node * build_bytes_per_rank(desc, layout),
                      offload=ranks_per_node * memory.cpu_per_rank,
                      export=export_bytes(desc, shard_bytes=export_shard_bytes))
