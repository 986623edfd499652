"""Launches that several test modules read, each started once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launcher import MATRIX, launch

SHM_BUFFERS = "deepspeed_allreduce_buffer_*"


@pytest.fixture(scope="session")
def zero_and_compile_runs(tmp_path_factory) -> tuple[Path, str, set[Path]]:
    """test_zero.py's layouts and test_compile.py's compiled runs (whose eager baselines at ZeRO 0, 2
    and 3 are test_zero's runs: the same run config) in one 2-rank launch of workers/train_matrix.py,
    one start instead of two: (root of the runs, the launch's stdout, /dev/shm buffers it left)."""
    from tests.distributed.test_compile import compile_specs
    from tests.distributed.test_zero import zero_specs

    root = tmp_path_factory.mktemp("zero_compile")
    shm_before = set(Path("/dev/shm").glob(SHM_BUFFERS))
    proc = launch([str(MATRIX), str(root), *zero_specs(), *compile_specs()], num_ranks=2, timeout=1500)
    return root, proc.stdout, set(Path("/dev/shm").glob(SHM_BUFFERS)) - shm_before
