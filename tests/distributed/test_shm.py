"""A run leaves no DeepSpeed shm all-reduce buffers behind in /dev/shm (69 MB per rank and job,
which DeepSpeed itself never removes: a busy machine ran out of memory on them)."""
from __future__ import annotations

from pathlib import Path

from tests.distributed.launcher import train_run


def test_no_shm_buffers_left_after_a_run(tmp_path):
    before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    losses = train_run(tmp_path / "run", ["train.steps=2"])
    assert len(losses) == 2
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= before
