"""Mixture-of-experts models (models/experts.py, models/autoep_compat.py, `parallel.ep`): which
configs have experts, what ep refuses before any rank starts, the DeepSpeed JSON section (checked
by DeepSpeed's own DeepSpeedConfig), and the one bridge between the installed DeepSpeed AutoEP and
transformers, which must go once transformers no longer needs it."""
from __future__ import annotations

import json

import deepspeed  # noqa: F401 - imported before CliRunner swaps sys.stdout: its logger binds the real one
import pytest
from click.testing import CliRunner

from dsframework.commands.cli import cli
from dsframework.config import build_run_config
from dsframework.dsconfig import build_ds_config, validate_ds_config
from dsframework.errors import UserError
from dsframework.layout import ParallelDims, grid_problem
from dsframework.models.experts import (
    autoep_preset,
    check_expert_parallel,
    describe_experts,
    expert_layout,
    routed_expert_parameters,
    train_router_loss,
)
from dsframework.models.tiny import tiny_config


@pytest.mark.parametrize("model_type, experts, top_k, preset", [
    ("mixtral", 4, 2, "mixtral"), ("qwen3_moe", 4, 2, "qwen3_moe"), ("qwen2_moe", 4, 2, "qwen3_moe"),
    ("deepseek_v3", 4, 2, "deepseek_v3"), ("olmoe", 4, 2, None), ("gpt_oss", 4, 2, None),
])
def test_experts_and_autoep_presets_of_moe_types(model_type, experts, top_k, preset):
    config = tiny_config(model_type)
    assert expert_layout(config) is not None
    assert (expert_layout(config).experts, expert_layout(config).top_k) == (experts, top_k)
    assert autoep_preset(model_type) == preset
    assert train_router_loss(config) and config.output_router_logits


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_layouts_that_split_the_routing_are_refused_while_the_router_loss_trains(model_type):
    """The router's load-balancing loss is one product of means over every layer's routing of the
    whole micro-batch: pipeline stages and sequence shards cannot add it up, so pp and cp are refused
    in one line naming what works; without that loss (output_router_logits off) they run."""
    from dsframework.models.pipeline import check_model_parallelism

    config = tiny_config(model_type)
    assert train_router_loss(config)
    for dims, field in ((ParallelDims(world=2, pp=2), "parallel.pp=2"), (ParallelDims(world=2, cp=2), "parallel.cp=2")):
        with pytest.raises(UserError) as info:
            check_model_parallelism(config, dims, seq_len=32)
        message = str(info.value)
        assert message.startswith(f"{field}: ") and "load-balancing loss" in message and "\n" not in message
        assert "ep, dp and ZeRO 0-3 train it with that loss" in message
    config.output_router_logits = False
    check_model_parallelism(config, ParallelDims(world=2, pp=2), seq_len=32)
    check_model_parallelism(config, ParallelDims(world=2, cp=2), seq_len=32)


def test_a_dense_model_has_no_experts():
    config = tiny_config("llama")
    assert expert_layout(config) is None and not train_router_loss(config)


@pytest.mark.parametrize("model_type, ep, fragment", [
    ("llama", 2, "parallel.ep=2: needs a mixture-of-experts model; 'llama' has no routed experts"),
    ("olmoe", 2, "cannot split 'olmoe''s experts: DeepSpeed's AutoEP has no preset for it (it knows deepseek_v2,"),
    ("mixtral", 3, "parallel.ep=3: does not divide mixtral's 4 experts; choose ep in {1, 2, 4}"),
])
def test_what_expert_parallelism_cannot_run_is_refused_in_one_line(model_type, ep, fragment):
    with pytest.raises(UserError) as info:
        check_expert_parallel(tiny_config(model_type), ep=ep)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    check_expert_parallel(tiny_config(model_type), ep=1)  # ep 1: nothing to check


@pytest.mark.parametrize("others, fragment", [
    ({"tp": 2}, "parallel.ep=2: does not compose with parallel.tp=2: DeepSpeed's AutoEP splits the experts over "
                "data-parallel ranks only; set parallel.tp=1 (ep composes with dp and ZeRO 0-3) or parallel.ep=1"),
    ({"pp": 2, "zero_stage": 1}, "does not compose with parallel.pp=2"),
    ({"cp": 2}, "does not compose with parallel.cp=2"),
    ({"zero_stage": 3, "zero_hpz": 2}, "does not compose with parallel.zero_hpz=2"),
])
def test_ep_composes_with_dp_and_zero_only(others, fragment):
    with pytest.raises(UserError, match="parallel.ep=2") as info:
        build_run_config({"parallel": {"ep": 2, **others}})
    assert fragment in str(info.value)


