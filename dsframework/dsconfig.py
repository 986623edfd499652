"""Run config -> DeepSpeed JSON, checked by deepspeed's own `DeepSpeedConfig`.

    from dsframework.config import build_run_config
    run = build_run_config({}, ["parallel.zero_stage=2", "train.global_batch=32", "train.micro_batch=4"])
    ds = build_ds_config(run.train, run.parallel, dp_size=8)   # grad_accum derived: 32 / (4 * 8) = 1
    validate_ds_config(ds, dp_size=8)                          # raises UserError if DeepSpeed objects

`dsf config` and `dsf train` both go through `build_ds_config`, so the JSON a user generates is the
JSON training uses.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from dsframework.config import ParallelSpec, TrainSpec
from dsframework.errors import UserError, raised_in
from dsframework.jit import pin_build_tools, release_shm_buffers
from dsframework.ports import free_port
from dsframework.runtime_facts import Knobs, grad_accum_dtype

# Large enough that DeepSpeed never prints its own per-step line; dsf logs progress itself.
_STEPS_PER_PRINT = 1_000_000_000


@dataclass(frozen=True)
class Batch:
    """The batch triple; global_batch = micro_batch * grad_accum * dp_size always holds."""

    micro_batch: int
    grad_accum: int
    global_batch: int
    dp_size: int


def resolve_batch(micro_batch: int | None, grad_accum: int | None, global_batch: int | None,
                  *, dp_size: int) -> Batch:
    """Fill in the batch triple from any two of its values (or fewer, with 1s) and dp_size.

    resolve_batch(4, None, 32, dp_size=4)  -> Batch(4, 2, 32, 4)
    resolve_batch(4, 2, 16, dp_size=4)     -> UserError: 4 * 2 * 4 = 32 != 16
    """
    if dp_size < 1:
        raise UserError("data-parallel size", dp_size, "must be >= 1", "use at least one rank")
    if global_batch is None:
        micro, accum = micro_batch or 1, grad_accum or 1
        return Batch(micro, accum, micro * accum * dp_size, dp_size)
    if micro_batch is not None and grad_accum is not None:
        if micro_batch * grad_accum * dp_size != global_batch:
            raise UserError("train.global_batch", global_batch,
                            f"!= micro_batch * grad_accum * dp = {micro_batch} * {grad_accum} * "
                            f"{dp_size} = {micro_batch * grad_accum * dp_size}",
                            "give only two of micro_batch, grad_accum, global_batch")
        return Batch(micro_batch, grad_accum, global_batch, dp_size)
    fixed_name, fixed = ("micro_batch", micro_batch) if micro_batch is not None else (
        ("grad_accum", grad_accum) if grad_accum is not None else ("grad_accum", 1))
    per_step = fixed * dp_size
    if global_batch % per_step:
        raise UserError("train.global_batch", global_batch,
                        f"is not divisible by {fixed_name} * dp = {fixed} * {dp_size} = {per_step}",
                        f"choose a global batch that is a multiple of {per_step}")
    other = global_batch // per_step
    if fixed_name == "micro_batch":
        return Batch(fixed, other, global_batch, dp_size)
    return Batch(other, fixed, global_batch, dp_size)


def _optimizer_section(train: TrainSpec, *, torch_adam: bool = False) -> dict[str, Any]:
    """DeepSpeed's Adam, or with `torch_adam` torch's fused AdamW (jit.adam_choice: on a GPU whose
    DeepSpeed did not build FusedAdam at install, whose JIT build needs nvcc)."""
    params: dict[str, Any] = {"lr": train.lr, "betas": list(train.betas), "eps": train.eps,
                              "weight_decay": train.weight_decay}
    if torch_adam:
        params.update(torch_adam=True, fused=True)
    return {"type": {"adamw": "AdamW", "adam": "Adam"}[train.optimizer], "params": params}


def _scheduler_section(train: TrainSpec) -> dict[str, Any]:
    """DeepSpeed's own schedulers: WarmupCosineLR, WarmupDecayLR (linear) or WarmupLR (constant)."""
    # DeepSpeed's schedulers refuse warmup_num_steps=0: no warmup is one step already at the peak.
    no_warmup = train.warmup_steps == 0
    warmup_steps = max(1, train.warmup_steps)
    if train.lr_schedule == "cosine":
        return {"type": "WarmupCosineLR",
                "params": {"total_num_steps": train.steps, "warmup_num_steps": warmup_steps,
                           "warmup_min_ratio": 1.0 if no_warmup else 0.0,
                           "cos_min_ratio": train.min_lr_ratio, "warmup_type": "linear"}}
    common = {"warmup_min_lr": train.lr if no_warmup else 0.0, "warmup_max_lr": train.lr,
              "warmup_num_steps": warmup_steps, "warmup_type": "linear"}
    if train.lr_schedule == "linear":
        return {"type": "WarmupDecayLR", "params": {"total_num_steps": train.steps, **common}}
    return {"type": "WarmupLR", "params": common}


