"""Resolve `model.name` to a transformers config and build the model, under ZeRO-3 partitioned.

    source = resolve_model(run.model)                 # preset, config.json, or pretrained dir
    config = source.config_for(tokenizer)             # vocab and special tokens follow the tokenizer
    model = build_model(source, config, seed=42, zero3_ds_config=None)
    device, dtype = rank_placement("bf16")            # a rank's engine device, its training dtype
    model = build_model(source, config, seed=42, device=device, dtype=dtype)   # never whole on the host

Random initialisation is deterministic per module name and seed, whatever the ZeRO stage: each
module is (gathered and) re-initialised with transformers' own `_init_weights` under a seed derived
from its name, so stage 0..3 and a plain PyTorch reference start from the same weights, and under
ZeRO-3 no rank ever holds more than one module's parameters in full.

With a `device` (`dsf train` at ZeRO 0-2, tp = pp = 1), the model is built on the meta device and
each module's parameters are made on that device in their training dtype as they get their values
(models/construct.py: the same seeded init, or the pretrained safetensors read tensor by tensor): a
rank's host holds one module's fp32 values at a time, not the fp32 model (8 ranks of an 8B model
held 8 x 32 GB at start-up). A directory sliced loading cannot read loads with from_pretrained
straight to the device.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsframework.config import ModelSpec
from dsframework.errors import UserError, did_you_mean
from dsframework.models.construct import (ConstructorValueUnknown, build_for_layout, check_pretrained_files,
                                          placed, reads_every_tensor)
from dsframework.models.experts import train_router_loss
from dsframework.models.hf import WEIGHT_FILES, causal_lm_class, check_causal_lm, skip_transformers_init
from dsframework.models.lora import check_lora_targets
from dsframework.models.presets import PRESETS
from dsframework.types import HFConfig, accelerator

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class ModelSource:
    """Where a model comes from: its config, and the pretrained directory when there are weights."""

    config: HFConfig
    pretrained_dir: Path | None = None
    vocab_overridden: bool = False  # model.overrides.vocab_size was given
    router_loss_overridden: bool = False  # model.overrides.output_router_logits was given

    @property
    def tokenizer_dir(self) -> Path | None:
        """The pretrained directory, when it carries a tokenizer."""
        if self.pretrained_dir and any((self.pretrained_dir / f).exists() for f in TOKENIZER_FILES):
            return self.pretrained_dir
        return None

    def config_for(self, tokenizer: Any) -> Any:
        """The config with vocab size and special token ids that fit `tokenizer`.

        A random-init model takes the tokenizer's vocabulary size (unless overridden larger);
        a pretrained model keeps its own, which must cover the tokenizer.
        """
        config, vocab = self.config, len(tokenizer)
        if self.pretrained_dir is not None and config.vocab_size < vocab:
            raise UserError("model.tokenizer", str(tokenizer.name_or_path),
                            f"has {vocab} tokens, more than the model's vocab_size={config.vocab_size}",
                            "use the pretrained model's own tokenizer")
        if self.pretrained_dir is None and not self.vocab_overridden:
            config.vocab_size = vocab
        elif config.vocab_size < vocab:
            raise UserError("model.overrides.vocab_size", config.vocab_size,
                            f"is smaller than the tokenizer's {vocab} tokens",
                            f"set it to at least {vocab} or remove it")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token_id = getattr(tokenizer, name, None)
            if token_id is not None:
                setattr(config, name, token_id)
        if not self.router_loss_overridden:
            train_router_loss(config)  # a mixture of experts trains with its load-balancing loss
        return config


def _config_from_dict(fields: dict[str, Any], *, origin: str) -> Any:
    from transformers import CONFIG_MAPPING

    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise UserError("model.name", origin, "config has no model_type",
                        "add \"model_type\" (e.g. \"llama\") to the config.json")
    if model_type not in CONFIG_MAPPING:
        raise UserError("model.name", origin, f"unknown model_type {model_type!r}",
                        did_you_mean(model_type, CONFIG_MAPPING.keys()))
    return CONFIG_MAPPING[model_type](**fields)


def _read_json(path: Path, *, field: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(field, str(path), f"is not readable JSON ({type(err).__name__})",
                        "point to a valid transformers config.json") from None
    if not isinstance(data, dict):
        raise UserError(field, str(path), "is not a JSON object", "point to a transformers config.json")
    from transformers import PretrainedConfig

    # transformers writes inf and nan as {"__float__": "Infinity"} (Bamba's time_step_limit): its own decoding
    return PretrainedConfig._decode_special_floats(data)


# Constructor keywords transformers 5 still accepts but folds into other fields (rope_parameters).
_LEGACY_CONFIG_KWARGS = {"rope_theta", "rope_scaling"}


def _check_override_names(fields: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Every override must be a field of the config class (as attribute or constructor argument)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[fields["model_type"]]
    known = (set(config_cls().to_dict()) | set(inspect.signature(config_cls.__init__).parameters)
             | set(getattr(config_cls, "attribute_map", {})) | set(fields) | _LEGACY_CONFIG_KWARGS)
    known -= {"self", "kwargs"}
    for key, value in overrides.items():
        if key not in known:
            raise UserError(f"model.overrides.{key}", value, f"is not a field of {config_cls.__name__}",
                            did_you_mean(key, known))


def _build_with_overrides(fields: dict[str, Any], overrides: dict[str, Any], *, origin: str) -> Any:
    """The config built from fields + overrides; a rejected override is named in a UserError."""
    try:
        return _config_from_dict({**fields, **overrides}, origin=origin)
    except Exception:  # noqa: BLE001 - huggingface_hub's strict validation error is no ValueError
        for key, value in overrides.items():  # find the culprit to name it
            try:
                _config_from_dict({**fields, key: value}, origin=origin)
            except Exception as err:  # noqa: BLE001
                rule = str(err).strip().splitlines()[-1].strip()
                raise UserError(f"model.overrides.{key}", value, f"rejected by the config: {rule}",
                                "fix its type or value") from None
        raise


def resolve_model(spec: ModelSpec) -> ModelSource:
    """ModelSource for a preset name, a config.json path, or a local pretrained directory.

    `spec.overrides` are merged into the config's fields before it is built, so derived fields
    (head_dim from hidden_size, rope parameters) follow them.
    """
    name, path = spec.name, Path(spec.name).expanduser()
    pretrained_dir = None
    if name in PRESETS:
        fields = dict(PRESETS[name])
    elif path.is_file():
        fields = _read_json(path, field="model.name")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError("model.name", name, "directory has no config.json",
                            "point to a transformers model directory (save_pretrained output)")
        fields = _read_json(path / "config.json", field="model.name")
        pretrained_dir = path if any((path / f).exists() for f in WEIGHT_FILES) else None
    else:
        raise UserError("model.name", name, "is neither a preset, a config.json nor a directory",
                        did_you_mean(name, PRESETS))
    config = _config_from_dict(fields, origin=name)  # checks model_type first
    if spec.overrides:
        _check_override_names(fields, spec.overrides)
        config = _build_with_overrides(fields, spec.overrides, origin=name)
    check_causal_lm(config, name)
    if spec.lora is not None:  # a target_modules entry naming no layer: one line, before anything is written
        check_lora_targets(config, spec.lora)
    if pretrained_dir is not None:
        check_pretrained_files(pretrained_dir, config)
    if "output_router_logits" not in spec.overrides:
        # a mixture of experts trains with its load-balancing loss: set here, so that every check
        # before the run (the layouts its loss allows) and the planner see the loss it trains
        train_router_loss(config)
    return ModelSource(config, pretrained_dir, vocab_overridden="vocab_size" in spec.overrides,
                       router_loss_overridden="output_router_logits" in spec.overrides)


def _gathered(params: list, *, modifier_rank: int | None = 0):
    """Context that makes ZeRO-3 partitioned params whole (no-op for ordinary tensors)."""
    if params and hasattr(params[0], "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)
    return contextlib.nullcontext()


def init_weights_deterministically(model: Any, seed: int) -> None:
    """Re-initialise every module with transformers' `_init_weights`, seeded by its name."""
    import torch

    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with _gathered(params), torch.no_grad():
            for param in params:
                param._is_hf_initialized = False  # transformers skips tensors flagged as done
            torch.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            model._init_weights(module)


