"""The plans are data (models/plans.py): transformers' own tp and pp plans, styles by their names
of any release, GPT-2's plan written the same way; what dsf cannot run is refused in one line,
before any rank starts (`dsf launch` / `dsf train`'s preflight), naming the model type and what works."""
from __future__ import annotations

import pytest
import torch

from dsframework.commands.cli import _run_command
from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.models.hf import causal_lm_class
from dsframework.models.plans import STYLES, architecture_plan, check_architecture, check_context_parallel
from dsframework.models.tiny import tiny_config
from dsframework.models.pipeline import check_model_parallelism, check_stages_reproduce_forward
from dsframework.planner.model import describe_model
from tests.unit.test_launch import TINY


def test_the_plans_are_transformers_own():
    plan = architecture_plan(tiny_config("qwen3"))
    assert dict(plan.tp)["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert (plan.pp.first, plan.pp.layers, plan.pp.last) == (("embed_tokens",), "layers", ("norm",))
    assert plan.tp_problem is None and plan.pp_problem is None
    phi3 = dict(architecture_plan(tiny_config("phi3")).tp)
    assert phi3["layers.*.self_attn.qkv_proj"] == "colwise_gather_output"
    assert phi3["layers.*.self_attn.o_proj"] == "rowwise_split_input"


def test_gpt2_plan_is_the_same_kind_of_data():
    from transformers import GPT2Config

    plan = architecture_plan(GPT2Config(n_layer=2))
    assert dict(plan.tp)["h.*.attn.c_attn"] == "packed_colwise" and plan.parts_of("h.*.attn.c_attn") == 3
    assert (plan.pp.first, plan.pp.layers, plan.pp.last) == (("wte", "wpe", "drop"), "h", ("ln_f",))


def test_older_style_names_map_to_the_same_layers():
    assert STYLES["colwise_rep"] == STYLES["gather"] == STYLES["colwise_gather_output"]
    assert STYLES["local_colwise"] == STYLES["colwise"] and STYLES["local_rowwise"] == STYLES["rowwise"]
    assert STYLES["local_packed_colwise"] == STYLES["packed_colwise"]


@pytest.mark.parametrize("model_type, tp, pp, fragment", [
    ("llama4_text", 2, 1,
     "parallel.tp=2: cannot shard 'llama4_text': it uses the tensor-parallel style moe_tp_experts"),
    ("minicpm3", 2, 1, "style mla_kv_a_proj, which dsframework does not implement"),
    ("granite_swa", 2, 1, "style local_params"),
    ("llama", 4, 1, "parallel.tp=4: does not divide llama's num_key_value_heads=2"),
])
def test_what_cannot_shard_is_refused_in_one_line(model_type, tp, pp, fragment):
    with pytest.raises(UserError) as info:
        check_architecture(tiny_config(model_type), tp=tp, pp=pp)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    if "does not implement" in message:
        assert "ZeRO 0-3 and context parallelism" in message  # the layouts that do work


def test_a_plan_that_splits_no_layer_is_refused():
    """Inkling 2's plan in transformers 5.25 is `embed_tokens: replicate` alone: tp 2 would run the
    whole model on each rank (and its logits came out wrong): refused, naming the plan."""
    config = tiny_config("llama")
    config.base_model_tp_plan = {"embed_tokens": "replicate",
                                 "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"}
    with pytest.raises(UserError) as info:
        check_architecture(config, tp=2)
    assert "splits no layer (embed_tokens: replicate, layers.*.self_attn.q_norm" in str(info.value)
    assert check_architecture(config, tp=1).tp_problem  # tp 1 runs; the reason stays on the plan


def test_opt_has_no_plan():
    from transformers import OPTConfig

    with pytest.raises(UserError, match="cannot shard 'opt': it has no tensor-parallel plan"):
        check_architecture(OPTConfig(), tp=2)


@pytest.mark.parametrize("model_type, fragment", [
    ("hrm_text", "uses weights outside its pipeline plan (L_module, H_module)"),
    ("gemma3n_text", "uses weights outside its pipeline plan (embed_tokens_per_layer"),
    ("dory", "has a forward its stages do not reproduce"),  # its layers run recurrently
    ("minicpm3", "its forward changes the hidden states before the head"),
])
def test_a_forward_the_stages_cannot_follow_is_refused(model_type, fragment):
    with pytest.raises(UserError) as info:
        check_model_parallelism(tiny_config(model_type), ParallelDims(world=2, pp=2))
    assert fragment in str(info.value) and f"'{model_type}'" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gemma3_text", "gpt_neox", "bamba", "lfm2",
                                        "nemotron"])
