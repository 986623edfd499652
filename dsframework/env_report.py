"""`dsf env`: what a bug report needs (versions, the accelerator, ranks per node, JIT ops built).

(placeholder: being written)
"""
from __future__ import annotations

import click


@click.command("env")
def env_cmd() -> None:
    """Print versions, the accelerator and the JIT ops built (not yet written)."""
    raise click.UsageError("dsf env is not written yet")
