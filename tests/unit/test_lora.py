"""LoRA through peft, in one process: which layers a target_modules list may name (one-line errors
naming the closest layer, also from the real `dsf train` command line, nothing written), which
parameters train, the seeded adapter init, and the merge that `dsf export` writes (Llama, and GPT-2's
Conv1D layers).

    python -m pytest tests/unit/test_lora.py -q
"""
from __future__ import annotations

import subprocess

import pytest
import torch

from dsframework.config import LoraSpec, ModelSpec
from dsframework.errors import UserError
from dsframework.models.build import build_model, resolve_model
from dsframework.models.lora import apply_lora, merge_lora, trainable_names
from tests.unit.test_bad_input import REPO, TIMEOUT_S, dsf_command, dsf_env


def built(name: str, *, seed: int = 5):
    source = resolve_model(ModelSpec(name=name))
    return build_model(source, source.config, seed=seed)


BAD_TARGETS = {  # id: (model, target_modules, what the one line says)
    "typo": ("tiny-llama", ["q_prj", "v_proj"], ["model.lora.target_modules='q_prj'", "matches no module",
                                                 "did you mean 'q_proj'?"]),
    "second_entry": ("tiny-llama", ["q_proj", "gate"], ["'gate'", "did you mean 'gate_proj'?"]),
    "not_a_layer": ("tiny-llama", ["mlp"], ["'mlp'", "LlamaMLP", "which LoRA does not adapt", "valid: down_proj"]),
    "nothing_close": ("tiny-llama", ["attention"], ["matches no module", "valid: down_proj, embed_tokens, gate_proj"]),
    "empty": ("tiny-llama", [], ["names no module", "all-linear"]),
    "gpt2_typo": ("tiny-gpt2", ["c_atn"], ["did you mean 'c_attn'?"]),
}


@pytest.mark.parametrize("case", list(BAD_TARGETS))
def test_a_target_matching_no_layer_is_one_line_naming_the_closest(case):
    model, targets, expect = BAD_TARGETS[case]
    with pytest.raises(UserError) as err:  # at resolve time: before a tokenizer or checkpoint is written
        resolve_model(ModelSpec(name=model, lora=LoraSpec(target_modules=targets)))
    message = str(err.value)
    assert "\n" not in message
    for part in expect:
        assert part in message, message


@pytest.mark.distributed
def test_dsf_train_refuses_a_bad_target_and_writes_nothing(tmp_path):
    """The real command line, a world of one: exit 2, one line on stderr, no output_dir made."""
    out = tmp_path / "out"
    proc = subprocess.run(dsf_command() + ["train", str(REPO / "launch" / "examples" / "tiny.yaml"),
                                           "--set", f"output_dir={out}", "--set", "model.lora.target_modules=[q_proj, vproj]"],
                          cwd=tmp_path, env=dsf_env(tmp_path / "home"), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["dsf: error: model.lora.target_modules='vproj': matches no module of the model; "
                     "did you mean 'v_proj'?"], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_only_the_adapters_train(one_thread, targets):
    model = apply_lora(built("tiny-llama"), LoraSpec(r=4, target_modules=targets), seed=1)
    config = model.config
    names = trainable_names(model)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    h, kv = config.hidden_size, config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, config.intermediate_size), "up_proj": (h, config.intermediate_size),
              "down_proj": (config.intermediate_size, h)}  # (in, out); the head is never adapted by all-linear
    adapted = list(shapes) if targets == "all-linear" else targets
    want = config.num_hidden_layers * sum(4 * (shapes[t][0] + shapes[t][1]) for t in adapted)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == want
    assert not any("lm_head" in n or "embed" in n for n in names)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert "base_model.model.lm_head.weight" in frozen and len(frozen) + len(names) == len(list(model.parameters()))


