"""What a GPU needs and CPU ranks never show, each handled and checked here (issue 31): the Adam a
run asks DeepSpeed for needs no JIT build it cannot do, and one that cannot be built is one line
before the rendezvous; a rank whose LOCAL_RANK names a device CUDA_VISIBLE_DEVICES hides is one
line; the hang watch times steps with device events; the decoupled writer gets host tensors and a
/dev/shm too small for its snapshots is one line before the first save."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsframework.checkpoints.checkpoint import DecoupledWriter, check_shm_for_snapshot, snapshot_bytes
from dsframework.config import build_run_config
from dsframework.dsconfig import build_ds_config, validate_ds_config
from dsframework.errors import UserError
from dsframework.jit import STALE_LOCK_S, adam_choice, clear_stale_build_locks
from dsframework.train.hang import StepTimer
from dsframework.train.world import local_device
from tests.device_discipline import CUDA, simulated_gpu_rank


# --- the optimizer ------------------------------------------------------------------------------

def test_the_adam_each_device_uses():
    no_build = adam_choice("cuda", offload=False, installed={"fused_adam": False})
    assert no_build.torch_adam and no_build.op is None and "torch AdamW (fused)" == no_build.name
    prebuilt = adam_choice("cuda", offload=False, installed={"fused_adam": True})
    assert not prebuilt.torch_adam and prebuilt.op == "FusedAdamBuilder"
    assert adam_choice("cuda", offload=True, installed={}).op == "CPUAdamBuilder"  # ZeRO-Offload takes no other
    cpu = adam_choice("cpu", offload=False)
    assert not cpu.torch_adam and cpu.op == "FusedAdamBuilder"  # the suite's losses: unchanged


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_adam_json_is_accepted_and_makes_torchs_fused_adamw(stage, precision):
    from deepspeed.runtime.engine import DeepSpeedEngine

    run = build_run_config({"parallel": {"zero_stage": stage}, "train": {"precision": precision}})
    ds = build_ds_config(run.train, run.parallel, dp_size=2, torch_adam=True)
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True
    validate_ds_config(ds, dp_size=2)
    # what DeepSpeed's engine then builds: torch's AdamW with the JSON's remaining params
    params = {k: v for k, v in ds["optimizer"]["params"].items()}
    optimizer_class, extra = DeepSpeedEngine.get_optimizer_configuration(object(), params, True)
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = optimizer_class([weight], **params, **extra)
    weight.grad = torch.ones(4)
    optimizer.step()
    assert optimizer_class is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert torch.all(weight < 1)


@pytest.mark.distributed  # a process of its own (the fast tier starts none)
def test_an_optimizer_op_that_cannot_be_built_is_one_line(tmp_path):
    """DeepSpeed's CPU Adam (ZeRO-Offload's) JIT-built with no compiler: one line naming the field
    and the fix, no traceback (in a process of its own: a loaded op stays loaded in a process)."""
    code = ("from dsframework.jit import adam_choice, load_adam_op\n"
            "load_adam_op(adam_choice('cpu', offload=True), field='parallel.offload_optimizer', value='cpu')\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": str(tmp_path / "no-compiler")}
    proc = subprocess.run([sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "UserError" in last, proc.stderr[-2000:]
    assert "parallel.offload_optimizer='cpu': needs DeepSpeed CPU Adam" in last and "could not be built" in last
    assert "apt-get install g++" in last and "DS_BUILD_CPU_ADAM=1" in last


def test_a_build_lock_a_killed_build_left_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """torch waits for an op's `lock` to go away; one a killed build left (older than any build
    takes) would make every later run wait forever: it goes, with a line; a fresh one stays."""
    stale, fresh = tmp_path / "fused_adam" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    now = fresh.stat().st_mtime
    os.utime(stale, (now - STALE_LOCK_S - 1, now - STALE_LOCK_S - 1))
    assert clear_stale_build_locks(tmp_path, now=now) == [stale]
    assert not stale.exists() and fresh.exists()
    assert f"dsf: removed {stale}" in capsys.readouterr().err
    assert clear_stale_build_locks(tmp_path, now=now) == []


# --- the rank's device ----------------------------------------------------------------------------

def test_a_rank_the_visible_devices_do_not_cover_is_one_line(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError) as info:
        local_device(2)
    line = str(info.value)
    assert line.startswith("LOCAL_RANK=3: names a device this rank cannot see: 2 visible (CUDA_VISIBLE_DEVICES=0,1)")
    assert "--num_gpus" in line and "\n" not in line
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_device(2) == 1


# --- the hang watch's clock ---------------------------------------------------------------------

class _Event:
    """A CUDA event's interface: recorded at a time, complete once the device got there."""

    now, reached = 0.0, 0.0

    def __init__(self) -> None:
        self.at = _Event.now

    def query(self) -> bool:
        return self.at <= _Event.reached

    def elapsed_time(self, end: "_Event") -> float:
        return (end.at - self.at) * 1000.0


def test_step_times_are_the_devices_read_without_waiting():
    timer = StepTimer(_Event)
    times = []
    for step in range(3):  # the host queues each step in no time; the device runs each in 2 s
        _Event.now = 2.0 * step
        timer.start()
        _Event.now = 2.0 * (step + 1)
        _Event.reached = 2.0 * step  # the device is a step behind the host
        times.append(timer.stop())
    assert times[0] == [] and times[1] == [2.0] and times[2] == [2.0]
    _Event.reached = 100.0
    timer.start()
    assert timer.stop() == [2.0, 0.0]  # the last queued step, then one the device finished at once
    assert StepTimer.for_device("cpu").event is None  # the host's clock is the device's


# --- the decoupled writer -------------------------------------------------------------------------

class _Inner:
    def __init__(self) -> None:
        self.saved = None

    def save(self, state_dict, path):
        self.saved = state_dict


def test_the_decoupled_writer_is_handed_host_tensors():
    with simulated_gpu_rank() as rank:
        inner = _Inner()
        DecoupledWriter(inner).save({"module": {"w": torch.ones(4, device=CUDA)}, "step": 3}, "x.pt")
        assert inner.saved["module"]["w"].device.type == "cpu" and inner.saved["step"] == 3
        assert rank.syncs == ["copy to the host"]  # the snapshot, copied once


def test_a_shm_too_small_for_the_snapshots_is_one_line(tmp_path):
    module = torch.nn.Linear(64, 64)
    snapshot = snapshot_bytes(module, zero_ranks=2)
    assert snapshot == 4 * (64 * 64 + 64) + 12 * (64 * 64 + 64) // 2
    check_shm_for_snapshot(snapshot, ranks_per_node=2, shm=tmp_path)  # a few KB: fits
    stat = os.statvfs(tmp_path)
    with pytest.raises(UserError) as info:
        check_shm_for_snapshot(stat.f_bavail * stat.f_frsize, ranks_per_node=2, shm=tmp_path)
    line = str(info.value)
    assert line.startswith("checkpoint.writer='decoupled': needs about") and f"of {tmp_path} per save (2 ranks x" in line
    assert "checkpoint.writer=sync" in line and "--shm-size=" in line and "\n" not in line
