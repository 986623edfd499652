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
