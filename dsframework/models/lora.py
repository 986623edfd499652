"""LoRA adapters through peft: apply them to a built model, say which parameters train, merge them back.

    model = build_model(source, config, seed=run.train.seed, zero3_ds_config=zero3)
    model = apply_lora(model, run.model.lora, seed=run.train.seed)   # a peft PeftModelForCausalLM
    trainable_names(model)      # ['base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight', ...]
    merged = merge_lora(model)  # the plain transformers model, W + (alpha / r) B A in every adapted layer
    count_lora_parameters(config, run.model.lora)   # LoraCount(trainable=..., persistent=..., total=...), on meta

peft does the adapting (`get_peft_model`, `merge_and_unload`); this module only checks the user's
`target_modules` first (a name that matches no layer, or a layer LoRA does not adapt, is one line naming
the closest layer name; `resolve_model` runs the check on a meta model, before anything is written) and seeds the adapters' initialisation with train.seed, so every rank, every
ZeRO stage, a resumed run's rebuild and a single-process reference start from the same adapters (lora_A
random, lora_B zero: the adapted model starts equal to the base). Under ZeRO-3 the base layers are
already partitioned when the adapters are added; the adapters themselves are ordinary parameters that
deepspeed.initialize partitions. The base stays frozen (requires_grad False): DeepSpeed's optimizer only
holds the adapters, and checkpoints save only them (checkpoint.py); the base is rebuilt from model.name.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from dsframework.config import LoraSpec
from dsframework.errors import UserError, did_you_mean
from dsframework.models.hf import causal_lm_class
from dsframework.runtime_facts import ZERO3_PERSISTENCE_THRESHOLD
from dsframework.types import HFConfig


def adaptable_layers(model: Any) -> dict[str, str]:
    """{module name: class name} of the layers peft's LoRA adapts here (linear layers, GPT-2's Conv1D,
    embeddings)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, Conv1D, torch.nn.Embedding)
    return {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, kinds)}


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the whole module name, or its last dotted parts."""
    return name == target or name.endswith("." + target)


def check_target_modules(model: Any, spec: LoraSpec) -> None:
    """UserError (one line) for a target_modules entry that matches no module, or only modules LoRA
    does not adapt; it names the closest adaptable layer name."""
    if isinstance(spec.target_modules, str):  # "all-linear": peft picks every linear layer but the head
        return
    if not spec.target_modules:
        raise UserError("model.lora.target_modules", "[]", "names no module to adapt",
                        "list layer names such as [q_proj, v_proj], or use all-linear")
    layers = adaptable_layers(model)
    leaves = {name.rsplit(".", 1)[-1] for name in layers}
    modules = [name for name, _ in model.named_modules() if name]
    for target in spec.target_modules:
        if any(_matches(name, target) for name in layers):
            continue
        others = [name for name in modules if _matches(name, target)]
        if others:
            kind = type(model.get_submodule(others[0])).__name__
            rule = f"matches {len(others)} {kind} module(s) (e.g. {others[0]}), which LoRA does not adapt"
        else:
            rule = "matches no module of the model"
        raise UserError("model.lora.target_modules", target, rule, did_you_mean(target, leaves))


def check_lora_targets(config: HFConfig, spec: LoraSpec) -> None:
    """`check_target_modules` on a weightless (meta) model of `config`: called when model.name is
    resolved, before a rank writes anything or joins the process group."""
    import torch

    if isinstance(spec.target_modules, str):
        return
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    check_target_modules(model, spec)


def lora_config(spec: LoraSpec) -> Any:
    """peft's LoraConfig for a causal LM from the run config's model.lora."""
    from peft import LoraConfig

    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    return LoraConfig(task_type="CAUSAL_LM", r=spec.r, lora_dropout=spec.dropout, target_modules=targets, bias="none",
                      # peft annotates lora_alpha as int, but only divides by it (scaling = lora_alpha / r)
                      lora_alpha=spec.alpha)  # pyright: ignore[reportArgumentType]  a float alpha: see above


def apply_lora(model: Any, spec: LoraSpec, *, seed: int) -> Any:
    """`model` wrapped by peft with LoRA adapters (initialised from `seed`); only they require grad."""
    import torch
    from peft import get_peft_model

    check_target_modules(model, spec)
    torch.manual_seed(seed)  # the adapters' init: the same on every rank, stage and rebuild
    with warnings.catch_warnings():  # peft's notes: it sets GPT-2 Conv1D's fan_in_fan_out itself; a
        warnings.filterwarnings("ignore", message=r".*fan_in_fan_out.*")  # transformers deprecation it calls
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora_config(spec))


def trainable_names(model: Any) -> list[str]:
    """Names of the parameters that train (the adapters of a peft model; every one of a plain one)."""
    return [name for name, param in model.named_parameters() if param.requires_grad]


def has_frozen_parameters(model: Any) -> bool:
    """Whether this is a LoRA run (peft's `lora_` adapters beside a frozen base): its checkpoints then
    hold only the parameters that train. A frozen parameter of the model's own (afmoe's `expert_bias`,
    moved by its router's load balancing, not by the optimizer) is saved like any other weight."""
    params = list(model.named_parameters())
    return any(not param.requires_grad for _, param in params) and any("lora_" in name for name, _ in params)


def merge_lora(model: Any) -> Any:
    """The base transformers model with the adapters merged into its weights (peft merge_and_unload)."""
    return model.merge_and_unload()


@dataclass(frozen=True)
class LoraCount:
    """Elements of a LoRA model of one config: what the planner's memory model needs (Workload.trainable_params)."""

    trainable: int   # the adapters: the only parameters with gradients and optimizer states
    persistent: int  # of those, in tensors small enough that ZeRO-3 keeps them whole on every rank
    total: int       # every parameter, the frozen base's and the adapters'


def count_lora_parameters(config: HFConfig, spec: LoraSpec) -> LoraCount:
    """The adapters `spec` adds to a model of `config`, counted on a weightless (meta) model with
    peft's own LoRA (the same layers `apply_lora` adapts): cheap even for 70B (about a second)."""
    import torch
    from peft import get_peft_model

    with torch.device("meta"):  # the adapters are made on meta too (real ones would cost seconds at 70B)
        model = causal_lm_class(config)(config)
        check_target_modules(model, spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # apply_lora's notes (fan_in_fan_out, deprecations)
            model = get_peft_model(model, lora_config(spec))
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    return LoraCount(trainable=sum(trainable),
                     persistent=sum(n for n in trainable if n <= ZERO3_PERSISTENCE_THRESHOLD),
                     total=sum(p.numel() for p in model.parameters()))
