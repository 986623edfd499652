"""Metric sinks (dsframework/train/metrics.py): each one written, then read back with its own library's reader.

    python -m pytest tests/unit/test_metrics.py -q

The readers below (TensorBoard's EventAccumulator, the csv module, W&B's offline transaction log
parsed into W&B's own protobuf records) are also what tests/distributed/test_metric_sinks.py
uses to compare a real run's sinks with its metrics.jsonl.
"""
from __future__ import annotations

import csv
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dsframework.config import build_run_config
from dsframework.errors import UserError
from dsframework.train.metrics import (COLUMNS, CsvSink, JsonlSink, MetricSinks, TensorBoardSink, WandbSink,
                                 check_no_previous_outputs, open_sinks, previous_outputs, remove_previous_outputs)
from tests.unit.test_bad_input import dsf_command, dsf_env

REPO = Path(__file__).resolve().parents[2]

# What the training loop logs: the step-0 eval baseline, then steps with the full set.
RECORDS = [
    (0, {"eval_loss": 2.75}),
    (1, {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 6100.5, "tflops_per_rank": 0.25, "mfu": 0.0125}),
    (2, {"loss": float("nan"), "lr": 9e-4, "tokens_per_s": 6200.0, "tflops_per_rank": 0.26, "mfu": 0.013,
         "skipped_steps": 1}),
    (3, {"loss": 2.25, "lr": 8e-4, "tokens_per_s": 6300.0, "tflops_per_rank": 0.27, "mfu": 0.0135,
         "eval_loss": 2.3, "forward_ms": 1.5, "backward_ms": 2.5, "allreduce_ms": 0.5, "optimizer_ms": 0.75}),
]


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


# --- readers --------------------------------------------------------------------------------------

