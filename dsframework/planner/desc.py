"""What the planner knows of a model (ModelDesc: shapes, parameter counts, FLOPs) and one tensor
rank's parameters (TensorShares), imported without torch: the search, the memory and speed models
and `dsf plan`'s disk cache read them; planner/model.py's `describe_model` counts them on the model,
planner/analytic.py's `analytic_desc` from the config alone (plain dense decoders).

    desc = describe_model(config)     # planner/model.py (builds the model on the meta device)
    desc.total_params, desc.flops_per_token(seq_len=4096), desc.shares(2).items, desc.tp_problem(8)

Both describers read a ModelDesc's features through the rules at the end of this module
(`layer_features`, `activation_of`, `dropout_of`, `tensors_split`, `unsplit_matrices`): the same
rule, fed the meta model's modules by one and a decoder layer's tensors, listed, by the other.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol


@dataclass(frozen=True)
class TensorShares:
    """One tensor rank's parameters at a tensor-parallel size, per pipeline layer."""

    tp: int
    # Per pipeline layer (the pipeline's LayerSpecs: embedding, decoder layers, final norm, head; or,
    # without a pipeline adapter, the same parts found in the module tree): the elements of each of
    # its tensors on this rank, and its kind ("embed", "layer", "norm", "head"). A tied head holds
    # the embedding's tensor (its copy on the last stage).
    items: tuple[tuple[tuple[int, ...], str], ...]

    @cached_property
    def layer(self) -> tuple[int, ...]:
        """The tensors of the largest decoder layer."""
        return max((sizes for sizes, kind in self.items if kind == "layer"), key=sum)


class SharesByTp:
    """What a model's counts answer per tensor-parallel size, over `_count_or_why(tp)` (its
    TensorShares, or why tp cannot split the model), each tp asked once and kept in `_shares`:
    count.ModelCounts counts on the model, desc_cache.CachedCounts reads them back from disk."""

    _shares: dict[int, TensorShares | str]

    def _count_or_why(self, tp: int) -> TensorShares | str:
        raise NotImplementedError

    def _compute(self, tp: int) -> TensorShares | str:
        if tp not in self._shares:
            self._shares[tp] = self._count_or_why(tp)
        return self._shares[tp]

    def tp_problem(self, tp: int) -> str | None:
        """None when tensor parallelism splits this model over `tp` ranks, else its reason."""
        shares = self._compute(tp)
        return shares if isinstance(shares, str) else None

    def shares(self, tp: int) -> TensorShares:
        """One rank's TensorShares at `tp` (ValueError when tp_problem says it cannot)."""
        shares = self._compute(tp)
        if isinstance(shares, str):
            raise ValueError(f"tp={tp}: {shares}")
        return shares

    def computed(self) -> dict[int, TensorShares | str]:
        """Every tp counted so far: its TensorShares, or why it cannot (planner/desc_cache.py keeps them)."""
        return dict(self._shares)


class Counts(Protocol):
    """What a ModelDesc asks of its counts: count.ModelCounts, or desc_cache.CachedCounts (read back
    from disk, no torch)."""

    pipeline_problem: str | None

    def tp_problem(self, tp: int) -> str | None: ...

    def shares(self, tp: int) -> TensorShares: ...

    def computed(self) -> dict[int, TensorShares | str]: ...

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
    counts: Counts | None = field(default=None, compare=False, repr=False)  # per tp and stage

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


# --- the rules both describers read a ModelDesc's fields by (planner/model.py, planner/analytic.py) ---

def problem_text(error: Exception) -> str:
    """What tp_problem / pp_problem say for a refusal: its first line (its type's name if it has none)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def layer_features(config: Any, named: Sequence[tuple[str, tuple[int, ...]]], norms: Sequence[tuple[str, str]], *,
                   q: int, kv: int, ffn: int) -> dict[str, Any]:
    """What the activation count needs from one decoder layer: `named` its matrices (path in the
    layer, shape), `norms` its norm modules (path, class name). A gated MLP (its matrices of width ffn
    or 2 ffn hold 3 x hidden x ffn), a fused q|k|v projection (a matrix q + 2 kv wide), its norms
    (those of the layer itself and, inside attention, q/k norms) and their kind."""
    h = config.hidden_size
    matrices = [shape for _, shape in named]
    # (gate|up fused: 2 ffn); attention's matrices left out, whose fused q|k|v may be 2 ffn wide too
    mlp = sum(a * b for name, (a, b) in named if "att" not in name and {a, b} & {ffn, 2 * ffn})
    layer_norms = [kind for name, kind in norms if "." not in name]
    return dict(gated_mlp=mlp >= 3 * h * ffn, fused_qkv=any(q + 2 * kv in shape for shape in matrices),
                layer_norms=len(layer_norms), qk_norm=any("." in name for name, _ in norms),
                norms_share_input=len(layer_norms) >= 2 and bool(getattr(config, "use_parallel_residual", False)),
                norm="rms" if any("RMS" in kind for kind in layer_norms) else "layer")


def activation_of(config: Any) -> str:
    """The MLP's activation function, as the config names it (GPT-2's default: gelu)."""
    for field_name in ("hidden_activation", "hidden_act", "activation_function"):
        if getattr(config, field_name, None):
            return getattr(config, field_name)
    return "gelu"


def dropout_of(config: Any) -> float:
    """The largest dropout probability in the layers (residual, attention, hidden)."""
    fields = ("resid_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "residual_dropout")
    return max([float(getattr(config, f, 0.0) or 0.0) for f in fields])


def tensors_split(whole: Sequence[tuple[int, bool]], counts: Counts, *, first: int) -> tuple[tuple[int, bool], ...]:
    """The first decoder layer's tensors at tp = 1, `whole` its (elements, a matrix?) in order:
    (elements, split by tensor parallelism?), the split read from a rank of tp = 2 (`first`: the
    layer's index among the pipeline layers); where tp cannot split the model, assumed of its matrices."""
    if counts.tp_problem(2) is not None:
        return tuple(whole)
    halves = counts.shares(2).items[first][0]
    return tuple((n, half < n) for (n, _), half in zip(whole, halves))


def unsplit_matrices(layers: Sequence[Sequence[tuple[str, int, int]]], counts: Counts, *, first: int) -> dict[str, Any]:
    """The decoder layers' matrices a rank of tp = 2 holds whole, `layers` each layer's tensors
    (path, elements, dimensions) in order (none where tp cannot split the model: the planner then
    counts every matrix as split, as for a dense model)."""
    if counts.tp_problem(2) is not None:
        return dict(matrices_unsplit=0, experts_unsplit=False)
    whole, experts = 0, False
    for index, tensors in enumerate(layers):
        halves = counts.shares(2).items[first + index][0]
        for (name, numel, dim), half in zip(tensors, halves):
            if dim > 1 and half == numel:
                whole += half
                experts = experts or ".experts." in f".{name}"
    return dict(matrices_unsplit=whole, experts_unsplit=experts)
