"""Resume is exact: 10 steps straight == 5 steps, a stop, and `--resume` for 5 more: ZeRO-3 on 2
ranks, and tp2 x pp2 with ZeRO-1 on 4 ranks (per-layer files of each tensor rank). Per layout, the
straight and the stopped run share a launch with other modules' runs (conftest.py); the resume is
a launch of its own (a new process group reading the checkpoint). The resumed run's start-up line
names every phase, restore included, and its parts sum to its total."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launcher import (
    assert_close,
    losses,
    read_metrics,
    startup_breakdown,
    train_launch,
)

LAYOUTS = {  # name: (overrides, ranks)
    "zero3": (["parallel.zero_stage=3"], 2),
    "tp2_pp2_zero1": (["parallel.zero_stage=1", "parallel.tp=2", "parallel.pp=2"], 4),
}


def common(layout: str) -> list[str]:
    return [*LAYOUTS[layout][0], "train.steps=10", "train.micro_batch=2", "checkpoint.save_final=true"]


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs of the layouts on `ranks` ranks: straight, and stopped after step 5
    (train.stop_after saves its checkpoint even with checkpoint.save_final off)."""
    stop = ["train.stop_after=5", "checkpoint.save_final=false"]
    return [spec for layout, (_, n) in LAYOUTS.items() if n == ranks for spec in (
        f"resume-{layout}-straight|eager|{';'.join(common(layout))}",
        f"resume-{layout}-stopped|eager|{';'.join([*common(layout), *stop])}")]


@pytest.fixture(scope="module")
def runs(shared_runs):
    """layout -> (straight's and stopped's directories, step -> loss of straight / first (the stopped
    run) / resumed, latest tag at the stop, the resumed run's stdout)."""
    out = {}
    for layout, (_, ranks) in LAYOUTS.items():
        root = shared_runs(ranks)[0]
        straight, stopped = (root / f"resume-{layout}-{run}" for run in ("straight", "stopped"))
        first = losses(stopped)
        latest = (stopped / "checkpoints" / "latest").read_text().strip()
        proc = train_launch(stopped, common(layout), num_ranks=ranks, flags=("--resume",))
        out[layout] = (straight, stopped), losses(straight), first, losses(stopped), latest, proc.stdout
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_exact(runs, layout):
    (straight_dir, stopped_dir), straight, first, resumed, latest_at_stop, stdout = runs[layout]
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert latest_at_stop == "global_step5"
    total, parts = startup_breakdown(stdout)
    assert list(parts) == ["imports", "checks", "rendezvous", "tokenizer", "data", "outputs", "model",
                           "deepspeed.initialize", "restore"], parts
    assert parts["imports"] > 0 and parts["deepspeed.initialize"] > 0 and min(parts.values()) >= 0, parts
    assert abs(sum(parts.values()) - total) <= 0.05 * len(parts) + 1e-9, (total, parts)  # each rounded to 0.1 s

    assert sorted(resumed) == list(range(1, 11)), "metrics.jsonl holds each step once"
    assert_close({s: resumed[s] for s in range(6, 11)}, {s: straight[s] for s in range(6, 11)},
                 rtol=1e-6, what=f"{layout}: resumed steps 6-10 vs straight")
    # The learning rate schedule continued too, not restarted.
    lrs = {m["step"]: m["lr"] for m in read_metrics(stopped_dir) if "lr" in m}
    straight_lrs = {m["step"]: m["lr"] for m in read_metrics(straight_dir) if "lr" in m}
    assert lrs == pytest.approx(straight_lrs, rel=1e-12)