def build_model(source: ModelSource, config: HFConfig, *, seed: int, zero3_ds_config: dict[str, Any] | None = None,
                device: Any = None, dtype: Any = None) -> Any:
    """The causal LM, random-init or pretrained; partitioned at construction under ZeRO-3. With
    `device` (and no ZeRO-3), built on the meta device and materialised on `device` in `dtype`
    (`build_on_device`); without, or for the few types a weightless build cannot initialise, built
    whole in fp32 on the host (`build_on_host`), where DeepSpeed's initialize casts and moves it."""
    from transformers import set_seed

    set_seed(seed)
    if device is not None and zero3_ds_config is None:
        try:
            return build_on_device(source, config, seed=seed, device=device, dtype=dtype)
        except ConstructorValueUnknown:  # e.g. Qwen3-Next's router weight: only its constructor sets it
            set_seed(seed)
    return build_on_host(source, config, seed=seed, zero3_ds_config=zero3_ds_config)


def build_on_host(source: ModelSource, config: HFConfig, *, seed: int,
                  zero3_ds_config: dict[str, Any] | None = None) -> Any:
    """The causal LM whole in fp32 on the host (under ZeRO-3: partitioned as it is built)."""
    import torch

    cls = causal_lm_class(config)
    if source.pretrained_dir is not None:
        keep_alive = None
        if zero3_ds_config is not None:
            # transformers loads under zero.Init, shard by shard, while this object is alive.
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            keep_alive = HfDeepSpeedConfig(zero3_ds_config)
        model = cls.from_pretrained(source.pretrained_dir, config=config, local_files_only=True,
                                    dtype=torch.float32)
        model._dsf_hf_ds_config = keep_alive
        return model
    partitioned = contextlib.nullcontext()
    if zero3_ds_config is not None:
        import deepspeed

        partitioned = deepspeed.zero.Init(config_dict_or_path=zero3_ds_config)
    with partitioned, skip_transformers_init():
        model = cls._from_config(config, dtype=torch.float32)
    init_weights_deterministically(model, seed)
    return model


