"""A plain dense decoder (Llama, Mistral, Qwen2, Qwen3) counted from its config alone: the ModelDesc that
planner/model.py's `describe_model` counts on the meta-device model, every field and every tensor rank's
share the same, without importing torch or transformers (what most of a cold `dsf plan` paid for).

    fields = config_fields("llama-7b")                  # models/presets.py: a preset's or a config.json's fields
    desc = analytic_desc(fields, name="llama-7b")       # a ModelDesc, or None: count it on the model
    desc = analytic_desc(fields, name="x", overrides={"num_hidden_layers": 4})   # a run's model.overrides
    desc = analytic_desc(config, name="mine")           # a transformers config at hand (its to_diff_dict)
    desc.shares(8).items, desc.tp_problem(3), desc.pp_problem

None whenever it cannot be sure of describe_model's answer, and the caller counts on the model (which
gives the answer, or transformers' own error): a model type outside FAMILIES, a field FAMILIES does not
list (whatever it changes: experts, softcapping, an attention implementation, sliding layers in a
Llama), a value transformers' strict config refuses or warns about, a RoPE other than the default and
llama3's, an override outside OVERRIDABLE. The rules are the meta
count's own, read from the same torch-free code: the tensor-parallel plan and its refusals from
models/plans.py (`architecture_plan`, `architecture_problem`, STYLES), each split by errors.divide in
the Megatron layers' words, the vocabulary's padding from runtime_facts.padded_vocab, the ModelDesc's
features from planner/desc.py. tests/unit/test_plan_analytic.py checks it against describe_model, field
by field and tp by tp, and pins FAMILIES to transformers' config classes and modules.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from dsframework.errors import UserError, divide
from dsframework.models.plans import (STYLES, architecture_plan, architecture_problem, context_parallel_problem,
                                      pattern_regex, sliding_window)
from dsframework.planner.desc import (ModelDesc, SharesByTp, TensorShares, activation_of, dropout_of, layer_features,
                                      problem_text, tensors_split, unsplit_matrices)
from dsframework.runtime_facts import padded_vocab
from dsframework.types import HFConfig

Check = Callable[[Any], bool]


def _size(value: Any) -> bool:
    return type(value) is int and value > 0


def _flag(value: Any) -> bool:
    return type(value) is bool


def _real(value: Any) -> bool:  # transformers' strict fields: a float field refuses an int
    return type(value) is float


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _text(value: Any) -> bool:
    return type(value) is str


def _token(value: Any) -> bool:  # (its range is checked against the vocabulary in _consistent)
    return value is None or type(value) is int


def _maybe(check: Check) -> Check:
    return lambda value: value is None or check(value)


# Activations without parameters (an xIELU has some), each in transformers' ACT2CLS (pinned by the tests).
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
DTYPES = ("float32", "float16", "bfloat16")
LAYER_TYPES = ("full_attention", "sliding_attention")

# Fields every family's config takes, with the values transformers takes without a word.
COMMON: dict[str, Check] = {
    "model_type": _text, "transformers_version": _text, "_name_or_path": _text,
    "architectures": _maybe(lambda v: type(v) is list and all(_text(x) for x in v)),
    "torch_dtype": _maybe(lambda v: v in DTYPES), "dtype": _maybe(lambda v: v in DTYPES),
    "vocab_size": _size, "hidden_size": _size, "intermediate_size": _size, "num_hidden_layers": _size,
    "num_attention_heads": _size, "hidden_act": lambda v: _text(v) and v in ACTIVATIONS,
    "max_position_embeddings": _size, "initializer_range": lambda v: _real(v) and 0.0 <= v <= 1.0,
    "rms_norm_eps": _real, "use_cache": _flag, "tie_word_embeddings": _flag, "attention_dropout": _real,
    "pad_token_id": _token, "bos_token_id": _token,
    "eos_token_id": lambda v: _token(v) or (type(v) is list and all(type(t) is int for t in v)),
    "rope_theta": _number, "rope_parameters": _maybe(lambda v: type(v) is dict),
    "rope_scaling": _maybe(lambda v: type(v) is dict),
}
# Fields a run's model.overrides may set here: fields of every family's config class (tests pin it).
OVERRIDABLE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings")


@dataclass(frozen=True)
class Family:
    """One model type: its config class's fields (beyond COMMON) and their defaults, and its decoder
    layer (transformers 5.25's; tests/unit/test_plan_analytic.py pins each to the library)."""

    fields: Mapping[str, Check]  # what its config may hold beyond COMMON
    defaults: Mapping[str, Any]  # the class's value of each field the count reads, when the config omits it
    qkv_bias: bool | str  # the q, k, v projections' bias: a constant, or the config field that says
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool  # RMS norms on each head's queries and keys (Qwen3)
    windows: bool  # Qwen's use_sliding_window / max_window_layers / layer_types decide the sliding layers
    tp_plan: Mapping[str, str]  # base_model_tp_plan, in its order (shard_model applies it in that order)
    pp_plan: tuple[str, ...] = ("embed_tokens", "layers", "norm")  # base_model_pp_plan's names


_LLAMA_TP = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
             "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
             "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
             "layers.*.mlp.down_proj": "rowwise"}