def test_ep_divides_the_data_parallel_ranks():
    assert grid_problem(ParallelDims(world=4, ep=2)) is None
    assert grid_problem(ParallelDims(world=4, ep=4)) is None
    problem = grid_problem(ParallelDims(world=6, ep=4))
    assert str(problem) == ("parallel.ep=4: does not divide the 6 data-parallel ranks (world 6 / tp*pp*cp = 1); "
                            "choose ep in {1, 2, 3, 6}")
    assert str(ParallelDims(world=4, ep=2)) == "tp 1 x pp 1 x cp 1 x dp 4, ep 2"
    assert ParallelDims.from_dict(ParallelDims(world=4, ep=2).as_dict()).ep == 2
    assert ParallelDims.from_dict({"world": 4, "tp": 1, "pp": 1, "dp": 4}).ep == 1  # manifests before ep


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_expert_parallel_section_passes_deepspeed_config(stage):
    run = build_run_config({"train": {"micro_batch": 2}, "parallel": {"ep": 2, "zero_stage": stage}})
    ds = build_ds_config(run.train, run.parallel, dp_size=4)
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    assert ds["train_batch_size"] == 2 * 4  # expert-parallel ranks are data-parallel ranks
    validate_ds_config(ds, dp_size=4)
    assert "expert_parallel" not in build_ds_config(run.train, run.parallel.model_copy(update={"ep": 1}), dp_size=4)


