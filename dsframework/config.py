"""The run config: one YAML file, one pydantic model per concern, validated before anything runs.

    run = load_run_config("launch/examples/tiny.yaml", ["parallel.zero_stage=3", "train.steps=20"])
    run.parallel.zero_stage   # 3
    run.train.lr              # 0.001

Unknown keys are errors with a close-match suggestion; every error is a one-line `UserError`
naming the dotted field, its value and the fix. Rules that need the world size (the batch triple)
are checked later, in `dsconfig.resolve_batch`.
"""
from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from dsframework.errors import UserError, did_you_mean
from dsframework.layout import composition_problem
from dsframework.runtime_facts import sequence_parallel_auto


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSpec(_Spec):
    """Low-rank adapters through peft: only these are trained, kept in optimizer state and saved."""

    r: int = Field(default=8, ge=1, description="adapter rank")
    alpha: float = Field(default=16.0, gt=0, description="scaling numerator (the update is scaled by alpha / r)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear", description="module names (or name suffixes) to adapt, e.g. [q_proj, v_proj]; "
        "all-linear: every linear layer but the output head")


class ModelSpec(_Spec):
    """Which model to train."""

    name: str = Field(default="tiny-llama", description="a preset name (see `dsf presets`), a path to a "
                      "transformers config.json (random init), or a local pretrained directory")
    overrides: dict[str, Any] = Field(default_factory=dict, description="transformers config "
                                      "fields to change, e.g. {num_hidden_layers: 4}")
    tokenizer: str | None = Field(default=None, description="local tokenizer directory; default: the "
                                  "pretrained directory's, else one trained locally on the data")
    lora: LoraSpec | None = Field(default=None, description="train LoRA adapters (peft) instead of every weight; "
                                    "ZeRO 0-3 at tp = pp = cp = 1")


class DataSpec(_Spec):
    """What to train on."""

    dataset: str = Field(default="addition", description="a built-in task (addition, reverse, counting) or a local "
                         "path: a json/jsonl/csv/parquet/txt file, a directory or glob of them (any text "
                         "extension, e.g. 'src/**/*.py', with format text), or a save_to_disk dir")
    format: Literal["text", "chat", "prompt_completion"] = Field(
        default="text", description="text: documents joined by EOS, every token trained; chat: a `messages` column of "
        "{role, content} turns rendered by the tokenizer's chat template; prompt_completion: two columns")
    text_unit: Literal["document", "paragraph", "line"] = Field(
        default="document", description="what one document of a text file is (newlines kept in documents and "
        "paragraphs)")
    text_field: str = Field(default="text", description="column holding the text in user data (format text); a "
                            "dataset with an `input_ids` column is taken as already tokenized")
    messages_field: str = Field(default="messages", description="column of {role, content} turns (format chat)")
    prompt_field: str = Field(default="prompt", description="prompt column (format prompt_completion)")
    completion_field: str = Field(default="completion", description="completion column (format prompt_completion)")
    train_on_prompt: bool = Field(default=False, description="chat/prompt_completion: also train on prompt and user "
                                  "tokens (default: loss on assistant / completion tokens only)")
    packing: bool = Field(default=True, description="chat/prompt_completion: pack whole examples into each row, "
                          "none attending to another; false: one example per row, padded")
    chat_template: str | None = Field(default=None, description="a Jinja chat template (the text, or a path to a "
                                      ".jinja file) for a tokenizer without one")
    num_proc: int | None = Field(default=None, ge=1, description="processes that tokenize; default: the CPU count "
                                 "(capped at 8) for data over 64 MiB, else 1")
    seq_len: int = Field(default=64, ge=8, description="tokens per packed training block")
    eval_fraction: float = Field(default=0.05, gt=0, lt=0.5, description="share of blocks held out for eval")
    num_examples: int = Field(default=20000, ge=100, description="examples generated for a built-in task")
    max_digits: int = Field(default=3, ge=1, le=12, description="operand length of the built-in tasks")
    tokenizer_vocab_size: int = Field(default=512, ge=64, description="vocab of a tokenizer trained on user data")
    seed: int = Field(default=1234, description="seed for generating, splitting and shuffling the data")


