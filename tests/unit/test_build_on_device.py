"""`build_model(..., device=, dtype=)` (`dsf train` at ZeRO 0-2, tp = pp = 1): the model is built on
the meta device and each module's parameters are made on the rank's device in its training dtype,
so no rank holds the fp32 model on the host (models/build.py, models/construct.py).

- the values equal the host build's, bit for bit, after DeepSpeed's cast (random init, pretrained
  safetensors, a pytorch_model.bin directory through from_pretrained), and so does the RNG state
  after (dropout draws from it), so no loss changes;
- on this CPU the build allocates each parameter once in its training dtype: the host's peak
  resident memory (VmHWM, reset as the build begins) grows by at most 1.1 x the parameters' bytes,
  where the host build of a bf16 run (fp32, cast later by DeepSpeed) grows by twice that;
- on a (fake) CUDA device every parameter and buffer ends on cuda:0 in its dtype, and the host
  never holds more than one module's values at a time;
- LoRA (peft) adapts a model built this way.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dsframework.config import LoraSpec, ModelSpec
from dsframework.models.build import build_model, build_on_host, rank_placement, resolve_model
from dsframework.models.construct import SeededInit, host_peak, release_freed_memory
from dsframework.models.lora import apply_lora, trainable_names

MODELS = {"llama": ("tiny-llama", {}), "llama-tied": ("tiny-llama", {"tie_word_embeddings": True}),
          "gpt2": ("tiny-gpt2", {})}
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def cast_as_deepspeed(model, dtype):
    """What DeepSpeed's initialize does to the host build for bf16/fp16: its floating parameters cast."""
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return model


def assert_same_model(got, want) -> None:
    params = dict(want.named_parameters(remove_duplicate=False))
    assert dict(got.named_parameters(remove_duplicate=False)).keys() == params.keys()
    for name, param in got.named_parameters(remove_duplicate=False):
        assert param.dtype == params[name].dtype and torch.equal(param, params[name]), name
    buffers = dict(want.named_buffers())
    for name, buffer in got.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    assert got.training == want.training
    assert (got.get_output_embeddings().weight is got.get_input_embeddings().weight) == \
        (want.get_output_embeddings().weight is want.get_input_embeddings().weight), "ties as the host build's"


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_built_on_the_device_equals_the_host_build(model_name, dtype, one_thread):
    preset, overrides = MODELS[model_name]
    source = resolve_model(ModelSpec(name=preset, overrides=overrides))
    want = cast_as_deepspeed(build_model(source, source.config, seed=7), dtype)
    rng_after_host_build = torch.get_rng_state()
    got = build_model(source, source.config, seed=7, device=CPU, dtype=dtype)
    assert torch.equal(torch.get_rng_state(), rng_after_host_build), "dropout draws from the same state"
    assert_same_model(got, want)


def save(model_type: str, path, *, safetensors: bool = True):
    from transformers import AutoModelForCausalLM

    from dsframework.models.tiny import tiny_config

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=101))
    model.save_pretrained(path, safe_serialization=safetensors)


@pytest.mark.parametrize("model_type, safetensors", [("llama", True), ("gpt2", True), ("llama", False)])
def test_a_pretrained_directory_loads_to_the_device(tmp_path, model_type, safetensors, one_thread):
    """Safetensors: read tensor by tensor (PretrainedSlices); pytorch_model.bin: from_pretrained with
    a device_map. Either equals the host build's from_pretrained, cast."""
    save(model_type, tmp_path, safetensors=safetensors)
    source = resolve_model(ModelSpec(name=str(tmp_path)))
    want = cast_as_deepspeed(build_model(source, source.config, seed=0), torch.bfloat16)
    got = build_model(source, source.config, seed=0, device=CPU, dtype=torch.bfloat16)
    assert_same_model(got, want)


def test_lora_adapts_a_model_built_on_the_device(one_thread):
    source = resolve_model(ModelSpec(name="tiny-llama"))
    spec = LoraSpec(r=4, target_modules=["q_proj", "v_proj"])
    want = apply_lora(cast_as_deepspeed(build_model(source, source.config, seed=3), torch.bfloat16), spec, seed=3)
    got = apply_lora(build_model(source, source.config, seed=3, device=CPU, dtype=torch.bfloat16), spec, seed=3)
    assert trainable_names(got) == trainable_names(want) != []
    for (name, param), (_, reference) in zip(got.named_parameters(), want.named_parameters()):
        assert param.dtype == reference.dtype and torch.equal(param, reference), name


