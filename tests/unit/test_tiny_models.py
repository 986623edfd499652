"""dsframework/models/tiny.py: every causal LM transformers ships a tensor-parallel plan for has a
tiny config whose model builds on the CPU with under 2M parameters and gives finite logits of the
vocabulary's width, unless it is in tiny.SKIP with its reason (in-process, ~25 s for all)."""
from __future__ import annotations

import pytest
import torch

from dsframework.models.tiny import (
    SKIP,
    TYPE_OVERRIDES,
    VOCAB,
    causal_lm_types_with_tp_plan,
    is_moe,
    tiny_config,
    unbuildable_types,
)

TYPES = causal_lm_types_with_tp_plan()


def test_the_types_are_transformers_plans():
    assert len(TYPES) >= 100 and TYPES == sorted(TYPES)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral"} <= set(TYPES)
    assert "gpt2" not in TYPES  # GPT2Config has no base_model_tp_plan (dsframework's own plan covers it)


def test_skip_list_is_small_and_reasoned():
    assert len(SKIP) <= 5
    assert set(SKIP) <= set(TYPES)
    assert all(len(reason.split()) >= 5 for reason in SKIP.values()), SKIP
    assert set(TYPE_OVERRIDES) <= set(TYPES)


def test_unbuildable_types_are_named_with_why():
    failed = unbuildable_types()
    assert not set(failed) & set(TYPES)
    assert all(why.strip() for why in failed.values())


def test_moe_and_dense():
    assert [is_moe(t) for t in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")] == [True] * 4
    assert [is_moe(t) for t in ("llama", "qwen3", "gemma2", "phi3")] == [False] * 4


def test_overrides_win():
    config = tiny_config("qwen3", vocab_size=512, num_hidden_layers=3)
    assert (config.vocab_size, config.num_hidden_layers, config.hidden_size) == (512, 3, 64)


@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in SKIP])
def test_tiny_model_builds_and_runs(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    torch.set_num_threads(1)
    config = tiny_config(model_type)
    assert config.vocab_size == VOCAB
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(config, name, None)
        assert all(i < VOCAB for i in (ids if isinstance(ids, list) else [ids]) if i is not None), (name, ids)
    torch.manual_seed(0)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, VOCAB, (2, 16))).logits
    assert logits.shape == (2, 16, VOCAB) and torch.isfinite(logits).all()