class TrainSpec(_Spec):
    """How to optimise. Give any two of micro_batch, grad_accum, global_batch (or one, or none):
    the rest is derived from the data-parallel size when the world is known."""

    steps: int = Field(default=200, ge=1, description="optimizer steps in total (the lr schedule spans them)")
    stop_after: int | None = Field(default=None, ge=1, description="stop with a checkpoint after this step, "
                                   "e.g. to fit a time slot; --resume goes on to `steps`")
    micro_batch: int | None = Field(default=None, ge=1, description="sequences per rank per forward pass")
    grad_accum: int | None = Field(default=None, ge=1, description="micro-batches per optimizer step")
    global_batch: int | None = Field(default=None, ge=1, description="sequences per optimizer step, all ranks")
    optimizer: Literal["adamw", "adam"] = "adamw"
    lr: float = Field(default=1e-3, gt=0, description="peak learning rate")
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, ge=0, description="max global gradient norm; 0 disables clipping")
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="final lr / peak lr (cosine)")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = Field(default=42, description="seed for weight init and dropout")
    tf32: bool | Literal["auto"] = Field(
        default="auto", description="TensorFloat-32 for fp32 matmuls and cuDNN convolutions (10-bit mantissa inputs, "
        "fp32 accumulation): auto: on for CUDA devices of compute capability >= 8 (Ampere and later), off elsewhere; "
        "true needs a CUDA device; false: full fp32 everywhere")
    compile: bool | Literal["auto"] = Field(
        default="auto", description="torch.compile the model (inductor; kernels cached beside the run): true, "
        "false, or auto: time the first eager steps, then compile when the steps left would win back the compile time")
    chunked_loss: bool | Literal["auto"] = Field(
        default="auto", description="compute the causal LM loss over chunks of tokens so the whole micro-batch's fp32 "
        "logits never exist at once (forward and backward); auto: when they would exceed one chunk")
    loss_chunk_tokens: int | None = Field(
        default=None, ge=1, description="tokens per loss chunk; default: as many as keep a chunk's fp32 logits "
        "to 256 MiB, rounded down to a multiple of 512, at least 512 (runtime_facts.loss_chunk_tokens)")

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_within_steps(cls, warmup_steps: int, info: ValidationInfo) -> int:
        steps = info.data.get("steps")
        if steps is not None and warmup_steps > steps:
            raise ValueError(f"exceeds steps={steps}; lower train.warmup_steps")
        return warmup_steps


class ZeroKnobsSpec(_Spec):
    """DeepSpeed's ZeRO bucket, persistence and prefetch settings, in elements; None: dsf's default
    (runtime_facts). `dsf plan -o` and `dsf config --auto-knobs` choose them from the memory the
    plan leaves free (planner/knobs.py); `--set parallel.zero_knobs.prefetch_bucket=2e7` sets one."""

    persistence_threshold: int | None = Field(
        default=None, ge=0, description="ZeRO-3 stage3_param_persistence_threshold: tensors of at most this many "
        "elements stay whole on every rank and are never gathered (default 1e5)")
    prefetch_bucket: int | None = Field(
        default=None, ge=0, description="ZeRO-3 stage3_prefetch_bucket_size: elements gathered ahead of the layer that "
        "needs them; 0 turns prefetching off (default 5e7)")
    max_live_parameters: int | None = Field(
        default=None, ge=1, description="ZeRO-3 stage3_max_live_parameters: gathered elements beyond which prefetching "
        "stops (default: DeepSpeed's 1e9)")
    reduce_bucket: int | None = Field(
        default=None, ge=1, description="ZeRO 1-3 reduce_bucket_size: gradient elements per reduce (default 5e7)")
    allgather_bucket: int | None = Field(
        default=None, ge=2, multiple_of=2, description="ZeRO 1-2 allgather_bucket_size: updated-weight elements per "
        "all-gather, even (DeepSpeed's rule; default 5e7)")


