"""planner/analytic.py: a plain dense decoder counted from its config alone is describe_model's ModelDesc
(every field, every tp's shares or refusal, the pipeline's answer) for each family it takes, whether the
config comes as a hand-written config.json, as transformers writes one, or as a transformers config; it
leaves everything it is not sure of to the meta count (None); its tables are transformers' own; and
`dsf plan` of a Llama config plans from it, in-process and as a cold process that imports neither torch
nor transformers, printing what the meta count prints."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from transformers import CONFIG_MAPPING
from transformers.activations import ACT2FN

from dsframework.commands.cli import cli
from dsframework.config import ModelSpec
from dsframework.models.build import resolve_model
from dsframework.models.plans import STYLES
from dsframework.models.presets import PRESETS, config_fields
from dsframework.planner import analytic
from dsframework.planner.analytic import (ACTIVATIONS, FAMILIES, OVERRIDABLE, analytic_desc, layer_tensors,
                                          read_config)
from dsframework.planner.count import model_counts
from dsframework.planner.model import describe_model

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
WIDE = dict(num_hidden_layers=2, max_position_embeddings=8192)  # real widths, two layers: the same per-layer rules
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4096, "rope_theta": 500000.0}
CASES = {  # name -> config.json fields (model_type first)
    "llama": {"model_type": "llama", **TINY},
    "llama-biases-tied": {"model_type": "llama", **TINY, "attention_bias": True, "mlp_bias": True,
                          "tie_word_embeddings": True},
    "llama-head-dim-mha": {"model_type": "llama", **TINY, "head_dim": 32, "num_key_value_heads": None},
    "llama-odd-vocab-ffn": {"model_type": "llama", **TINY, "vocab_size": 1001, "intermediate_size": 100,
                            "num_attention_heads": 8, "num_key_value_heads": 8, "pad_token_id": 0,
                            "eos_token_id": [1, 2]},  # ffn 100: tp 8 refused by its split, not by the heads
    "llama3-8b-wide": {"model_type": "llama", **WIDE, "vocab_size": 128256, "hidden_size": 4096,
                       "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                       "rope_scaling": LLAMA3_ROPE, "torch_dtype": "bfloat16", "hidden_act": "silu"},
    "llama-1t-wide": {"model_type": "llama", **WIDE, "vocab_size": 128256, "hidden_size": 25600,
                      "intermediate_size": 102400, "num_attention_heads": 160, "num_key_value_heads": 8},
    "mistral": {"model_type": "mistral", **TINY, "attention_dropout": 0.1},  # its default window of 4096
    "mistral-no-window-head-dim": {"model_type": "mistral", **TINY, "sliding_window": None, "head_dim": 8,
                                   "hidden_act": "gelu"},
    "qwen2-tied": {"model_type": "qwen2", **TINY, "tie_word_embeddings": True},
    "qwen2-sliding": {"model_type": "qwen2", **TINY, "num_hidden_layers": 3, "use_sliding_window": True,
                      "sliding_window": 64, "max_window_layers": 1},
    "qwen2-7b-wide": {"model_type": "qwen2", **WIDE, "vocab_size": 152064, "hidden_size": 3584,
                      "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
                      "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 131072},
    "qwen3": {"model_type": "qwen3", **TINY, "head_dim": 16},
    "qwen3-bias-tied-kv3": {"model_type": "qwen3", **TINY, "num_attention_heads": 6, "num_key_value_heads": 3,
                            "head_dim": 16, "attention_bias": True, "tie_word_embeddings": True,
                            "hidden_size": 96},
    "qwen3-8b-wide": {**PRESETS["qwen3-8b"], **WIDE},
}
TPS = (1, 2, 3, 4, 8)


def _fields(desc) -> dict:
    return {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc) if f.name != "counts"}


def _same(desc, meta) -> None:
    assert desc is not None and _fields(desc) == _fields(meta)
    assert desc.pp_problem == meta.pp_problem
    for tp in TPS:
        assert desc.tp_problem(tp) == meta.tp_problem(tp)
        if meta.tp_problem(tp) is None:
            assert desc.shares(tp) == meta.shares(tp)


@pytest.mark.parametrize("case", list(CASES))
def test_a_dense_config_counts_as_on_the_model(case, tmp_path):
    """The config.json as written by hand, as transformers writes it, and transformers' config itself:
    each describes as the meta-device count does, and the layer's tensors are the module's, in order."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CASES[case]))
    config = resolve_model(ModelSpec(name=str(path))).config  # what dsf plan counts on the model
    meta = describe_model(config, name=case)
    config.to_json_file(tmp_path / "written.json")
    for given in (config_fields(str(path)), config_fields(str(tmp_path / "written.json")), config):
        _same(analytic_desc(given, name=case), meta)
    counts = model_counts(config)
    layer = counts.model.get_submodule(counts.layers_path)[0]
    read = read_config(CASES[case])
    assert read is not None and layer_tensors(read) == [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
    assert ("ColumnParallelLinear" in (meta.tp_problem(8) or "")) == (case == "llama-odd-vocab-ffn")  # (met)


REFUSED = {  # what analytic.py leaves to the meta count (a MoE, another architecture, what may change it)
    "moe": PRESETS["qwen3-30b-a3b"],
    "another type": PRESETS["olmo2-13b"],
    "gpt2": PRESETS["tiny-gpt2"],
    "no type": TINY,
    "a llama's window": {"model_type": "llama", **TINY, "sliding_window": 16},
    "eager attention": {"model_type": "llama", **TINY, "attn_implementation": "eager"},
    "an int for a float": {"model_type": "llama", **TINY, "rms_norm_eps": 1},
    "a bool for a size": {"model_type": "llama", **TINY, "num_hidden_layers": True},
    "yarn": {"model_type": "qwen3", **TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "llama3 short of a key": {"model_type": "llama", **TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "an activation with weights": {"model_type": "llama", **TINY, "hidden_act": "xielu"},
    "pad outside the vocabulary": {"model_type": "llama", **TINY, "pad_token_id": 512},
    "a linear-attention layer": {"model_type": "qwen3", **TINY, "layer_types": ["linear_attention"] * 2},
    "layer types not one per layer": {"model_type": "qwen2", **TINY, "layer_types": ["full_attention"]},
    "an odd head": {"model_type": "qwen3", **TINY, "head_dim": 15},
    "hidden not by heads": {"model_type": "llama", **TINY, "hidden_size": 66},
    "mistral without kv heads": {"model_type": "mistral", **TINY, "num_key_value_heads": None},
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_it_is_not_sure_of_is_left_to_the_meta_count(case):
    assert analytic_desc(REFUSED[case], name=case) is None


def test_config_fields_are_resolve_models_or_none(tmp_path):
    """The fields resolve_model builds a config from (a preset's, a config.json's), a run's overrides
    over them; None where resolve_model must look (weights, an override the reader does not take)."""
    assert config_fields("llama-7b") == PRESETS["llama-7b"]
    deeper = resolve_model(ModelSpec(name="tiny-llama", overrides={"num_hidden_layers": 4})).config
    _same(analytic_desc(PRESETS["tiny-llama"], name="x", overrides={"num_hidden_layers": 4}),
          describe_model(deeper, name="x"))
    assert analytic_desc(PRESETS["tiny-llama"], name="x", overrides={"rms_norm_eps": 1e-6}) is None
    (tmp_path / "config.json").write_text(json.dumps(CASES["llama"]))
    assert config_fields(str(tmp_path)) == CASES["llama"]
    (tmp_path / "model.safetensors").write_text("")  # a pretrained directory: its weights are checked on the model
    assert config_fields(str(tmp_path)) is None
    for text in ("{not json", "[1, 2]"):
        (tmp_path / "bad.json").write_text(text)
        assert config_fields(str(tmp_path / "bad.json")) is None
    assert config_fields(str(tmp_path / "missing.json")) is None


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_families_are_transformers_own(model_type):
    """Each family's plans, defaults and overridable fields are its config class's; its styles are the
    ones the count splits by."""
    cls, family = CONFIG_MAPPING[model_type], FAMILIES[model_type]
    assert list(family.tp_plan.items()) == list(cls.base_model_tp_plan.items())
    assert family.pp_plan == tuple(cls.base_model_pp_plan)
    assert {STYLES[style] for style in family.tp_plan.values()} <= {"column", "row", "grad_allreduce"}
    default, read = cls(), read_config({"model_type": model_type})
    assert read is not None
    for key in family.defaults:
        want = getattr(default, key, None)
        want = want or default.hidden_size // default.num_attention_heads if key == "head_dim" else want
        assert getattr(read, key) == want, key
    assert set(OVERRIDABLE) <= set(default.to_dict())
    assert set(family.fields) - {"head_dim"} <= set(default.to_dict())


def test_the_activations_it_takes_have_no_parameters():
    for name in ACTIVATIONS:
        assert not list(ACT2FN[name].parameters()), name


def _plan_args(path) -> list[str]:
    return ["plan", "--model", str(path), "--cluster", "h100-80gb", "--nodes", "4", "--seq-len", "4096",
            "--global-batch", "512", "--explain", "tp=4 pp=2 zero=1"]


def test_dsf_plan_of_a_llama_config_counts_it_without_the_model(tmp_path, monkeypatch):
    """`dsf plan` describes a Llama config.json from the config (the meta count never asked) and prints
    what it prints when the model is counted."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CASES["llama3-8b-wide"]))

    def refuse(*args, **kwargs):
        raise AssertionError("counted on the model")

    with monkeypatch.context() as patched:
        patched.setattr("dsframework.planner.model.describe_model", refuse)
        fast = CliRunner().invoke(cli, _plan_args(path), catch_exceptions=False)
    monkeypatch.setattr(analytic, "analytic_desc", lambda *args, **kwargs: None)
    meta = CliRunner().invoke(cli, _plan_args(path), catch_exceptions=False)
    assert fast.exit_code == meta.exit_code == 0 and "explain tp=4" in fast.output
    assert fast.output == meta.output


@pytest.mark.distributed
def test_a_cold_dsf_plan_of_a_llama_imports_neither_torch_nor_transformers(tmp_path, monkeypatch):
    """A `dsf plan` process with nothing cached plans a Llama config.json without importing torch,
    transformers or deepspeed, and prints what the meta count prints."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CASES["llama-1t-wide"]))
    code = ("import sys; from dsframework.commands.cli import cli\n"
            "try:\n    cli.main(sys.argv[1:], standalone_mode=False)\n"
            "finally:\n    print('imported:', [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules])")
    env = {**os.environ, "DSF_PLAN_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", code, *_plan_args(path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    printed, imported = run.stdout.rsplit("imported:", 1)
    assert imported.strip() == "[]", imported
    monkeypatch.setattr(analytic, "analytic_desc", lambda *args, **kwargs: None)
    assert printed == CliRunner().invoke(cli, _plan_args(path), catch_exceptions=False).output
