"""The planner counts any architecture: parameters per tensor rank and per pipeline stage are what
a sharded model really holds (shard_model with a LayoutOnlyGroup, on a real CPU model; the
pipeline's stage_module_paths), activations what autograd saves, and the presets of other
architectures have their published sizes. An architecture shard_model or the pipeline refuses is
skipped here and planned with tp = pp = 1 (its tp > 1 and pp > 1 candidates dropped, with why)."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dsframework.commands.cli import cli
from dsframework.config import ModelSpec
from dsframework.layout import ParallelDims
from dsframework.models.build import resolve_model
from dsframework.models.hf import causal_lm_class
from dsframework.models.tensor_parallel import shard_model
from dsframework.models.pipeline import stage_module_paths
from dsframework.parallel.tensor import LayoutOnlyGroup
from dsframework.planner.cluster import cluster_preset
from dsframework.planner.memory import Workload, Layout, memory_per_rank, stage_shapes
from dsframework.planner.model import describe_model
from dsframework.planner.search import search
from tests.saved_tensors import saved_bytes

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
TINY = {  # model_type: extra config fields (beside _SMALL)
    "llama": {},
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "olmo2": {},
    "granite": {},
    "starcoder2": {},
    "gpt_neox": {"num_key_value_heads": None, "rotary_pct": 0.25},
}


def tiny_config(model_type: str):
    from transformers import AutoConfig

    fields = {k: v for k, v in {**_SMALL, **TINY[model_type]}.items() if v is not None}
    return AutoConfig.for_model(model_type, **fields)


def _real_model(config):
    torch.manual_seed(0)
    return causal_lm_class(config)(config)


def _numel(model, paths=None) -> int:
    """Elements of the model's parameters (tied ones once), only under `paths` when given."""
    return sum(p.numel() for name, p in model.named_parameters()
               if paths is None or any(name == q or name.startswith(q + ".") for q in paths))


@pytest.mark.parametrize("model_type", list(TINY))
def test_parameters_per_tensor_rank_are_the_sharded_models(model_type):
    config = tiny_config(model_type)
    desc = describe_model(config, name=model_type)
    assert desc.total_params == _numel(_real_model(config))
    if desc.tp_problem(2):
        pytest.skip(f"shard_model refuses {model_type}: {desc.tp_problem(2)}")
    for rank in range(2):
        model = shard_model(_real_model(config), group=LayoutOnlyGroup(size=2, rank=rank))
        assert sum(s.params for s in stage_shapes(desc, 2, 1)) == _numel(model)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model_type", list(TINY))
def test_parameters_per_stage_are_the_pipelines(model_type, tp):
    config = tiny_config(model_type)
    desc = describe_model(config, name=model_type)
    if desc.pp_problem or desc.tp_problem(tp):
        pytest.skip(f"no pipeline or tp={tp} for {model_type}: {desc.pp_problem or desc.tp_problem(tp)}")
    model = _real_model(config)
    if tp > 1:
        shard_model(model, group=LayoutOnlyGroup(size=tp, rank=0))
    planned = [s.params for s in stage_shapes(desc, tp, 2)]
    assert planned == [_numel(model, stage_module_paths(model, num_stages=2, stage=s)) for s in range(2)]


def test_a_refused_split_is_dropped_with_the_reason():
    desc = describe_model(tiny_config("olmo2"), name="olmo2")
    if not desc.tp_problem(2):
        pytest.skip("shard_model splits olmo2 here")
    plan = search(desc, cluster_preset("a100-80gb", nodes=1, gpus_per_node=4), Workload(seq_len=64, global_batch=8))
    assert plan.best is not None and all(c.layout.dims.tp == 1 for c in plan.candidates)
    assert "olmo2" in plan.dropped_families["tp=2"]


# Activations: what autograd saves at tp 1 (as test_planner.py checks Llama and GPT-2), within 10 %.
@pytest.mark.parametrize("model_type", list(TINY))
def test_activation_bytes_match_what_autograd_saves(one_thread, model_type):
    config = tiny_config(model_type)
    model = _real_model(config).train()
    desc = describe_model(model.config, name=model_type)
    for micro_batch, seq_len in [(1, 32), (2, 64), (1, 128)]:
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        measured = saved_bytes(model, lambda: model(input_ids=ids, labels=ids))[0]
        predicted = memory_per_rank(desc, Layout(ParallelDims(world=1), micro_batch=micro_batch),
                                    Workload(seq_len=seq_len, global_batch=micro_batch, precision="fp32")).activations
        assert abs(predicted - measured) <= 0.10 * measured, (micro_batch, seq_len, predicted, measured)


PUBLISHED = {"qwen3-8b": 8.19e9, "gemma3-12b": 11.8e9, "llama3-8b": 8.03e9, "phi4-14b": 14.7e9, "olmo2-13b": 13.7e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_their_published_sizes(name):
    config = resolve_model(ModelSpec(name=name)).config
    assert abs(describe_model(config, name=name).total_params - PUBLISHED[name]) <= 0.03 * PUBLISHED[name]


def test_dsf_plan_plans_a_new_architecture_preset():
    result = CliRunner().invoke(cli, ["plan", "--model", "qwen3-8b", "--cluster", "h100-80gb", "--nodes", "1",
                                      "--seq-len", "4096", "--global-batch", "64", "--top", "3"],
                                catch_exceptions=False)
    assert result.exit_code == 0 and "qwen3-8b: 8.19 B parameters" in result.output
