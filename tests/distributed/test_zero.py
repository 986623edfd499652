"""ZeRO 0-3 (and CPU optimizer offload) and gradient accumulation are exact at world size 2; the
stage 0 and 1 checkpoints export to the reference's weights; no run leaves shm buffers behind.

Every run is a real `dsf train` of 2 CPU ranks (gloo), all of them in one launch (shared with
other modules: conftest.shared_runs);
the reference is a single-process plain PyTorch loop over the same weights and global batches (reference.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dsframework.config import build_run_config
from tests.distributed.launcher import (
    BASE_OVERRIDES,
    assert_close,
    losses,
    read_metrics,
    run_overrides,
)
from tests.distributed.reference import assert_export_matches, reference_train

STAGES = {
    "zero0": ["parallel.zero_stage=0", "checkpoint.save_final=true"],  # whole module in the checkpoint
    "zero1": ["parallel.zero_stage=1", "checkpoint.save_final=true"],  # fp32 partitions (both exported)
    "zero2": ["parallel.zero_stage=2", "logging.breakdown=true"],  # + DeepSpeed's timers (metrics test)
    "zero3": ["parallel.zero_stage=3"],
    "zero2_offload": ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"],
    "zero3_offload": ["parallel.zero_stage=3", "parallel.offload_optimizer=cpu"],
    "zero3_checkpointing": ["parallel.zero_stage=3", "parallel.activation_checkpointing=full"],
    "zero1_selective": ["parallel.zero_stage=1", "parallel.activation_checkpointing=selective"],
}
ACCUM = ["parallel.zero_stage=1", "train.micro_batch=2", "train.grad_accum=2"]  # test_gradient_accumulation_is_exact


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs: every layout in STAGES and "accum", at world 2."""
    runs = {**STAGES, "accum": ACCUM} if ranks == 2 else {}
    return [f"{name}|eager|{';'.join(overrides)}" for name, overrides in runs.items()]


@pytest.fixture(scope="module")
def stage_runs(shared_runs):
    """name -> (step -> loss) for every layout in STAGES and "accum" (one launch), plus the reference of the first."""
    root, _, shm_left = shared_runs(2)
    runs = {name: losses(root / name) for name in {**STAGES, "accum": ACCUM}}
    runs["shm_left"] = shm_left
    run = build_run_config({}, run_overrides(root / "zero0", STAGES["zero0"]))
    runs["reference"], runs["reference_model"] = reference_train(run)
    runs["root"] = root
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


def test_selective_recompute_gives_the_same_losses(stage_runs):
    """parallel.activation_checkpointing=selective recomputes each attention core in the backward
    (what it keeps less: tests/unit/test_planner.py's saved-tensor counter): the same losses as none."""
    assert_close(stage_runs["zero1_selective"], stage_runs["zero1"], rtol=1e-6, what="selective vs none")


def test_gradient_accumulation_is_exact(stage_runs):
    """micro 2 x accum 2 x dp 2 == micro 4 x accum 1 x dp 2 == one process with batch 8."""
    accum = stage_runs["accum"]
    no_accum = stage_runs["zero1"]  # global batch 8 at dp 2: micro 4 x accum 1 (derived)
    assert_close(accum, no_accum, rtol=1e-5, what="2x2x2 vs 4x1x2")
    assert_close(accum, stage_runs["reference"], rtol=1e-5, what="2x2x2 vs single process batch 8")


def test_metrics_report_mfu_and_the_step_breakdown(stage_runs):
    """Every logged step has model TFLOP/s and an MFU in (0, 1) (against the matmul peak measured at
    start); with logging.breakdown, forward + backward + optimizer ms add up to about the step."""
    tokens_per_step = 8 * 32  # BASE_OVERRIDES: global batch 8 of 32 tokens
    assert {"train.global_batch=8", "data.seq_len=32"} <= set(BASE_OVERRIDES)
    for name in ("zero1", "zero2"):
        logged = [m for m in read_metrics(stage_runs["root"] / name) if "loss" in m]
        assert len(logged) == 8
        for m in logged:
            assert m["tflops_per_rank"] > 0 and 0 < m["mfu"] < 1, m
            if name == "zero2":
                step_ms = 1000 * tokens_per_step / m["tokens_per_s"]
                parts = m["forward_ms"] + m["backward_ms"] + m["optimizer_ms"]
                assert all(m[k] > 0 for k in ("forward_ms", "backward_ms", "allreduce_ms", "optimizer_ms")), m
                assert 0.3 * step_ms < parts < 1.5 * step_ms, (parts, step_ms, m)
            else:
                assert "forward_ms" not in m, "the breakdown is opt-in (DeepSpeed's timers synchronise)"


@pytest.mark.parametrize("name", ["zero0", "zero1"])
def test_export_holds_the_reference_weights(stage_runs, name):
    """`dsf export` of the step-8 checkpoint equals the single-process reference after 8 steps."""
    assert_export_matches(stage_runs["root"] / name, stage_runs["reference_model"])


def test_no_shm_buffers_left_behind(stage_runs):
    """DeepSpeed's CPU comm op makes a 69 MB /dev/shm file per rank and job and never removes it (a
    busy machine ran out of memory on them); dsf unlinks its own once every rank has mapped it."""
    assert not stage_runs["shm_left"], sorted(stage_runs["shm_left"])
