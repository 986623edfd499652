"""ZeRO 0-3 (and CPU optimizer offload) and gradient accumulation are exact at world size 2.

Every run is a real `deepspeed --num_gpus 2 dsf train` (2 CPU ranks, gloo); the reference is a
single-process plain PyTorch loop over the same weights and global batches (reference.py).
"""
from __future__ import annotations

import pytest

from dsframework.config import build_run_config
from tests.distributed.launcher import assert_close, run_overrides, train_run
from tests.distributed.reference import reference_losses

STAGES = {
    "zero0": ["parallel.zero_stage=0"],
    "zero1": ["parallel.zero_stage=1"],
    "zero2": ["parallel.zero_stage=2"],
    "zero3": ["parallel.zero_stage=3"],
    "zero2_offload": ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"],
    "zero3_offload": ["parallel.zero_stage=3", "parallel.offload_optimizer=cpu"],
    "zero3_checkpointing": ["parallel.zero_stage=3", "parallel.activation_checkpointing=full"],
}


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """name -> (step -> loss) for every layout in STAGES, plus the reference of the first."""
    root = tmp_path_factory.mktemp("zero")
    runs = {name: train_run(root / name, overrides) for name, overrides in STAGES.items()}
    run = build_run_config({}, run_overrides(root / "zero0", STAGES["zero0"]))
    runs["reference"] = reference_losses(run)
    return runs


def test_reference_learns_something(stage_runs):
    ref = stage_runs["reference"]
    assert len(ref) == 8 and ref[8] < ref[1]


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_stages_agree_with_each_other(stage_runs, name):
    assert_close(stage_runs[name], stage_runs["zero0"], rtol=1e-5, what=f"{name} vs zero0")


@pytest.mark.parametrize("name", list(STAGES))
def test_stage_matches_single_process_reference(stage_runs, name):
    assert_close(stage_runs[name], stage_runs["reference"], rtol=1e-4, what=f"{name} vs reference")


def test_gradient_accumulation_is_exact(tmp_path, stage_runs):
    """micro 2 x accum 2 x dp 2 == micro 4 x accum 1 x dp 2 == one process with batch 8."""
    accum = train_run(tmp_path / "accum", ["parallel.zero_stage=1", "train.micro_batch=2",
                                           "train.grad_accum=2"])
    no_accum = train_run(tmp_path / "no_accum", ["parallel.zero_stage=1", "train.micro_batch=4",
                                                 "train.grad_accum=1"])
    assert_close(accum, no_accum, rtol=1e-5, what="2x2x2 vs 4x1x2")
    assert_close(accum, stage_runs["reference"], rtol=1e-5, what="2x2x2 vs single process batch 8")
