"""The planner's model states match a live DeepSpeed engine: on every rank, the predicted bytes of
parameters, gradients and optimizer states are within 5% of what the engine holds (see
workers/model_states.py for what is counted), at world 1, 2 and 4, ZeRO 0-3, with CPU optimizer
(and parameter) offload, at tp2 and pp2, and for LoRA (model.lora, peft's all-linear adapters at r 8:
the frozen base held whole at ZeRO-2 and partitioned at ZeRO-3, gradients and optimizer states of the
adapters alone; the planner's Workload.trainable_params from models/lora.py count_lora_parameters), for a
mixture of experts at ep 2 (ZeRO-1 and ZeRO-3: a rank's half of the experts; to the byte), and with
ZeRO's knobs set (parallel.zero_knobs): the tensors ZeRO-3 keeps whole at a persistence threshold are
the planner's persistent elements, and its reduce bucket the bytes the planner counts.

One launch per world size trains every case of that world one step, case after case.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dsframework.config import load_run_config
from dsframework.dsconfig import resolve_batch
from dsframework.layout import ParallelDims
from dsframework.models.lora import count_lora_parameters
from dsframework.models.tiny import tiny_config
from dsframework.planner.memory import Workload, Knobs, Layout, stage_memories
from dsframework.planner.model import describe_model
from tests.distributed.launcher import TINY_YAML, launch

WORKER = Path(__file__).parent / "workers" / "model_states.py"
BASE = ["model.name=tiny-llama", "data.dataset=counting", "data.num_examples=400", "data.seq_len=32",
        "train.global_batch=8", "train.micro_batch=2", "train.precision=fp32", "logging.progress=false",
        "logging.eval_every=0", "checkpoint.every=0", "checkpoint.save_final=false"]
CASES = {  # world: {case: overrides}
    1: {"zero0": "parallel.zero_stage=0", "zero3": "parallel.zero_stage=3"},
    2: {"zero0": "parallel.zero_stage=0", "zero1": "parallel.zero_stage=1", "zero2": "parallel.zero_stage=2",
        "zero3": "parallel.zero_stage=3",
        "zero2_offload": "parallel.zero_stage=2,parallel.offload_optimizer=cpu",
        "zero3_offload": "parallel.zero_stage=3,parallel.offload_optimizer=cpu,parallel.offload_param=cpu",
        "lora_zero2": "parallel.zero_stage=2,model.lora.r=8", "lora_zero3": "parallel.zero_stage=3,model.lora.r=8",
        # q, k, v, o and the norms stay whole (<= 5000 elements), the MLP and embedding are partitioned
        "zero3_knobs": "parallel.zero_stage=3,parallel.zero_knobs.persistence_threshold=5000,"
                       "parallel.zero_knobs.reduce_bucket=3000000,parallel.zero_knobs.prefetch_bucket=20000,"
                       "parallel.zero_knobs.max_live_parameters=40000"},
    4: {"zero1": "parallel.zero_stage=1", "tp2_zero1": "parallel.zero_stage=1,parallel.tp=2",
        "pp2_zero1": "parallel.zero_stage=1,parallel.pp=2,train.micro_batch=1",
        # a tiny Mixtral (4 experts) at ep 2: each rank's half of the experts, ZeRO over the expert-data group
        "ep2_zero1": "parallel.zero_stage=1,parallel.ep=2,model.name={mixtral}",
        "ep2_zero3": "parallel.zero_stage=3,parallel.ep=2,model.name={mixtral}"},
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{(world, case): [per-rank measurement]}, from one launch per world size."""
    results = {}
    for world, cases in CASES.items():
        out = tmp_path_factory.mktemp(f"world{world}")
        sets = [arg for o in BASE for arg in ("--set", o)]
        mixtral = out / "mixtral.json"
        tiny_config("mixtral").to_json_file(mixtral)
        launch([str(WORKER), str(out), str(TINY_YAML),
                *[f"case:{n}:{o.format(mixtral=mixtral)}" for n, o in cases.items()], *sets], num_ranks=world)
        for name in cases:
            ranks = sorted(out.glob(f"{name}-rank*.json"))
            assert len(ranks) == world, f"{name}: {len(ranks)} of {world} ranks reported"
            results[(world, name)] = (out / name, [json.loads(p.read_text()) for p in ranks])
    return results


def predicted(output_dir: Path, world: int):
    """The planner's per-stage memory for the run that wrote `output_dir`."""
    from transformers import AutoConfig

    run = load_run_config(output_dir / "checkpoints" / "run.yaml")
    config = AutoConfig.from_pretrained(output_dir / "checkpoints" / "hf_config")
    desc = describe_model(config, name="tiny-llama")
    par = run.parallel
    dp = world // (par.tp * par.pp)
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=dp)
    layout = Layout(ParallelDims(world=world, tp=par.tp, pp=par.pp, zero_stage=par.zero_stage, ep=par.ep),
                    offload_optimizer=par.offload_optimizer == "cpu", offload_param=par.offload_param == "cpu",
                    micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                    activation_checkpointing=par.activation_checkpointing, knobs=Knobs.of(par.zero_knobs))
    job = Workload(seq_len=run.data.seq_len, global_batch=batch.global_batch, precision=run.train.precision)
    if run.model.lora is not None:
        count = count_lora_parameters(config, run.model.lora)
        job = replace(job, trainable_params=count.trainable, trainable_persistent=count.persistent)
    return stage_memories(desc, layout, job)


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases])
def test_model_states_match_the_live_engine(measured, world, case):
    output_dir, ranks = measured[(world, case)]
    stages = predicted(output_dir, world)
    for got in ranks:
        want = stages[got["stage"]]
        # Host and device bytes together: on CPU ranks the offloaded states are host memory too.
        expected = {"params": want.params + want.cpu_params, "grads": want.grads + want.cpu_grads,
                    "optimizer": want.optimizer + want.cpu_optimizer}
        for key, value in expected.items():
            assert got[key] > 0, f"{case} rank {got['rank']}: measured no {key}"
            assert abs(value - got[key]) <= 0.05 * got[key], (
                f"{case} rank {got['rank']} {key}: predicted {value:,.0f} B, engine holds {got[key]:,} B")


@pytest.mark.parametrize("case", ["zero3", "zero3_knobs"])
def test_zero3_knobs_match_the_live_engine(measured, case):
    """Persistent elements exactly; the reduce bucket's bytes exactly (allocated whole, fp32 here)."""
    output_dir, ranks = measured[(2, case)]
    want = predicted(output_dir, 2)[0]
    run = load_run_config(output_dir / "checkpoints" / "run.yaml")
    knobs = Knobs.of(run.parallel.zero_knobs)
    for got in ranks:
        assert got["persistent"] == want.parts["persistent_elements"], (case, got["persistent"])
        assert got["reduce_bucket"] == knobs.reduce_bucket * 4, (case, got["reduce_bucket"])


@pytest.mark.parametrize("case", ["ep2_zero1", "ep2_zero3"])
def test_expert_parallel_states_match_to_the_byte(measured, case):
    """At ep 2 the planner puts the dense part's states over the 4 ZeRO ranks and each rank's half of
    the experts over its expert-data group of 2 (at ZeRO-3 AutoEP's grouped tensors, small here, are
    kept whole, not transformers' fused ones): every rank's bytes, exactly."""
    output_dir, ranks = measured[(4, case)]
    want = predicted(output_dir, 4)[0]
    for got in ranks:
        assert (got["params"], got["grads"], got["optimizer"]) == (want.params, want.grads, want.optimizer), got
