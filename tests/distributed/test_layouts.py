"""Parallel layouts are exact: per-step losses of tp2 and pp2 (world 2), tp2 x dp2 and pp2 x dp2
(world 4, ZeRO-1 over the data-parallel group), tp2 x pp2 (world 4) and tp2 x pp2 x dp2 (world 8,
one slow test) equal the single-process reference, for a grouped-query Llama and a tied-embedding
GPT-2. The runs of each world size share one launch, with other modules' runs (conftest.shared_runs)."""
from __future__ import annotations

from pathlib import Path

import pytest

from dsframework.config import build_run_config
from tests.distributed.launcher import assert_close, losses, run_overrides, train_run
from tests.distributed.reference import reference_losses

LAYOUTS = {
    "tp2": (["parallel.tp=2", "parallel.zero_stage=0"], 2),
    "tp2_dp2_zero1": (["parallel.tp=2", "parallel.zero_stage=1"], 4),
    "tp2_dp2_zero3": (["parallel.tp=2", "parallel.zero_stage=3"], 4),
    # pipeline: several micro-batches per step, so the 1F1B schedule has something to overlap
    "pp2": (["parallel.pp=2", "parallel.zero_stage=0", "train.micro_batch=2"], 2),
    "pp2_dp2_zero1": (["parallel.pp=2", "parallel.zero_stage=1", "train.micro_batch=1"], 4),
    "tp2_pp2": (["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=0", "train.micro_batch=2"], 4),
}


CASES = [(model, layout) for layout in LAYOUTS for model in ("tiny-llama", "tiny-gpt2")
         if not (layout == "tp2_dp2_zero3" and model == "tiny-gpt2")]  # ZeRO-3 x TP: one model is enough


def case_overrides(model: str, layout: str) -> list[str]:
    return [f"model.name={model}", *LAYOUTS[layout][0]]


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs: the cases of this world size."""
    return [f"{model}-{layout}|eager|{';'.join(case_overrides(model, layout))}"
            for model, layout in CASES if LAYOUTS[layout][1] == ranks]


@pytest.fixture(scope="module")
def layout_runs(shared_runs):
    """(model, layout) -> (its run directory, step -> loss) of every case: one launch per world size."""
    out = {}
    for model, layout in CASES:
        run_dir = shared_runs(LAYOUTS[layout][1])[0] / f"{model}-{layout}"
        out[model, layout] = run_dir, losses(run_dir)
    return out


@pytest.mark.parametrize("model,layout", CASES)
def test_tensor_parallel_layout_matches_reference(layout_runs, model, layout):
    run_dir, got = layout_runs[model, layout]
    want = reference_losses(build_run_config({}, run_overrides(run_dir, case_overrides(model, layout))))
    assert_close(got, want, rtol=1e-4, what=f"{model} {layout} vs single process")


@pytest.mark.slow
def test_3d_layout_at_world_8_matches_reference(tmp_path):
    """tp2 x pp2 x dp2 (ZeRO-1 over the data-parallel pairs): 8 ranks, the full 3D grid."""
    overrides = ["model.name=tiny-llama", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1",
                 "train.micro_batch=2"]
    got = train_run(tmp_path / "3d", overrides, num_ranks=8)
    want = reference_losses(build_run_config({}, run_overrides(tmp_path / "3d", overrides)))
    assert_close(got, want, rtol=1e-4, what="tiny-llama tp2 x pp2 x dp2 vs single process")
