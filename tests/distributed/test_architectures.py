"""Architectures beyond Llama at tp2 x pp2 (4 ranks, ZeRO-1, one launch for all, shared with
test_experts: conftest.engine_runs): each trains 4
steps to the single-process reference (transformers' own model and loss, in this process), its
export loads in transformers with the trained engine's logits, and every rank holds the parameter
count the planner predicts for its stage and tensor rank. The shards come from each model's own
plans (models/plans.py), the stages' glue from its own forward (models/pipeline.py), the loss
from its own post-processing (models/logits.py: Gemma 2's softcapping and Granite's scaling are
set so that they matter). The whole table of architectures is bench/architectures.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsframework.config import build_run_config
from dsframework.planner.memory import stage_shapes
from dsframework.planner.model import describe_model
from tests.distributed.launcher import assert_close, dsf, losses, run_overrides
from tests.distributed.reference import reference_losses

ARCHITECTURES = {  # model type: config fields beside models/tiny.py's sizes
    "llama": {}, "qwen3": {}, "gemma2": {"final_logit_softcapping": 2.0}, "gemma3_text": {}, "phi3": {},
    "olmo2": {}, "granite": {"logits_scaling": 0.25}, "starcoder2": {}, "gpt_neox": {},
    # transformers 5.25's plan splits attention only: the experts and the router stay whole on each
    # tensor rank, where they must see the same gradient (export refuses a replicated tensor that
    # differs between tensor ranks) and the planner must count them whole
    "mixtral": {},
}
# Beside the layout, per type: a pipeline stage sees its own layers' routing only, so the router's
# balancing loss (dsf's default for a mixture of experts) is off for Mixtral at pp 2
SETS = {"mixtral": ["model.overrides.output_router_logits=false"]}
LAYOUT = ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "train.micro_batch=2", "train.steps=4",
          "checkpoint.save_final=true"]


def overrides(root: Path, model_type: str) -> list[str]:
    return [f"model.name={root / f'{model_type}.json'}", *LAYOUT, *SETS.get(model_type, [])]


def engine_specs(root: Path) -> list[str]:
    """conftest.engine_runs' specs (after writing each architecture's config under root)."""
    from dsframework.models.tiny import tiny_config

    for model_type, fields in ARCHITECTURES.items():
        tiny_config(model_type, **fields).to_json_file(root / f"{model_type}.json")
    return [f"{model_type}|{';'.join(overrides(root, model_type))}" for model_type in ARCHITECTURES]


@pytest.fixture(scope="module")
def trained(engine_runs) -> Path:
    """The root of the 4-rank launch that trains every architecture (shared with test_experts)."""
    return engine_runs


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_tp2_pp2_trains_like_transformers(trained, model_type):
    """Step 1's loss is the loss of the untrained model on the same batch (through the pipeline's
    vocab-parallel head, after the model's own post-processing): 1e-5; the 4 steps: 1e-4."""
    run = build_run_config({}, run_overrides(trained / model_type, overrides(trained, model_type)))
    got, want = losses(trained / model_type), reference_losses(run)
    assert abs(got[1] - want[1]) <= 1e-5 * abs(want[1]), (got[1], want[1])
    assert_close(got, want, rtol=1e-4, what=model_type)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_export_gives_the_engines_logits(trained, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    dsf("export", str(trained / model_type / "checkpoints"), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32).eval()
    assert model.config.model_type == model_type
    engine = torch.load(trained / model_type / "engine.pt")
    with torch.no_grad():
        exported = model(input_ids=engine["input_ids"]).logits
    assert exported.shape == engine["logits"].shape
    assert torch.allclose(exported, engine["logits"], atol=1e-5, rtol=0), (
        f"max |diff| {(exported - engine['logits']).abs().max().item():.3g}")


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_planner_counts_each_ranks_parameters(trained, model_type):
    """The planner's parameters per stage and tensor rank (planner/count.py, from the meta model and
    the plans) are what each rank's engine holds, to the element (fp32: to the byte)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(trained / model_type / "checkpoints" / "hf_config")
    shapes = stage_shapes(describe_model(config, name=model_type), 2, 2)
    held = [json.loads(p.read_text()) for p in sorted((trained / model_type).glob("held-rank*.json"))]
    assert len(held) == 4
    assert sorted((h["stage"], h["tensor_rank"]) for h in held) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for h in held:
        assert h["parameters"] == shapes[h["stage"]].params, (h, [s.params for s in shapes])