def test_dsf_config_writes_ep():
    result = CliRunner().invoke(cli, ["config", "--zero-stage", "2", "--ep", "2", "--world-size", "4",
                                      "--micro-batch", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    bad = CliRunner().invoke(cli, ["config", "--ep", "4", "--world-size", "6", "--micro-batch", "1"])
    assert isinstance(bad.exception, UserError)  # dsf's main prints it in one line and exits 2 (test_bad_input)
    assert str(bad.exception).startswith("--ep=4: does not divide the 6 data-parallel ranks")


def test_the_transformers_bridge_is_still_needed_and_works():
    """Fails once the installed transformers' registry takes AutoEP's calls itself: then delete
    models/autoep_compat.py and its call in train/setup.py."""
    from transformers.utils.output_capturing import _CanRecordRegistry

    from dsframework.models.autoep_compat import bridge_output_capture_registry, registry_needs_bridge

    original_get, original_set = _CanRecordRegistry.get, _CanRecordRegistry.__setitem__
    try:
        if not getattr(original_get, "dsf_bridge", False):
            assert registry_needs_bridge(), "transformers' _CanRecordRegistry.get takes a default now: drop the bridge"
            with pytest.raises(TypeError):
                _CanRecordRegistry().get("<class 'x'>", None)  # the call DeepSpeed 0.19.8's AutoEP makes
        bridge_output_capture_registry()
        registry = _CanRecordRegistry()
        model = tiny_config("llama")  # any object: keyed by its class, as transformers does
        registry[model] = {"router_logits": 1}
        assert registry.get(model) == {"router_logits": 1} == registry.get(str(model.__class__), None)
        registry["<class 'other'>"] = {"x": 2}  # AutoEP's restore: keyed by the name it was given
        assert dict(registry)["<class 'other'>"] == {"x": 2}
        assert registry.get("<class 'missing'>", "default") == "default" and registry.get(object()) == {}
        assert not registry_needs_bridge() and not bridge_output_capture_registry()  # idempotent
    finally:
        _CanRecordRegistry.get, _CanRecordRegistry.__setitem__ = original_get, original_set


def test_the_first_line_counts_active_parameters():
    """Mixtral's routed experts, from its config (3 matrices of hidden x ffn per expert and layer),
    not from the module names the count uses; a token passes through top_k of them."""
    config = tiny_config("mixtral")
    h, f, layers, experts = config.hidden_size, config.intermediate_size, config.num_hidden_layers, 4
    total, routed = routed_expert_parameters(config)
    assert routed == layers * experts * 3 * h * f
    active = total - routed + routed // 2
    assert describe_experts(config, ep=2) == f"{active:,} active per token: 4 experts, top 2, 2 per rank"
    assert describe_experts(tiny_config("llama"), ep=1) is None


def test_lora_with_ep_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"model.lora: is not offered with parallel.ep=2: DeepSpeed's AutoEP replaces "
                                        r"the MoE blocks peft would wrap"):
        build_run_config({"model": {"lora": {"r": 4}}, "parallel": {"ep": 2}})
    with pytest.raises(UserError, match=r"model.lora: is not offered with parallel.ep=1 autoep=true: "):
        build_run_config({"model": {"lora": {"r": 4}}, "parallel": {"autoep": True}})


def test_the_planners_autoep_types_are_deepspeeds():
    """planner/model.py reads models/experts.AUTOEP_MODEL_TYPES (the planner imports no DeepSpeed)."""
    from dsframework.models.experts import AUTOEP_MODEL_TYPES, autoep_model_types

    assert sorted(AUTOEP_MODEL_TYPES) == autoep_model_types()


def test_the_planner_counts_qwen3_30b_a3b_as_published():
    """Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated (128 experts, 8 per token)."""
    from dsframework.config import ModelSpec
    from dsframework.models.build import resolve_model
    from dsframework.planner.model import describe_model

    config = resolve_model(ModelSpec(name="qwen3-30b-a3b")).config
    config.base_model_tp_plan = attention_only(config.base_model_tp_plan)
    desc = describe_model(config, name="qwen3-30b-a3b")
    assert (desc.experts, desc.top_k, desc.autoep) == (128, 8, True)
    assert abs(desc.total_params / 30.5e9 - 1) < 0.01 and abs(desc.active_params / 3.3e9 - 1) < 0.03
    assert desc.routed_params == 48 * 128 * 3 * 2048 * 768
    dense = describe_model(tiny_config("llama"))
    assert dense.active_params == dense.total_params and dense.experts == 0


def attention_only(plan: dict | None) -> dict:
    """A MoE type's tensor-parallel plan as transformers 5.25 ships it (the experts' entries gone:
    they stay whole on each tensor rank), whichever release is installed (5.24 still split them)."""
    return {pattern: style for pattern, style in (plan or {}).items() if ".experts" not in pattern}


@pytest.mark.parametrize("nodes", [1, 4])
def test_dsf_plan_ranks_expert_parallel_layouts(nodes):
    """On 1 x 8 and 4 x 8 H100: ep layouts are ranked with the rest (their all-to-alls priced);
    splitting the experts beats training them as dense weights under ZeRO (what the planner did
    before ep), and the report says why in one line; tensor parallelism splits attention only
    (transformers 5.25's plan leaves the experts out), so its layouts hold every expert whole on each
    tensor rank and run all of them; the pipeline and context parallelism are refused (the router's
    balancing loss spans the whole micro-batch)."""
    from dsframework.config import ModelSpec
    from dsframework.models.build import resolve_model
    from dsframework.planner.cluster import cluster_preset
    from dsframework.planner.memory import Workload
    from dsframework.planner.model import describe_model
    from dsframework.planner.report import plan_table
    from dsframework.planner.search import search

    config = resolve_model(ModelSpec(name="qwen3-30b-a3b")).config
    config.base_model_tp_plan = attention_only(config.base_model_tp_plan)
    desc = describe_model(config, name="qwen3-30b-a3b")
    cluster, job = cluster_preset("h100-80gb", nodes=nodes, gpus_per_node=8), Workload(seq_len=4096,
                                                                                   global_batch=64 * nodes)
    plan = search(desc, cluster, job)
    experts_split = [c for c in plan.fitting if c.layout.dims.ep > 1]
    assert experts_split and all(c.time.ep_comm > 0 for c in experts_split)
    assert plan.best.layout.dims.ep > 1, plan.best.layout
    dense = search(desc, cluster, job, ep=1)
    assert dense.best is None or dense.best.tokens_per_s < plan.best.tokens_per_s
    assert not any(c.layout.dims.pp > 1 or c.layout.dims.cp > 1 for c in plan.candidates)
    assert desc.experts_unsplit and desc.tp_problem(2) is None and "tp=2" not in plan.dropped_families
    split = [c for c in plan.candidates if c.layout.dims.tp > 1 and c.layout.dims.zero_stage < 3]
    assert split and all(c.layout.dims.ep == 1 for c in split)  # AutoEP composes with dp only
    for c in split:  # every routed expert on each tensor rank (bf16 weights unpartitioned below ZeRO-3)
        assert c.memory.params >= 2 * desc.routed_params, (c.layout.dims, c.memory.params)
        assert c.time.compute > plan.best.time.compute / c.layout.dims.tp  # and each rank runs them all
    for split in ("pp > 1", "cp > 1"):  # its loss adds the router's balancing loss over the whole micro-batch
        assert "load-balancing loss" in plan.dropped_families[split], plan.dropped_families
    why = f"  why ep {plan.best.layout.dims.ep}:"
    reason = [line for line in plan_table(plan).splitlines() if line.startswith(why)]
    assert len(reason) == 1 and "of the 128 experts" in reason[0]
    assert "tensor parallelism keeps all 128 experts whole on each tensor rank" in reason[0], reason[0]
