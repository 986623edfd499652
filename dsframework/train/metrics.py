"""Metric sinks: where rank 0 sends each logged step's metrics (torchtitan's `BaseLogger` shape).

    sinks = open_sinks(run, resume_step=None, enabled=rank == 0)   # [] on the other ranks
    try:
        sinks.log({"loss": 2.5, "lr": 1e-3, "tokens_per_s": 6.1e4}, step=10)
    finally:
        sinks.close()

Every run writes `<output_dir>/metrics.jsonl` (JsonlSink); the run config adds, each only when set:

    logging:
      tensorboard: runs/tiny/tb     # TensorBoardSink: event files (tensorboard --logdir runs/tiny/tb)
      csv: runs/tiny                # CsvSink: runs/tiny/metrics.csv
      wandb: {project: tiny}        # WandbSink: an offline W&B run under <output_dir>/wandb

A sink is `log(record, step)` and `close()`; all of them get the same records (a `step` key in
a record is ignored: `step` is the argument). A sink's library is imported only when that sink is
configured. On resume each sink drops what it holds past the checkpoint's step (the resumed run
logs those steps again), so no step appears twice.

DeepSpeed has monitors for the same three backends (`deepspeed.monitor`), but they write one
CSV file per metric, cannot purge a TensorBoard log on resume and start W&B online; the
libraries are used directly here.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Iterable, Protocol

from dsframework.errors import UserError
from dsframework.files import written_then_renamed

# The metrics the training loop logs, in the order a CSV shows them (others come after).
COLUMNS = ("step", "loss", "eval_loss", "lr", "tokens_per_s", "tflops_per_rank", "mfu", "forward_ms", "backward_ms",
           "allreduce_ms", "optimizer_ms", "skipped_steps")
CSV_NAME = "metrics.csv"
TENSORBOARD_EVENTS = "events.out.tfevents.*"


class MetricSink(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _values(record: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key != "step"}


class JsonlSink:
    """`<output_dir>/metrics.jsonl`: one strict-JSON object per logged step, non-finite values null."""

    def __init__(self, path: Path, *, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            # Lines past the checkpoint were never saved; the resumed run writes them anew.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict[str, Any], step: int) -> None:
        # Strict JSON for jq and JavaScript readers: a non-finite value (fp16's skipped step) is null.
        row = {"step": step, **{k: None if isinstance(v, float) and not math.isfinite(v) else v
                                for k, v in _values(record).items()}}
        with self.path.open("a") as f:  # opened per record: a killed run keeps every line it logged
            f.write(json.dumps(row, allow_nan=False) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars in a TensorBoard event file in `directory`, one tag per metric (`loss`, `mfu`, ...).

    On resume the writer is opened with `purge_step`: TensorBoard hides the events the earlier
    process wrote past the checkpoint, so the resumed steps are not shown twice."""

    def __init__(self, directory: Path, *, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in _values(record).items():
            if isinstance(value, (int, float)):  # a NaN is written as NaN: TensorBoard shows it
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a few hundred bytes per logged step; nothing lost if the job is killed

    def close(self) -> None:
        self.writer.close()


class CsvSink:
    """`<directory>/metrics.csv`, a header then one row per logged step; a spreadsheet opens it.

    Columns are the metrics the run has logged, in the fixed order of COLUMNS (step, loss,
    eval_loss, lr, ...; any other metric after them); a step without a metric leaves its cell
    empty (the step-0 row has only eval_loss). A metric that first appears later (the loss after
    the step-0 eval row) rewrites the small file with the wider header, a few times a run at most.
    Non-finite values are written `nan`/`inf`, as Python and pandas read them."""

    def __init__(self, directory: Path, *, resume_step: int | None = None):
        self.path = Path(directory) / CSV_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] = []
        if self.path.exists():
            self.columns, rows = self._read()
            if resume_step is not None:  # rows past the checkpoint are logged again by the resumed run
                self._rewrite([row for row in rows if row.get("step") and int(row["step"]) <= resume_step])

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or []), rows

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        with written_then_renamed(self.path) as tmp:
            with tmp.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.columns)
                writer.writeheader()
                writer.writerows(rows)

    def log(self, record: dict[str, Any], step: int) -> None:
        row = {"step": step, **_values(record)}
        if any(key not in self.columns for key in row) or not self.path.exists():
            _, rows = self._read() if self.path.exists() else ([], [])
            seen = [*self.columns, *(key for key in row if key not in self.columns)]
            known = [key for key in COLUMNS if key in seen]
            self.columns = known + [key for key in seen if key not in known]
            self._rewrite(rows)
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def close(self) -> None:
        pass