def build_on_device(source: ModelSource, config: HFConfig, *, seed: int, device: Any, dtype: Any = None) -> Any:
    """The model `build_model` makes, its parameters made on `device` in `dtype` module by module:
    the seeded init (the same values, bit for bit, as the host build then DeepSpeed's cast) or the
    pretrained safetensors read tensor by tensor. A directory `PretrainedSlices` cannot read whole
    (pytorch_model.bin, or tensors transformers merges at load) loads with from_pretrained straight
    to `device` in fp32, then its parameters are cast as DeepSpeed would."""
    import torch

    pretrained = source.pretrained_dir
    if pretrained is not None and not reads_every_tensor(pretrained, config):
        model = causal_lm_class(config).from_pretrained(pretrained, config=config, local_files_only=True,
                                                        dtype=torch.float32, device_map={"": device})
        cast_parameters(model, dtype)
        return model
    model = build_for_layout(source, config, seed=seed, device=device, dtype=dtype).model
    if pretrained is not None:
        model.eval()  # the mode from_pretrained returns, which the host build hands to DeepSpeed
    return model


def cast_parameters(model: Any, dtype: Any) -> None:
    """Every floating parameter of `model` in `dtype` (None: as they are), in place, as DeepSpeed's
    engine casts them for bf16/fp16 at initialize; buffers keep their dtype there too."""
    for param in model.parameters():
        param.data = placed(param.data, dtype=dtype)


PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def rank_placement(precision: str) -> tuple[Any, Any]:
    """(device, dtype) a rank trains its parameters on: DeepSpeed's engine device (the accelerator's
    device of LOCAL_RANK, as the engine picks it; the CPU on CPU ranks) and train.precision's dtype
    (with bf16/fp16 DeepSpeed trains the module's parameters in it, its optimizer holding fp32
    master copies made from them).

        rank_placement("bf16")      # (device(type='cuda', index=3), torch.bfloat16) on local rank 3
    """
    import torch

    device = torch.device(accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))
    return device, getattr(torch, PRECISION_DTYPES[precision])


def built_line(model: Any, peak: Any) -> str:
    """The start-up line on where `model`'s parameters were made and the host memory it took
    (`peak`: construct.host_peak's measure of the build).

        dsf: model built: parameters on cuda:0 in bfloat16; host peak RSS 2.10 GiB while building (+0.12 GiB)
    """
    places = sorted({f"{p.device} in {str(p.dtype).removeprefix('torch.')}" for p in model.parameters()
                     if p.device.type != "meta"})
    gib = 2**30
    peak_words = f"host peak RSS {peak.peak / gib:.2f} GiB " + (
        f"while building (+{max(0, peak.peak - peak.before) / gib:.2f} GiB)" if peak.reset else "so far")
    return f"dsf: model built: parameters on {', '.join(places) or 'no device'}; {peak_words}"
