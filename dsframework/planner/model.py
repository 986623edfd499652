"""What the planner needs to know about a model: its shapes, parameter counts and FLOPs.

    desc = describe_model(resolve_model(ModelSpec(name="llama-7b")).config)
    desc.total_params                 # 6,738,415,616 (exact)
    desc.flops_per_token(seq_len=4096)  # forward + backward, attention included
    desc.shares(2).items              # one tensor rank's tensors at tp=2, per pipeline layer
    desc.tp_problem(8)                # None, or why tp=8 cannot run this architecture
    desc.pp_problem                   # None, or why it cannot be cut into pipeline stages

Counts are exact for every architecture: the model is built on the meta device (no memory, no
weights), sharded for one tensor rank as dsf train shards it and cut where its pipeline cuts it
(planner/count.py). What the activation count needs is read from the config and the layer's
modules, not from a family name: a gated MLP or not, fused q|k|v, attention and key/value heads
and head_dim, the layer's norms and their kind, q/k norms, a sliding window, the activation
function, dropout. No torch.distributed, no disk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

from dsframework.models.experts import AUTOEP_MODEL_TYPES, expert_layout
from dsframework.models.plans import context_parallel_problem, sliding_window
from dsframework.planner.count import ModelCounts, TensorShares, model_counts
from dsframework.types import HFConfig

# (Counts are exact, so the planner can be checked against a live engine to the byte.)


@dataclass(frozen=True)
class ModelDesc:
    """A decoder-only transformer, counted. Parameters are numbers of elements (at tp = 1)."""

    name: str
    model_type: str  # transformers' (the architecture: what shard_model and the pipeline adapt)
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int  # config.head_dim, else hidden / heads
    layers: int
    vocab: int
    embedding_params: int  # token embedding (vocab x hidden), split by vocab under tp
    position_params: int  # the rest of the embedding layer (learned positions: GPT-2), replicated
    layer_tensors: tuple[tuple[int, bool], ...]  # the first decoder layer: (elements, split by tp?) per tensor
    final_norm_params: int  # every parameter outside the embedding, the decoder layers and the head
    head_params: int  # untied lm_head (0 when tied to the embedding), split by vocab
    tied: bool
    total_params: int
    dropout: float = 0.0  # residual/attention dropout probability (GPT-2 presets: 0 or 0.1)
    activation: str = "silu"  # the MLP's activation function, as the config names it (hidden_act,
    #                           GPT-2's activation_function): what autograd saves depends on it
    gated_mlp: bool = True  # act(gate) * up (SwiGLU, GeGLU), else act(fc)
    fused_qkv: bool = False  # one q|k|v projection whose output is split (GPT-2, Phi-3, GPT-NeoX)
    layer_norms: int = 2  # norms of a decoder layer (2 pre-norms; Gemma 2/3: 4, OLMo 2: 2 post-norms)
    norm: Literal["rms", "layer"] = "rms"  # RMSNorm or LayerNorm
    qk_norm: bool = False  # norms on the queries and keys (Qwen3, Gemma 3, OLMo 2)
    norms_share_input: bool = False  # a parallel residual's two norms read one input (GPT-NeoX): kept once
    sliding_window: int | None = None  # tokens a sliding-window layer attends to (None: all)
    eager_attention: bool = False  # transformers picks eager attention (Gemma 2): s x s scores are kept
    attn_softcapping: bool = False  # tanh-capped attention scores (Gemma 2): one more s x s tensor
    logit_softcapping: bool = False  # tanh-capped logits (Gemma 2): one more logits-sized tensor
    cp_problem: str | None = None  # why context parallelism cannot split it at any length (plans.py)
    experts: int = 0  # routed experts of a mixture of experts (0: dense)
    top_k: int = 0  # experts each token goes to
    routed_params: int = 0  # the routed experts' parameters, all layers (what expert parallelism splits)
    expert_matrix: int = 0  # one layer's down projections of all experts (experts x hidden x ffn elements)
    # The decoder layers' matrices tensor parallelism leaves whole on every tensor rank (experts a
    # plan does not shard: transformers 5.25's MoE plans shard attention only), all layers; and
    # whether the routed experts are among them (then each tensor rank runs every routed expert).
    matrices_unsplit: int = 0
    experts_unsplit: bool = False
    autoep: bool = False  # DeepSpeed's AutoEP has a preset for its model type (parallel.ep > 1 can run)
    counts: ModelCounts | None = field(default=None, compare=False, repr=False)  # per tp and stage

    @property
    def layer_sharded(self) -> int:
        """One decoder layer's parameters that tensor parallelism splits."""
        return sum(n for n, sharded in self.layer_tensors if sharded)

    @property
    def layer_replicated(self) -> int:
        """... and those every tensor rank keeps whole (norms, row-parallel biases)."""
        return sum(n for n, sharded in self.layer_tensors if not sharded)

    @property
    def layer_params(self) -> int:
        return self.layer_sharded + self.layer_replicated

    @property
    def pp_problem(self) -> str | None:
        """None when the pipeline cuts this model into stages, else why not."""
        assert self.counts is not None  # describe_model sets it
        return self.counts.pipeline_problem

    def tp_problem(self, tp: int) -> str | None:
        """None when tensor parallelism splits this model over `tp` ranks, else why not."""
        if tp == 1:
            return None
        assert self.counts is not None  # describe_model sets it
        return self.counts.tp_problem(tp)

    def shares(self, tp: int) -> TensorShares:
        """One tensor rank's tensors at `tp`, per pipeline layer (planner/count.py)."""
        assert self.counts is not None  # describe_model sets it
        return self.counts.shares(tp)

    @property
    def idle_expert_params(self) -> int:
        """The routed experts' parameters a token does not pass through (experts - top_k of them)."""
        return self.routed_params * (self.experts - self.top_k) // self.experts if self.experts else 0

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: all of a dense model's."""
        return self.total_params - self.idle_expert_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward).

        Forward: 2 FLOPs per multiply-add of every matmul weight (the decoder layers' linear
        layers and the output head; embedding lookups cost none) plus attention's two
        [s x s] products, QK^T and AV: 2 x 2 x seq_len x hidden per layer per token (counted in
        full, as Megatron's and PaLM's MFU formulas do, though causal kernels skip half).
        """
        matmul = (self.layers * self.layer_sharded + self.matrices_unsplit + self.vocab * self.hidden
                  - self.idle_expert_params)
        attention = 4 * self.layers * seq_len * self.hidden
        return 3.0 * (2.0 * matmul + attention)

    def unsplit_flops_per_token(self) -> float:
        """Of `flops_per_token`, the matmuls each tensor rank runs whole (`matrices_unsplit`, the
        experts a token passes through when they are among them): tensor parallelism divides the rest."""
        return 6.0 * (self.matrices_unsplit - (self.idle_expert_params if self.experts_unsplit else 0))


def _features(config: HFConfig, layer: Any, *, q: int, kv: int, ffn: int) -> dict[str, Any]:
    """What the activation count needs from one decoder layer's modules: a gated MLP (its matrices
    of width ffn or 2 ffn hold 3 x hidden x ffn), a fused q|k|v projection (a matrix q + 2 kv wide), its norms (those of
    the layer itself and, inside attention, q/k norms) and their kind."""
    h = config.hidden_size
    named = [(name, tuple(p.shape)) for name, p in layer.named_parameters() if p.dim() == 2]
    matrices = [shape for _, shape in named]
    # (gate|up fused: 2 ffn); attention's matrices left out, whose fused q|k|v may be 2 ffn wide too
    mlp = sum(a * b for name, (a, b) in named if "att" not in name and {a, b} & {ffn, 2 * ffn})
    norms = [(name, type(module).__name__) for name, module in layer.named_modules() if "Norm" in type(module).__name__]
    layer_norms = [kind for name, kind in norms if "." not in name]
    return dict(gated_mlp=mlp >= 3 * h * ffn, fused_qkv=any(q + 2 * kv in shape for shape in matrices),
                layer_norms=len(layer_norms), qk_norm=any("." in name for name, _ in norms),
                norms_share_input=len(layer_norms) >= 2 and bool(getattr(config, "use_parallel_residual", False)),
                norm="rms" if any("RMS" in kind for kind in layer_norms) else "layer")


def _experts(config: HFConfig, model: Any) -> dict[str, Any]:
    """A mixture of experts' routed experts, top-k and their parameters (on the meta model)."""
    moe = expert_layout(config)
    if moe is None:
        return {}
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    down = next((p.numel() for name, p in model.named_parameters() if name.endswith(".experts.down_proj")), 0)
    return dict(experts=moe.experts, top_k=moe.top_k, routed_params=routed, expert_matrix=down,
                autoep=config.model_type in AUTOEP_MODEL_TYPES)


