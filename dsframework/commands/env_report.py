"""`dsf env`: what a bug report needs (versions, the accelerator, ranks per node, JIT ops built,
which Adam `dsf train` will use: jit.adam_choice).

    dsf env          # paste the whole output into the issue

Like DeepSpeed's `ds_report`, whose pieces it reuses (the op builders' compatibility probe, the
ops a wheel shipped pre-built, nvcc's version, the /dev/shm check), plus what dsf adds: the
versions of the libraries dsf trains with, the ranks per node `deepspeed` would start, which ops
are already JIT-built in the extensions folder dsf uses (dsframework/jit.py) and the launchers'
tools on PATH. No process group is formed; it takes a few seconds (importing deepspeed). In Python:

    from dsframework.commands.env_report import collect, render
    print(render(collect()))
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys
from pathlib import Path

import click

import dsframework
from dsframework.jit import adam_choice, pin_build_tools
from dsframework.types import accelerator

Section = tuple[str, list[tuple[str, str]]]
LAUNCH_TOOLS = ("pdsh", "mpirun", "srun", "ssh")  # deepspeed's pdsh/mpirun runners, SLURM, dsf launch --check
OPTIONAL = ("peft", "accelerate", "tensorboard", "wandb", "matplotlib")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> Section:
    import datasets
    import deepspeed
    import torch
    import transformers

    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("dsframework", f"{_version('dsframework')} ({Path(dsframework.__file__).parent})"),
            ("torch", f"{torch.__version__} (cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)})"),
            ("deepspeed", f"{deepspeed.__version__} (git {deepspeed.__git_hash__})"),
            ("transformers", transformers.__version__),
            ("datasets", datasets.__version__)]
    return "versions", rows + [(name, _version(name)) for name in OPTIONAL]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine() -> Section:
    import torch
    from deepspeed.env_report import get_shm_size, nvcc_version

    device = accelerator()
    rows = [("os", platform.platform()),
            ("accelerator", f"{device.device_name()} (deepspeed's get_accelerator)")]
    if device.device_name() == "cuda" and torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            rows.append((f"cuda:{index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                          f"compute capability {props.major}.{props.minor}"))
        rows.append(("nvcc", nvcc_version()))
        rows.append(("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)")))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows.append(("cpu", f"{_cpu_model()}, {os.cpu_count()} cores ({usable} usable by this process)"))
    count = device.device_count()
    why = "NUMA nodes with cores, or LOCAL_SIZE; pass --num_gpus N for N CPU ranks" \
        if device.device_name() == "cpu" else "devices visible"
    rows.append(("ranks per node", f"{count} (what `deepspeed` starts without --num_gpus: {why})"))
    rows.append(("distributed backend", device.communication_backend_name()))
    size, warnings = get_shm_size()
    rows.append(("/dev/shm", size + "".join(" " + w.strip() for w in warnings or [])))
    return "machine", rows


def _jit_ops() -> Section:
    """Each op builder of this accelerator: compatible here, shipped pre-built, JIT-built already."""
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible

    pin_build_tools()  # the extensions folder and ninja that dsf train uses, exactly as it sets them
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    ninja = shutil.which("ninja")
    rows = [("extensions folder", str(folder)),
            ("ninja", ninja or "not found: ops cannot be JIT-built (pip install ninja)")]
    prebuilt = accelerator_name == getattr(accelerator(), "_name")  # as ds_report does; private: not in the protocol
    for name, builder in ALL_OPS.items():
        if name == "deepspeed_not_implemented":
            continue
        compatible = probe_is_compatible(builder, verbose=False)  # its dependencies are here (ds_report's column)
        state = ["compatible" if compatible else "not compatible (cannot be built here)"]
        if prebuilt and installed_ops.get(name, False):
            state.append("pre-built in the deepspeed wheel")
        elif (folder / name / f"{name}.so").is_file():  # torch.utils.cpp_extension's layout: <folder>/<op>/<op>.so
            state.append("built (cached)")
        elif compatible:
            state.append("not built yet (built on first use)")
        rows.append((name, ", ".join(state)))
    device = accelerator().device_name()
    for offload, what in ((False, "optimizer"), (True, "optimizer with offload")):
        choice = adam_choice(device, offload=offload, installed=installed_ops if prebuilt else {})
        rows.append((what, f"{choice.name}" + ("" if choice.op is None else f" (op {choice.op})")))
    return "JIT ops (DeepSpeed's op builders for this accelerator)", rows


def _launch_tools() -> Section:
    return "launchers' tools on PATH", [(tool, shutil.which(tool) or "not found") for tool in LAUNCH_TOOLS]


def collect() -> list[Section]:
    """The report as (section title, [(name, value)]) in the order it is printed."""
    return [_versions(), _machine(), _jit_ops(), _launch_tools()]


def render(sections: list[Section]) -> str:
    width = max(len(name) for _, rows in sections for name, _ in rows) + 2
    lines = []
    for title, rows in sections:
        lines += ["", f"-- {title}"] + [f"{name} {'.' * (width - len(name))} {value}" for name, value in rows]
    return "\n".join(lines[1:])


@click.command("env")
def env_cmd() -> None:
    """Print versions, the accelerator, ranks per node, the JIT ops built and the launchers found."""
    click.echo(render(collect()))
