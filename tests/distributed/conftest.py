"""Launches that several test modules share: one process group per world size trains the eager
runs of every module in SHARED_MODULES (each run as `dsf train` does, one after the other,
workers/train_matrix.py), instead of a launch per module (~10-25 s of start-up each).

    def shared_specs(ranks: int, root: Path) -> list[str]:   # in a module of SHARED_MODULES
        return ["zero1|eager|parallel.zero_stage=1"] if ranks == 2 else []

    def test_x(shared_runs):
        root, stdout, shm_left = shared_runs(2)     # the launch of world 2, started once a session
        losses(root / "zero1")

A spec is `NAME|BACKEND|OVERRIDES[|resume]` (train_matrix.py); names are directories under one
root, so they must be unique across the modules. A module may write what its runs read (a data
file, a pretrained directory) under `root`, named after it, before it returns its specs. A run
that fails fails every module's tests at that world size, with the launch's output.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import pytest

from tests.distributed.launcher import MATRIX, launch

SHM_BUFFERS = "deepspeed_allreduce_buffer_*"
# In this order in each launch: the eager runs first; test_compile's compiled ones leave dynamo's
# caches in the process, and context parallelism its Ulysses attention, so those come late; W&B's
# offline writer last.
SHARED_MODULES = ("test_zero", "test_resume", "test_faults", "test_layouts", "test_resume_layouts", "test_export",
                  "test_export_stream", "test_lora", "test_sft", "test_experts", "test_compile", "test_hpz",
                  "test_context_parallel", "test_metric_sinks", "test_restarts", "test_export_experts_stream",
                  "test_nothing_lost")
NEEDS = {"test_compile": ("test_zero",),  # test_compile's eager baselines are test_zero's runs
         "test_nothing_lost": ("test_faults",),  # its undisturbed run is faults-common
         "test_sequence_parallel": ("test_architectures",)}  # its runs with sequence parallelism on


def shared_specs(ranks: int, root: Path, modules: set[str]) -> list[str]:
    """The specs at world `ranks` of those of SHARED_MODULES in `modules`, in SHARED_MODULES' order."""
    modules = modules | {need for module in modules for need in NEEDS.get(module, ())}
    specs = [spec for module in SHARED_MODULES if module in modules
             for spec in importlib.import_module(f"tests.distributed.{module}").shared_specs(ranks, root)]
    names = [spec.split("|", 1)[0] for spec in specs]
    assert len(set(names)) == len(names), f"run names shared by two specs: {sorted(names)}"
    return specs


def selected_modules(request) -> set[str]:
    return {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items}


@pytest.fixture(scope="session")
def shared_runs(request, tmp_path_factory) -> Callable[[int], tuple[Path, str, set[Path]]]:
    """ranks -> (root of the runs, the launch's stdout, /dev/shm buffers it left), launched on first
    use, with the runs of the modules this session has tests of (`pytest tests/distributed/test_zero.py`
    trains test_zero's alone)."""
    selected = selected_modules(request)
    done: dict[int, tuple[Path, str, set[Path]]] = {}

    def at(ranks: int) -> tuple[Path, str, set[Path]]:
        if ranks not in done:
            root = tmp_path_factory.mktemp(f"shared{ranks}")
            before = set(Path("/dev/shm").glob(SHM_BUFFERS))
            specs = shared_specs(ranks, root, selected)
            proc = launch([str(MATRIX), str(root), *specs], num_ranks=ranks, timeout=2400)
            done[ranks] = root, proc.stdout, set(Path("/dev/shm").glob(SHM_BUFFERS)) - before
        return done[ranks]

    return at


# workers/architectures.py at world 4 (each run's engine logits and held parameters written too)
ENGINE_MODULES = ("test_architectures", "test_experts", "test_sequence_parallel")
ENGINES = Path(__file__).parent / "workers" / "architectures.py"


@pytest.fixture(scope="session")
def engine_runs(request, tmp_path_factory) -> Path:
    """The root of one 4-rank launch of workers/architectures.py with the runs of ENGINE_MODULES
    selected this session (each module's `engine_specs(root)`, which writes its model configs under
    root); the launch's stdout is root / "stdout.txt"."""
    selected = selected_modules(request)
    root = tmp_path_factory.mktemp("engines")
    specs = [spec for module in ENGINE_MODULES if module in selected
             for spec in importlib.import_module(f"tests.distributed.{module}").engine_specs(root)]
    proc = launch([str(ENGINES), str(root), *specs], num_ranks=4, timeout=1500)
    (root / "stdout.txt").write_text(proc.stdout)
    return root
