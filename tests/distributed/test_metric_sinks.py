"""The metric sinks of a real run: TensorBoard, CSV and W&B hold what metrics.jsonl holds.

    python -m pytest tests/distributed/test_metric_sinks.py -q

One 2-rank run (tiny model, 4 steps, every step logged, evaluation at steps 0, 2 and 4,
DeepSpeed's timer breakdown on; in the launch other modules share, conftest.shared_runs) with all
three sinks configured; then every file is read back
with its own library's reader (tests/unit/test_metrics.py) and compared with metrics.jsonl: the
same steps, each once, and the same values.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.distributed.launcher import read_metrics
from tests.unit.test_metrics import csv_rows, tensorboard_scalars, wandb_history


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' spec at world 2: the run with every sink (TensorBoard under root/sinks-tb)."""
    out = root / "sinks"
    overrides = ["train.steps=4", "logging.eval_every=2", "logging.breakdown=true",
                 f"logging.tensorboard={root / 'sinks-tb'}", f"logging.csv={out}", "logging.wandb.project=sinks"]
    return [f"sinks|eager|{';'.join(overrides)}"] if ranks == 2 else []


def test_tensorboard_csv_and_wandb_match_metrics_jsonl(shared_runs):
    root = shared_runs(2)[0]
    out = root / "sinks"
    records = read_metrics(out)
    steps = [r["step"] for r in records]
    assert steps == [0, 1, 2, 3, 4], "the step-0 eval baseline, then every step"
    assert {"loss", "lr", "tokens_per_s", "tflops_per_rank", "mfu", "forward_ms"} <= set(records[1])
    assert set(records[0]) == {"step", "eval_loss"}

    def check(sink: str, got: dict[int, dict[str, float]]) -> None:
        assert sorted(got) == steps, f"{sink}: steps {sorted(got)} != {steps}"
        for record in records:
            row = got[record["step"]]
            for key, value in record.items():
                assert key in row, f"{sink}: step {record['step']} has no {key}"
                # TensorBoard keeps float32; the others every digit
                assert row[key] == pytest.approx(value, rel=1e-6 if sink == "tensorboard" else 1e-12), \
                    f"{sink}: step {record['step']} {key} = {row[key]}, metrics.jsonl: {value}"
            extra = {k for k, v in row.items() if k not in record and v is not None and not k.startswith("_")}
            assert not extra, f"{sink}: step {record['step']} has {extra}, which metrics.jsonl has not"

    by_step: dict[int, dict[str, float]] = {}
    for tag, values in tensorboard_scalars(root / "sinks-tb").items():  # (asserts no step appears twice)
        for step, value in values.items():
            by_step.setdefault(step, {"step": step})[tag] = value
    check("tensorboard", by_step)

    header, rows = csv_rows(out / "metrics.csv")
    assert header[:3] == ["step", "loss", "eval_loss"] and len(rows) == len(records)
    check("csv", {int(r["step"]): {k: float(v) if v else None for k, v in r.items()} for r in rows})

    history = wandb_history(out)
    assert len(history) == len(records), "one W&B history row per logged step"
    check("wandb", {row["_step"]: {"step": row["_step"], **row} for row in history})
    assert all(math.isfinite(r["loss"]) for r in records[1:])
