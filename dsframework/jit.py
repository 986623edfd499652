"""DeepSpeed JIT-builds some ops (shm comm on CPU, fused/CPU Adam) with the `ninja` on PATH and
caches them in ~/.cache/torch_extensions. Two things made that cache rebuild (about a minute per
op) or, worse, wait forever: a different ninja from one run to the next (the venv's when it is
activated, the system's when not), and two environments (say a checkout and a fresh CI clone)
building the same op into the same folder, each invalidating and locking the other's build.
dsf pins the ninja beside its interpreter and gives each environment its own build folder.

    from dsframework.jit import pin_build_tools
    pin_build_tools()      # before deepspeed.init_distributed / deepspeed.initialize
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def pin_build_tools() -> None:
    """The interpreter's bin directory (pip's ninja) first on PATH, and TORCH_EXTENSIONS_DIR
    inside this environment (sys.prefix) unless the user chose one."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (Path(bin_dir) / "ninja").exists() and path[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *[p for p in path if p != bin_dir]])


def release_shm_buffers() -> None:
    """Unlink this rank's DeepSpeed shm all-reduce buffer now that every rank has mapped it.

    DeepSpeed's CPU comm op creates a 69 MB /dev/shm file per rank and job
    (deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>) and never removes it: a machine that
    runs many jobs fills /dev/shm and then its memory. All ranks open all buffers while
    init_distributed runs, so after a barrier the names can go; the memory stays mapped until the
    processes exit, and is freed then even if they crash.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    (Path("/dev/shm") / name).unlink(missing_ok=True)
