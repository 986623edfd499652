"""The transformers glue every model module uses: the causal LM class of a config, construction
without transformers' own init, parameter counts. Imports nothing of dsframework's but errors, and
transformers only inside functions (the planner imports this module).

    cls = causal_lm_class(LlamaConfig(...))     # LlamaForCausalLM
    with skip_transformers_init():
        model = cls._from_config(config)        # weights set afterwards (build.init_weights_deterministically)
"""
from __future__ import annotations

import contextlib
from typing import Any, cast

from dsframework.errors import UserError
from dsframework.types import HFConfig

# The files that make a directory with a config.json a pretrained model (what from_pretrained loads);
# here, without torch, for the planner too (a directory of weights is checked on its model).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def causal_lm_class(config: HFConfig) -> type:
    """The AutoModelForCausalLM class for a config, imported now (not lazily inside zero.Init)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    # cast: the mapping is typed for its (slow, fast) tokenizer pairs too; a model mapping's value is a class
    return cast(type, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])


def check_causal_lm(config: HFConfig, name: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError("model.name", name, f"architecture {config.model_type!r} has no causal LM head",
                        "use a decoder model (llama, mistral, qwen2, gpt2, ...)")


@contextlib.contextmanager
def skip_transformers_init():
    """Skip transformers' own init at construction (post_init); tying still happens.

    Under zero.Init each module's parameters are already partitioned (empty) when post_init runs,
    which transformers' init cannot handle (it indexes padding rows); and every weight is set
    afterwards by `init_weights_deterministically` anyway.
    """
    from transformers import PreTrainedModel

    original = PreTrainedModel.initialize_weights
    PreTrainedModel.initialize_weights = lambda self: None
    try:
        yield
    finally:
        PreTrainedModel.initialize_weights = original


def count_parameters(model: Any) -> int:
    """Parameters of a model, counted whole also when ZeRO-3 has partitioned them."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def is_tied(model: Any) -> bool:
    """Whether the causal LM's output head is its input embedding's weight (tie_word_embeddings)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is getattr(embedding, "weight", None)


def module_path(root: Any, module: Any) -> str:
    """The path of `module` inside `root` ("model.embed_tokens"), found by identity."""
    return next(path for path, child in root.named_modules() if child is module)


def hf_parameter_shapes(config: HFConfig) -> dict[str, Any]:
    """{transformers name: dense shape} of every trainable parameter of `config`'s causal LM, tied
    copies once (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    return {name: param.shape for name, param in model.named_parameters()}


def learned_positions(model: Any) -> int | None:
    """Positions of the model's learned absolute-position table (GPT-2's `wpe`, OPT's
    `embed_positions`: an embedding of max_position_embeddings rows, or 2 more), None when it has
    none (rotary, ALiBi). `model` may be on the meta device (planner/count.py builds one)."""
    import torch

    limit = getattr(model.config, "max_position_embeddings", None)
    inputs = model.get_input_embeddings()
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if (limit and isinstance(module, torch.nn.Embedding) and module is not inputs
                and ("pos" in last or last == "wpe") and module.num_embeddings in (limit, limit + 2)):
            return int(limit)
    return None


def _rope_scaled(config: HFConfig) -> bool:
    """Whether the config scales its rotary positions (linear, dynamic, yarn, llama3, ...: rope_type
    other than 'default'), in transformers' rope_parameters (per layer type, too) or rope_scaling."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    return any((kind.get("rope_type") or kind.get("type") or "default") != "default" for kind in kinds)


def check_positions(model: Any, *, seq_len: int) -> str | None:
    """data.seq_len against the positions `model` has: a UserError past a learned table (position
    n_positions has no embedding: an IndexError in the first forward); the warning line when its
    rotary positions, unscaled, would be extrapolated past max_position_embeddings; else None.

        warning = check_positions(describe_model(config).counts.model, seq_len=run.data.seq_len)
    """
    config = model.config
    field = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
    limit = learned_positions(model)
    if limit is not None and seq_len > limit:
        raise UserError("data.seq_len", seq_len, f"exceeds the {limit} positions {config.model_type!r} has learned "
                        f"({field}={limit}: position {limit} has no embedding)", f"set data.seq_len <= {limit}")
    limit = getattr(config, "max_position_embeddings", None)
    rotary = any(type(module).__name__.endswith("RotaryEmbedding") for module in model.modules())
    if not rotary or not limit or seq_len <= limit or _rope_scaled(config):
        return None
    return (f"data.seq_len={seq_len} exceeds {field}={limit} of {config.model_type!r}, whose rotary positions are "
            f"not scaled: positions past {limit} are extrapolated, unseen in pre-training; set data.seq_len <= "
            f"{limit}, or scale them (rope_parameters in the model's config)")
