"""checkpoint.writer: the run-config field, the DeepSpeed JSON it writes (accepted by DeepSpeed's own
DeepSpeedConfig) and checkpoint.DecoupledWriter, dsf's adapter over DeepSpeed's decoupled engine.

The writer itself runs in tests/distributed/test_faults.py (a crash while it writes, then an exact
resume from what it wrote); here, what needs no process.
"""
from __future__ import annotations

import deepspeed  # noqa: F401 - imported before anything swaps sys.stdout: its logger binds the real one
import pytest
import torch

from dsframework.checkpoints.checkpoint import DecoupledWriter
from dsframework.config import build_run_config
from dsframework.dsconfig import DECOUPLED_WRITER, build_ds_config, validate_ds_config
from dsframework.errors import UserError


def test_sync_is_the_default_and_writes_no_writer_section():
    run = build_run_config({})
    assert run.checkpoint.writer == "sync"
    assert "checkpoint" not in build_ds_config(run.train, run.parallel, dp_size=2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("load_universal", [False, True])
def test_decoupled_writes_deepspeeds_writer_section_and_deepspeed_accepts_it(stage, load_universal):
    run = build_run_config({"checkpoint": {"writer": "decoupled"}, "parallel": {"zero_stage": stage},
                            "train": {"micro_batch": 2, "grad_accum": 1}})
    ds = build_ds_config(run.train, run.parallel, dp_size=2, load_universal=load_universal,
                         checkpoint_writer=run.checkpoint.writer)
    assert ds["checkpoint"]["writer"] == DECOUPLED_WRITER
    assert ds["checkpoint"].get("load_universal", False) == load_universal  # both keys, neither lost
    validate_ds_config(ds, dp_size=2)
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(ds, mpu=_DataParallel(2)).checkpoint_config["writer"]
    assert (parsed["type"], parsed["decoupled"], parsed["data_parallel"]) == ("PYTHON", True, "MACHINE")


class _DataParallel:
    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.mark.parametrize("value", ["async", "Decoupled", 1])
def test_a_writer_dsf_does_not_know_is_one_line_naming_field_value_and_choices(value):
    with pytest.raises(UserError) as err:
        build_run_config({"checkpoint": {"writer": value}})
    message = str(err.value)
    assert message.startswith(f"checkpoint.writer={value!r}" if isinstance(value, str) else "checkpoint.writer=1")
    assert "'sync' or 'decoupled'" in message and "\n" not in message


class _Engine:
    """What DecoupledWriter wraps: records what DeepSpeed's engine would be given."""

    def __init__(self) -> None:
        self.saved: list = []
        self.commit_info = "info"

    def save(self, state_dict, path):
        self.saved.append((state_dict, path))

    def commit(self, info):
        return info == "info"

    def is_decoupled(self):
        return True

    def get_commit_info(self):
        return self.commit_info


def test_the_writer_gets_tensors_off_the_autograd_graph_sharing_their_storage():
    """ZeRO-1/2's state_dict holds slices of requires-grad fp32 partitions: torch's process pickler
    refuses them ("Cowardly refusing to serialize non-leaf tensor which requires_grad")."""
    partition = torch.arange(6.0, requires_grad=True)
    state = {"single_partition_of_fp32_groups": [partition[:4]], "step": 3, "nested": ({"t": partition},)}
    inner = _Engine()
    DecoupledWriter(inner).save(state, "/ckpt/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (sent, path), = inner.saved
    assert path.endswith("optim_states.pt") and sent["step"] == 3
    for tensor in (sent["single_partition_of_fp32_groups"][0], sent["nested"][0]["t"]):
        assert not tensor.requires_grad and tensor.grad_fn is None
        assert tensor.untyped_storage().data_ptr() == partition.untyped_storage().data_ptr()  # no copy
    assert state["single_partition_of_fp32_groups"][0].grad_fn is not None  # the caller's dict is unchanged


def test_the_writer_counts_the_seconds_waited_in_commit_and_delegates_the_rest(monkeypatch):
    inner = _Engine()
    writer = DecoupledWriter(inner)
    clock = iter([10.0, 12.5, 20.0, 20.25])
    monkeypatch.setattr("dsframework.checkpoints.checkpoint.time.perf_counter", lambda: next(clock))
    assert writer.commit("info") and writer.commit("info")
    assert writer.take_waited() == pytest.approx(2.75)
    assert writer.take_waited() == 0.0
    assert writer.is_decoupled() and writer.get_commit_info() == "info"  # DeepSpeed's engine, unchanged


def test_the_writer_loads_deepspeeds_own_files(tmp_path):
    """DeepSpeed's files hold more than tensors; the decoupled engine's plain torch.load refuses them
    under torch's weights_only default ("Weights only load failed"); the sync engine's load reads them."""
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "ds_config": _Opaque()}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path)
    loaded = DecoupledWriter(_Engine()).load(str(path))
    assert torch.equal(loaded["module"]["w"], torch.ones(2)) and isinstance(loaded["ds_config"], _Opaque)


class _Opaque:
    """An object of a class torch's weights-only unpickler does not know."""


def test_the_writer_is_started_with_sigterm_ignored_and_the_trainers_handler_comes_back():
    """A spawned process keeps an ignored SIGTERM across exec: the job's SIGTERM (a preemption) then
    leaves the writer alive for the checkpoint the trainer saves on it. Without it that save fails
    with "Cannot commit checkpoint: checkpoint process is not running" (seen with a real SIGTERM)."""
    import signal

    from dsframework.checkpoints.checkpoint import writer_spared_by_sigterm

    def handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with writer_spared_by_sigterm(True):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is handler
        with writer_spared_by_sigterm(False):  # the sync writer: nothing changes
            assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
