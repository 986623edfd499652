"""Mixture-of-experts models: which configs have experts, how many, DeepSpeed AutoEP's preset for
them, and what `parallel.ep` needs of them.

    moe = expert_layout(config)          # None for a dense model
    moe.experts, moe.top_k               # 4, 2 (a tiny Mixtral)
    check_expert_parallel(config, ep=2)  # UserError (one line) when ep cannot run for it
    train_router_loss(config)            # the model's loss adds router_aux_loss_coef x its aux loss
    describe_experts(config, ep=2)       # '160,768 active per token: 4 experts, top 2, 2 per rank'

Expert parallelism itself is DeepSpeed's AutoEP (`deepspeed/module_inject/auto_ep*.py`): at
`deepspeed.initialize` it finds the MoE blocks of a transformers model (by the preset of its model
type), builds the expert and expert-data groups and swaps in a block that sends tokens to the rank
holding their expert (all-to-all). dsframework writes its JSON section (`dsconfig.py`), checks the
layout before any rank starts (here and `layout.py`), and bridges the installed transformers
(`models/autoep_compat.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from dsframework.errors import UserError
from dsframework.models.hf import causal_lm_class
from dsframework.types import HFConfig

# The config fields transformers' MoE configs name their routed experts and experts per token by.
EXPERTS_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclass(frozen=True)
class ExpertLayout:
    """A MoE config's routed experts and how many each token goes to."""

    experts: int
    top_k: int


# The model types DeepSpeed 0.19's AutoEP presets recognise (auto_ep_presets/*.py `hf_model_types`),
# for the planner, which does not import DeepSpeed; tests/unit/test_experts.py pins it to the registry.
AUTOEP_MODEL_TYPES = frozenset({"mixtral", "qwen3_moe", "qwen2_moe", "qwen3_5_moe_text", "deepseek_v2",
                                "deepseek_v3", "minimax_m3_vl_text"})


def expert_layout(config: HFConfig) -> ExpertLayout | None:
    """The routed experts of `config` (None: a dense model, or an MoE config with one expert)."""
    experts = next((getattr(config, f) for f in EXPERTS_FIELDS if isinstance(getattr(config, f, None), int)), None)
    if not experts or experts < 2:
        return None
    top_k = next((getattr(config, f) for f in TOP_K_FIELDS if isinstance(getattr(config, f, None), int)), 1)
    return ExpertLayout(experts=experts, top_k=top_k)


def autoep_preset(model_type: str) -> str | None:
    """The name of DeepSpeed AutoEP's preset for a transformers model type, or None."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return next((name for name, preset in PRESET_MODELS.items() if model_type in preset.hf_model_types), None)


def autoep_model_types() -> list[str]:
    """Every model type some AutoEP preset recognises (for the refusals' 'what works')."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return sorted({t for preset in PRESET_MODELS.values() for t in preset.hf_model_types})


def expert_parallel_problem(model_type: str, experts: int, *, ep: int, autoep: bool = False) -> UserError | None:
    """Why a model of `model_type` with `experts` routed experts (0: dense) cannot train at ep (or in
    AutoEP's blocks at ep 1, `autoep`), or None: a dense model, an MoE type DeepSpeed's AutoEP has no
    preset for, or ep not dividing the experts. The one expert-parallel rule of the model, which dsf
    train's pre-flight applies to the config (`check_expert_parallel`) and the planner to its
    description (planner/search.py `expert_sizes`); which axes ep composes with is layout.py's."""
    if ep <= 1 and not autoep:
        return None
    field, value, off = ("parallel.ep", ep, "parallel.ep=1") if ep > 1 else ("parallel.autoep", True,
                                                                           "parallel.autoep=false")
    if experts < 2:
        return UserError(field, value, f"needs a mixture-of-experts model; {model_type!r} has no routed experts",
                         f"set {off} (dense models train with dp, tp, pp, cp and ZeRO)")
    if model_type not in AUTOEP_MODEL_TYPES:  # pinned to DeepSpeed's registry by tests/unit/test_experts.py
        return UserError(field, value, f"cannot split {model_type!r}'s experts: DeepSpeed's AutoEP has no preset "
                         f"for it (it knows {', '.join(sorted(AUTOEP_MODEL_TYPES))})",
                         f"set {off} (its experts then train as dense weights under ZeRO)")
    if experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        return UserError("parallel.ep", ep, f"does not divide {model_type}'s {experts} experts",
                         f"choose ep in {{{', '.join(map(str, divisors))}}}")
    return None


def check_expert_parallel(config: HFConfig, *, ep: int, autoep: bool = False) -> None:
    """UserError in one line, before any rank starts, when `config`'s model cannot train at ep
    (`expert_parallel_problem` with its routed experts)."""
    moe = expert_layout(config)
    problem = expert_parallel_problem(config.model_type, moe.experts if moe else 0, ep=ep, autoep=autoep)
    if problem is not None:
        raise problem


def train_router_loss(config: HFConfig) -> bool:
    """Turn on the router's load-balancing loss for training, as transformers computes it: with
    `output_router_logits` the CausalLM's forward adds `router_aux_loss_coef` x its aux loss to
    the loss (off by default in most MoE configs, which are written for inference). True when it
    did; a config that sets it to False on purpose (model.overrides) is left alone by the caller."""
    if expert_layout(config) is None or not hasattr(config, "output_router_logits"):
        return False
    config.output_router_logits = True
    return True


ROUTER_LOSS_LAYOUTS = ("ep, dp and ZeRO 0-3 train it with that loss; model.overrides.output_router_logits=false "
                       "trains it without")


def router_loss_problem(config: HFConfig) -> str | None:
    """Why a layout that splits a micro-batch's routing between ranks (pipeline stages, sequence
    shards) would train another loss than `config`'s model: its forward adds the router's
    load-balancing loss, computed once over every layer's routing of every token of the micro-batch
    (a product of means, which no sum of per-stage or per-shard terms gives). None when it adds none
    (a dense model, `output_router_logits` off, a zero coefficient)."""
    if (expert_layout(config) is None or not getattr(config, "output_router_logits", False)
            or not getattr(config, "router_aux_loss_coef", 0)):
        return None
    return ("adds its router's load-balancing loss, which transformers computes over every layer's routing of the "
            "whole micro-batch at once")


def routed_expert_parameters(config: HFConfig) -> tuple[int, int]:
    """(all parameters, those of the routed experts) of `config`'s model, counted on the meta device.
    Routed experts are the tensors under an `experts` module (shared experts and routers are not)."""
    import torch

    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, routed


def describe_experts(config: HFConfig, *, ep: int) -> str | None:
    """What the run's first line says of its experts (None for a dense model): the parameters a token
    passes through (the dense part and top_k of the routed experts), experts, top-k, experts per rank."""
    moe = expert_layout(config)
    if moe is None:
        return None
    total, routed = routed_expert_parameters(config)
    active = total - routed + routed * moe.top_k // moe.experts
    return f"{active:,} active per token: {moe.experts} experts, top {moe.top_k}, {moe.experts // ep} per rank"