def _activation(config: HFConfig) -> str:
    for field_name in ("hidden_activation", "hidden_act", "activation_function"):
        if getattr(config, field_name, None):
            return getattr(config, field_name)
    return "gelu"


def _dropout(config: HFConfig) -> float:
    """The largest dropout probability in the layers (residual, attention, hidden)."""
    fields = ("resid_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "residual_dropout")
    return max([float(getattr(config, f, 0.0) or 0.0) for f in fields])


def _tp1_layer_tensors(counts: ModelCounts, layer: Any) -> tuple[tuple[int, bool], ...]:
    """One decoder layer's tensors at tp = 1: (elements, split by tensor parallelism?), the split
    read from a rank of tp = 2 (or, where the model cannot be split, assumed of its matrices)."""
    whole = [(p.numel(), p.dim() > 1) for p in layer.parameters()]
    if counts.tp_problem(2) is not None:
        return tuple(whole)
    first = next(i for i, (_, kind) in enumerate(counts.specs_paths) if kind == "layer")
    halves = counts.shares(2).items[first][0]
    return tuple((n, half < n) for (n, _), half in zip(whole, halves))


def _unsplit_matrices(counts: ModelCounts, layers: Any) -> dict[str, Any]:
    """The decoder layers' matrices a rank of tp = 2 holds whole (none where tp cannot split the
    model: the planner then counts every matrix as split, as for a dense model)."""
    if counts.tp_problem(2) is not None:
        return dict(matrices_unsplit=0, experts_unsplit=False)
    first = next(i for i, (_, kind) in enumerate(counts.specs_paths) if kind == "layer")
    whole, experts = 0, False
    for index, layer in enumerate(layers):
        halves = counts.shares(2).items[first + index][0]
        for (name, param), half in zip(layer.named_parameters(), halves):
            if param.dim() > 1 and half == param.numel():
                whole += half
                experts = experts or ".experts." in f".{name}"
    return dict(matrices_unsplit=whole, experts_unsplit=experts)


def describe_model(config: HFConfig, *, name: str | None = None) -> ModelDesc:
    """The ModelDesc of a transformers config (see the module docstring)."""
    name = name or cast("str | None", getattr(config, "name_or_path", None)) or config.model_type
    counts = model_counts(config)
    model = counts.model
    h, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    layers = model.get_submodule(counts.layers_path)
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    head_params = 0 if tied or head is None else sum(p.numel() for p in head.parameters())
    first = counts.shares(1).items[0][0]
    position = sum(first) - embedding
    total = sum(p.numel() for p in model.parameters())
    all_layers = sum(p.numel() for p in layers.parameters())
    return ModelDesc(
        name=name, model_type=config.model_type, hidden=h, ffn=ffn, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, layers=len(layers), vocab=config.vocab_size, embedding_params=embedding,
        position_params=position, layer_tensors=_tp1_layer_tensors(counts, layers[0]),
        final_norm_params=total - embedding - position - all_layers - head_params, head_params=head_params,
        tied=tied, total_params=total, dropout=_dropout(config), activation=_activation(config),
        sliding_window=sliding_window(config), eager_attention=model.config._attn_implementation == "eager",
        attn_softcapping=bool(getattr(config, "attn_logit_softcapping", None)),
        logit_softcapping=bool(getattr(config, "final_logit_softcapping", None)),
        cp_problem=context_parallel_problem(config), **_experts(config, model), **_unsplit_matrices(counts, layers),
        **_features(config, layers[0], q=heads * head_dim, kv=kv_heads * head_dim, ffn=ffn), counts=counts)