# Which ZeRO stages read each knob (DeepSpeed ignores the rest).
_KNOB_STAGES = {"persistence_threshold": (3,), "prefetch_bucket": (3,), "max_live_parameters": (3,),
                "reduce_bucket": (1, 2, 3), "allgather_bucket": (1, 2)}


class ParallelSpec(_Spec):
    """How to split the work across ranks."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    offload_param: Literal["none", "cpu", "nvme"] = Field(default="none", description="ZeRO-3 only")
    nvme_path: str = Field(default="/local_nvme", description="directory for nvme offload")
    tp: int = Field(default=1, ge=1, description="tensor-parallel size (Megatron-style layers)")
    pp: int = Field(default=1, ge=1, description="pipeline stages (DeepSpeed's pipeline engine)")
    cp: int = Field(default=1, ge=1, description="context-parallel size (DeepSpeed Ulysses): each rank of a group "
                    "holds seq_len / cp tokens of the same sequences; divides the heads and seq_len")
    dp: int | None = Field(default=None, ge=1, description="data-parallel size; default: world / (tp * pp * cp)")
    ep: int = Field(default=1, ge=1, description="expert-parallel size (DeepSpeed AutoEP, mixture-of-experts models): "
                    "each group of ep data-parallel ranks splits the experts; divides dp and the experts")
    autoep: bool = Field(default=False, description="at ep 1 too, train the experts in DeepSpeed AutoEP's blocks "
                         "(every rank holds all of them, no all-to-all): a resume at ep 1 from a checkpoint saved at "
                         "ep > 1 turns it on; start with it to resume at ep > 1 later")
    zero_hpz: int = Field(default=1, ge=1, description="ZeRO-3 hierarchical partitioning (ZeRO++ hpZ): a secondary "
                          "copy of the weight shards within each group of this many ranks (a node), so the backward "
                          "all-gathers stay on the node's links")
    zero_quantized: Literal["none", "weights", "gradients", "both"] = Field(
        default="none", description="ZeRO++ quantized weights/gradients: not offered (see docs/parallel-layouts.md: "
        "they do not run here)")
    partition_method: str = Field(default="parameters", description="pipeline partition: parameters, "
                                  "uniform or type:<regex>")
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        default="none", description="recompute activations in the backward pass: none; selective (each layer's "
        "attention core, softmax(QK^T)V: the projections and the MLP keep theirs); full (every layer from its input)")
    zero_knobs: ZeroKnobsSpec = Field(default_factory=ZeroKnobsSpec, description="ZeRO's bucket, persistence and "
                                      "prefetch sizes (elements); unset: dsf's defaults")
    sequence_parallel: Literal["auto"] | bool = Field(
        default="auto", description="Megatron's sequence parallelism with tp > 1: between the attention and MLP "
        "blocks each tensor rank holds seq_len / tp of the tokens (norms, residuals, dropout and their "
        "activations split tp ways); auto: on with tp > 1 where the architecture allows it and tp (x cp) "
        "divides data.seq_len")

    @field_validator("zero_knobs")
    @classmethod
    def _knobs_of_this_stage(cls, knobs: ZeroKnobsSpec, info: ValidationInfo) -> ZeroKnobsSpec:
        stage = info.data.get("zero_stage")
        for name, stages in _KNOB_STAGES.items():
            if stage is not None and getattr(knobs, name) is not None and stage not in stages:
                raise UserError(f"parallel.zero_knobs.{name}", getattr(knobs, name),
                                f"is read at ZeRO stage {'/'.join(map(str, stages))} only, not at zero_stage={stage}",
                                f"remove parallel.zero_knobs.{name} or change parallel.zero_stage")
        return knobs

    @field_validator("offload_optimizer")
    @classmethod
    def _offload_optimizer_needs_zero(cls, device: str, info: ValidationInfo) -> str:
        if device != "none" and info.data.get("zero_stage") == 0:
            raise ValueError("needs zero_stage >= 1; set parallel.zero_stage to 1, 2 or 3")
        return device

    @field_validator("offload_param")
    @classmethod
    def _offload_param_needs_stage3(cls, device: str, info: ValidationInfo) -> str:
        stage = info.data.get("zero_stage")
        if device != "none" and stage is not None and stage != 3:
            raise ValueError(f"needs zero_stage=3, got zero_stage={stage}; set parallel.zero_stage=3 "
                             "or parallel.offload_param=none")
        return device

    @field_validator("sequence_parallel")
    @classmethod
    def _sequence_parallel_needs_tp(cls, value: Any, info: ValidationInfo) -> Any:
        if value is True and info.data.get("tp") == 1:
            raise UserError("parallel.sequence_parallel", True, "splits the sequence over the tensor ranks, and "
                            "parallel.tp is 1", "set parallel.tp > 1, or parallel.sequence_parallel=auto")
        return value

    @model_validator(mode="after")
    def _axes_compose(self) -> "ParallelSpec":
        # The same rules parallel.topology applies with the world known (one rule set).
        problem = composition_problem(tp=self.tp, pp=self.pp, cp=self.cp, zero_stage=self.zero_stage,
                                      zero_hpz=self.zero_hpz, ep=self.ep, autoep=self.autoep)
        if problem is not None:
            raise problem
        return self

    @field_validator("zero_quantized")
    @classmethod
    def _quantized_zero_is_not_offered(cls, what: str) -> str:
        if what != "none":
            raise ValueError("is not offered: DeepSpeed 0.19's quantizer kernels do not build on the CPU accelerator "
                             "this project is tested on (zero_quantized_weights fails in zero.Init, "
                             "zero_quantized_gradients in its first inter-node reduce: 'This op had not been "
                             "implemented on CPU backend'), so their loss deviation could not be measured; "
                             "set parallel.zero_quantized=none (hpZ, parallel.zero_hpz, runs without them)")
        return what

    @field_validator("partition_method")
    @classmethod
    def _known_partition_method(cls, method: str) -> str:
        if method.startswith("type:"):
            try:
                re.compile(method[len("type:"):])
            except re.error as err:
                raise ValueError(f"has an invalid regex ({err}); write e.g. type:DecoderLayer") from None
        elif method not in ("parameters", "uniform"):
            raise ValueError("must be parameters, uniform or type:<regex>")
        return method


class CheckpointSpec(_Spec):
    """When to save (under <output_dir>/checkpoints)."""

    every: int = Field(default=100, ge=0, description="save every N steps; 0: only at the end")
    save_final: bool = True
    writer: Literal["sync", "decoupled"] = Field(
        default="sync", description="sync: the training loop waits while the checkpoint is written; decoupled: "
        "DeepSpeed's background writer (checkpoint.writer.decoupled) writes it while the next step runs, the "
        "loop waits only to hand the state over and, at that step's optimizer step, for what is left to write")
    fallback: Literal["none", "previous"] = Field(
        default="none", description="a resume whose latest checkpoint is damaged (a file missing, truncated or "
        "changed since it was saved): none stops naming the file; previous resumes from the newest earlier "
        "checkpoint whose files check, and says so")
    keep: int = Field(default=0, ge=0, description="keep the newest N checkpoints, removing older ones as each new one "
                      "is committed; 0: keep every one (each costs the model's weights and optimizer states on disk)")
    keep_every: int = Field(default=0, ge=0, description="with checkpoint.keep, also keep every checkpoint whose step "
                            "is a multiple of this (0: none beyond the newest N)")
    on_low_space: Literal["stop", "skip"] = Field(
        default="stop", description="when the disk has less free space than the last checkpoint took: stop ends the "
        "run (the last good checkpoint stays latest), skip skips this save and trains on; either way it says so")


def _directory_field(field: str, value: str | None, *, package: str | None, example: str) -> str | None:
    """A metric sink's directory: not an existing regular file, and its library (`package`) installed."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"is empty; name a directory (created if missing), e.g. logging.{field}={example}")
    if Path(value).exists() and not Path(value).is_dir():
        raise ValueError(f"is an existing file, not a directory; name a directory (created if missing), "
                         f"e.g. logging.{field}={example}")
    if package and importlib.util.find_spec(package) is None:  # found before anything starts, not in the first log step
        raise ValueError(f"needs the {package} package, which is not installed; pip install {package} "
                         f"(or pip install dsframework[metrics]), or remove logging.{field}")
    return value


