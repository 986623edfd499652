"""Built-in model presets: transformers config fields by name, no weights and no hub access; and the
fields any `model.name` names, read without transformers (`config_fields`, for the planner).

    PRESETS["tiny-llama"]["num_key_value_heads"]   # 2: grouped-query attention even when tiny
    config_fields("runs/my-model")    # its config.json as a dict (None: a directory of weights)

The tiny presets train on a CPU in seconds; the real-size ones (llama-7b, llama-70b, ...; qwen3-8b,
gemma3-12b, phi4-14b, olmo2-13b, the mixture of experts qwen3-30b-a3b in their published shapes) exist for planning and for GPUs. A randomly
initialised model takes the tokenizer's vocabulary size at build time.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsframework.models.hf import WEIGHT_FILES

_LLAMA_DEFAULTS = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
                   "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_dropout": 0.0}

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.2M parameters besides embeddings: for tests and the CPU quickstart.
    "tiny-llama": {**_LLAMA_DEFAULTS, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 512},
    "tiny-gpt2": {"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4,
                  "n_positions": 512, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                  "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    # A few M parameters: still CPU friendly, closer to a real shape.
    "small-llama": {**_LLAMA_DEFAULTS, "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688,
                    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "max_position_embeddings": 1024},
    # A few M parameters of Qwen3 (q_norm / k_norm, head_dim apart from hidden / heads): the
    # architecture bench/tp_vs_autotp.py shards from transformers' own plan.
    "small-qwen3": {"model_type": "qwen3", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688,
                    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                    "max_position_embeddings": 1024, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0},
    # Real sizes (Llama-2/3 shapes), described by config only.
    "llama-1b": {**_LLAMA_DEFAULTS, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                 "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": True},
    "llama-7b": {**_LLAMA_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "max_position_embeddings": 4096},
    "llama-13b": {**_LLAMA_DEFAULTS, "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                  "max_position_embeddings": 4096},
    "llama-70b": {**_LLAMA_DEFAULTS, "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
                  "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "max_position_embeddings": 4096},
    # Real sizes of other architectures (their published configs' shapes): for planning and GPUs.
    "llama3-8b": {**_LLAMA_DEFAULTS, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 128 experts, 8 per token; 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "max_position_embeddings": 40960,
                      "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                      "hidden_act": "silu", "attention_dropout": 0.0},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False},
    "gemma3-12b": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
                   "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                   "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "sliding_window": 1024, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
                   "tie_word_embeddings": True, "final_logit_softcapping": None},
    "phi4-14b": {"model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920,
                 "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
                 "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 250000.0,
                 "max_position_embeddings": 16384, "tie_word_embeddings": False},
    "olmo2-13b": {"model_type": "olmo2", "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 13824,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                  "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
                  "max_position_embeddings": 4096, "tie_word_embeddings": False},
    "gpt2-124m": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
                  "n_positions": 1024, "tie_word_embeddings": True},
}


def config_fields(name: str) -> dict[str, Any] | None:
    """The fields of the config `name` names, found where models/build.py's resolve_model finds them
    (a preset, a config.json, a directory's config.json) and read as plain JSON: no transformers, no
    defaults filled in. None where resolve_model must decide: a directory of weights (it checks them on
    the model), anything unreadable or no JSON object (its error names the problem)."""
    if name in PRESETS:
        return dict(PRESETS[name])
    path = Path(name).expanduser()
    try:
        if path.is_dir():
            if any((path / weights).exists() for weights in WEIGHT_FILES):
                return None
            path = path / "config.json"
        fields = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None
