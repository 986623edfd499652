"""The planner's copies of runtime facts cannot drift: each has one home (runtime_facts.py) that the
runtime and the planner both read, and the stage partition is pinned to DeepSpeed's own."""
from __future__ import annotations

import random

import pytest

from dsframework import dsconfig, runtime_facts
from dsframework.config import ModelSpec, build_run_config
from dsframework.dsconfig import build_ds_config
from dsframework.layout import ParallelDims
from dsframework.models.build import resolve_model
from dsframework.parallel import tensor
from dsframework.models.pipeline import layer_parameter_counts, partition_layers, pipeline_layer_specs
from dsframework.planner import memory, speed
from dsframework.planner.cluster import MATMUL_EFFICIENCY, Cluster, cluster_preset
from dsframework.planner.fit import RESERVED_PER_GPU, usable_gpu_memory
from dsframework.planner.memory import Workload, Layout, _items, stage_shapes
from dsframework.planner.model import describe_model


def _ds():
    from deepspeed.runtime import utils

    return utils


def test_partition_balanced_is_deepspeeds_on_random_weights():
    ds, rng = _ds(), random.Random(0)
    for _ in range(300):
        n, parts = rng.randint(1, 40), rng.randint(1, 12)
        kind = rng.random()
        if kind < 0.3:  # small integers: many ties (DeepSpeed keeps the last split point)
            weights = [rng.randint(0, 5) for _ in range(n)]
        elif kind < 0.6:  # a model: heavy ends, equal layers
            weights = ([rng.randint(10, 10**6)] + [rng.randint(1, 10**5)] * max(n - 2, 0) + [rng.randint(10, 10**6)])[:n]
        else:
            weights = [rng.randint(0, 10**9) for _ in range(n)]
        assert runtime_facts.partition_balanced(weights, parts) == [int(p) for p in ds.partition_balanced(weights, parts)]
        assert runtime_facts.partition_uniform(n, parts) == [int(p) for p in ds.partition_uniform(n, parts)]


