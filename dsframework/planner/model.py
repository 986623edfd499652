"""What the planner needs to know about a model: its shapes, parameter counts and FLOPs.

    desc = describe_model(resolve_model(ModelSpec(name="llama-7b")).config)
    desc.total_params                 # 6,738,415,616 (exact)
    desc.flops_per_token(seq_len=4096)  # forward + backward, attention included

Counts are exact and analytic for the Llama family (llama, mistral, qwen2) and GPT-2, and split
the way tensor parallelism splits them (`layer_sharded` / `layer_replicated`); any other causal
LM is built on the meta device (no memory, no weights) and counted module by module, with every
layer parameter assumed shardable. Pure: no torch.distributed, no disk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsframework.models.families import family_of
from dsframework.models.hf import causal_lm_class

# (Counts are exact, so the planner can be checked against a live engine to the byte.)


@dataclass(frozen=True)
class ModelDesc:
    """A decoder-only transformer, counted. Parameters are numbers of elements."""

    name: str
    family: str  # "llama", "gpt2" or "generic"
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    embedding_params: int  # token embedding (vocab x hidden), split by vocab under tp
    position_params: int  # learned positions (GPT-2), replicated
    layer_tensors: tuple[tuple[int, bool], ...]  # one decoder layer: (elements, split by tp?) per tensor
    final_norm_params: int
    head_params: int  # untied lm_head (0 when tied to the embedding), split by vocab
    tied: bool
    dropout: float = 0.0  # residual/attention dropout probability (GPT-2 presets: 0 or 0.1)
    activation: str = "silu"  # the MLP's activation function, as the config names it (hidden_act,
    #                           GPT-2's activation_function): what autograd saves depends on it

    @property
    def layer_sharded(self) -> int:
        """One decoder layer's parameters that tensor parallelism splits."""
        return sum(n for n, sharded in self.layer_tensors if sharded)

    @property
    def layer_replicated(self) -> int:
        """... and those every tensor rank keeps whole (norms, row-parallel biases)."""
        return sum(n for n, sharded in self.layer_tensors if not sharded)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        return self.layer_sharded + self.layer_replicated

    @property
    def total_params(self) -> int:
        return (self.embedding_params + self.position_params + self.layers * self.layer_params
                + self.final_norm_params + self.head_params)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward).

        Forward: 2 FLOPs per multiply-add of every matmul weight (the decoder layers' linear
        layers and the output head; embedding lookups cost none) plus attention's two
        [s x s] products, QK^T and AV: 2 x 2 x seq_len x hidden per layer per token (counted in
        full, as Megatron's and PaLM's MFU formulas do, though causal kernels skip half).
        """
        matmul = self.layers * self.layer_sharded + self.vocab * self.hidden
        attention = 4 * self.layers * seq_len * self.hidden
        return 3.0 * (2.0 * matmul + attention)


def _llama(config: Any, name: str) -> ModelDesc:
    h, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    ffn = config.intermediate_size
    qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    tensors = [(h * q, True), (h * kv, True), (h * kv, True), (q * h, True),  # q, k, v, o
               (h * ffn, True), (h * ffn, True), (ffn * h, True), (h, False), (h, False)]  # mlp; norms
    if qkv_bias:  # column biases split with their rows; o_proj's (llama only) is replicated
        tensors += [(q, True), (kv, True), (kv, True)] + ([(h, False)] if config.model_type != "qwen2" else [])
    if mlp_bias:
        tensors += [(ffn, True), (ffn, True), (h, False)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return ModelDesc(name=name, family="llama", hidden=h, ffn=ffn, heads=heads, kv_heads=kv_heads,
                     layers=config.num_hidden_layers, vocab=config.vocab_size,
                     embedding_params=config.vocab_size * h, position_params=0, layer_tensors=tuple(tensors),
                     final_norm_params=h,
                     head_params=0 if tied else config.vocab_size * h, tied=tied,
                     activation=getattr(config, "hidden_act", None) or "silu")


def _gpt2(config: Any, name: str) -> ModelDesc:
    h = config.n_embd
    ffn = config.n_inner or 4 * h
    tensors = ((h * 3 * h, True), (3 * h, True), (h * h, True), (h, False),  # c_attn, attn c_proj
               (h * ffn, True), (ffn, True), (ffn * h, True), (h, False),  # c_fc, mlp c_proj
               (h, False), (h, False), (h, False), (h, False))  # ln_1, ln_2 (weight, bias)
    dropout = max(config.resid_pdrop, config.attn_pdrop)
    return ModelDesc(name=name, family="gpt2", hidden=h, ffn=ffn, heads=config.n_head, kv_heads=config.n_head,
                     layers=config.n_layer, vocab=config.vocab_size, embedding_params=config.vocab_size * h,
                     position_params=config.n_positions * h, layer_tensors=tensors,
                     final_norm_params=2 * h, head_params=0, tied=True, dropout=dropout,
                     activation=config.activation_function)


def _generic(config: Any, name: str) -> ModelDesc:
    """Count a weightless instance: the first decoder layer, the embeddings, the rest."""
    import torch

    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    base = model.base_model
    layers = next(m for m in base.children() if isinstance(m, torch.nn.ModuleList))
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    embedding = count(model.get_input_embeddings())
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    head = 0 if tied or model.get_output_embeddings() is None else count(model.get_output_embeddings())
    total = sum(p.numel() for p in model.parameters())
    layer_tensors = tuple((p.numel(), p.dim() > 1) for p in layers[0].parameters())  # matrices split
    rest = total - embedding - head - len(layers) * sum(n for n, _ in layer_tensors)
    h = config.hidden_size
    heads = config.num_attention_heads
    return ModelDesc(name=name, family="generic", hidden=h, ffn=getattr(config, "intermediate_size", 4 * h),
                     heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                     layers=len(layers), vocab=config.vocab_size, embedding_params=embedding, position_params=0,
                     layer_tensors=layer_tensors, final_norm_params=rest, head_params=head, tied=tied,
                     activation=getattr(config, "hidden_act", None) or getattr(config, "activation_function", "gelu"))


def describe_model(config: Any, *, name: str | None = None) -> ModelDesc:
    """The ModelDesc of a transformers config (see the module docstring)."""
    name = name or getattr(config, "name_or_path", None) or config.model_type
    count = {"llama": _llama, "gpt2": _gpt2}.get(family_of(config.model_type), _generic)
    return count(config, name)