def test_adapters_start_as_the_base_from_the_seed(one_thread):
    """lora_B starts at zero (the adapted model is the base), lora_A from train.seed: the same on every
    rank and rebuild, another with another seed."""
    spec = LoraSpec(r=4, target_modules=["q_proj", "v_proj"])
    base = built("tiny-llama")
    input_ids = torch.arange(24).remainder(base.config.vocab_size).view(2, 12)
    with torch.no_grad():
        want = base(input_ids=input_ids).logits
    first, again, other = (apply_lora(built("tiny-llama"), spec, seed=s) for s in (7, 7, 8))
    a = {n: p for n, p in first.named_parameters() if p.requires_grad}
    b = {n: p for n, p in again.named_parameters() if p.requires_grad}
    c = {n: p for n, p in other.named_parameters() if p.requires_grad}
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.count_nonzero(a[n]) == 0 for n in a if ".lora_B." in n)
    assert not any(torch.equal(a[n], c[n]) for n in a if ".lora_A." in n)
    with torch.no_grad():
        assert torch.equal(first(input_ids=input_ids).logits, want)


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_merged_model_gives_the_adapted_logits(one_thread, model_name):
    """merge_and_unload (what `dsf export` writes) equals the adapted model, and differs from the base:
    Llama's Linear layers and GPT-2's Conv1D (fan_in_fan_out, which peft sets itself)."""
    model = apply_lora(built(model_name), LoraSpec(r=4, alpha=8), seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:  # as if trained
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    input_ids = torch.arange(24).remainder(model.config.vocab_size).view(2, 12)
    base = built(model_name).eval()
    with torch.no_grad():
        adapted = model.eval()(input_ids=input_ids).logits
        merged_model = merge_lora(model)
        merged = merged_model(input_ids=input_ids).logits
        plain = base(input_ids=input_ids).logits
    assert type(merged_model) is type(base) and not any("lora" in n for n, _ in merged_model.named_parameters())
    assert torch.allclose(merged, adapted, atol=1e-5, rtol=0), (merged - adapted).abs().max()
    assert (merged - plain).abs().max() > 1e-2


RESUMES = {  # id: (the run's model.lora, the resume's, what the one line says; None: it resumes)
    "other_rank": ({"r": 4}, {"r": 2}, ["model.lora.r=2", "checkpoint's 4", "resume with model.lora.r=4"]),
    "other_targets": ({"target_modules": ["q_proj", "v_proj"]}, {"target_modules": "all-linear"},
                      ["model.lora.target_modules='all-linear'", "checkpoint's [q_proj, v_proj]"]),
    "other_alpha": ({"alpha": 8}, {"alpha": 16}, ["model.lora.alpha=16.0", "checkpoint's 8.0"]),
    "lora_dropped": ({"r": 4}, None, ["model.lora: is not set", "r=4", "resume with the model.lora"]),
    "lora_added": (None, {"r": 4}, ["model.lora: is set", "without adapters", "resume without model.lora"]),
    "same_targets_reordered": ({"target_modules": ["q_proj", "v_proj"]}, {"target_modules": ["v_proj", "q_proj"]}, None),
    "other_dropout": ({"dropout": 0.0}, {"dropout": 0.1}, None),
    "no_lora": (None, None, None),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_a_resume_keeps_the_adapters(tmp_path, case):
    """Checked against the run.yaml beside the checkpoints, before a checkpoint is converted or a model
    built (train/setup.py prepare); dropout may change."""
    from dsframework.checkpoints.checkpoint import RUN_YAML, check_same_adapters
    from dsframework.config import build_run_config, dump_run_config

    saved, now, expect = RESUMES[case]
    run = build_run_config({"model": {"name": "tiny-llama", **({"lora": saved} if saved else {})}})
    (tmp_path / RUN_YAML).write_text(dump_run_config(run))
    spec = LoraSpec(**now) if now is not None else None
    if expect is None:
        check_same_adapters(tmp_path, spec)
        return
    with pytest.raises(UserError) as err:
        check_same_adapters(tmp_path, spec)
    for part in expect:
        assert part in str(err.value), str(err.value)