_QWEN3_TP = {**dict(list(_LLAMA_TP.items())[:3]), "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
             "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce", **dict(list(_LLAMA_TP.items())[3:])}
_SHAPE = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
          "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0}
_QWEN_WINDOWS = {"use_sliding_window": _flag, "sliding_window": _maybe(_size), "max_window_layers": _size,
                 "layer_types": _maybe(lambda v: type(v) is list)}
_QWEN = {**_SHAPE, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
         "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
         "max_window_layers": 28, "layer_types": None, "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None}

FAMILIES: dict[str, Family] = {
    "llama": Family(
        fields={"num_key_value_heads": _maybe(_size), "head_dim": _maybe(_size), "attention_bias": _flag,
                "mlp_bias": _flag, "pretraining_tp": _maybe(_size)},
        defaults={**_SHAPE, "intermediate_size": 11008, "num_key_value_heads": None, "head_dim": None,
                  "max_position_embeddings": 2048, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
                  "attention_bias": False, "mlp_bias": False},
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False, windows=False,
        tp_plan=_LLAMA_TP),
    "mistral": Family(
        fields={"num_key_value_heads": _size, "head_dim": _maybe(_size), "sliding_window": _maybe(_size)},
        defaults={**_SHAPE, "intermediate_size": 14336, "num_key_value_heads": 8, "head_dim": None,
                  "max_position_embeddings": 131072, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
                  "sliding_window": 4096},
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, windows=False, tp_plan=_LLAMA_TP),
    "qwen2": Family(  # no head_dim field: hidden / heads, unless the config.json names one
        fields={"num_key_value_heads": _maybe(_size), "head_dim": _size, **_QWEN_WINDOWS},
        defaults={**_QWEN, "head_dim": None},
        qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False, windows=True, tp_plan=_LLAMA_TP),
    "qwen3": Family(
        fields={"num_key_value_heads": _maybe(_size), "head_dim": _size, "attention_bias": _flag, **_QWEN_WINDOWS},
        defaults={**_QWEN, "head_dim": 128, "attention_bias": False},
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True, windows=True,
        tp_plan=_QWEN3_TP),
}


def _rope_ok(fields: Mapping[str, Any], max_positions: int) -> bool:
    """Whether transformers takes the config's RoPE without a word: none, the default rotary embedding,
    or llama3's with its keys and sane values (other types and anything it warns about: left to it)."""
    rope = fields.get("rope_scaling") or fields.get("rope_parameters")  # transformers' own precedence
    if not rope:
        return True
    if "rope_theta" in rope and not _number(rope["rope_theta"]):
        return False
    keys = set(rope) - {"rope_type", "rope_theta"}
    if rope.get("rope_type") == "default":
        return not keys
    llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if rope.get("rope_type") != "llama3" or keys != set(llama3):
        return False
    factor, low, high, original = (rope[key] for key in llama3)
    return (all(_number(v) for v in (factor, low, high)) and factor >= 1 and high > low
            and type(original) is int and original < max_positions)


def _consistent(config: Any, fields: Mapping[str, Any]) -> bool:
    """The checks transformers' config and model make that would refuse or warn (then: its answer)."""
    c = config
    tokens = [getattr(c, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")]
    layer_types = getattr(c, "layer_types", None)
    return (c.hidden_size % c.num_attention_heads == 0  # LlamaConfig.validate_architecture
            and c.head_dim % 2 == 0  # RoPE refuses an odd head
            and all(not isinstance(t, int) or 0 <= t < c.vocab_size for t in tokens)  # else a warning
            and (layer_types is None or (len(layer_types) == c.num_hidden_layers
                                         and all(t in LAYER_TYPES for t in layer_types)))
            and _rope_ok(fields, c.max_position_embeddings))


def read_config(fields: Mapping[str, Any]) -> HFConfig | None:
    """The config transformers would build from `fields` (a config.json's), as a namespace of its
    attributes (what models/plans.py's rules read of a config): the family's defaults, then what its
    `__post_init__` derives; None for anything FAMILIES is not sure of."""
    model_type = fields.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        return None
    schema = {**COMMON, **family.fields}
    if any(key not in schema or not schema[key](value) for key, value in fields.items()):
        return None
    c: Any = SimpleNamespace(**{**family.defaults, **fields})
    c.num_key_value_heads = c.num_key_value_heads or c.num_attention_heads
    c.head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    if family.windows:  # Qwen2Config / Qwen3Config.__post_init__
        c.sliding_window = c.sliding_window if c.use_sliding_window else None
        if c.layer_types is None:
            c.layer_types = ["sliding_attention" if c.sliding_window is not None and i >= c.max_window_layers
                             else "full_attention" for i in range(c.num_hidden_layers)]
    c.base_model_tp_plan, c.base_model_pp_plan = dict(family.tp_plan), dict.fromkeys(family.pp_plan)
    return cast("HFConfig", c) if _consistent(c, fields) else None


def layer_tensors(config: HFConfig) -> list[tuple[str, tuple[int, ...]]]:
    """One decoder layer's parameters (path in the layer, shape), in the order the module registers them."""
    c, family = config, FAMILIES[config.model_type]
    h, ffn, q, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, \
        c.num_key_value_heads * c.head_dim
    out: list[tuple[str, tuple[int, ...]]] = []

    def linear(path: str, inputs: int, outputs: int, bias: bool | str) -> None:
        out.append((f"{path}.weight", (outputs, inputs)))
        if getattr(c, bias) if isinstance(bias, str) else bias:
            out.append((f"{path}.bias", (outputs,)))

    for proj, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        linear(f"self_attn.{proj}", h, width, family.qkv_bias)
    linear("self_attn.o_proj", q, h, family.o_bias)
    if family.qk_norm:
        out += [("self_attn.q_norm.weight", (c.head_dim,)), ("self_attn.k_norm.weight", (c.head_dim,))]
    for proj, inputs, outputs in (("gate_proj", h, ffn), ("up_proj", h, ffn), ("down_proj", ffn, h)):
        linear(f"mlp.{proj}", inputs, outputs, family.mlp_bias)
    return out + [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]


def _split_layer(config: HFConfig, tensors: list[tuple[str, tuple[int, ...]]], tp: int) -> tuple[int, ...]:
    """Each tensor's elements on one rank at `tp`, as shard_model applies the plan: pattern by pattern
    in its order (its first refusal is shard_model's), a column layer's output rows (weight and bias)
    and a row layer's input columns split (its bias whole), divided as the Megatron layers divide."""
    sizes = {path: math.prod(shape) for path, shape in tensors}
    plan = architecture_plan(config)
    for pattern, style in plan.tp:
        regex, kind = pattern_regex(pattern), STYLES[style]
        assert kind in ("column", "row", "grad_allreduce", "replicated")  # FAMILIES' plans (pinned by the tests)
        for path, shape in tensors:
            if not regex.match(f"layers.0.{path.rpartition('.')[0]}"):
                continue
            if kind == "column":
                sizes[path] = divide(shape[0], tp, what="ColumnParallelLinear out_features") * math.prod(shape[1:])
            elif kind == "row" and len(shape) == 2:
                sizes[path] = shape[0] * divide(shape[1], tp, what="RowParallelLinear in_features")
    return tuple(sizes[path] for path, _ in tensors)


class AnalyticCounts(SharesByTp):
    """desc.Counts of a config `read_config` read: per tp, one rank's tensors per pipeline layer
    (embedding, each decoder layer, final norm, head: the embedding's tensor when tied), or why tp
    cannot split the model (count.ModelCounts' words)."""

    pipeline_problem: str | None = None  # every family's pipeline plan holds all its parameters (tests check)

    def __init__(self, config: HFConfig) -> None:
        self.config, self.tensors = config, layer_tensors(config)
        self._shares: dict[int, TensorShares | str] = {}

    def _count_or_why(self, tp: int) -> TensorShares | str:
        c = self.config
        try:
            problem = architecture_problem(c, tp=tp) if tp > 1 else None  # shard_model's check_architecture
            if problem is not None:
                raise problem
            layer = _split_layer(c, self.tensors, tp) if tp > 1 else tuple(math.prod(s) for _, s in self.tensors)
        except UserError as error:
            return problem_text(error)
        vocab = (padded_vocab(c.vocab_size, tp=tp) // tp * c.hidden_size,)  # VocabParallelEmbedding's rows
        return TensorShares(tp=tp, items=((vocab, "embed"), *[(layer, "layer")] * c.num_hidden_layers,
                                          ((c.hidden_size,), "norm"), (vocab, "head")))


def _fields_of(config: Mapping[str, Any] | HFConfig) -> dict[str, Any] | None:
    """A config.json's fields, or those a transformers config differs from its defaults by (None when
    it was told another attention implementation than the sdpa its model picks)."""
    if isinstance(config, Mapping):
        return dict(config)
    if getattr(config, "_attn_implementation", None) not in (None, "sdpa"):
        return None
    return config.to_diff_dict()


def analytic_desc(config: Mapping[str, Any] | HFConfig, *, name: str,
                  overrides: Mapping[str, Any] | None = None) -> ModelDesc | None:
    """describe_model's ModelDesc of `config` (a config.json's fields, or a transformers config) with
    `overrides` (a run's model.overrides: resolve_model sets them over the fields), counted from the
    config alone; None when FAMILIES is not sure of it (see the module docstring)."""
    fields = _fields_of(config)
    if overrides and (fields is None or any(key not in OVERRIDABLE for key in overrides)):
        return None
    fields = {**fields, **(overrides or {})} if fields is not None else None
    c = read_config(fields) if fields is not None else None
    if c is None:
        return None
    counts = AnalyticCounts(c)
    h, ffn, layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    tensors = [(path, math.prod(shape), len(shape)) for path, shape in counts.tensors]
    named = [(path, shape) for path, shape in counts.tensors if len(shape) == 2]
    norms = [(path.rpartition(".")[0], "RMSNorm") for path, _ in counts.tensors if path.endswith("norm.weight")]
    head = 0 if c.tie_word_embeddings else vocab * h
    return ModelDesc(
        name=name, model_type=c.model_type, hidden=h, ffn=ffn, heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads, head_dim=c.head_dim, layers=layers, vocab=vocab, embedding_params=vocab * h,
        position_params=0, layer_tensors=tensors_split([(n, dim > 1) for _, n, dim in tensors], counts, first=1),
        final_norm_params=h, head_params=head, tied=c.tie_word_embeddings,
        total_params=vocab * h + layers * sum(n for _, n, _ in tensors) + h + head, dropout=dropout_of(c),
        activation=activation_of(c), sliding_window=sliding_window(c), cp_problem=context_parallel_problem(c),
        **unsplit_matrices([tensors] * layers, counts, first=1),
        **layer_features(c, named, norms, q=c.num_attention_heads * c.head_dim,
                         kv=c.num_key_value_heads * c.head_dim, ffn=ffn), counts=counts)