class FaultsSpec(_Spec):
    """How a run notices that it is stuck: each rank's watcher reads its heartbeat
    (protocol/heartbeat.py) and stops the job, naming the rank, when it makes no progress."""

    hang_timeout: float | Literal["auto"] = Field(
        default="auto", description="seconds a rank may go without progress in a training phase (data, forward, "
        "backward, optimizer step) before the job stops as hung; auto: max(60, 10 x the measured step time); 0 or off: "
        "not watched. The first step, the step after compiling, checkpoints and evaluation get max(600, 10 x it)")

    @field_validator("hang_timeout", mode="before")
    @classmethod
    def _hang_timeout(cls, value: Any) -> Any:
        if value is False or value == "off":  # YAML 1.1 reads `off` as false
            return 0.0
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError("must be positive seconds, auto, or 0 / off (not watched); e.g. faults.hang_timeout=120")
        return value


class WandbSpec(_Spec):
    """A Weights & Biases run, written offline (no network, no login); `wandb sync` uploads it later."""

    project: str = Field(default="dsframework", min_length=1, description="W&B project the run is filed under")
    name: str | None = Field(default=None, description="run name; default: W&B's own (runs are grouped by the "
                             "output_dir's name)")
    dir: str | None = Field(default=None, description="directory that gets wandb/offline-run-*; default: output_dir")
    mode: Literal["offline"] = Field(default="offline", description="offline only: upload with `wandb sync "
                                     "DIR/wandb/offline-run-*`")

    @field_validator("mode", mode="before")
    @classmethod
    def _offline_only(cls, mode: Any) -> Any:
        if mode != "offline":
            raise ValueError("dsf writes W&B runs offline only (the ranks need no network or login); set "
                             "logging.wandb.mode=offline and upload later with `wandb sync DIR/wandb/offline-run-*`")
        return mode

    @field_validator("dir")
    @classmethod
    def _dir_is_a_directory(cls, value: str | None) -> str | None:
        return _directory_field("wandb.dir", value, package="wandb", example="runs/tiny")


