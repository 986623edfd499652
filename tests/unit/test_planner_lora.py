"""The planner's memory model of a LoRA run: the adapters' count (models/lora.py count_lora_parameters,
on a meta model) equals peft's own on a real model and r x (in + out) per adapted linear on a 70B
config, fast; with it (Workload.trainable_params) gradients, optimizer states, their offload and the
gradient-sized buffers shrink to the adapters' while the parameters stay every one (frozen base +
adapters). The live engines' bytes are checked in tests/distributed/test_planner_memory.py.

    python -m pytest tests/unit/test_planner_lora.py -q
"""
from __future__ import annotations

import time
from functools import lru_cache

import pytest

from dsframework.config import LoraSpec, ModelSpec
from dsframework.layout import ParallelDims
from dsframework.models.build import build_model, resolve_model
from dsframework.models.lora import apply_lora, count_lora_parameters
from dsframework.planner.cluster import GiB, cluster_preset
from dsframework.planner.fit import check_fit
from dsframework.planner.memory import Workload, Layout, memory_per_rank, stage_shapes
from dsframework.planner.model import describe_model
from dsframework.runtime_facts import ZERO3_PERSISTENCE_THRESHOLD

SPECS = {"all_linear": LoraSpec(r=4), "q_v": LoraSpec(r=8, target_modules=["q_proj", "v_proj"]),
         "gpt2_attn": LoraSpec(r=4, target_modules=["c_attn"])}


@pytest.mark.parametrize("model,spec", [("tiny-llama", "all_linear"), ("tiny-llama", "q_v"),
                                        ("tiny-gpt2", "all_linear"), ("tiny-gpt2", "gpt2_attn")])
def test_count_on_meta_equals_peft_on_the_real_model(model, spec):
    source = resolve_model(ModelSpec(name=model))
    real = apply_lora(build_model(source, source.config, seed=0), SPECS[spec], seed=0)
    trainable, total = real.get_nb_trainable_parameters()
    count = count_lora_parameters(source.config, SPECS[spec])
    assert (count.trainable, count.total) == (trainable, total)
    assert count.persistent == sum(p.numel() for p in real.parameters()
                                   if p.requires_grad and p.numel() <= ZERO3_PERSISTENCE_THRESHOLD)


@lru_cache(maxsize=None)
def llama_70b():
    return resolve_model(ModelSpec(name="llama-70b")).config


@lru_cache(maxsize=None)
def lora_70b():
    """The adapters of peft's all-linear LoRA at r = 8 on llama-70b (counted once for these tests)."""
    return count_lora_parameters(llama_70b(), LoraSpec(r=8))


def test_a_70b_count_is_r_times_in_plus_out_per_adapted_linear_and_fast():
    config = llama_70b()
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * h // config.num_attention_heads
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}  # (in, out)
    start = time.monotonic()
    count = count_lora_parameters(config, LoraSpec(r=8))  # all-linear: every linear layer but lm_head
    elapsed = time.monotonic() - start
    r = 8
    assert count.trainable == layers * sum(r * (i + o) for i, o in shapes.values()) == 103_546_880
    # A (r x in) and B (out x r) tensors of <= 1e5 elements stay whole under ZeRO-3
    assert count.persistent == layers * sum(n for i, o in shapes.values() for n in (r * i, r * o)
                                            if n <= ZERO3_PERSISTENCE_THRESHOLD)
    assert count.total == describe_model(config).total_params + count.trainable
    assert elapsed < 8, f"{elapsed:.1f} s to count a 70B model's adapters on meta"


def lora_job(count, **kwargs) -> Workload:
    return Workload(trainable_params=count.trainable, trainable_persistent=count.persistent, **kwargs)


LAYOUTS = {  # name: Layout of 8 data-parallel ranks
    "zero0": Layout(ParallelDims(world=8, zero_stage=0)), "zero1_accum": Layout(ParallelDims(world=8, zero_stage=1), grad_accum=4),
    "zero1": Layout(ParallelDims(world=8, zero_stage=1)), "zero2": Layout(ParallelDims(world=8, zero_stage=2)), "zero3": Layout(ParallelDims(world=8, zero_stage=3)),
    "zero2_offload": Layout(ParallelDims(world=8, zero_stage=2), offload_optimizer=True),
    "zero3_offload": Layout(ParallelDims(world=8, zero_stage=3), offload_optimizer=True, offload_param=True),
}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradients_and_optimizer_shrink_to_the_adapters_parameters_do_not(name, precision):
    desc = describe_model(llama_70b(), name="llama-70b")
    count = lora_70b()
    layout = LAYOUTS[name]
    full = memory_per_rank(desc, layout,
                           Workload(seq_len=2048, global_batch=8 * layout.grad_accum, precision=precision))
    lora = memory_per_rank(desc, layout, lora_job(count, seq_len=2048, global_batch=8 * layout.grad_accum,
                                                  precision=precision))
    P, T, d, w = desc.total_params, count.trainable, 8, 4 if precision == "fp32" else 2
    assert stage_shapes(desc, 1, 1)[0].params == P
    for key in ("grads", "optimizer", "cpu_grads", "cpu_optimizer"):  # every one proportional to what trains
        assert getattr(lora, key) == pytest.approx(getattr(full, key) * T / P), key
    assert lora.grads + lora.cpu_grads > 0 and lora.optimizer + lora.cpu_optimizer > 0
    if layout.dims.zero_stage < 3:  # the frozen base whole, beside the adapters
        assert lora.params == pytest.approx(full.params + w * T)
    else:  # partitioned, the small adapter tensors kept whole
        assert lora.params + lora.cpu_params == pytest.approx(
            full.params + full.cpu_params + w * T / d + w * count.persistent)
        assert lora.cpu_params == pytest.approx(full.cpu_params + (w * T / d if layout.offload_param else 0))
    assert lora.activations == full.activations
    assert lora.buffers < full.buffers
    assert lora.parts["trainable_elements"] == T and "trainable_elements" in full.parts


def test_a_70b_lora_on_8_gpus_fits_where_full_fine_tuning_does_not():
    """ZeRO-3 on one node of 8 H100s: full fine-tuning's gradients and Adam states (fp32 gradients,
    bf16 accumulated in fp32, and fp32 master + Adam: 16 bytes a parameter, / 8) do not fit; LoRA's,
    the adapters' alone, do."""
    desc = describe_model(llama_70b(), name="llama-70b")
    cluster = cluster_preset("h100-80gb", nodes=1, gpus_per_node=8)
    layout = Layout(ParallelDims(world=8, zero_stage=3), activation_checkpointing="full")
    full = check_fit(desc, layout, Workload(seq_len=4096, global_batch=8), cluster)
    lora = check_fit(desc, layout, lora_job(lora_70b(), seq_len=4096, global_batch=8), cluster)
    assert not full.fits and lora.fits, (full.why_not, lora.need / GiB)
    saved = (full.memory.grads + full.memory.optimizer) - (lora.memory.grads + lora.memory.optimizer)
    assert saved == pytest.approx((4 + 12) * (desc.total_params - lora_70b().trainable) / 8)