def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every event file in `directory`, as TensorBoard shows them (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step appears twice: {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def wandb_history(directory: Path) -> list[dict]:
    """The history rows of the one offline run under `directory`/wandb: W&B's transaction log
    (run-ID.wandb, LevelDB log framing: 7-byte file header, 32 KiB blocks, records with a 7-byte
    header of crc, length, type) holding W&B's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(directory).glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    rows, pos, part, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                # (a key is in `key`, or split into `nested_key`, as W&B's writer chose)
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def log_all(sink, records=RECORDS) -> None:
    for step, record in records:
        sink.log(record, step)
    sink.close()


# --- metrics.jsonl ----------------------------------------------------------------------------------

def test_jsonl_round_trip_with_null_for_non_finite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log_all(JsonlSink(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # strict JSON: no NaN token
    assert "NaN" not in path.read_text()
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["loss"] is None and rows[2]["skipped_steps"] == 1
    for row, (step, record) in zip(rows, RECORDS):
        assert list(row) == ["step", *record], "the record's keys, in order, after the step"
        assert all(row[k] == v for k, v in record.items() if not (isinstance(v, float) and math.isnan(v)))


def test_jsonl_resume_drops_lines_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log_all(JsonlSink(path))
    sink = JsonlSink(path, resume_step=1)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]
    sink.log({"loss": 9.0}, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()][-1] == {"step": 2, "loss": 9.0}


def test_a_step_key_in_the_record_is_the_argument(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log({"step": 99, "loss": 1.0}, 7)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 7, "loss": 1.0}


# --- TensorBoard ------------------------------------------------------------------------------------

def test_tensorboard_round_trip(tmp_path):
    log_all(TensorBoardSink(tmp_path / "tb"))
    scalars = tensorboard_scalars(tmp_path / "tb")
    want: dict[str, dict[int, float]] = {}
    for step, record in RECORDS:
        for key, value in record.items():
            want.setdefault(key, {})[step] = value
    assert sorted(scalars) == sorted(want)
    for tag, by_step in want.items():
        assert sorted(scalars[tag]) == sorted(by_step), tag
        assert all(same(scalars[tag][s], v) for s, v in by_step.items()), (tag, scalars[tag], by_step)
    assert math.isnan(scalars["loss"][2]), "a NaN loss stays NaN (TensorBoard shows it)"


def test_tensorboard_resume_purges_the_steps_past_the_checkpoint(tmp_path):
    log_all(TensorBoardSink(tmp_path / "tb"))  # steps 0-3
    # resumed from the step-1 checkpoint: steps 2 and 3 are trained again, with other values
    log_all(TensorBoardSink(tmp_path / "tb", resume_step=1), [(2, {"loss": 7.0}), (3, {"loss": 6.0})])
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    scalars = tensorboard_scalars(tmp_path / "tb")  # asserts no step appears twice
    assert scalars["loss"] == {1: 2.5, 2: 7.0, 3: 6.0}
    assert sorted(scalars["lr"]) == [1], "the first process's steps past the checkpoint are hidden"


# --- CSV --------------------------------------------------------------------------------------------

def test_csv_round_trip_fixed_column_order_and_empty_cells(tmp_path):
    log_all(CsvSink(tmp_path))
    header, rows = csv_rows(tmp_path / "metrics.csv")
    logged = {key for _, record in RECORDS for key in record} | {"step"}
    assert header == [c for c in COLUMNS if c in logged], "known columns, in COLUMNS order, only those logged"
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for row, (step, record) in zip(rows, RECORDS):
        for column in header[1:]:
            if column in record:
                assert same(float(row[column]), record[column]), (step, column)
            else:
                assert row[column] == "", f"step {step}: {column} was not logged, the cell is empty"
    assert rows[2]["loss"] == "nan"


def test_csv_unknown_metric_goes_after_the_known_ones(tmp_path):
    log_all(CsvSink(tmp_path), [(1, {"zeta": 1.0, "loss": 2.0}), (2, {"loss": 1.5, "alpha": 3.0})])
    header, rows = csv_rows(tmp_path / "metrics.csv")
    assert header == ["step", "loss", "zeta", "alpha"]
    assert rows == [{"step": "1", "loss": "2.0", "zeta": "1.0", "alpha": ""},
                    {"step": "2", "loss": "1.5", "zeta": "", "alpha": "3.0"}]


def test_csv_resume_drops_rows_past_the_checkpoint(tmp_path):
    log_all(CsvSink(tmp_path))
    sink = CsvSink(tmp_path, resume_step=1)
    assert [r["step"] for r in csv_rows(tmp_path / "metrics.csv")[1]] == ["0", "1"]
    log_all(sink, [(2, {"loss": 7.0})])
    header, rows = csv_rows(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["0", "1", "2"] and rows[-1]["loss"] == "7.0"
    assert "forward_ms" in header, "the header keeps the columns the file had"


# --- W&B --------------------------------------------------------------------------------------------

def test_wandb_offline_round_trip(tmp_path):
    log_all(WandbSink(tmp_path, project="unit", name="sinks", group="g", config={"train": {"lr": 1e-3}}))
    history = wandb_history(tmp_path)
    assert [row["_step"] for row in history] == [0, 1, 2, 3]
    for row, (step, record) in zip(history, RECORDS):
        assert all(same(row[k], v) for k, v in record.items()), (step, row)
    assert not list(tmp_path.glob("wandb/run-*")), "offline: no online run directory"


# --- together ---------------------------------------------------------------------------------------

def run_config(tmp_path: Path, *sets: str):
    return build_run_config({}, [f"output_dir={tmp_path / 'out'}", *sets])


def test_open_sinks_sends_the_same_records_everywhere(tmp_path):
    run = run_config(tmp_path, f"logging.tensorboard={tmp_path / 'tb'}", f"logging.csv={tmp_path / 'csv'}",
                     "logging.wandb=true")
    (tmp_path / "out").mkdir()
    sinks = open_sinks(run, resume_step=None)
    assert [type(s) for s in sinks.sinks] == [JsonlSink, TensorBoardSink, CsvSink, WandbSink]
    log_all(sinks)
    jsonl = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    scalars = tensorboard_scalars(tmp_path / "tb")
    _, rows = csv_rows(tmp_path / "csv" / "metrics.csv")
    history = wandb_history(tmp_path / "out")
    for row, tb_step, csv_row, wb in zip(jsonl, sorted(scalars["lr"] | scalars["eval_loss"]), rows, history):
        assert row["step"] == tb_step == int(csv_row["step"]) == wb["_step"]
    assert len(jsonl) == len(rows) == len(history) == len(RECORDS)
    assert open_sinks(run, resume_step=None, enabled=False).sinks == [], "ranks other than 0 write nothing"


@pytest.mark.distributed
def test_a_sink_library_is_imported_only_when_configured(tmp_path):
    code = ("import sys; from dsframework.config import build_run_config; from dsframework.train.metrics import open_sinks\n"
            f"run = build_run_config({{}}, ['output_dir={tmp_path}', 'logging.csv={tmp_path}'])\n"
            "sinks = open_sinks(run, resume_step=None); sinks.close()\n"
            "print(sorted(m for m in ('tensorboard', 'wandb', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_close_is_once_even_after_an_error(tmp_path):
    closed = []

    class Sink:
        def log(self, record, step):
            raise OSError("disk full")

        def close(self):
            closed.append(1)

    sinks = MetricSinks([Sink()])
    with pytest.raises(OSError):
        try:
            sinks.log({"loss": 1.0}, 1)
        finally:
            sinks.close()
    sinks.close()
    assert closed == [1]


def test_previous_outputs_refused_then_removed_on_overwrite(tmp_path):
    run = run_config(tmp_path, f"logging.tensorboard={tmp_path / 'tb'}", f"logging.csv={tmp_path / 'csv'}")
    check_no_previous_outputs(run.logging)  # nothing there yet
    log_all(TensorBoardSink(tmp_path / "tb"))
    log_all(CsvSink(tmp_path / "csv"))
    (tmp_path / "tb" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"^logging.tensorboard=.*tb': already holds 1 TensorBoard event file"):
        check_no_previous_outputs(run.logging)
    assert [field for field, _, _ in previous_outputs(run.logging)] == ["logging.tensorboard", "logging.csv"]
    remove_previous_outputs(run.logging)
    assert previous_outputs(run.logging) == []
    assert (tmp_path / "tb" / "notes.txt").read_text() == "mine", "only the sinks' own files go"


# --- bad input: one line, exit 2, nothing started ---------------------------------------------------

@pytest.mark.parametrize("field", ["tensorboard", "csv", "wandb.dir"])
@pytest.mark.distributed
def test_sink_directory_that_is_a_file_is_one_line_exit_2(tmp_path, field):
    taken = tmp_path / "taken.txt"
    taken.write_text("a file\n")
    out = tmp_path / "run"
    proc = subprocess.run([*dsf_command(), "train", str(REPO / "launch" / "examples" / "tiny.yaml"),
                           "--set", f"output_dir={out}", "--set", f"logging.{field}={taken}"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, env=dsf_env(tmp_path / "home"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [f"dsf: error: logging.{field}='{taken}': is an existing file, not a directory; name a "
                     f"directory (created if missing), e.g. logging.{field}=" + ("runs/tiny/tb" if field == "tensorboard"
                                                                                 else "runs/tiny")], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists() and taken.read_text() == "a file\n", "nothing started, the file untouched"