class LoggingSpec(_Spec):
    """What to report, and where: metrics.jsonl always, plus TensorBoard, CSV and W&B when set."""

    every: int = Field(default=10, ge=1, description="log loss, lr and tokens/s every N steps")
    eval_every: int = Field(default=50, ge=0, description="evaluate every N steps (and at the end); 0: never")
    progress: bool = Field(default=True, description="progress bar on rank 0")
    cluster: str | None = Field(default=None, description="peak FLOP/s for MFU: a cluster preset or a dsf calibrate "
                                "profile; default: the GPU's preset, else a matmul measured at start")
    breakdown: bool = Field(default=False, description="forward/backward/all-reduce/optimizer ms per step from "
                            "DeepSpeed's timers (they synchronise the device: a little slower)")
    tensorboard: str | None = Field(default=None, description="directory for TensorBoard event files of the same "
                                    "metrics (one run's own: tensorboard --logdir its parent compares runs)")
    csv: str | None = Field(default=None, description="directory that gets metrics.csv, the same metrics as a "
                                                      "spreadsheet")
    wandb: WandbSpec | None = Field(default=None, description="an offline W&B run of the same metrics; `true` for "
                                    "the defaults")

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_is_a_directory(cls, value: str | None) -> str | None:
        return _directory_field("tensorboard", value, package="tensorboard", example="runs/tiny/tb")

    @field_validator("csv")
    @classmethod
    def _csv_is_a_directory(cls, value: str | None) -> str | None:
        return _directory_field("csv", value, package=None, example="runs/tiny")  # csv: the standard library

    @field_validator("wandb", mode="before")
    @classmethod
    def _wandb_switch(cls, value: Any) -> Any:
        if value is True:  # logging.wandb: true -> every default
            return {}
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _wandb_installed(self) -> "LoggingSpec":
        if self.wandb is not None and importlib.util.find_spec("wandb") is None:
            raise UserError("logging.wandb", None, "needs the wandb package, which is not installed",
                            "pip install wandb (or pip install dsframework[metrics]), or remove logging.wandb")
        return self


