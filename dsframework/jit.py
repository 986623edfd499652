"""DeepSpeed JIT-builds some ops (shm comm on CPU, fused/CPU Adam) with the `ninja` on PATH and
caches them in ~/.cache/torch_extensions. Two things made that cache rebuild (about a minute per
op) or, worse, wait forever: a different ninja from one run to the next (the venv's when it is
activated, the system's when not), and two environments (say a checkout and a fresh CI clone)
building the same op into the same folder, each invalidating and locking the other's build.
dsf pins the ninja beside its interpreter and gives each environment its own build folder.

    from dsframework.jit import pin_build_tools
    pin_build_tools()      # before deepspeed.init_distributed / deepspeed.initialize

The CPU op builders also ask py-cpuinfo for the CPU's flags each time they load an op, and each
ask starts a Python interpreter; dsf answers from a cache (see cache_cpu_info).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsframework.errors import UserError
from dsframework.files import written_then_renamed
from dsframework.types import accelerator


def pin_build_tools() -> None:
    """The interpreter's bin directory (pip's ninja) first on PATH, and TORCH_EXTENSIONS_DIR
    inside this environment (sys.prefix) unless the user chose one."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (Path(bin_dir) / "ninja").exists() and path[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *[p for p in path if p != bin_dir]])
    cache_cpu_info(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


# A build of one op takes about a minute here (two on a loaded machine); a lock older than this was
# left by a build that was killed (a timeout, Ctrl-C, a node lost), not one still running.
STALE_LOCK_S = 20 * 60


def clear_stale_build_locks(folder: Path, *, now: float | None = None) -> list[Path]:
    """Remove the build locks in `folder` (an op's `lock`, torch's FileBaton) older than STALE_LOCK_S;
    returns them. torch waits for a lock to go away and the file names no process: a build killed
    while it held one makes every later run that loads the op wait forever, silently (seen: every
    tp 2 x pp 2 run of bench/architectures.py timing out after a killed run)."""
    now = time.time() if now is None else now
    removed = []
    for lock in folder.glob("*/lock"):
        try:
            if now - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink()
                removed.append(lock)
        except OSError:  # another rank removed it first
            continue
    for lock in removed:
        print(f"dsf: removed {lock}, a JIT build lock left {STALE_LOCK_S // 60}+ minutes ago by a build that "
              "did not finish; the op is built again", file=sys.stderr, flush=True)
    return removed


def _cpu_signature() -> str:
    """The first CPU's model and flags: what py-cpuinfo's answer (and -march=native) depend on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    first = text.split("\n\n", 1)[0].splitlines()
    return "\n".join(line for line in first if line.startswith(("model name", "flags", "Features", "cpu model")))


def cache_cpu_info(folder: Path) -> None:
    """Answer py-cpuinfo's get_cpu_info() from a cache: in this process, and on disk in `folder`
    keyed by the CPU's model and flags.

    get_cpu_info() starts a second Python interpreter to read the CPU (about a second), and
    DeepSpeed's CPU op builders call it for every op they load (-march and SIMD width): 2-3 s of
    every rank's start, every run, for an answer that depends only on the machine.
    """
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed falls back to lscpu
        return
    if getattr(cpuinfo.get_cpu_info, "dsf_cached", False):
        return
    key = hashlib.sha1(f"{platform.machine()}\n{_cpu_signature()}".encode()).hexdigest()[:16]
    path = folder / f"cpuinfo-{key}.json"
    ask = cpuinfo.get_cpu_info

    @functools.cache
    def answer() -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            info = ask()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with written_then_renamed(path) as tmp:  # ranks starting together never read half a file
                tmp.write_text(json.dumps(info))
        except OSError:
            pass
        return info

    def get_cpu_info() -> dict:
        return copy.deepcopy(answer())

    get_cpu_info.dsf_cached = True
    cpuinfo.get_cpu_info = get_cpu_info


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


CPU_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")  # what dsf's CPU runs load


@dataclass(frozen=True)
class AdamChoice:
    """The Adam a run's DeepSpeed JSON asks for: `torch_adam` (torch's fused AdamW: nothing to
    build) or DeepSpeed's own, whose op (`op`, an op builder's class name) must load."""

    name: str
    torch_adam: bool = False
    op: str | None = None


def adam_choice(device: str, *, offload: bool, installed: dict[str, bool] | None = None) -> AdamChoice:
    """Which Adam a run on `device` uses, so that its first step builds nothing it cannot build.

        adam_choice("cuda", offload=False)   # AdamChoice('torch AdamW (fused)', torch_adam=True)

    - optimizer offload: DeepSpeed's CPU Adam (ZeRO-Offload refuses any other), a host C++ op;
    - CUDA: DeepSpeed's FusedAdam where the install built it (DS_BUILD_FUSED_ADAM=1, `installed`:
      deepspeed.git_version_info.installed_ops), else torch's fused AdamW: FusedAdam's JIT build
      needs nvcc and CUDA_HOME, which a pip-installed torch does not bring;
    - the CPU: DeepSpeed's FusedAdam, built by launch/setup_env.sh (python -m dsframework.jit): the
      losses the suite's references were taken with.
    """
    if offload:
        return AdamChoice("DeepSpeed CPU Adam (cpu_adam op, built for the host)", op="CPUAdamBuilder")
    if device == "cuda":
        if (installed if installed is not None else _installed_ops()).get("fused_adam"):
            return AdamChoice("DeepSpeed FusedAdam (built at install)", op="FusedAdamBuilder")
        return AdamChoice("torch AdamW (fused)", torch_adam=True)
    return AdamChoice(f"DeepSpeed FusedAdam ({device} op)", op="FusedAdamBuilder")


def _installed_ops() -> dict[str, bool]:
    from deepspeed.git_version_info import installed_ops

    return dict(installed_ops)


def load_adam_op(choice: AdamChoice, *, field: str, value: object) -> None:
    """Load (building if need be) the op `choice` needs, before any rank waits at the rendezvous;
    UserError in one line when it can be neither built nor loaded here."""
    if choice.op is None:
        return
    pin_build_tools()

    try:
        accelerator().create_op_builder(choice.op).load(verbose=False)
    except Exception as err:  # noqa: BLE001 - a compiler, a header or a library missing: all the same to the user
        why = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
        raise UserError(field, value, f"needs {choice.name}, which could not be built or loaded here ({why})",
                        "install a C++ compiler and ninja (apt-get install g++), or DeepSpeed with its ops "
                        "built (DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 pip install deepspeed)") from None


def build_ops(builders: tuple[str, ...] = CPU_OPS) -> list[str]:
    """Build DeepSpeed's JIT ops that runs on this accelerator load (or find them in the cache), as
    `DS_BUILD_OPS=1 pip install deepspeed` builds ops at install time: the first training then
    does not stop for about a minute per op. Returns the ops now ready.

        python -m dsframework.jit        # launch/setup_env.sh runs it; a no-op once built
    """
    pin_build_tools()

    device = accelerator()
    if device.device_name() != "cpu":  # GPU wheels ship or JIT their own ops; nothing dsf pins there
        return []
    ready = []
    for name in builders:
        builder = device.create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)
            ready.append(builder.name)
    return ready


if __name__ == "__main__":
    started = time.perf_counter()
    ops = build_ops()
    print(f"jit: {', '.join(ops) or 'no CPU ops'} ready in {os.environ['TORCH_EXTENSIONS_DIR']} "
          f"({time.perf_counter() - started:.0f} s)")