def _offload(device: str, nvme_path: str) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def _zero_section(parallel: ParallelSpec) -> dict[str, Any]:
    """zero_optimization: the stage, dsf's bucket / persistence / prefetch sizes (runtime_facts, or
    parallel.zero_knobs where set: the planner counts the same ones), offload, hpZ."""
    zero: dict[str, Any] = {"stage": parallel.zero_stage}
    knobs = Knobs.of(parallel.zero_knobs)  # (the defaults where a field is None: one source, runtime_facts)
    if parallel.zero_stage >= 1:
        # Overlap communication with compute, and contiguous gradients to avoid fragmentation:
        # the settings DeepSpeed's own tutorials recommend for stages 1-3.
        zero.update(overlap_comm=True, contiguous_gradients=True,
                    reduce_bucket_size=knobs.reduce_bucket, allgather_bucket_size=knobs.allgather_bucket)
    if parallel.zero_stage >= 1 and parallel.pp > 1:
        zero["overlap_comm"] = False  # the pipeline engine turns it off anyway, with a warning
    if parallel.zero_stage == 3:
        zero.pop("allgather_bucket_size")
        zero.update(stage3_prefetch_bucket_size=knobs.prefetch_bucket,
                    stage3_param_persistence_threshold=knobs.persistence_threshold,
                    stage3_gather_16bit_weights_on_model_save=False)
        if parallel.zero_knobs.max_live_parameters is not None:  # else DeepSpeed's own default (1e9), as before
            zero["stage3_max_live_parameters"] = knobs.max_live_parameters
    if parallel.zero_stage == 3 and parallel.cp > 1:
        # ZeRO-3's reduce-scatter path: the one parallel.context.zero_gradient_scale corrects for.
        zero["reduce_scatter"] = True
    if parallel.zero_hpz > 1:
        # ZeRO++ hpZ: a secondary copy of the weight shards within each group of this many ranks.
        zero["zero_hpz_partition_size"] = parallel.zero_hpz
    if parallel.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(parallel.offload_optimizer, parallel.nvme_path)
    if parallel.offload_param != "none":
        zero["offload_param"] = _offload(parallel.offload_param, parallel.nvme_path)
    return zero


