"""`dsf plot RUN_DIR [RUN_DIR ...] [-o FILE.png]`: loss, eval loss, lr, tokens/s and MFU against steps.

(placeholder: being written)
"""
from __future__ import annotations

from pathlib import Path

import click


@click.command("plot")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="the PNG to write")
def plot_cmd(run_dirs: tuple[Path, ...], output: Path | None) -> None:
    """Draw the metrics of one or more runs (not yet written)."""
    raise click.UsageError("dsf plot is not written yet")
