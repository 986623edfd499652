"""The DeepSpeed JSON generator: batch triple, every stage x offload x precision accepted by
DeepSpeed's own DeepSpeedConfig at dp 1, 2 and 8, and ds_configs/ in sync with `dsf config`."""
from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path

import deepspeed  # noqa: F401 - imported before CliRunner swaps sys.stdout: its logger binds the real one
import pytest
from click.testing import CliRunner

from dsframework.commands.cli import cli
from dsframework.config import build_run_config
from dsframework.dsconfig import build_ds_config, resolve_batch, validate_ds_config
from dsframework.errors import UserError

REPO = Path(__file__).resolve().parents[2]
PRESET_DIR = REPO / "ds_configs"


# --- batch triple --------------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2, 4, 8])
@pytest.mark.parametrize("micro,accum", [(1, 1), (2, 1), (1, 4), (4, 2)])
def test_any_two_of_the_triple_give_the_third(dp, micro, accum):
    total = micro * accum * dp
    for given in [(micro, accum, None), (micro, None, total), (None, accum, total), (micro, accum, total)]:
        batch = resolve_batch(*given, dp_size=dp)
        assert (batch.micro_batch, batch.grad_accum, batch.global_batch) == (micro, accum, total), given


def test_global_batch_alone_uses_no_accumulation():
    batch = resolve_batch(None, None, 32, dp_size=4)
    assert (batch.micro_batch, batch.grad_accum) == (8, 1)


@pytest.mark.parametrize("given", [(4, 2, 7), (4, None, 6), (None, 3, 8), (4, 2, 32)])
def test_inconsistent_or_indivisible_triple_is_a_user_error(given):
    with pytest.raises(UserError, match="train.global_batch"):
        resolve_batch(*given, dp_size=2)


# --- every combination passes DeepSpeed's own validation -------------------------------------------

def _valid_combinations():
    for stage, opt, param, precision in itertools.product(
            [0, 1, 2, 3], ["none", "cpu", "nvme"], ["none", "cpu", "nvme"], ["fp32", "fp16", "bf16"]):
        if (param != "none" and stage != 3) or (opt != "none" and stage == 0):
            continue
        yield stage, opt, param, precision


COMBINATIONS = list(_valid_combinations())


def test_the_rules_leave_the_expected_combinations():
    # stage 0: 1 x 1; stages 1, 2: 3 x 1; stage 3: 3 x 3 — times 3 precisions.
    assert len(COMBINATIONS) == (1 + 3 + 3 + 9) * 3


@pytest.mark.parametrize("stage,opt,param,precision", COMBINATIONS)
def test_every_combination_passes_deepspeed_config(stage, opt, param, precision):
    run = build_run_config({"train": {"micro_batch": 2, "grad_accum": 2, "precision": precision},
                            "parallel": {"zero_stage": stage, "offload_optimizer": opt, "offload_param": param}})
    for dp in (1, 2, 8):
        ds = build_ds_config(run.train, run.parallel, dp_size=dp)
        assert ds["train_batch_size"] == 2 * 2 * dp
        assert ds["zero_optimization"]["stage"] == stage
        assert ("offload_optimizer" in ds["zero_optimization"]) == (opt != "none")
        assert ("offload_param" in ds["zero_optimization"]) == (param != "none")
        assert ds.get("bf16", {}).get("enabled", False) == (precision == "bf16")
        assert ds.get("fp16", {}).get("enabled", False) == (precision == "fp16")
        # bf16 accumulates gradients in fp32 where DeepSpeed takes it (ZeRO 1-3; stage 0 refuses it)
        fp32_accum = precision == "bf16" and stage >= 1
        assert ds.get("data_types") == ({"grad_accum_dtype": "fp32"} if fp32_accum else None)
        validate_ds_config(ds, dp_size=dp)


def test_deepspeed_rejects_what_it_should():
    """The validator is real: a hand-broken batch triple and a bad scheduler are refused."""
    run = build_run_config({"train": {"micro_batch": 2, "grad_accum": 2}})
    ds = build_ds_config(run.train, run.parallel, dp_size=2)
    with pytest.raises(UserError, match="DeepSpeedConfig"):
        validate_ds_config(ds, dp_size=4)  # 2 * 2 * 4 != 8
    ds["scheduler"]["params"]["warmup_num_steps"] = 0
    with pytest.raises(UserError, match="warmup_num_steps"):
        validate_ds_config(ds, dp_size=2)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 5])
def test_schedules_instantiate_and_reach_peak_lr(schedule, warmup):
    import torch
    from deepspeed.runtime import lr_schedules

    run = build_run_config({"train": {"steps": 50, "warmup_steps": warmup, "lr": 0.01,
                                      "lr_schedule": schedule}})
    section = build_ds_config(run.train, run.parallel, dp_size=1)["scheduler"]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    sched = getattr(lr_schedules, section["type"])(opt, **section["params"])
    lrs = []
    for _ in range(50):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    # DeepSpeed's cosine starts decaying on the step after warmup, so the peak is approached.
    assert 0.0099 <= max(lrs) <= 0.01 * (1 + 1e-9)
    if warmup:
        assert lrs[0] < 0.01 * 0.5, "warmup starts low"
    if warmup == 0:
        assert lrs[0] == pytest.approx(0.01, rel=1e-6), "no warmup starts at the peak"
    if schedule == "cosine":
        assert lrs[-1] == pytest.approx(0.01 * run.train.min_lr_ratio, rel=1e-2)


