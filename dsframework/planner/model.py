"""What the planner needs to know about a model (a ModelDesc, planner/desc.py), counted on the model.

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
function, dropout. No torch.distributed, no disk (planner/desc_cache.py keeps what `dsf plan` counted).
"""
from __future__ import annotations

from typing import Any, cast

from dsframework.models.experts import AUTOEP_MODEL_TYPES, expert_layout
from dsframework.models.plans import context_parallel_problem, sliding_window
from dsframework.planner.count import ModelCounts, model_counts
from dsframework.planner.desc import (Counts, ModelDesc, TensorShares, activation_of, dropout_of, layer_features,
                                      tensors_split, unsplit_matrices)
from dsframework.types import HFConfig

__all__ = ["Counts", "ModelDesc", "TensorShares", "describe_model"]  # ModelDesc's home is planner/desc.py


def _features(config: HFConfig, layer: Any, *, q: int, kv: int, ffn: int) -> dict[str, Any]:
    """desc.layer_features of one decoder layer's modules: its matrices and its norm modules."""
    named = [(name, tuple(p.shape)) for name, p in layer.named_parameters() if p.dim() == 2]
    norms = [(name, type(module).__name__) for name, module in layer.named_modules() if "Norm" in type(module).__name__]
    return layer_features(config, named, norms, q=q, kv=kv, ffn=ffn)


def _experts(config: HFConfig, model: Any) -> dict[str, Any]:
    """A mixture of experts' routed experts, top-k and their parameters (on the meta model)."""
    moe = expert_layout(config)
    if moe is None:
        return {}
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    down = next((p.numel() for name, p in model.named_parameters() if name.endswith(".experts.down_proj")), 0)
    return dict(experts=moe.experts, top_k=moe.top_k, routed_params=routed, expert_matrix=down,
                autoep=config.model_type in AUTOEP_MODEL_TYPES)


def _first_layer(counts: ModelCounts) -> int:
    """The first decoder layer's index among the pipeline layers (asked only where tp = 2 splits the
    model: the rules read its tp = 2 share; 0, unread, otherwise)."""
    if counts.tp_problem(2) is not None:
        return 0
    return next(i for i, (_, kind) in enumerate(counts.specs_paths) if kind == "layer")


def _tp1_layer_tensors(counts: ModelCounts, layer: Any) -> tuple[tuple[int, bool], ...]:
    """One decoder layer's tensors at tp = 1: (elements, split by tensor parallelism?) (desc.tensors_split)."""
    whole = [(p.numel(), p.dim() > 1) for p in layer.parameters()]
    return tensors_split(whole, counts, first=_first_layer(counts))


def _unsplit_matrices(counts: ModelCounts, layers: Any) -> dict[str, Any]:
    """The decoder layers' matrices a rank of tp = 2 holds whole (desc.unsplit_matrices)."""
    tensors = [[(name, p.numel(), p.dim()) for name, p in layer.named_parameters()] for layer in layers]
    return unsplit_matrices(tensors, counts, first=_first_layer(counts))


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
        tied=tied, total_params=total, dropout=dropout_of(config), activation=activation_of(config),
        sliding_window=sliding_window(config), eager_attention=model.config._attn_implementation == "eager",
        attn_softcapping=bool(getattr(config, "attn_logit_softcapping", None)),
        logit_softcapping=bool(getattr(config, "final_logit_softcapping", None)),
        cp_problem=context_parallel_problem(config), **_experts(config, model), **_unsplit_matrices(counts, layers),
        **_features(config, layers[0], q=heads * head_dim, kv=kv_heads * head_dim, ffn=ffn), counts=counts)