def test_a_type_only_its_constructor_initialises_is_built_on_the_host(one_thread):
    """Qwen3-Next's router weight is set by its module's constructor, not by transformers' init: the
    weightless build cannot know it, so the build falls back to the host's (today's values)."""
    from dsframework.models.build import ModelSource
    from dsframework.models.tiny import tiny_config

    source = ModelSource(tiny_config("qwen3_next"))
    want = build_model(source, source.config, seed=2)
    got = build_model(source, source.config, seed=2, device=CPU, dtype=torch.float32)
    assert_same_model(got, want)


def test_rank_placement_is_the_engines_device_and_the_training_dtype(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_placement("bf16") == (CPU, torch.bfloat16)  # DeepSpeed's CPU accelerator: the CPU
    assert rank_placement("fp32") == (CPU, torch.float32)
    assert rank_placement("fp16") == (CPU, torch.float16)


# --- host memory --------------------------------------------------------------------------------

BIG = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 8,
       "num_key_value_heads": 8, "vocab_size": 1024}  # 43M parameters; the largest module 1.2% of them


def measured_build(source, **placement) -> tuple[int, int]:
    """(peak host growth while building, parameter bytes) of one build in this process: VmHWM reset
    as it begins, less the resident memory then, freed pages given back to the OS first (so that no
    earlier test's freed heap serves it unseen)."""
    gc.collect()
    release_freed_memory()
    with host_peak() as peak:
        model = build_model(source, source.config, seed=1, **placement)
    if not peak.reset:
        pytest.skip("the peak resident memory cannot be reset here (/proc/self/clear_refs)")
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    return peak.peak - peak.before, kept


def test_the_build_allocates_each_parameter_once_in_its_training_dtype(one_thread):
    source = resolve_model(ModelSpec(name="tiny-llama", overrides=BIG))
    warm = resolve_model(ModelSpec(name="tiny-llama"))
    build_model(warm, warm.config, seed=1, device=CPU, dtype=torch.bfloat16)  # the first build's one-off costs
    figures = {}
    for dtype in (torch.bfloat16, torch.float32):
        growth, kept = measured_build(source, device=CPU, dtype=dtype)
        figures[str(dtype)] = (growth, kept)
        assert growth <= 1.1 * kept, (dtype, growth / 2**20, kept / 2**20)
    bf16_bytes, fp32_bytes = figures["torch.bfloat16"][1], figures["torch.float32"][1]
    assert fp32_bytes == 2 * bf16_bytes > 70e6, "every parameter in the dtype asked for"
    # The host build of a bf16 run (fp32, cast by DeepSpeed later), measured the same way: twice the bytes.
    gc.collect()
    release_freed_memory()
    with host_peak() as peak:
        dense = build_on_host(source, source.config, seed=1)
    host_growth = peak.peak - peak.before
    assert host_growth >= 1.8 * bf16_bytes, (host_growth / 2**20, bf16_bytes / 2**20)
    del dense
    print({name: f"+{growth / 2**20:.1f} MiB for {kept / 2**20:.1f} MiB" for name, (growth, kept) in figures.items()},
          f"host build: +{host_growth / 2**20:.1f} MiB")


# --- a CUDA device, simulated -------------------------------------------------------------------

def test_on_a_cuda_device_no_host_copy_of_the_model(monkeypatch, one_thread):
    """Under FakeTensorMode (tensors on cuda:0 without a GPU), with what a GPU rank does on its host
    done for real: the meta model (its buffers computed on the host) and each module's values (random
    init does not run on fake tensors). Every parameter lands on cuda:0 in bf16, every buffer on
    cuda:0, and no module's host values outlive its turn."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    from dsframework.models import construct

    real_empty_model = construct.empty_model

    def empty_model(config):
        with unset_fake_temporarily():
            return real_empty_model(config)

    monkeypatch.setattr(construct, "empty_model", empty_model)
    handed_out: list[weakref.ref] = []
    alive_at_each_turn: list[int] = []
    real_values = SeededInit.values

    def values(self, path, template, module):
        alive_at_each_turn.append(sum(ref() is not None for ref in handed_out))
        with unset_fake_temporarily():
            out = real_values(self, path, template, module)
        assert all(type(value) is torch.Tensor and value.device == CPU for value in out.values())
        handed_out.extend(weakref.ref(value) for value in out.values())
        return out

    monkeypatch.setattr(SeededInit, "values", values)
    source = resolve_model(ModelSpec(name="tiny-llama"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(source, source.config, seed=1, device=CUDA, dtype=torch.bfloat16)
    assert len(alive_at_each_turn) == len([m for m in model.modules() if m._parameters]) > 5
    assert max(alive_at_each_turn) == 0 and not any(ref() is not None for ref in handed_out), \
        "a module's host values outlived its turn"
    for name, param in model.named_parameters():
        assert param.device == CUDA and param.dtype == torch.bfloat16, name
    for name, buffer in model.named_buffers():
        assert buffer.device == CUDA, name
