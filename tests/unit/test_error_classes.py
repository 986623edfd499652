"""A programming error is never reported as bad user input.

    python -m pytest tests/unit/test_error_classes.py -q

`dsf` prints a `UserError` as one line and exits 2 ("your input is wrong"); any other exception is a
bug and keeps its traceback (exit 1). The two places that turn a library's exceptions into
UserErrors catch only what the library raises for bad input:

- `dsconfig.validate_ds_config`: DeepSpeedConfig's and its lr schedulers' verdicts (ValueError,
  DeepSpeedConfigError, DeepSpeedConfig's own asserts); a TypeError, KeyError, AttributeError or an
  assert from anywhere else propagates;
- `checkpoint.load`: torch.load's and DeepSpeed's errors for a damaged checkpoint; the same exception
  types raised by other code (a bug) propagate.

Each bug is injected in this process by replacing a function called inside the `try`.
"""
from __future__ import annotations

import pytest
import torch

from dsframework.checkpoints import checkpoint

from dsframework import dsconfig
from dsframework.config import build_run_config
from dsframework.errors import UserError


def ds_config(dp: int = 2) -> dict:
    run = build_run_config({"train": {"micro_batch": 2, "grad_accum": 2}})
    return dsconfig.build_ds_config(run.train, run.parallel, dp_size=dp)


# --- validate_ds_config ----------------------------------------------------------------------------

def test_deepspeeds_own_verdicts_stay_user_errors():
    """Real DeepSpeed: its batch assert (in DeepSpeedConfig) and its scheduler's ValueError."""
    with pytest.raises(UserError, match=r"rejected by DeepSpeedConfig at dp=4: Check batch related parameters"):
        dsconfig.validate_ds_config(ds_config(dp=2), dp_size=4)  # 2 * 2 * 4 != 8
    ds = ds_config()
    ds["scheduler"]["params"]["warmup_num_steps"] = 0
    with pytest.raises(UserError, match="warmup_num_steps must be a positive integer"):
        dsconfig.validate_ds_config(ds, dp_size=2)
    ds = ds_config()
    ds["zero_optimization"]["stage"] = "two"  # a value DeepSpeed's pydantic model refuses (ValidationError)
    with pytest.raises(UserError, match="zero_optimization|stage"):
        dsconfig.validate_ds_config(ds, dp_size=2)


def _raise(exc: BaseException):
    def broken(*args, **kwargs):
        raise exc
    return broken


@pytest.mark.parametrize("bug", [TypeError("bug: unexpected keyword"), KeyError("bug"),
                                 AttributeError("bug: no such attribute"), AssertionError("bug: our invariant")])
def test_a_bug_inside_deepspeed_config_validation_propagates(monkeypatch, bug):
    from deepspeed.runtime import config as ds_runtime_config

    monkeypatch.setattr(dsconfig, "_ensure_comm", lambda: None)  # the broken DeepSpeedConfig needs no group
    monkeypatch.setattr(ds_runtime_config, "DeepSpeedConfig", _raise(bug))
    with pytest.raises(type(bug), match="bug") as caught:
        dsconfig.validate_ds_config(ds_config(), dp_size=2)
    assert not isinstance(caught.value, UserError)


@pytest.mark.parametrize("bug", [TypeError("bug: scheduler got an unexpected keyword"), KeyError("bug")])
def test_a_bug_building_the_scheduler_propagates(monkeypatch, bug):
    from deepspeed.runtime import config as ds_runtime_config
    from deepspeed.runtime import lr_schedules

    ds = ds_config()
    monkeypatch.setattr(dsconfig, "_ensure_comm", lambda: None)
    monkeypatch.setattr(ds_runtime_config, "DeepSpeedConfig", lambda *args, **kwargs: None)
    monkeypatch.setattr(lr_schedules, ds["scheduler"]["type"], _raise(bug))
    with pytest.raises(type(bug), match="bug"):
        dsconfig.validate_ds_config(ds, dp_size=2)


