"""Run config: defaults, `--set` overrides, unknown keys, validation rules, YAML round trip."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from dsframework.config import (RunConfig, build_run_config, dump_run_config, load_run_config,
                                read_yaml)
from dsframework.errors import UserError

TINY_YAML = Path(__file__).resolve().parents[2] / "launch" / "examples" / "tiny.yaml"


def _sections() -> dict[str, type[BaseModel]]:
    out = {}
    for name, field in RunConfig.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out[name] = field.annotation
    return out


def _every_key() -> list[tuple[str | None, str]]:
    """(section or None for the top level, key) for every key of the schema."""
    keys: list[tuple[str | None, str]] = [(None, name) for name in RunConfig.model_fields]
    for section, model in _sections().items():
        keys += [(section, name) for name in model.model_fields]
    return keys


def _get(run: RunConfig, dotted: str):
    node = run
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


# --- defaults -----------------------------------------------------------------------------------

def test_defaults_validate_and_equal_an_empty_mapping():
    run = RunConfig()
    assert build_run_config({}) == run
    assert RunConfig.model_validate(run.model_dump()) == run
    # The sections exist as their own models with their own defaults.
    assert run.parallel.zero_stage == 0 and run.parallel.offload_param == "none"
    assert run.train.warmup_steps <= run.train.steps
    assert run.checkpoint_dir == Path(run.output_dir) / "checkpoints"


# --- --set overrides ------------------------------------------------------------------------------

@pytest.mark.parametrize("assignment, dotted, expected", [
    ("train.steps=20", "train.steps", 20),
    ("train.lr=3e-4", "train.lr", 3e-4),
    ("train.lr=0.0003", "train.lr", 3e-4),
    ("train.eps=1.0e-12", "train.eps", 1e-12),
    ("train.stop_after=null", "train.stop_after", None),
    ("train.betas=[0.8, 0.99]", "train.betas", (0.8, 0.99)),
    ("train.precision=bf16", "train.precision", "bf16"),
    ("checkpoint.save_final=false", "checkpoint.save_final", False),
    ("checkpoint.writer=decoupled", "checkpoint.writer", "decoupled"),
    ("logging.progress=true", "logging.progress", True),
    ("parallel.zero_stage=3", "parallel.zero_stage", 3),
    ("model.tokenizer=null", "model.tokenizer", None),
    ("model.name=tiny-gpt2", "model.name", "tiny-gpt2"),
    ("output_dir=runs/a=b", "output_dir", "runs/a=b"),  # only the first '=' splits
    ("model.overrides.num_hidden_layers=4", "model.overrides.num_hidden_layers", 4),
    ("model.overrides.tie_word_embeddings=true", "model.overrides.tie_word_embeddings", True),
    ("model.overrides.layer_types=[full, sliding]", "model.overrides.layer_types", ["full", "sliding"]),
    ("model.overrides.rope_scaling={type: linear, factor: 2.0}", "model.overrides.rope_scaling",
     {"type": "linear", "factor": 2.0}),
])
def test_set_override_is_parsed_as_yaml(assignment, dotted, expected):
    base = {"train": {"stop_after": 5}, "model": {"tokenizer": "some/dir"}}
    run = build_run_config(base, [assignment])
    value = _get(run, dotted)
    assert value == expected
    assert type(value) is type(expected)  # 20 is an int, not "20"; True a bool, not "true"


def test_set_exponent_float_in_free_form_override_is_a_float():
    run = build_run_config({}, ["model.overrides.rms_norm_eps=1e-6"])
    assert run.model.overrides["rms_norm_eps"] == 1e-6


def test_yaml_file_exponent_float_in_free_form_override_is_a_float(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  overrides:\n    rms_norm_eps: 1e-6\n")
    assert load_run_config(path).model.overrides["rms_norm_eps"] == 1e-6


def test_overrides_apply_in_order_and_keep_other_keys():
    data = {"model": {"overrides": {"hidden_size": 32}}, "train": {"steps": 10}}
    run = build_run_config(data, ["train.steps=5", "model.overrides.num_hidden_layers=4", "train.steps=7"])
    assert run.train.steps == 7
    assert run.model.overrides == {"hidden_size": 32, "num_hidden_layers": 4}
    # The caller's mapping is not modified.
    assert data == {"model": {"overrides": {"hidden_size": 32}}, "train": {"steps": 10}}


def test_override_creates_a_missing_section():
    run = build_run_config({"output_dir": "x"}, ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"])
    assert (run.parallel.zero_stage, run.parallel.offload_optimizer, run.output_dir) == (2, "cpu", "x")


@pytest.mark.parametrize("assignment, fragment", [
    ("train.steps", "dotted.key=value"),
    ("=3", "dotted.key=value"),
    ("train.lr.peak=1", "train.lr is a value, not a section"),
    ("output_dir.x=1", "output_dir is a value, not a section"),
])
def test_malformed_override_is_a_user_error(assignment, fragment):
    with pytest.raises(UserError) as info:
        build_run_config({}, [assignment])
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


# --- unknown keys -------------------------------------------------------------------------------

@pytest.mark.parametrize("section, key", _every_key(), ids=lambda v: str(v))
def test_unknown_key_in_set_suggests_the_close_match(section, key):
    typo = key + key[-1] if len(key) > 2 else key[0] + key  # 'dpp' would be as close to 'pp'
    dotted = f"{section}.{typo}" if section else typo
    with pytest.raises(UserError) as info:
        build_run_config({}, [f"{dotted}=1"])
    message = str(info.value)
    assert f"unknown key {typo!r}" in message
    assert f"did you mean {key!r}?" in message


@pytest.mark.parametrize("section, key", _every_key(), ids=lambda v: str(v))
def test_unknown_key_in_mapping_suggests_the_close_match(section, key):
    typo = key + key[-1] if len(key) > 2 else key[0] + key  # 'dpp' would be as close to 'pp'
    data = {section: {typo: 1}} if section else {typo: 1}
    with pytest.raises(UserError) as info:
        build_run_config(data)
    message = str(info.value)
    assert message.startswith(f"{section}.{typo}" if section else typo)
    assert f"did you mean {key!r}?" in message
    assert "\n" not in message


def test_unknown_key_without_close_match_lists_the_valid_keys():
    with pytest.raises(UserError) as info:
        build_run_config({}, ["zzzz=1"])
    assert "valid: checkpoint, data, faults, logging, model, output_dir, parallel, train" in str(info.value)


# --- validation rules ---------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, fragments", [
    (["train.steps=10", "train.warmup_steps=11"], ["train", "warmup_steps=11", "steps=10", "train.warmup_steps"]),
    (["parallel.offload_param=cpu", "parallel.zero_stage=2"], ["parallel", "parallel.offload_param='cpu'", "zero_stage=3"]),
    (["parallel.offload_param=nvme"], ["parallel", "parallel.offload_param='nvme'", "zero_stage=3"]),
    (["parallel.offload_optimizer=cpu", "parallel.zero_stage=0"], ["parallel", "parallel.offload_optimizer='cpu'", "zero_stage"]),
    (["train.lr=0"], ["train.lr=0", "greater than 0"]),
    (["train.lr=-0.001"], ["train.lr=-0.001", "greater than 0"]),
    (["train.lr=-3e-4"], ["train.lr=", "greater than 0"]),
    (["parallel.zero_stage=4"], ["parallel.zero_stage=4"]),
    (["train.optimizer=sgd"], ["train.optimizer='sgd'"]),
])
def test_invalid_values_raise_a_one_line_user_error_naming_the_field(overrides, fragments):
    with pytest.raises(UserError) as info:
        build_run_config({}, overrides)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("overrides, expected", [
    (["train.steps=10", "train.warmup_steps=10"], {"train.warmup_steps": 10}),  # may span the run
    (["parallel.offload_param=cpu", "parallel.zero_stage=3"], {"parallel.offload_param": "cpu"}),
    (["parallel.offload_optimizer=cpu", "parallel.zero_stage=1"], {"parallel.offload_optimizer": "cpu"}),
    (["parallel.offload_optimizer=nvme", "parallel.offload_param=nvme", "parallel.zero_stage=3"],
     {"parallel.offload_optimizer": "nvme", "parallel.offload_param": "nvme"}),
    (["train.lr=1e-9"], {"train.lr": 1e-9}),
])
def test_boundary_values_are_accepted(overrides, expected):
    run = build_run_config({}, overrides)
    for dotted, value in expected.items():
        assert _get(run, dotted) == value


# --- files and round trip -------------------------------------------------------------------------

def test_load_tiny_example():
    run = load_run_config(TINY_YAML)
    raw = yaml.safe_load(TINY_YAML.read_text())
    for section, values in raw.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert getattr(getattr(run, section), key) == value, f"{section}.{key}"
        else:
            assert getattr(run, section) == values
    assert run.model.name == "tiny-llama" and run.data.dataset == "counting"
    assert run.train.lr == 3e-3 and run.parallel.zero_stage == 2


def test_load_tiny_example_with_overrides():
    run = load_run_config(TINY_YAML, ["parallel.zero_stage=3", "train.steps=20"])
    assert run.parallel.zero_stage == 3 and run.train.steps == 20
    assert run.train.global_batch == 32  # untouched keys keep the file's values


@pytest.mark.parametrize("text, fragment", [
    ("train: [1, 2\n", "is not valid YAML at line"),
    ("- a\n- b\n", "holds a list, not a mapping"),
])
def test_bad_yaml_files_are_user_errors(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        read_yaml(path)
    assert fragment in str(info.value)


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_run_config(tmp_path / "absent.yaml")


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_run_config(path) == RunConfig()


ROUND_TRIP_CASES = {
    "defaults": ({}, []),
    "tiny-example": (yaml.safe_load(TINY_YAML.read_text()), []),
    "everything-changed": ({}, [
        "model.name=/models/llama/config.json", "model.tokenizer=/tok",
        "model.overrides={num_hidden_layers: 4, rope_scaling: {type: linear, factor: 2.0}, "
        "layer_types: [a, b], tie_word_embeddings: false, initializer_range: 0.01}",
        "data.dataset=/data/*.jsonl", "data.text_field=content", "data.seq_len=16",
        "data.eval_fraction=0.25", "data.num_examples=100", "data.max_digits=12",
        "data.tokenizer_vocab_size=300", "data.seed=-7", "data.text_unit=paragraph", "data.messages_field=turns",
        "data.prompt_field=question", "data.completion_field=answer", "data.train_on_prompt=true",
        "data.packing=false", "data.chat_template=/t.jinja", "data.num_proc=3",
        "train.steps=1000", "train.stop_after=10", "train.micro_batch=2", "train.grad_accum=4",
        "train.global_batch=64", "train.optimizer=adam", "train.lr=3e-4", "train.betas=[0.8, 0.999]",
        "train.eps=1.0e-12", "train.weight_decay=0.1", "train.grad_clip=0", "train.lr_schedule=linear",
        "train.warmup_steps=1000", "train.min_lr_ratio=0", "train.precision=bf16", "train.seed=0",
        "train.compile=true", "train.chunked_loss=false", "train.loss_chunk_tokens=300", "train.tf32=false",
        "parallel.zero_stage=3", "parallel.offload_optimizer=nvme", "parallel.offload_param=cpu",
        "parallel.zero_knobs.persistence_threshold=5000", "parallel.zero_knobs.prefetch_bucket=20000000",
        "parallel.zero_knobs.max_live_parameters=40000000", "parallel.zero_knobs.reduce_bucket=3000000",
        "parallel.nvme_path=/scratch/nvme", "parallel.tp=2", "parallel.cp=2", "parallel.dp=4",
        "parallel.partition_method=type:Decoder", "parallel.activation_checkpointing=full",
        "parallel.sequence_parallel=false", "checkpoint.every=0", "checkpoint.save_final=false",
        "checkpoint.writer=decoupled", "checkpoint.fallback=previous", "checkpoint.keep=3", "checkpoint.keep_every=1000",
        "checkpoint.on_low_space=skip",
        "logging.every=1", "logging.eval_every=0", "logging.progress=false", "logging.cluster=h100-80gb",
        "logging.breakdown=true", "logging.tensorboard=runs/x y/tb", "logging.csv=runs/x y",
        "logging.wandb.project=x", "faults.hang_timeout=90", "output_dir=runs/x y",
    ]),
    "fine-tuning": ({"model": {"lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}}},
                    ["data.format=chat", "model.lora.r=2", "parallel.zero_stage=3"]),
    "hierarchical-zero": ({}, ["parallel.zero_stage=3", "parallel.cp=2", "parallel.zero_hpz=4"]),
    "expert-parallel": ({}, ["parallel.zero_stage=2", "parallel.ep=4"]),
    "autoep-blocks-at-ep1": ({}, ["parallel.zero_stage=1", "parallel.autoep=true"]),
    "hang-watch-off": ({"faults": {"hang_timeout": False}}, []),
    "odd-floats": ({"train": {"lr": 1.0e-20, "eps": 1.5e-300, "min_lr_ratio": 1.0}}, ["train.weight_decay=1e-5"]),
}


@pytest.mark.parametrize("data, overrides", ROUND_TRIP_CASES.values(), ids=ROUND_TRIP_CASES.keys())
def test_dump_round_trips(tmp_path, data, overrides):
    run = build_run_config(data, overrides)
    text = dump_run_config(run)
    again = build_run_config(yaml.safe_load(text))
    assert again == run
    assert yaml.safe_load(dump_run_config(again)) == yaml.safe_load(text)
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert load_run_config(path) == run


def test_everything_changed_case_differs_from_defaults_in_every_section():
    data, overrides = ROUND_TRIP_CASES["everything-changed"]
    run, default = build_run_config(data, overrides), RunConfig()
    for section in _sections():
        model = type(getattr(run, section))
        for key in model.model_fields:
            if (section, key) in (("parallel", "pp"), ("parallel", "zero_hpz"), ("parallel", "zero_quantized"),
                                ("parallel", "ep"), ("parallel", "autoep"), ("model", "lora"), ("data", "format")):
                continue  # pp > 1 needs ZeRO 0/1, hpZ and ep need tp 1 (this case: ZeRO-3 offload, tp 2); quantized
                # is refused; LoRA and chat data need tp = cp = 1 (the fine-tuning case has them)
            assert getattr(getattr(run, section), key) != getattr(getattr(default, section), key), \
                f"{section}.{key} is not exercised by the round trip"