# --- the CLI and the presets ----------------------------------------------------------------------

def _invoke(args):
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_cli_output_is_pure_json_that_matches_the_library():
    text = _invoke(["config", "--zero-stage", "3", "--world-size", "4", "--global-batch", "32",
                    "--micro-batch", "2", "--precision", "bf16"])
    ds = json.loads(text)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (32, 2, 4)
    run = build_run_config({"train": {"global_batch": 32, "micro_batch": 2, "precision": "bf16"},
                            "parallel": {"zero_stage": 3}})
    assert ds == build_ds_config(run.train, run.parallel, dp_size=4)


def test_portable_json_leaves_train_batch_size_to_deepspeed():
    ds = json.loads(_invoke(["config", "--zero-stage", "2", "--micro-batch", "4", "--grad-accum", "2"]))
    assert "train_batch_size" not in ds
    for dp in (1, 2, 8):
        validate_ds_config(ds, dp_size=dp)


def test_pipeline_json_has_its_section_and_the_batch_of_the_data_parallel_ranks():
    """world 8 = tp 2 x pp 2 x dp 2: the batch triple counts the 2 data-parallel ranks only."""
    ds = json.loads(_invoke(["config", "--tp", "2", "--pp", "2", "--world-size", "8", "--zero-stage", "1",
                             "--micro-batch", "2", "--global-batch", "64"]))
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 2, 16)
    assert ds["pipeline"]["stages"] == 2 and ds["pipeline"]["partition"] == "parameters"
    assert ds["zero_optimization"]["overlap_comm"] is False
    validate_ds_config(ds, dp_size=2)
    assert "pipeline" not in json.loads(_invoke(["config", "--tp", "2", "--micro-batch", "2", "--grad-accum", "1"]))


def _preset_commands():
    for line in (PRESET_DIR / "regenerate.sh").read_text().splitlines():
        if line.startswith("dsf config "):
            args = shlex.split(line)[1:]
            out = args[args.index("-o") + 1]
            yield out, [a for i, a in enumerate(args) if a not in ("-o", "--force") and args[i - 1] != "-o"]


PRESETS = list(_preset_commands())


def test_every_preset_file_has_a_command_and_every_family_is_there():
    files = sorted(p.name for p in PRESET_DIR.glob("*.json"))
    assert files == sorted(out for out, _ in PRESETS)
    for family in ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]:
        for precision in ["fp32", "bf16"]:
            assert f"{family}_{precision}.json" in files
    assert {"pp2_zero1_bf16.json", "tp2_pp2_dp2_zero1_bf16.json"} <= set(files), "pipeline and 3D presets"


@pytest.mark.parametrize("out,args", PRESETS, ids=[out for out, _ in PRESETS])
def test_preset_matches_the_command(out, args):
    assert (PRESET_DIR / out).read_text() == _invoke(args), (
        f"ds_configs/{out} drifted from `dsf {' '.join(args)}`; run ds_configs/regenerate.sh")


def test_context_parallel_and_hpz_json_carry_their_keys_and_pass_deepspeed_config():
    """world 8 = cp 2 x dp 4, ZeRO-3 with hpZ groups of 4: the batch counts the 4 replicas; DeepSpeed
    reads sequence_parallel_size and zero_hpz_partition_size."""
    ds = json.loads(_invoke(["config", "--cp", "2", "--zero-stage", "3", "--zero-hpz", "4", "--world-size", "8",
                             "--micro-batch", "1", "--global-batch", "16"]))
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (16, 4)
    assert ds["sequence_parallel_size"] == 2 and ds["zero_optimization"]["zero_hpz_partition_size"] == 4
    validate_ds_config(ds, dp_size=4)
    plain = json.loads(_invoke(["config", "--zero-stage", "3", "--micro-batch", "1", "--grad-accum", "1"]))
    assert "sequence_parallel_size" not in plain and "zero_hpz_partition_size" not in plain["zero_optimization"]


@pytest.mark.parametrize("args,match", [
    (["--cp", "2", "--pp", "2"], "--cp=2: does not compose with parallel.pp=2"),
    (["--zero-hpz", "2", "--zero-stage", "1"], "--zero-hpz=2: needs zero_stage=3"),
    (["--zero-hpz", "4", "--zero-stage", "3", "--world-size", "6"], "--zero-hpz=4: does not divide the 6 ranks"),
])
def test_cli_refuses_axes_that_do_not_compose(args, match):
    with pytest.raises(UserError, match=re.escape(match)):  # `dsf` prints it as one line, exit 2
        CliRunner().invoke(cli, ["config", "--micro-batch", "1", "--grad-accum", "1", *args], catch_exceptions=False)