def test_a_config_the_json_encoder_cannot_write_is_a_bug_not_user_input():
    ds = ds_config()
    ds["optimizer"]["params"]["betas"] = {0.9, 0.95}  # a set: a bug in build_ds_config, never a user's value
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        dsconfig.validate_ds_config(ds, dp_size=2)


def test_dsf_config_lets_a_bug_through_instead_of_exit_2(monkeypatch):
    """The command line: a KeyError inside the validation leaves `_run_command` as a KeyError (main()
    prints its traceback, exit 1), not as `dsf: error: ...` and exit 2."""
    from deepspeed.runtime import config as ds_runtime_config

    from dsframework.commands import cli

    monkeypatch.setattr(dsconfig, "_ensure_comm", lambda: None)
    monkeypatch.setattr(ds_runtime_config, "DeepSpeedConfig", _raise(KeyError("bug")))
    with pytest.raises(KeyError, match="bug"):
        cli._run_command(["config", "--zero-stage", "2", "--micro-batch", "2", "--grad-accum", "1"])


# --- checkpoint.load -------------------------------------------------------------------------------

class Loader:
    """The two things checkpoint.load asks of an engine besides loading: its module and rank.
    `load_checkpoint` reads the model file the way DeepSpeed's TorchCheckpointEngine does."""

    def __init__(self, read=None):
        self.module, self.global_rank = torch.nn.Linear(2, 2), 0
        self._read = read

    def load_checkpoint(self, load_dir, *, tag, load_module_strict=True):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        if self._read is not None:
            return self._read(load_dir, tag)
        state = TorchCheckpointEngine().load(f"{load_dir}/{tag}/mp_rank_00_model_states.pt")
        return f"{load_dir}/{tag}", state


def write_model_file(tmp_path, damage: str):
    """A checkpoint whose model file is whole, truncated, emptied or overwritten with garbage."""
    tag_dir = tmp_path / "global_step2"
    tag_dir.mkdir()
    path = tag_dir / "mp_rank_00_model_states.pt"
    torch.save({"module": torch.nn.Linear(2, 2).state_dict(), "dsf": {"step": 2, "consumed_samples": 8}}, path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(bytes(range(256)) * (len(data) // 256 + 1))
    return path


def test_a_whole_checkpoint_loads(tmp_path):
    write_model_file(tmp_path, "none")
    assert checkpoint.load(Loader(), tmp_path, tag="global_step2") == {"step": 2, "consumed_samples": 8}


@pytest.mark.parametrize("damage,error", [("truncated", "RuntimeError"), ("empty", "EOFError"),
                                          ("garbage", "UnpicklingError")])
def test_a_damaged_checkpoint_file_is_one_user_error_line(tmp_path, damage, error):
    write_model_file(tmp_path, damage)
    with pytest.raises(UserError) as caught:
        checkpoint.load(Loader(), tmp_path, tag="global_step2")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"checkpoint='{tmp_path / 'global_step2'}': could not be loaded")
    assert f"({error}: " in line and "resume from an earlier tag" in line


def test_a_missing_checkpoint_file_is_a_user_error(tmp_path):
    (tmp_path / "global_step2").mkdir()
    with pytest.raises(UserError, match=r"could not be loaded \(FileNotFoundError: "):
        checkpoint.load(Loader(), tmp_path, tag="global_step2")


@pytest.mark.parametrize("bug", [KeyError("module"), RuntimeError("bug: shapes"), AssertionError("bug"),
                                 ValueError("bug"), OSError("bug"), TypeError("bug")])
def test_a_bug_while_loading_propagates(tmp_path, bug):
    """The same exception types as a damaged file, raised by code other than torch's or DeepSpeed's."""
    write_model_file(tmp_path, "none")
    with pytest.raises(type(bug)) as caught:
        checkpoint.load(Loader(read=_raise(bug)), tmp_path, tag="global_step2")
    assert not isinstance(caught.value, UserError)