class RunConfig(_Spec):
    """A whole training run."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    faults: FaultsSpec = Field(default_factory=FaultsSpec)
    output_dir: str = Field(default="runs/default", description="metrics, checkpoints and tokenizer go here")

    @model_validator(mode="after")
    def _workflow_fits_layout(self) -> "RunConfig":
        par = self.parallel
        if self.model.lora is not None and (par.tp, par.pp, par.cp) != (1, 1, 1):
            raise UserError("model.lora", None, f"runs at tp = pp = cp = 1 with ZeRO 0-3 (got tp={par.tp}, pp={par.pp}, "
                            f"cp={par.cp}): peft wraps whole HF modules, not tensor shards or pipeline stages",
                            "set parallel.tp=1 parallel.pp=1 parallel.cp=1 (or remove model.lora)")
        if self.model.lora is not None and (par.ep > 1 or par.autoep):
            setting = f"parallel.ep={par.ep}" + (" autoep=true" if par.autoep else "")
            raise UserError("model.lora", None, f"is not offered with {setting}: DeepSpeed's AutoEP "
                            "replaces the MoE blocks peft would wrap (not tried here)",
                            "set parallel.ep=1 parallel.autoep=false (LoRA on a mixture of experts at ep 1 trains "
                            "its adapters under ZeRO)")
        if par.sequence_parallel is True and self.data.seq_len % (par.tp * par.cp):
            raise UserError("parallel.sequence_parallel", True, f"splits each sequence tp x cp = {par.tp * par.cp} "
                            f"ways, which does not divide data.seq_len={self.data.seq_len}",
                            f"choose data.seq_len a multiple of {par.tp * par.cp}, or parallel.sequence_parallel=auto")
        if self.data.format != "text" and (par.pp, par.cp) != (1, 1):
            raise UserError("data.format", self.data.format, f"runs at tp x dp with ZeRO 0-3 (got pp={par.pp}, "
                            f"cp={par.cp}): its loss is normalised over the trained tokens of the whole batch",
                            "set parallel.pp=1 parallel.cp=1, or use data.format=text")
        return self

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"

    @property
    def sequence_parallel(self) -> bool:
        """Whether the tensor ranks split the sequence (parallel.sequence_parallel, auto resolved; the
        architecture may still refuse: train/setup.py)."""
        par = self.parallel
        if par.sequence_parallel == "auto":  # (the architecture decides the rest: train/setup.py)
            return sequence_parallel_auto(tp=par.tp, cp=par.cp, seq_len=self.data.seq_len)
        return bool(par.sequence_parallel)


# --- loading -----------------------------------------------------------------------------------

class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as 1e-6 and 3E+2 as floats.

    PyYAML follows YAML 1.1, where a float needs a dot; `lr: 1e-6` would be the string '1e-6'.
    """


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass

