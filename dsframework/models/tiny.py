"""Tiny configs of every causal LM transformers ships a tensor-parallel plan for: one model per
architecture, small enough to build, shard and train on a CPU in seconds.

    tiny_config("qwen3")                     # Qwen3Config: hidden 64, 2 layers, 4 heads (2 kv), vocab 256
    tiny_config("gemma2", vocab_size=512)    # overrides win over the tiny sizes
    causal_lm_types_with_tp_plan()           # ['afmoe', 'apertus', ..., 'youtu']: 116 in transformers 5.24
    is_moe("mixtral"), is_moe("llama")       # True, False
    tiny_twin(config)                        # a user's config at these sizes, its own flags kept

How a config is shrunk: start from the type's defaults (its published size), then walk its
fields and set each size it has by its name (SIZES: hidden 64, intermediate 128, 4 heads over 2
kv heads of 16, vocab 256, 256 positions, sliding windows of 8, 4 experts, MLA ranks of 32, ...),
zero every dropout, move special token ids inside the vocabulary, and cut every per-layer list
(layer_types, mlp_layer_types, ...) to the new depth. Depth is 2, or 4 where the layers are not
all alike (sliding/full attention, dense/MoE, attention/mamba), with each kind on both halves, so
that a two-stage pipeline sees every kind on each stage. What the walk cannot do is in
TYPE_OVERRIDES, one small dict per type, each with the reason. Pure but for transformers' configs.
"""
from __future__ import annotations

from typing import Any
from dsframework.types import HFConfig

HIDDEN, INTERMEDIATE, EXPERT_INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 32, 4, 2, 16
VOCAB, POSITIONS, WINDOW, EXPERTS, TOP_K = 256, 256, 8, 4, 2

# Field name -> its tiny value. Only fields a type already has are set (a config's unknown keyword
# would become a stray attribute); a value of 0 or None in the defaults means "off" and stays.
SIZES: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed"), HIDDEN),
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size", "n_inner", "intermediate_size_mlp",
                     "dense_intermediate_size"), INTERMEDIATE),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
                     "shared_intermediate_size"), EXPERT_INTERMEDIATE),
    **dict.fromkeys(("num_attention_heads", "n_head", "swa_num_attention_heads", "linear_num_heads",
                     "index_n_heads", "linear_num_value_heads", "num_attention_heads_per_layer"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "swa_num_key_value_heads", "linear_num_key_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "swa_head_dim", "index_head_dim", "mamba_head_dim", "mamba_d_head", "qk_nope_head_dim",
                     "v_head_dim", "query_pre_attn_scalar", "d_rel"), HEAD_DIM),
    "qk_rope_head_dim": 8, "qk_head_dim": HEAD_DIM + 8, "rotary_dim": 8,
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank"), 32),
    **dict.fromkeys(("loop_gate_rank", "laurel_rank", "gated_norm_rank", "hc_lowrank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "model_max_length",
                     "original_max_position_embeddings"), POSITIONS),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_chunk_size", "keep_window_size"), WINDOW),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk"), TOP_K),
    "zero_expert_num": 2,  # longcat: experts that return zero, beside the routed ones
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group", "mamba_n_groups", "n_groups"), 1),
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "mamba_chunk_size", "chunk_size"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), HEADS),
    "mamba_d_ssm": HIDDEN, "hidden_size_per_layer_input": 16, "ple_embed_dim": 16,
    **dict.fromkeys(("index_topk", "index_block_size"), WINDOW), "index_topk_blocks": 2,
    # Periods of alternating layer kinds: every kind within two layers.
    **dict.fromkeys(("sliding_window_pattern", "_sliding_window_pattern", "attn_layer_period",
                     "expert_layer_period", "global_attn_every_n_layers", "no_rope_layer_interval",
                     "layer_group_size", "n_layers_per_attn_res_block"), 2),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset", "first_k_dense_replace", "num_dense_layers"), 1),
}
# Fields that count layers: the new depth (a period of 2 needs 4 layers to show each kind twice).
DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "max_window_layers")
ALTERNATING = ("sliding_window_pattern", "_sliding_window_pattern", "attn_layer_period", "expert_layer_period",
               "global_attn_every_n_layers", "no_rope_layer_interval", "first_k_dense_replace", "num_dense_layers",
               "layer_group_size", "n_layers_per_attn_res_block", "num_kv_shared_layers")
