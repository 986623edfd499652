"""ZeRO's knobs from the plan (planner/knobs.py) and the chunked loss in the memory model.

    python -m pytest tests/unit/test_planner_knobs.py -q

- the knobs a plan chooses keep it within the fit rule, on many models, clusters, stages;
- more free memory never chooses smaller knobs; none free keeps dsf's defaults;
- the speed model prices them: more persistent tensors -> fewer gathered bytes -> no slower;
- `dsf config --auto-knobs` and `dsf plan -o` write them, and DeepSpeedConfig accepts the JSON;
- a chunked loss holds less than the plain one at a 32k vocabulary, and the rest is unchanged.
"""
from __future__ import annotations

import json
from dataclasses import replace

import deepspeed  # noqa: F401 - imported before CliRunner swaps sys.stdout: its logger binds the real one
import pytest
from click.testing import CliRunner

from dsframework.commands import cli as cli_module
from dsframework.config import ModelSpec, load_run_config
from dsframework.dsconfig import validate_ds_config
from dsframework.layout import ParallelDims
from dsframework.models.build import resolve_model
from dsframework.planner.cluster import cluster_preset
from dsframework.planner.fit import MEMORY_HEADROOM, check_fit, usable_gpu_memory
from dsframework.planner.knobs import KNOB_SHARE, choose_knobs, free_bytes, largest_micro_batch, with_knobs
from dsframework.planner.memory import (DEFAULT_KNOBS, Workload, Knobs, Layout, layer_gathered, memory_per_rank,
                                        stage_shapes)
from dsframework.planner.model import describe_model
from dsframework.planner.speed import step_time


def _desc(name):
    return describe_model(resolve_model(ModelSpec(name=name)).config, name=name)


DESCS = {name: _desc(name) for name in ("small-llama", "llama-1b", "llama-7b", "llama-13b", "gpt2-124m")}
KNOB_NAMES = list(Knobs.__dataclass_fields__)


def _layouts(zero_stage):
    for micro, ckpt, offload in ((1, "none", False), (2, "full", False), (4, "full", True)):
        yield Layout(ParallelDims(world=8, zero_stage=zero_stage), micro_batch=micro, grad_accum=8 // micro,
                     activation_checkpointing=ckpt, offload_optimizer=offload and zero_stage > 0)