@pytest.mark.parametrize("name", ["llama-7b", "llama-70b", "llama-1b", "gpt2-124m"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_planner_stage_boundaries_are_deepspeeds(name, tp):
    """The planner's stages of real models are DeepSpeed's partition of the planner's weights."""
    ds = _ds()
    desc = describe_model(resolve_model(ModelSpec(name=name)).config, name=name)
    if desc.tp_problem(tp):
        pytest.skip(f"no such layout: {desc.tp_problem(tp)}")  # gpt2-124m's 12 heads over 8 ranks
    weights = [n for n, _, _ in _items(desc, tp)]
    for pp in sorted({2, 3, 4, 7, 8, 16, desc.layers // 2, desc.layers}):
        bounds = [int(p) for p in ds.partition_balanced(weights, pp)]
        assert [s.params for s in stage_shapes(desc, tp, pp)] == [sum(weights[bounds[i]:bounds[i + 1]])
                                                                  for i in range(pp)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "small-llama"])
def test_planner_weights_and_stages_are_the_pipelines(name):
    """What the pipeline counts per layer spec (what PipelineModule's 'parameters' method sees)
    is the planner's per item, and the pipeline's partition is the planner's."""
    config = resolve_model(ModelSpec(name=name)).config
    desc = describe_model(config, name=name)
    specs = pipeline_layer_specs(config)
    assert layer_parameter_counts(specs) == [n for n, _, _ in _items(desc, 1)]
    for pp in range(2, len(specs) + 1):
        parts = partition_layers(specs, pp)
        planner = stage_shapes(desc, 1, pp)
        assert [sum(layer_parameter_counts(specs[parts[s]:parts[s + 1]])) for s in range(pp)] == \
            [s.params for s in planner]


def test_zero_settings_dsf_writes_are_the_ones_the_planner_counts():
    run = build_run_config({"model": {"name": "tiny-llama"}, "parallel": {"zero_stage": 2}})
    zero = build_ds_config(run.train, run.parallel, dp_size=2)["zero_optimization"]
    assert zero["reduce_bucket_size"] == runtime_facts.ZERO_REDUCE_BUCKET
    assert zero["allgather_bucket_size"] == runtime_facts.ZERO_ALLGATHER_BUCKET
    run3 = build_run_config({"model": {"name": "tiny-llama"}, "parallel": {"zero_stage": 3}})
    zero3 = build_ds_config(run3.train, run3.parallel, dp_size=2)["zero_optimization"]
    assert zero3["stage3_prefetch_bucket_size"] == runtime_facts.ZERO3_PREFETCH_BUCKET
    assert zero3["stage3_param_persistence_threshold"] == runtime_facts.ZERO3_PERSISTENCE_THRESHOLD
    assert "stage3_max_live_parameters" not in zero3  # DeepSpeed's own default unless a plan chooses one
    for name in ("STAGE0_ALLREDUCE_BUCKET", "ZERO3_PERSISTENCE_THRESHOLD", "Knobs", "DEFAULT_KNOBS"):
        assert getattr(memory, name) is getattr(runtime_facts, name)  # imported, not copied
    assert dsconfig.Knobs is runtime_facts.Knobs  # the JSON's knobs and their defaults: Knobs.of, one source
    # The planner's default knobs (memory and speed both read Layout.knobs) are those same values.
    assert memory.Knobs() == memory.Knobs(runtime_facts.ZERO3_PERSISTENCE_THRESHOLD, runtime_facts.ZERO3_PREFETCH_BUCKET,
                                          runtime_facts.ZERO3_MAX_LIVE_PARAMETERS, runtime_facts.ZERO_REDUCE_BUCKET,
                                          runtime_facts.ZERO_ALLGATHER_BUCKET)
    assert speed.gathered_tensors is memory.gathered_tensors  # ZeRO-3's gathered tensors: one rule


@pytest.mark.parametrize("vocab", [97, 512, 32000, 50257, 128256])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_vocab_padding_is_one_function(vocab, tp):
    assert tensor.padded_vocab is runtime_facts.padded_vocab
    padded = runtime_facts.padded_vocab(vocab, tp=tp)
    step = 1 if tp == 1 else 128 * tp  # Megatron's: each rank's slice a multiple of 128 rows
    assert padded % step == 0 and vocab <= padded < vocab + step
    assert memory._padded_vocab_rows(vocab, tp) * tp == padded
    assert runtime_facts.padded_vocab(vocab, tp=tp, multiple=64) % (64 if tp > 1 else 1) == 0


def test_cpu_ranks_are_one_test_for_fit_and_speed():
    """A `dsf calibrate` profile of CPU ranks (named 'calibrated-cpu', cores_per_node set) is CPU
    for the fit rule (no CUDA reservation) as for the speed model; a GPU profile is not."""
    cpu = Cluster(name="calibrated-cpu", nodes=1, gpus_per_node=4, memory_per_gpu=6e9, peak_flops={"fp32": 5e10},
                  cores_per_node=2)
    gpu = Cluster(name="calibrated-gpu", nodes=1, gpus_per_node=4, memory_per_gpu=80e9, peak_flops={"fp32": 5e13})
    assert cpu.is_cpu and not gpu.is_cpu and cluster_preset("cpu-local").is_cpu
    assert usable_gpu_memory(cpu) == cpu.memory_per_gpu
    assert usable_gpu_memory(gpu) == gpu.memory_per_gpu - RESERVED_PER_GPU
    desc = describe_model(resolve_model(ModelSpec(name="tiny-llama")).config, name="tiny-llama")
    job = Workload(seq_len=64, global_batch=4, precision="fp32")
    layout = Layout(ParallelDims(world=4, zero_stage=3))
    # CPU ranks pay their operator overhead on top of compute; a GPU hides it behind the device
    slow_gpu = Cluster(**{**gpu.to_dict(), "peak_flops": {"fp32": 5e10}})
    assert speed.step_time(desc, layout, job, cpu).overhead > speed.step_time(desc, layout, job, slow_gpu).overhead


def test_matmul_efficiency_has_one_home():
    assert not hasattr(speed, "MATMUL_EFFICIENCY")  # it was a second, unread copy
    assert Cluster(name="x", nodes=1, gpus_per_node=1, memory_per_gpu=1, peak_flops={"fp32": 1}).matmul_efficiency \
        == MATMUL_EFFICIENCY
    desc = describe_model(resolve_model(ModelSpec(name="llama-7b")).config, name="llama-7b")
    job, layout = Workload(seq_len=2048, global_batch=8), Layout(ParallelDims(world=8))
    h100 = cluster_preset("h100-80gb")
    half = Cluster(**{**h100.to_dict(), "matmul_efficiency": MATMUL_EFFICIENCY / 2})
    assert speed.step_time(desc, layout, job, half).compute == pytest.approx(2 * speed.step_time(desc, layout, job,
                                                                                                  h100).compute)


@pytest.mark.distributed
def test_the_planner_imports_no_deepspeed():
    # The planner counts parameters on a meta-device model (planner/count.py), so it imports torch, and
    # torch 2.13 imports torch.distributed itself; what it must not import is DeepSpeed (seconds of import,
    # and its accelerator warning printed on stdout ahead of `dsf plan --json`), nor start a process group.
    import subprocess
    import sys

    code = ("import sys; import dsframework.planner.search, dsframework.planner.report, dsframework.planner.fit; "
            "import torch.distributed as dist; "
            "print(any(m.startswith('deepspeed') for m in sys.modules), dist.is_initialized())")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False False"
