"""Fixtures and markers shared by both test tiers.

    pytest -m "not distributed" tests     # the fast tier: in-process tests only (a few minutes)
    pytest tests                          # the full suite (CI): also every launched rank and `dsf` process

A test that starts a process (the `deepspeed` launcher, a `dsf` or `python` subprocess, a cluster
node) is marked `distributed`: every test under tests/distributed and tests/cluster by its path
(below), a unit test explicitly. An unmarked test that starts one fails, naming the command.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

# Every `dsf plan` of the suite counts its model afresh, in-process or launched, and writes nothing to
# ~/.cache (planner/desc_cache.py's own tests turn it on in a temporary directory).
os.environ["DSF_PLAN_CACHE"] = "off"

PROCESS_DIRS = ("distributed", "cluster")  # tests/<dir>: every test there launches ranks or nodes
# Programs an unmarked test may not start: Python (and so `dsf`, the launchers, a worker) and the
# shells and launchers that start it. Libraries' own probes (`file`, `uname`, a compiler) are no test's.
REFUSED = {"dsf", "deepspeed", "torchrun", "bash", "sh", "pdsh", "ssh", "mpirun", "srun", "sbatch", "salloc"}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls in this process: one thread, like each rank of a distributed test (and immune
    to thread contention on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    if getattr(config.option, "durations", None) is None:
        config.option.durations = 30  # every run (CI's too) ends with its 30 slowest: where the time went
    config.addinivalue_line("markers", "slow: the one world-8 run (about a minute here); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "distributed: starts processes (launched ranks, a `dsf` or `python` "
                                       "subprocess, cluster nodes); the fast tier is -m 'not distributed'")


def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).parent
    for item in items:
        parts = Path(item.fspath).relative_to(tests_dir).parts
        if parts[0] in PROCESS_DIRS:
            item.add_marker(pytest.mark.distributed)


@contextlib.contextmanager
def _processes_refused(item):
    """Inside an unmarked test (its fixtures included), starting a subprocess fails the test: the
    fast tier stays in-process, and a test that needs a process says so with its marker."""
    if item.get_closest_marker("distributed"):
        yield
        return
    real = subprocess.Popen._execute_child

    def refuse(self, args, executable, *rest):
        shown = str(args) if isinstance(args, (str, bytes, os.PathLike)) else " ".join(map(str, args))
        program = Path(str(executable or shown.split()[0])).name
        if program in REFUSED or program.startswith("python"):
            raise AssertionError(f"{item.nodeid} starts a process ({shown[:200]}); mark it @pytest.mark.distributed, "
                                 "or keep it in this process (the fast tier has no processes)")
        return real(self, args, executable, *rest)

    subprocess.Popen._execute_child = refuse
    try:
        yield
    finally:
        subprocess.Popen._execute_child = real


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _processes_refused(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _processes_refused(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with _processes_refused(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test leaves the process's SIGTERM and SIGINT handlers as it found them. A handler an
    in-process test installs (dsf's stop flag, the launcher's forwarding) would outlive it, and a
    later test's fork (datasets' worker pool) would inherit it: Pool.terminate's SIGTERM then no
    longer ends a worker and the test waits forever (seen: test_examples under a loaded machine)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)