@pytest.mark.parametrize("model", list(DESCS))
@pytest.mark.parametrize("cluster_name", ["a100-40gb", "h100-80gb", "h200-141gb"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_chosen_knobs_keep_the_plan_within_memory(model, cluster_name, zero_stage):
    desc, cluster = DESCS[model], cluster_preset(cluster_name, nodes=1, gpus_per_node=8)
    job = Workload(seq_len=2048, global_batch=64, precision="bf16")
    for layout in _layouts(zero_stage):
        layout = replace(layout, grad_accum=64 // (8 * layout.micro_batch))
        before = check_fit(desc, layout, job, cluster)
        tuned, fit, choice = with_knobs(desc, layout, job, cluster)
        if not before.fits:
            assert choice is None and tuned.knobs == DEFAULT_KNOBS
            continue
        memory = memory_per_rank(desc, tuned, job)
        assert memory.total * (1 + MEMORY_HEADROOM) <= usable_gpu_memory(cluster), choice.why
        assert fit.fits
        # The knobs take at most their share of what was free, and the reasons said so.
        assert memory.total - before.memory.total <= KNOB_SHARE * choice.free + 1, choice.why
        assert choice.extra >= memory.total - before.memory.total - 1


@pytest.mark.parametrize("model", ["small-llama", "llama-7b", "llama-13b"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_more_free_memory_never_chooses_smaller_knobs(model, zero_stage):
    desc, job = DESCS[model], Workload(seq_len=2048, global_batch=64, precision="bf16")
    layout = Layout(ParallelDims(world=8, zero_stage=zero_stage), micro_batch=1, grad_accum=8)
    def layers_ahead(knobs):  # the prefetch in layers: a layer gathers less once more of it persists
        layer = layer_gathered(desc, tp=1, threshold=knobs.persistence_threshold)
        return knobs.prefetch_bucket / layer if layer else float("inf")

    previous = DEFAULT_KNOBS
    for free_gib in (0.01, 0.1, 0.5, 1, 2, 4, 8, 16, 32, 64, 128):
        knobs = choose_knobs(desc, layout, job, free=free_gib * 2**30).knobs
        for name in ("persistence_threshold", "reduce_bucket", "allgather_bucket", "prefetch_bucket"):
            assert getattr(knobs, name) >= getattr(DEFAULT_KNOBS, name)
            if name != "prefetch_bucket":
                assert getattr(knobs, name) >= getattr(previous, name), (free_gib, name)
        assert layers_ahead(knobs) >= layers_ahead(previous), free_gib
        previous = knobs
    if model != "small-llama":  # a large model with plenty free: the knobs do move
        assert previous != DEFAULT_KNOBS


@pytest.mark.parametrize("free", [0.0, -5 * 2**30])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_no_free_memory_keeps_the_defaults(free, zero_stage):
    layout = Layout(ParallelDims(world=8, zero_stage=zero_stage), micro_batch=1, grad_accum=8)
    choice = choose_knobs(DESCS["llama-7b"], layout, Workload(seq_len=2048, global_batch=64), free=free)
    assert choice.knobs == DEFAULT_KNOBS and choice.extra == 0 and choice.why


def test_persistent_tensors_are_gathered_less_and_never_slow_the_step():
    desc, job = DESCS["llama-7b"], Workload(seq_len=2048, global_batch=64, precision="bf16")
    cluster = cluster_preset("h100-80gb", nodes=2, gpus_per_node=8)
    times, persistent = [], []
    for threshold in (100_000, 16_777_216, 45_088_768, 131_072_000):
        layout = Layout(ParallelDims(world=16, zero_stage=3), micro_batch=1, grad_accum=4, knobs=Knobs(persistence_threshold=threshold))
        persistent.append(stage_shapes(desc, 1, 1, threshold)[0].persistent)
        times.append(step_time(desc, layout, job, cluster))
    assert persistent == sorted(persistent) and persistent[-1] == desc.total_params
    assert all(a.dp_comm >= b.dp_comm and a.total >= b.total for a, b in zip(times, times[1:]))
    assert times[-1].dp_comm < times[0].dp_comm  # nothing left to gather but the gradients' reduce
    # ... and the memory pays for it: every persisted tensor is whole on every rank.
    mems = [memory_per_rank(desc, Layout(ParallelDims(world=16, zero_stage=3), micro_batch=1, grad_accum=4, knobs=Knobs(persistence_threshold=t)), job).params
            for t in (100_000, 16_777_216)]
    assert mems[1] - mems[0] == pytest.approx(2 * (persistent[1] - persistent[0]))


def test_buckets_and_prefetch_are_priced():
    desc, job = DESCS["llama-7b"], Workload(seq_len=2048, global_batch=64, precision="bf16")
    cluster = cluster_preset("h100-80gb", nodes=2, gpus_per_node=8)
    for stage in (1, 2, 3):
        small = Layout(ParallelDims(world=16, zero_stage=stage), micro_batch=1, grad_accum=4, knobs=Knobs(reduce_bucket=10**6,
                                                                                          allgather_bucket=10**6))
        large = replace(small, knobs=Knobs(reduce_bucket=10**9, allgather_bucket=10**9))
        assert step_time(desc, large, job, cluster).dp_comm < step_time(desc, small, job, cluster).dp_comm
        # bf16 at ZeRO-1 runs BF16_Optimizer (fp32 gradient accumulation), which has no ZeRO buckets
        buckets = replace(job, precision="fp32") if stage == 1 else job
        assert memory_per_rank(desc, large, buckets).buffers > memory_per_rank(desc, small, buckets).buffers
        if stage == 1:
            assert memory_per_rank(desc, large, job).buffers == memory_per_rank(desc, small, job).buffers
    layer = 202_375_168  # llama-7b's gathered elements per layer
    no_prefetch = Layout(ParallelDims(world=8, zero_stage=3), micro_batch=1, grad_accum=8, knobs=Knobs(prefetch_bucket=0))
    one_layer = replace(no_prefetch, knobs=Knobs(prefetch_bucket=layer, max_live_parameters=2 * layer))
    capped = replace(one_layer, knobs=Knobs(prefetch_bucket=layer, max_live_parameters=layer))  # live limit: none ahead
    # One node: its gathers take less than the compute, so what the prefetch hides decides (across two
    # nodes the gathers outlast the compute, and at most the compute's worth of them hides either way).
    node = cluster_preset("h100-80gb", nodes=1, gpus_per_node=8)
    # DeepSpeed's prefetch takes the next tensor in the trace whatever its size: a bucket of one element
    # still runs one sub-module ahead, and hides as much as a layer-sized one (prefetch_bucket 0: nothing).
    one_tensor = replace(no_prefetch, knobs=Knobs(prefetch_bucket=1, max_live_parameters=2 * layer))
    t = {name: step_time(desc, lay, job, node).dp_comm for name, lay in
         (("none", no_prefetch), ("one", one_layer), ("capped", capped), ("one tensor", one_tensor))}
    assert t["one"] == t["one tensor"] < t["none"] == t["capped"]
    across = {name: step_time(desc, replace(lay, dims=ParallelDims(world=16, zero_stage=3), grad_accum=4), job,
                              cluster) for name, lay in (("none", no_prefetch), ("one", one_layer))}
    assert across["one"].dp_comm == across["none"].dp_comm  # all of the compute hides gathers either way
    assert across["one"].dp_comm > across["one"].compute
    m = {name: memory_per_rank(desc, lay, job).buffers for name, lay in
         (("none", no_prefetch), ("one", one_layer), ("capped", capped))}
    assert m["one"] - m["none"] == pytest.approx(2 * layer) and m["capped"] == m["none"]


def test_largest_micro_batch_fits_and_the_next_does_not():
    desc, cluster = DESCS["llama-7b"], cluster_preset("h100-80gb", nodes=1, gpus_per_node=8)
    job = Workload(seq_len=4096, global_batch=128, precision="bf16")
    layout = Layout(ParallelDims(world=8, zero_stage=3))
    micro = largest_micro_batch(desc, layout, job, cluster, per_replica=16)
    assert micro is not None and micro < 16
    assert check_fit(desc, replace(layout, micro_batch=micro, grad_accum=16 // micro), job, cluster).fits
    bigger = min(m for m in (1, 2, 4, 8, 16) if m > micro)
    assert not check_fit(desc, replace(layout, micro_batch=bigger, grad_accum=16 // bigger), job, cluster).fits


# --- the chunked loss -----------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_chunked_loss_holds_less_at_a_32k_vocabulary(tp, zero_stage):
    desc = DESCS["llama-7b"]
    assert desc.vocab == 32000
    layout = Layout(ParallelDims(world=8, tp=tp, zero_stage=zero_stage), micro_batch=4, grad_accum=2)
    plain = memory_per_rank(desc, layout, Workload(seq_len=4096, global_batch=64, chunked_loss=False))
    chunked = memory_per_rank(desc, layout, Workload(seq_len=4096, global_batch=64, chunked_loss=True))
    auto = memory_per_rank(desc, layout, Workload(seq_len=4096, global_batch=64))  # 16k tokens > one chunk
    rows = 32000 // tp
    tokens = 4 * 4096
    chunk = 2**26 // rows // 512 * 512  # 2048 at tp 1, 4096 at tp 2: a multiple of 512
    assert chunked.parts["loss_chunk_tokens"] == chunk and plain.parts["loss_chunk_tokens"] is None
    assert (plain.params, plain.grads, plain.optimizer) == (chunked.params, chunked.grads, chunked.optimizer)
    assert plain.activations - chunked.activations == pytest.approx(tokens * rows * 4)  # no fp32 logits kept
    assert plain.buffers - chunked.buffers == pytest.approx(tokens * rows * (2 + 4) - chunk * rows * 8)
    assert chunked.total < plain.total and auto == chunked
    # a micro-batch within one chunk: auto computes the loss whole, as the training loop does
    small = replace(layout, micro_batch=1, grad_accum=8)
    short = Workload(seq_len=512, global_batch=64)
    assert memory_per_rank(desc, small, short) == memory_per_rank(desc, small, replace(short, chunked_loss=False))
    explicit = memory_per_rank(desc, small, replace(short, chunked_loss=True, loss_chunk_tokens=128))
    assert explicit.parts["loss_chunk_tokens"] == 128


# --- the command line -----------------------------------------------------------------------------

def _invoke(args):
    result = CliRunner().invoke(cli_module.cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_dsf_config_auto_knobs_writes_them_and_deepspeed_accepts_them():
    result = _invoke(["config", "--zero-stage", "3", "--precision", "bf16", "--world-size", "8",
                      "--global-batch", "64", "--auto-knobs", "--model", "llama-7b", "--cluster", "h100-80gb",
                      "--seq-len", "4096"])
    ds = json.loads(result.stdout)
    zero = ds["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] > DEFAULT_KNOBS.prefetch_bucket
    assert zero["stage3_max_live_parameters"] >= zero["stage3_prefetch_bucket_size"]
    assert zero["reduce_bucket_size"] > DEFAULT_KNOBS.reduce_bucket
    assert "largest that fits" in result.stderr and "knobs:" in result.stderr
    micro = ds["train_micro_batch_size_per_gpu"]
    desc, cluster = DESCS["llama-7b"], cluster_preset("h100-80gb", nodes=1, gpus_per_node=8)
    assert micro == largest_micro_batch(desc, Layout(ParallelDims(world=8, zero_stage=3)),
                                        Workload(seq_len=4096, global_batch=64), cluster, per_replica=8)
    validate_ds_config(ds, dp_size=8)
    stage2 = json.loads(_invoke(["config", "--zero-stage", "2", "--world-size", "8", "--micro-batch", "1",
                                 "--grad-accum", "1", "--auto-knobs", "--model", "llama-1b", "--cluster",
                                 "h100-80gb", "--seq-len", "2048"]).stdout)["zero_optimization"]
    assert stage2["allgather_bucket_size"] > DEFAULT_KNOBS.allgather_bucket and stage2["allgather_bucket_size"] % 2 == 0
    validate_ds_config({**ds, "zero_optimization": stage2, "train_micro_batch_size_per_gpu": 1,
                        "gradient_accumulation_steps": 1, "train_batch_size": 8}, dp_size=8)


@pytest.mark.parametrize("missing", ["--model", "--cluster", "--seq-len", "--world-size"])
def test_auto_knobs_names_the_missing_flag_in_one_line(missing, capsys):
    flags = {"--model": "llama-7b", "--cluster": "h100-80gb", "--seq-len": "4096", "--world-size": "8"}
    del flags[missing]
    with pytest.raises(SystemExit) as stop:
        cli_module._run_command(["config", "--zero-stage", "3", "--micro-batch", "1", "--grad-accum", "1",
                                 "--auto-knobs", *[a for kv in flags.items() for a in kv]])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dsf: error: --auto-knobs needs {missing}:"), err


def test_dsf_plan_writes_the_knobs_and_the_chunked_loss(tmp_path):
    out = tmp_path / "plan"
    result = _invoke(["plan", "--model", "llama-7b", "--cluster", "h100-80gb", "--seq-len", "4096",
                      "--global-batch", "64", "--zero-stage", "3", "--tp", "1", "-o", str(out)])
    assert "knobs:" in result.stdout and "free per rank" in result.stdout
    run = load_run_config(out / "run.yaml")
    ds = json.loads((out / "ds_config.json").read_text())
    knobs = run.parallel.zero_knobs
    assert knobs.prefetch_bucket == ds["zero_optimization"]["stage3_prefetch_bucket_size"] > DEFAULT_KNOBS.prefetch_bucket
    assert knobs.max_live_parameters == ds["zero_optimization"]["stage3_max_live_parameters"]
    assert run.train.chunked_loss is True
    validate_ds_config(ds, dp_size=ds["train_batch_size"] // (ds["train_micro_batch_size_per_gpu"]
                                                                * ds["gradient_accumulation_steps"]))
    # The run as written fits by the rule `dsf launch` checks (its knobs and chunked loss counted).
    from dsframework.planner.fit import run_job, run_layout

    dp = 8
    layout = run_layout(run.parallel, ParallelDims.of(run.parallel, world=dp), micro_batch=run.train.micro_batch,
                        grad_accum=run.train.global_batch // (dp * run.train.micro_batch))
    assert layout.knobs != DEFAULT_KNOBS
    fit = check_fit(DESCS["llama-7b"], layout, run_job(run, global_batch=64), cluster_preset("h100-80gb"))
    assert fit.fits and free_bytes(fit.memory.total, cluster_preset("h100-80gb")) > 0
