"""`dsf plot RUN_DIR [RUN_DIR ...] [-o FILE.png]`: loss, eval loss, lr, tokens/s and MFU against steps.

    dsf plot runs/tiny                          # -> runs/tiny/metrics.png
    dsf plot runs/zero2 runs/zero3 -o cmp.png   # both runs overlaid, named by their directories

Reads each run's `metrics.jsonl` (it may still be training: a half-written last line is left
out) and draws four panels with matplotlib's Agg renderer (no display needed), six for a mixture
of experts (its router's aux loss and expert load); a run restarted by `dsf launch --max-restarts`
(restarts.jsonl) has each restart marked on its loss panel at the step it resumed from. One run's default
output is RUN_DIR/metrics.png; several runs' is metrics.png in the current directory. In Python:

    from dsframework.commands.plot import read_metrics, draw
    draw({"tiny": read_metrics(Path("runs/tiny"))}, Path("tiny.png"))
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from dsframework.errors import UserError
from dsframework.files import written_then_renamed

# (panel title, y label, [(metric, line style, label suffix)])
PANELS = [
    ("loss", "loss", [("loss", "-", "train"), ("eval_loss", "--o", "eval")]),
    ("learning rate", "lr", [("lr", "-", "")]),
    ("throughput", "tokens/s (all ranks)", [("tokens_per_s", "-", "")]),
    ("model FLOPs utilisation", "MFU (%)", [("mfu", "-", "")]),
]
# A mixture of experts' router (train/expert_load.py): a third row, drawn when a run logged it.
EXPERT_PANELS = [
    ("router load-balancing loss", "aux loss", [("aux_loss", "-", "")]),
    ("expert load", "tokens per expert", [("expert_load_cv", "-", "CV"),
                                          ("expert_load_max_share", "--", "busiest share")]),
]
FIX_RUN_DIR = "pass a dsf train output_dir (the directory that holds metrics.jsonl)"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl, or a UserError naming what is wrong with RUN_DIR."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise UserError("RUN_DIR", str(run_dir), "is not a directory", FIX_RUN_DIR)
    if not path.is_file():
        raise UserError("RUN_DIR", str(run_dir), "holds no metrics.jsonl", FIX_RUN_DIR)
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                break  # the run is writing this line right now
            raise UserError("RUN_DIR", str(run_dir), f"metrics.jsonl line {number} is not JSON",
                            "fix or delete that line (dsf train writes one JSON object per line)") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UserError("RUN_DIR", str(run_dir), f"metrics.jsonl line {number} has no integer `step`",
                            "pass a dsf train output_dir; its metrics.jsonl has one object per logged step")
        records.append(record)
    if not records:
        raise UserError("RUN_DIR", str(run_dir), "has no logged step in metrics.jsonl yet",
                        "wait for the first logging step (logging.every), then plot again")
    return records


def output_path(run_dirs: list[Path], output: Path | None) -> Path:
    """Where the PNG goes: -o, else RUN_DIR/metrics.png (one run) or ./metrics.png (several)."""
    if output is None:
        return Path(run_dirs[0]) / "metrics.png" if len(run_dirs) == 1 else Path("metrics.png")
    if output.suffix.lower() != ".png":
        raise UserError("-o/--output", str(output), "must be a .png file (dsf plot draws PNG)",
                        f"write e.g. -o {output.with_suffix('.png').name}")
    if output.is_dir():
        raise UserError("-o/--output", str(output), "is a directory", f"write e.g. -o {output / 'metrics.png'}")
    if not output.parent.is_dir():
        raise UserError("-o/--output", str(output), f"is in {output.parent}, which is not a directory",
                        "create that directory first, or choose another path")
    return output


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's legend name: its directory's name, or the path as given where two names are equal."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]


def _series(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; a null (a non-finite value) is NaN, which leaves a gap."""
    points = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in points], [math.nan if v is None else v * scale for _, v in points]


def read_restarts(run_dir: Path) -> list[int]:
    """The steps a run restarted from (`dsf launch --max-restarts`: restarts.jsonl's checkpoints; 0
    for a restart from the start); none without restarts.jsonl."""
    path = Path(run_dir) / "restarts.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            tag = json.loads(line).get("resumes")
        except json.JSONDecodeError:
            continue
        steps.append(int(tag.removeprefix("global_step")) if tag else 0)
    return steps


def draw(runs: dict[str, list[dict[str, Any]]], output: Path, restarts: dict[str, list[int]] | None = None) -> Any:
    """Four panels (loss and eval loss, lr, tokens/s, MFU) of every run in `runs` (label -> records),
    and two more (the router's aux loss, the experts' load) when a run is a mixture of experts;
    `restarts` (label -> steps) marks where a run restarted on its loss panel. Returns the Figure."""
    try:
        from matplotlib.figure import Figure  # a Figure of its own: no pyplot state, Agg for PNG
    except ImportError:
        raise UserError("dsf plot", None, "needs matplotlib, which is not installed",
                        "pip install matplotlib (or pip install dsframework[metrics])") from None
    experts = any("aux_loss" in record for records in runs.values() for record in records)
    panels = PANELS + (EXPERT_PANELS if experts else [])
    fig = Figure(figsize=(11, 11 if experts else 7.5), layout="constrained")
    axes = fig.subplots(len(panels) // 2, 2, sharex=True).flat
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, ylabel, lines) in zip(axes, panels):
        drawn = False
        for (label, records), colour in zip(runs.items(), colours):
            for key, style, suffix in lines:
                steps, values = _series(records, key, 100.0 if key == "mfu" else 1.0)
                if steps:
                    ax.plot(steps, values, style, color=colour, markersize=3, linewidth=1.2,
                            label=f"{label} {suffix}".strip() if len(lines) > 1 or len(runs) > 1 else None)
                    drawn = True
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for (label, steps), colour in zip((restarts or {}).items(), colours):
        for i, step in enumerate(steps):  # a restart resumes here: the steps after it were trained twice
            fig.axes[0].axvline(step, linestyle=":", color=colour, linewidth=1,
                                label=f"{label} restart" if i == 0 and len(runs) > 1 else "restart" if i == 0 else None)
    if restarts and any(restarts.values()):
        fig.axes[0].legend(fontsize="small")
    for ax in list(fig.axes)[-2:]:
        ax.set_xlabel("step")
    fig.suptitle(" vs ".join(runs) if len(runs) > 1 else next(iter(runs)))
    try:
        with written_then_renamed(output) as tmp:  # a plot being redrawn is never seen half-written
            fig.savefig(tmp, format="png", dpi=100)
    except OSError as err:
        raise UserError("-o/--output", str(output), f"cannot be written ({err.strerror or err})",
                        "choose a path in a directory you can write") from None
    return fig


@click.command("plot")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="RUN_DIR...")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="the PNG to write (default: RUN_DIR/metrics.png for one run, ./metrics.png for several)")
def plot_cmd(run_dirs: tuple[Path, ...], output: Path | None) -> None:
    """Draw loss, eval loss, lr, tokens/s and MFU of one or more runs (overlaid) into a PNG."""
    target = output_path(list(run_dirs), output)  # flags checked before any run is read
    runs = {label: read_metrics(d) for label, d in zip(_labels(list(run_dirs)), run_dirs)}
    draw(runs, target, restarts={label: read_restarts(d) for label, d in zip(runs, run_dirs)})
    steps = ", ".join(f"{label}: {len(records)} logged steps" for label, records in runs.items())
    click.echo(f"dsf: wrote {target} ({steps})")