def test_stages_reproduce_the_forward(model_type):
    """With a plan (llama, gemma*, gpt_neox) or inferred from the module tree (bamba, lfm2,
    nemotron): the stages one after the other give the model's own logits."""
    check_stages_reproduce_forward(tiny_config(model_type))


def test_context_parallel_refuses_what_its_attention_would_change():
    with pytest.raises(UserError, match="sliding-window attention .8 tokens, sequences of 32"):
        check_context_parallel(tiny_config("mistral"), cp=2, seq_len=32)
    check_context_parallel(tiny_config("mistral"), cp=2, seq_len=8)  # the window covers the sequence
    with pytest.raises(UserError, match="softcapped attention scores"):
        check_context_parallel(tiny_config("gemma2", sliding_window=64), cp=2, seq_len=32)
    check_context_parallel(tiny_config("qwen2"), cp=2, seq_len=4096)  # names a window, slides nowhere


@pytest.mark.parametrize("model_type, fragment", [
    ("qwen3_5_text", "has linear_attention layers, which mix tokens outside attention"),
    ("falcon_h1", "has hybrid layers"), ("bamba", "has linear_attention layers"),
    ("minicpm3", "multi-head latent attention (kv_lora_rank)"), ("youtu", "multi-head latent attention"),
    ("cohere_compass_text", "without position_ids"),
])
def test_context_parallel_refuses_what_splits_outside_attention(model_type, fragment):
    """Ulysses gives attention every token and all else its rank's shard of the sequence: a layer
    that mixes tokens outside attention (a recurrence, a convolution) would compute another model."""
    with pytest.raises(UserError) as info:
        check_context_parallel(tiny_config(model_type), cp=2, seq_len=32)
    assert fragment in str(info.value) and "parallel.cp=1" in str(info.value) and "\n" not in str(info.value)
    assert describe_model(tiny_config(model_type)).cp_problem  # the planner drops cp for it too


def test_a_token_mixer_outside_attention_needs_the_whole_sequence():
    """Why: Qwen 3.5's gated delta net gives the second half of a sequence other outputs when it
    sees only that half (as a context-parallel rank would), by much more than rounding."""
    config = tiny_config("qwen3_5_text")
    torch.manual_seed(0)
    model = causal_lm_class(config)(config).eval()
    mixer = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    hidden = torch.randn(1, 32, config.hidden_size)
    with torch.no_grad():
        whole, half = mixer(hidden)[:, 16:], mixer(hidden[:, 16:])
    assert (whole - half).abs().max() > 0.01 * whole.abs().max()


def test_dsf_launch_refuses_before_anything_starts(tmp_path, capsys):
    """`dsf launch --dry-run` of a Llama 4 at tp 2: exit 2, one line naming the model type, the style
    and what works; nothing printed of what would start."""
    tiny_config("llama4_text").to_json_file(tmp_path / "llama4_text.json")
    model = f"model.name={tmp_path / 'llama4_text.json'}"
    with pytest.raises(SystemExit) as stop:
        _run_command(["launch", TINY, "--num-gpus", "2", "--dry-run", "--set", model,
                      "--set", "parallel.tp=2", "--set", "parallel.zero_stage=1"])
    out = capsys.readouterr()
    assert stop.value.code == 2 and "Traceback" not in out.err and out.out == ""
    (line,) = out.err.splitlines()
    assert line.startswith("dsf: error: parallel.tp=2: cannot shard 'llama4_text'") and "moe_tp_experts" in line