# Sizes some defaults leave None although the model needs them (the published checkpoints set them).
NEEDED = ("head_dim", "num_key_value_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 3, "eod_token_id": 2}
NESTED = ("text_config",)  # sub-configs the causal LM is built from

# Per type, what the generic walk gets wrong, and why.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
TYPE_OVERRIDES: dict[str, dict[str, Any]] = {
    # The defaults leave every layer linear (mamba) attention, which transformers' cache cannot
    # serve: layers 1 and 3 attend, so each pipeline stage holds one of each kind.
    "bamba": {"attn_layer_indices": [1, 3]},
    "granitemoehybrid": {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"]},
    # Its per-layer sizes make layer 2's indexed attention differ from the others, which it refuses.
    "dots3_note_text": {"per_layer_config": {}, "head_dim": HEAD_DIM + 8},  # its SWA head: nope + rope
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},  # default None fails
    # Its default rope_parameters is {}, but its rotary embedding reads one entry per layer type.
    "cohere_compass_text": {"rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    # Input, recurrent and output blocks partition the depth: 1 + 2 (looped) + 1 layers.
    # Its defaults list attention and mlp blocks as separate entries (halved at construction).
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention"] * 2},
    # num_hidden_layers is rewritten to layers-per-stack x H_cycles x (L_cycles + 1): one of each.
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1]},
    # Its indexed-attention layers need the query-sparse indexer, whose sizes default to None.
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                       "indexer_budget": WINDOW, "indexer_compress_ratio": 2},
    # Its first indexed-attention layer must be an indexer (index_layers), each layer reads its own
    # keys and values (kv_source_layers is per layer, not a list of indices), the indexer's heads fit
    # one key head's queries, and its pool is a multiple of its compression: one indexer per half.
    "kolibri1_1": {"index_layers": [1, 3], "kv_source_layers": [0, 1, 2, 3], "index_num_heads": HEADS // KV_HEADS,
                   "index_pool_size": 64, "index_num_local_tokens": 4, "index_num_sink_tokens": 2},
}
# Types whose tiny model is not checked (tests/unit/test_tiny_models.py), and why.
SKIP: dict[str, str] = {
    "llama4": "a vision + text config; its causal LM is llama4_text's, checked as that type",
    "phi4_multimodal": "builds vision and audio towers (870M parameters at the tiny text sizes)",
}


def causal_lm_types_with_tp_plan() -> list[str]:
    """Every causal LM `model_type` whose default config has a non-empty `base_model_tp_plan`."""
    return sorted(t for t in _causal_lm_types() if _tp_plan(t))


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def unbuildable_types() -> dict[str, str]:
    """Causal LM types whose config does not build from its own defaults -> the error's last line
    (their plan, if any, cannot be read, so they are not in causal_lm_types_with_tp_plan)."""
    failed = {}
    for model_type in _causal_lm_types():
        try:
            default_config(model_type)
        except Exception as err:  # noqa: BLE001 - transformers' validators raise several kinds
            failed[model_type] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1].strip()}"
    return failed


def default_config(model_type: str) -> Any:
    """The type's config with its defaults (the published model's sizes)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


def _tp_plan(model_type: str) -> dict[str, str]:
    try:
        config = default_config(model_type)
    except Exception:  # noqa: BLE001 - see unbuildable_types
        return {}
    return dict(getattr(config, "base_model_tp_plan", None) or {})


MOE_STYLES = ("moe_", "ep_", "grouped_gemm")
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def is_moe(model_type_or_config: Any) -> bool:
    """Whether the architecture routes tokens to experts: a plan style for experts (moe_*, ep_*,
    grouped_gemm*) or more than one expert in its config."""
    config = (default_config(model_type_or_config) if isinstance(model_type_or_config, str)
              else model_type_or_config)
    plan = {**(getattr(config, "base_model_tp_plan", None) or {}),
            **(getattr(config, "base_model_ep_plan", None) or {})}
    if any(str(style).startswith(MOE_STYLES) for style in plan.values()):
        return True
    return any((getattr(config, name, None) or 0) > 1 for name in EXPERT_COUNTS)


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The type's config at the tiny sizes (module docstring), then `overrides` on top (a depth
    given there also sets the length of the per-layer lists)."""
    from transformers import CONFIG_MAPPING

    depth = next((overrides[name] for name in DEPTH_FIELDS[:3] if name in overrides), None)
    fields = tiny_fields(default_config(model_type), depth=depth)
    fields.update(TYPE_OVERRIDES.get(model_type, {}))
    fields.update(overrides)
    return CONFIG_MAPPING[model_type](**fields)


def tiny_twin(config: HFConfig) -> Any:
    """`config` itself at the tiny sizes: its own flags and layer kinds kept (sliding windows,
    softcapping, tied embeddings), its sizes shrunk. What a check of the architecture's glue runs on
    before the real model is built (models/pipeline.py `check_stages_reproduce_forward`)."""
    from transformers import CONFIG_MAPPING

    layers = next((getattr(config, n) for n in DEPTH_FIELDS[:3] if isinstance(getattr(config, n, None), int)), None)
    depth = layers if layers and layers <= 4 else None  # already small: its own depth (its lists as they are)
    fields = {**config.to_diff_dict(), **tiny_fields(config, depth=depth), **TYPE_OVERRIDES.get(config.model_type, {})}
    return CONFIG_MAPPING[config.model_type](**fields)