class WandbSink:
    """An offline Weights & Biases run in `<directory>/wandb/offline-run-*` (no network, no login).

    Upload it later with `wandb sync <directory>/wandb/offline-run-*`. Each start of a run (and
    each resume) is its own W&B run, grouped under the output directory's name, with the run
    config as its config; a resumed one starts at the checkpoint's step."""

    def __init__(self, directory: Path, *, project: str, name: str | None, group: str, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        Path(directory).mkdir(parents=True, exist_ok=True)
        # console="off": W&B would otherwise wrap stdout and stderr, which the launcher reads.
        self.run = wandb.init(mode="offline", dir=str(directory), project=project, name=name, group=group,
                              job_type="train", config=config,
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(_values(record), step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() returns before W&B's service process has written the run's log (measured: 3 in 6
        # offline runs held no history yet); teardown() waits for it. W&B would call it at exit,
        # but dsf ends a rank with os._exit (supervise.exit_process), where no atexit hook runs.
        self.wandb.teardown()


class MetricSinks:
    """Several sinks as one: each record goes to every sink; `close` closes them all."""

    def __init__(self, sinks: Iterable[MetricSink] = ()):
        self.sinks = list(sinks)

    def log(self, record: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(record, step)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []  # closed once, even if called again after an error
        for sink in sinks:
            sink.close()


def open_sinks(run: Any, *, resume_step: int | None, enabled: bool = True) -> MetricSinks:
    """The sinks `run.logging` asks for (metrics.jsonl always); none where not `enabled` (rank != 0).

    `resume_step`: the checkpoint's step when the run resumes (each sink drops what lies past it)."""
    if not enabled:
        return MetricSinks()
    out, spec = Path(run.output_dir), run.logging
    sinks: list[MetricSink] = [JsonlSink(out / "metrics.jsonl", resume_step=resume_step)]
    try:
        if spec.tensorboard:
            sinks.append(TensorBoardSink(Path(spec.tensorboard), resume_step=resume_step))
        if spec.csv:
            sinks.append(CsvSink(Path(spec.csv), resume_step=resume_step))
        if spec.wandb is not None:
            sinks.append(WandbSink(Path(spec.wandb.dir or out), project=spec.wandb.project, name=spec.wandb.name,
                                   group=out.resolve().name, config=run.model_dump(mode="json")))
    except BaseException:
        MetricSinks(sinks).close()
        raise
    return MetricSinks(sinks)


# --- what a previous run left (dsf train refuses to mix runs unless --resume or --overwrite) -----

def previous_outputs(logging: Any) -> list[tuple[str, str, list[Path]]]:
    """(config field, its value, the files) for each metric file a previous run left where this
    run's sinks write. metrics.jsonl is the output directory's concern (train/setup.py check_output_dir);
    W&B makes a new offline run directory each start, so it leaves nothing to collide with."""
    found = []
    if logging.tensorboard and (events := sorted(Path(logging.tensorboard).glob(TENSORBOARD_EVENTS))):
        found.append(("logging.tensorboard", logging.tensorboard, events))
    if logging.csv and (Path(logging.csv) / CSV_NAME).is_file():
        found.append(("logging.csv", logging.csv, [Path(logging.csv) / CSV_NAME]))
    return found


def check_no_previous_outputs(logging: Any) -> None:
    """A UserError naming the first metric files a previous run left (a fresh run would mix with them)."""
    for field, value, files in previous_outputs(logging):
        what = CSV_NAME if field == "logging.csv" else f"{len(files)} TensorBoard event file(s)"
        raise UserError(field, value, f"already holds {what} of a run",
                        "pass --resume to continue that run, --overwrite to replace it, or give this run a "
                        "directory of its own")


def remove_previous_outputs(logging: Any) -> None:
    """--overwrite: delete the TensorBoard event files and metrics.csv a previous run left (nothing else)."""
    for _, _, files in previous_outputs(logging):
        for file in files:
            file.unlink(missing_ok=True)