def build_ds_config(train: TrainSpec, parallel: ParallelSpec, *, dp_size: int, wall_clock_breakdown: bool = False,
                    load_universal: bool = False, checkpoint_writer: str = "sync",
                    torch_adam: bool = False, sequence_parallel: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON (as a dict) for a train/parallel spec at a data-parallel size, whole:
    `dsf train` adds DeepSpeed's per-step timers (logging.breakdown), to resume at another
    layout, `load_universal` (the checkpoint it loads is a universal one), and the checkpoint
    writer (run.checkpoint.writer: `decoupled` writes DeepSpeed's `checkpoint.writer` section), and
    `torch_adam` where jit.adam_choice picks torch's fused AdamW (a GPU without a prebuilt FusedAdam).

        build_ds_config(run.train, run.parallel, dp_size=2, checkpoint_writer="decoupled")["checkpoint"]
        # {"writer": {"type": "python", "decoupled": True, "data_parallel": "machine"}}
    """
    batch = resolve_batch(train.micro_batch, train.grad_accum, train.global_batch, dp_size=dp_size)
    ds: dict[str, Any] = {
        "train_batch_size": batch.global_batch,
        "train_micro_batch_size_per_gpu": batch.micro_batch,
        "gradient_accumulation_steps": batch.grad_accum,
        "optimizer": _optimizer_section(train, torch_adam=torch_adam),
        "scheduler": _scheduler_section(train),
        "zero_optimization": _zero_section(parallel),
        "steps_per_print": _STEPS_PER_PRINT,
        "wall_clock_breakdown": wall_clock_breakdown,
    }
    if parallel.pp > 1:
        # DeepSpeed's pipeline engine reads pipe/grad_partitioned (with tensor parallelism, the
        # activations sent between stages are split over the tensor ranks, which it assumes hold the
        # same ones: with sequence parallelism each holds its own slice already, and is sent whole);
        # the other keys record the layout `dsf train` builds its PipelineModule with.
        ds["pipeline"] = {"stages": parallel.pp, "partition": parallel.partition_method,
                          "activation_checkpoint_interval": int(parallel.activation_checkpointing == "full"),
                          "pipe_partitioned": not sequence_parallel, "grad_partitioned": not sequence_parallel}
    if parallel.cp > 1:
        # DeepSpeed Ulysses: ZeRO shards and reduces over data x context ranks; the batch counts replicas.
        ds["sequence_parallel_size"] = parallel.cp
    if parallel.ep > 1 or parallel.autoep:
        # DeepSpeed AutoEP (models/experts.py): at initialize it swaps each MoE block for one whose
        # experts are split over groups of ep data-parallel ranks (at ep 1: each rank holds them all);
        # the batch still counts every rank.
        ds["expert_parallel"] = {"enabled": True, "autoep_size": parallel.ep}
    if train.grad_clip > 0:
        ds["gradient_clipping"] = train.grad_clip
    if train.precision == "bf16":
        ds["bf16"] = {"enabled": True}
        if accum := grad_accum_dtype(train.precision, parallel.zero_stage):  # fp32 at ZeRO 1-3; see runtime_facts
            ds["data_types"] = {"grad_accum_dtype": accum}
    elif train.precision == "fp16":
        # Dynamic loss scaling (loss_scale 0): overflowing steps are skipped and the scale halved.
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                      "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    if checkpoint_writer == "decoupled":
        ds.setdefault("checkpoint", {})["writer"] = dict(DECOUPLED_WRITER)
    return ds


# DeepSpeed's decoupled writer (a background process per writing rank) with the plain file writer:
# its `fast` type needs DeepNVMe (libaio and pinned memory: on a CPU host it stops at pin_memory with
# "Cannot access accelerator device when none is available"). `data_parallel` is named because
# DeepSpeed 0.19.8 fails without it when no mpu is given (a data-parallel-only run):
# "AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank'". With `machine` each
# rank with ZeRO >= 1 writes its own shards, and at stage 0 data-parallel rank 0 writes the model.
DECOUPLED_WRITER = {"type": "python", "decoupled": True, "data_parallel": "machine"}


def dumps(ds: dict[str, Any]) -> str:
    """The canonical JSON text of a DeepSpeed config (what `dsf config` prints and presets hold)."""
    return json.dumps(ds, indent=2) + "\n"


class _DataParallelOnly:
    """The one mpu method DeepSpeedConfig asks for: the data-parallel size to check batches at."""

    def __init__(self, dp_size: int):
        self._dp_size = dp_size

    def get_data_parallel_world_size(self) -> int:
        return self._dp_size


def _ensure_comm() -> None:
    """DeepSpeedConfig reads the rank from deepspeed.comm; give it a one-process group if none."""
    import deepspeed.comm as dist

    if dist.is_initialized():
        return
    pin_build_tools()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                          rank=0, world_size=1)
    release_shm_buffers()


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """DeepSpeed logs and JIT-build notes go to stderr at ERROR level only, never to stdout:
    `dsf config` prints the JSON on stdout, and it must stay parseable."""
    saved_stdout = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    from deepspeed.utils import logger  # importing deepspeed already logs the accelerator it found

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # and Python-level prints where sys.stdout is not fd 1
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
        logger.setLevel(level)


def validate_ds_config(ds: dict[str, Any], *, dp_size: int) -> None:
    """Run deepspeed's own DeepSpeedConfig over `ds` at `dp_size`, and build its lr scheduler
    (which DeepSpeedConfig does not check); UserError if DeepSpeed objects to either."""
    as_json = json.loads(json.dumps(ds))  # what DeepSpeed would read from the file (a TypeError here is a bug)
    with _quiet_deepspeed():
        import torch
        from deepspeed.runtime import lr_schedules
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

        _ensure_comm()
        scheduler = getattr(lr_schedules, ds["scheduler"]["type"]) if "scheduler" in ds else None
        # Only DeepSpeed's verdicts on the values are the user's: ValueError (its pydantic models'
        # ValidationError, its own checks, the schedulers' argument checks), DeepSpeedConfigError, and
        # the asserts DeepSpeedConfig states its batch and ZeRO rules with. Anything else (TypeError,
        # KeyError, AttributeError, an assert outside DeepSpeedConfig) is a bug: it keeps its traceback.
        try:
            DeepSpeedConfig(as_json, mpu=_DataParallelOnly(dp_size))
            if scheduler is not None:
                probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
                scheduler(probe, **ds["scheduler"]["params"])
        except (ValueError, DeepSpeedConfigError, AssertionError) as err:
            if isinstance(err, AssertionError) and not raised_in(err, "deepspeed.runtime.config"):
                raise
            raise UserError("DeepSpeed config", None, f"rejected by DeepSpeedConfig at dp={dp_size}: {err}",
                            "check the batch, ZeRO and precision settings") from None