def tiny_fields(config: HFConfig, *, depth: int | None = None) -> dict[str, Any]:
    """The constructor keywords that shrink `config` (sub-configs in NESTED shrunk the same way)."""
    fields = config.to_dict()
    depth = depth or _depth(fields)
    out: dict[str, Any] = {}
    for name, value in fields.items():
        new = _tiny_value(name, value, fields, depth)
        if new is not _KEEP:
            out[name] = new
    out.update(_consistent(fields, out, depth))
    for name in NESTED:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out[name] = {**sub.to_dict(), **tiny_fields(sub, depth=depth)}
    return out


_KEEP = object()


def _consistent(fields: dict[str, Any], out: dict[str, Any], depth: int) -> dict[str, Any]:
    """Sizes tied to each other by the architecture, after the walk set each one alone."""
    tied: dict[str, Any] = {}
    if fields.get("head_dim") and fields.get("head_dim") == fields.get("qk_rope_head_dim"):
        tied["head_dim"] = out["qk_rope_head_dim"]  # MLA: rotary part of the query/key head
    if fields.get("kv_lora_rank"):  # MLA: keys and values come whole out of the latent, one per head
        tied["num_key_value_heads"] = out.get("num_attention_heads", HEADS)
    if fields.get("mamba_expand") and isinstance(fields.get("mamba_d_head"), int) and fields.get("mamba_n_heads"):
        # mamba heads x head width = the mixer's width (mamba_d_ssm, else expand x hidden)
        width = out.get("mamba_d_ssm") or fields["mamba_expand"] * out.get("hidden_size", HIDDEN)
        tied["mamba_n_heads"] = width // out["mamba_d_head"]
    if isinstance(fields.get("per_layer_config"), dict):  # {layer index: its own sizes}: within depth
        tied["per_layer_config"] = {key: {**value, **tiny_fields_of(value, depth)}
                                    for key, value in fields["per_layer_config"].items() if int(key) < depth}
    return tied


def tiny_fields_of(fields: dict[str, Any], depth: int) -> dict[str, Any]:
    """The tiny values of a plain dict of config fields (a per-layer override)."""
    return {name: new for name, value in fields.items()
            if (new := _tiny_value(name, value, fields, depth)) is not _KEEP}


def _tiny_value(name: str, value: Any, fields: dict[str, Any], depth: int) -> Any:
    """The tiny value of one field, or _KEEP."""
    if isinstance(value, bool) or (value is None and name not in NEEDED):
        return _KEEP
    if name in DEPTH_FIELDS and isinstance(value, int):
        return depth
    if name in SIZES and isinstance(value, (int, float)):
        return SIZES[name] if value else value  # 0 means "off"
    if name in NEEDED and value is None:
        return SIZES[name]
    if isinstance(value, float) and ("dropout" in name or "pdrop" in name or "jitter" in name):
        return 0.0
    if name in TOKEN_IDS:
        return _token_id(name, value)
    if name == "num_kv_shared_layers" and isinstance(value, int):
        return min(value, depth // 2)
    if isinstance(value, list):
        return _per_layer(name, value, fields, depth)
    return _KEEP


def _token_id(name: str, value: Any) -> Any:
    """Special token ids inside the tiny vocabulary (lists of eos ids become one)."""
    if isinstance(value, list):
        return [TOKEN_IDS[name]] if any(v >= VOCAB for v in value) else value
    return TOKEN_IDS[name] if isinstance(value, int) and value >= VOCAB else value


def _depth(fields: dict[str, Any]) -> int:
    """2 layers, or 4 where layers differ: a per-layer list of more than one value, or a period."""
    layers = next((fields[n] for n in DEPTH_FIELDS[:3] if isinstance(fields.get(n), int)), None)
    for name, value in fields.items():
        if isinstance(value, list) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return 4
        if name in ALTERNATING and isinstance(value, int) and value > 0:
            return 4
    return 2


def _per_layer(name: str, value: list, fields: dict[str, Any], depth: int) -> Any:
    """A per-layer list at the new depth: each kind of layer it names on both halves (kinds cycle
    in the order they first appear: [a, b, a, b]); a list of layer indices keeps those below depth."""
    layers = next((fields[n] for n in DEPTH_FIELDS[:3] if isinstance(fields.get(n), int)), None)
    if name.endswith(("layers", "idxs", "layer_ids")) and all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in value) and name != "no_rope_layers":
        return [v for v in value if v < depth] if value else _KEEP
    if not value or len(value) != layers:
        return _KEEP
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value) and name in SIZES:
        return [SIZES[name]] * depth
    kinds = list(dict.fromkeys(repr(v) for v in value))
    first = {repr(v): v for v in reversed(value)}
    return [first[kinds[i % len(kinds)]] for i in range(depth)]