def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file, or a UserError saying what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError("run config", str(path), "no such file", "pass the path of a YAML run config")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError("run config", str(path), f"is not valid YAML{where}",
                        "fix the syntax (indentation, colons, quotes)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError("run config", str(path), f"holds a {type(data).__name__}, not a mapping",
                        "write sections such as `model:`, `train:` at the top level")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to a raw config mapping, in place."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError("--set", assignment, "is not of the form dotted.key=value",
                        "write e.g. --set train.steps=20")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
    model: type[BaseModel] | None = RunConfig  # None below a free-form mapping (model.overrides)
    node = data
    for depth, part in enumerate(parts):
        if model is not None:
            if part not in model.model_fields:
                where = ".".join(parts[:depth]) or "the top level"
                raise UserError("--set", key, f"unknown key {part!r} in {where}",
                                did_you_mean(part, model.model_fields))
            annotation = model.model_fields[part].annotation
            if get_origin(annotation) in (Union, UnionType):  # `LoraSpec | None`: a section that may be absent
                annotation = next((a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)),
                                  annotation)
        if depth == len(parts) - 1:
            node[part] = value
            return
        if model is not None:
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                model = annotation
            elif get_origin(annotation) is dict:
                model = None
            else:
                section = ".".join(parts[: depth + 1])
                raise UserError("--set", key, f"{section} is a value, not a section",
                                f"write --set {section}=VALUE")
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child


def _field_path(loc: list[str]) -> list[str]:
    """The leading parts of a pydantic error location that name fields (the rest tag union members,
    e.g. train.compile's `bool` and `literal['auto']`); an optional section (`X | None`) is its model's."""
    annotation: Any = RunConfig
    for index, part in enumerate(loc):
        models = [m for m in (get_args(annotation) or (annotation,)) if isinstance(m, type) and issubclass(m, BaseModel)]
        owner = next((m for m in models if part in m.model_fields), None)
        if owner is None:
            return loc[:index] if index else loc
        annotation = owner.model_fields[part].annotation
    return loc


def _format_validation_error(err: ValidationError) -> UserError:
    """The first pydantic error as a one-line UserError with the dotted field and the fix."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    field = ".".join(loc) or "run config"
    if first["type"] == "extra_forbidden":
        parent: type[BaseModel] = RunConfig
        for part in loc[:-1]:
            ann = parent.model_fields[part].annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                parent = ann
        return UserError(field, None, f"unknown key {loc[-1]!r}", did_you_mean(loc[-1], parent.model_fields))
    raised = first.get("ctx", {}).get("error")
    if isinstance(raised, UserError):  # a rule that phrased itself (e.g. layout.composition_problem)
        return raised
    msg = first["msg"].removeprefix("Value error, ")
    fields = _field_path(loc)
    if len(fields) < len(loc) and first["type"] != "value_error":  # a union (`bool | Literal["auto"]`): pydantic tags each member's error
        field = ".".join(fields)
        msg = " or ".join(dict.fromkeys(e["msg"].split(",")[0].lower() for e in err.errors()
                                        if [str(p) for p in e["loc"]][:len(fields)] == fields))
    if first["type"] == "value_error":  # our own validators say the rule and the fix
        return UserError(field, first.get("input"), msg)
    value = first.get("input")
    if isinstance(value, (dict, list)):
        value = None
    fix = "fix the value, or remove the key to use the default" if first["type"] != "missing" else ""
    return UserError(field, value, msg[0].lower() + msg[1:], fix)


def build_run_config(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """RunConfig from a raw mapping plus `dotted.key=value` overrides."""
    data = copy.deepcopy(data)
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise _format_validation_error(err) from None


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read, override and validate a YAML run config."""
    return build_run_config(read_yaml(path), overrides)


def dump_run_config(run: RunConfig) -> str:
    """The YAML text of a RunConfig; `load_run_config` of it gives the same RunConfig back."""
    return yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False)
