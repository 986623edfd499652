"""Fixtures shared by both test tiers."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls in this process: one thread, like each rank of a distributed test (and immune
    to thread contention on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the one world-8 run (about a minute here); deselect with -m 'not slow'")
