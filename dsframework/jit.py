"""DeepSpeed JIT-builds some ops (shm comm on CPU, fused/CPU Adam) with the `ninja` on PATH and
caches them in ~/.cache/torch_extensions. A different ninja from one run to the next (the venv's
when it is activated, the system's when not) rebuilds them, about a minute each time. dsf pins the
one installed beside its interpreter before anything is built.

    from dsframework.jit import pin_build_tools
    pin_build_tools()      # before deepspeed.init_distributed / deepspeed.initialize
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def pin_build_tools() -> None:
    """Put the interpreter's bin directory (with pip's ninja) first on PATH, once."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (Path(bin_dir) / "ninja").exists() and path[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *[p for p in path if p != bin_dir]])
