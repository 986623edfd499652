"""dsframework/models/tiny.py: every causal LM transformers ships a tensor-parallel plan for has a
tiny config whose model builds on the CPU with under 2M parameters and gives finite logits of the
vocabulary's width, unless it is in tiny.SKIP with its reason (in-process, ~25 s for all).

The types are the pinned stack's (tests/pinned_model_types.json, written with launch/constraints.txt
by bench/newest_stack.py --pin): a type a newer transformers adds is reported (a warning naming it),
not failed; bench/newest_stack.py shows whether it builds before the pin moves."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

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

PINNED = json.loads((Path(__file__).parents[1] / "pinned_model_types.json").read_text())
INSTALLED = causal_lm_types_with_tp_plan()
TYPES = sorted(set(PINNED["causal_lm_types_with_tp_plan"]) & set(INSTALLED))


def test_the_installed_types_are_the_pinned_ones():
    """With the pinned transformers the lists are equal (the contract); with another release the
    difference is reported, not failed."""
    import transformers

    added = sorted(set(INSTALLED) - set(PINNED["causal_lm_types_with_tp_plan"]))
    gone = sorted(set(PINNED["causal_lm_types_with_tp_plan"]) - set(INSTALLED))
    if transformers.__version__ == PINNED["transformers"]:
        assert (added, gone) == ([], []), "tests/pinned_model_types.json is not this transformers' list"
        assert sorted(unbuildable_types()) == PINNED["unbuildable"]
    elif added or gone:
        warnings.warn(f"transformers {transformers.__version__} (pinned: {PINNED['transformers']}): types with a "
                      f"tensor-parallel plan added {added or 'none'}, gone {gone or 'none'}; not tested here "
                      "(bench/newest_stack.py reports whether they build)", stacklevel=1)


def test_the_types_are_transformers_plans():
    assert len(TYPES) >= 100 and TYPES == sorted(TYPES)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral"} <= set(TYPES)
    assert "gpt2" not in TYPES  # GPT2Config has no base_model_tp_plan (dsframework's own plan covers it)


def test_skip_list_is_small_and_reasoned():
    assert len(SKIP) <= 5
    pinned = set(PINNED["causal_lm_types_with_tp_plan"])  # an override may serve a type another release lacks
    assert set(SKIP) <= pinned
    assert all(len(reason.split()) >= 5 for reason in SKIP.values()), SKIP
    assert set(TYPE_OVERRIDES) <= pinned


def test_unbuildable_types_are_named_with_why():
    failed = unbuildable_types()
    assert not set(failed) & set(INSTALLED)
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
