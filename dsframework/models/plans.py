"""How to shard a transformers causal LM, read from the model's own config: its tensor-parallel
plan (`config.base_model_tp_plan`) and pipeline plan (`config.base_model_pp_plan`).

    plan = architecture_plan(config)          # any model type transformers ships a plan for
    plan.tp                                   # (("layers.*.self_attn.q_proj", "colwise"), ...)
    plan.pp.layers                            # "layers": the decoder layers' ModuleList
    check_architecture(config, tp=2, pp=2)    # UserError (one line) unless both can run

transformers writes the plans for its own tensor parallelism and pipeline support, for 116
causal-LM types: dsframework applies them with its own Megatron layers (models/tensor_parallel.py)
and DeepSpeed's pipeline engine (models/pipeline.py) instead of a hand-written plan per family.
A plan names a style per module pattern; `STYLES` maps transformers' style names (today's and
older releases') to what dsframework does. A style it does not implement (experts, MLA,
sequence parallelism, ...) refuses tp > 1 in one line before any rank starts, never a partial
plan. GPT-2 has no plan in transformers; its plan is `EXTRA_PLANS` data of the same kind.

Pure: reads configs, no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dsframework.errors import UserError
from dsframework.models.experts import ROUTER_LOSS_LAYOUTS, router_loss_problem
from dsframework.types import HFConfig

# transformers' style name -> dsframework's layer (models/tensor_parallel.py).
STYLES: dict[str, str] = {
    "colwise": "column", "local_colwise": "column",                     # output features split
    "colwise_gather_output": "column_gather", "colwise_rep": "column_gather", "gather": "column_gather",
    "rowwise": "row", "local_rowwise": "row",                           # input features split, output summed
    "rowwise_split_input": "row_split_input", "rowwise_rep": "row_split_input",
    "packed_colwise": "packed_column", "local_packed_colwise": "packed_column",  # fused [gate | up]: each part split
    "embedding_rowwise": "vocab_embedding",                             # vocabulary split
    "replicated_with_grad_allreduce": "grad_allreduce",                 # e.g. Qwen3's per-head q_norm/k_norm
    "replicate": "replicated", "local": "replicated",
}
WORKING_LAYOUTS = "ZeRO 0-3 and context parallelism (parallel.cp) work for every model"


@dataclass(frozen=True)
class PipelinePlan:
    """The base model's children in forward order: those before the decoder layers (embedding,
    dropout, learned positions), the decoder layers' ModuleList, those after (final norm)."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]


@dataclass(frozen=True)
class ArchitecturePlan:
    """A model type's plans. `tp`: (module pattern relative to the base model, transformers style);
    `packed_parts`: pattern -> parts of a fused output (default 2: gate | up); `tp_problem` /
    `pp_problem`: why tp > 1 / pp > 1 cannot run (None: it can); `working`: the layouts that do."""

    model_type: str
    tp: tuple[tuple[str, str], ...]
    pp: PipelinePlan | None
    packed_parts: tuple[tuple[str, int], ...] = ()
    tp_problem: str | None = None
    pp_problem: str | None = None
    working: str = WORKING_LAYOUTS

    def parts_of(self, pattern: str) -> int:
        return dict(self.packed_parts).get(pattern, 2)


# Model types whose plans transformers does not ship ("tp", "pp"), or whose plan misses a
# tensor ("tp_extra": added to transformers' plan), written as the same data.
EXTRA_PLANS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "tp": {"wte": "embedding_rowwise", "h.*.attn.c_attn": "packed_colwise", "h.*.attn.c_proj": "rowwise",
               "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
        "packed_parts": {"h.*.attn.c_attn": 3},  # [q | k | v], each split by heads
        "pp": {"wte": None, "wpe": None, "drop": None, "h": None, "ln_f": None},
    },
    # xIELU's learned alphas act on each rank's slice of the MLP's width: their gradient is a sum
    # over the slices. transformers' plan leaves them out; without the sum the tensor ranks drift
    # apart (dsf export refuses: "the replicated tensor differs between tensor ranks").
    **{apertus: {"tp_extra": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}}
       for apertus in ("apertus", "apertus1p5_text")},
    # Their per-head q/k norms see each rank's heads only (as Qwen3's do, whose plan lists them);
    # transformers 5.25's plans leave them out, and the tensor ranks drift apart (export refuses).
    **{model_type: {"tp_extra": {"layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                                 "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}}
       for model_type in ("sarvam_moe", "param2moe")},
}
# Styles that split nothing: a plan of these alone leaves every layer whole on every tensor rank.
NOT_SPLIT = {"replicated", "grad_allreduce"}


# Model types whose plan applies but whose sharded forward is measured wrong (bench/architectures.py):
# refused rather than trained on another function.
TP_MEASURED_WRONG: dict[str, str] = {
    "gemma3n_text": "gives other logits than transformers' own at tp 2 (bench/architectures.py: its AltUp and "
                    "per-layer-input projections run outside the plan)",
}
PP_MEASURED_WRONG: dict[str, str] = {}


def _pipeline_plan(pp: dict[str, Any] | None) -> tuple[PipelinePlan | None, str | None]:
    """(the plan, why it cannot be used); (None, None) without one: models/pipeline.py then reads
    the order from the model's children (`infer_pipeline_plan`)."""
    if not pp:
        return None, None
    names = list(pp)
    layered = [name for name in names if name in ("layers", "h", "blocks")]
    if len(layered) != 1:
        return None, f"has a pipeline plan whose decoder layers dsframework cannot find ({', '.join(names)})"
    at = names.index(layered[0])
    return PipelinePlan(first=tuple(names[:at]), layers=layered[0], last=tuple(names[at + 1:])), None


def infer_pipeline_plan(children: list[tuple[str, Any]], num_layers: int) -> PipelinePlan | None:
    """For a model type without `base_model_pp_plan`: the base model's children in registration
    order around its one list of `num_layers` decoder layers (None: no such list). Checked like a
    written plan: the pipeline's logits against the model's own (bench/architectures.py)."""
    lists = [i for i, (_, child) in enumerate(children)
             if type(child).__name__ == "ModuleList" and len(child) == num_layers]
    if len(lists) != 1:
        return None
    at = lists[0]
    return PipelinePlan(first=tuple(n for n, _ in children[:at]), layers=children[at][0],
                        last=tuple(n for n, _ in children[at + 1:]))


def architecture_plan(config: HFConfig) -> ArchitecturePlan:
    """The plans of `config`'s model type (see the module docstring)."""
    model_type = config.model_type
    extra = EXTRA_PLANS.get(model_type, {})
    tp = extra.get("tp") or getattr(config, "base_model_tp_plan", None) or {}
    tp = {**tp, **extra["tp_extra"]} if tp and "tp_extra" in extra else tp
    pp, pp_problem = _pipeline_plan(extra.get("pp") or getattr(config, "base_model_pp_plan", None))
    pp_problem = PP_MEASURED_WRONG.get(model_type, pp_problem)
    router = router_loss_problem(config)  # a stage sees its own layers' routing only
    pp_problem = pp_problem or (router and f"{router} (a stage sees its own layers' routing)")
    tp_problem = None
    if not tp:
        tp_problem = "has no tensor-parallel plan (base_model_tp_plan) in transformers"
    elif model_type in TP_MEASURED_WRONG:
        tp_problem = TP_MEASURED_WRONG[model_type]
    else:
        unknown = sorted({style for style in tp.values() if style not in STYLES})
        if unknown:
            tp_problem = f"uses the tensor-parallel style {', '.join(unknown)}, which dsframework does not implement"
        elif all(STYLES[style] in NOT_SPLIT for style in tp.values()):  # Inkling 2 in transformers 5.25
            styles = ", ".join(f"{pattern}: {style}" for pattern, style in tp.items())
            tp_problem = (f"has a tensor-parallel plan that splits no layer ({styles}): tensor parallelism "
                          "would hold the whole model on every rank")
    return ArchitecturePlan(model_type=model_type, tp=tuple(tp.items()), pp=pp,
                            packed_parts=tuple(extra.get("packed_parts", {}).items()),
                            tp_problem=tp_problem, pp_problem=pp_problem,
                            working=ROUTER_LOSS_LAYOUTS if router else WORKING_LAYOUTS)


def pattern_regex(pattern: str) -> re.Pattern:
    """A plan pattern ("layers.*.self_attn.q_proj") as a regex over module paths ('*': a layer index)."""
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")


def architecture_problem(config: HFConfig, *, tp: int = 1, pp: int = 1,
                         plan: ArchitecturePlan | None = None) -> UserError | None:
    """Why tp > 1 or pp > 1 cannot run for `config`'s model type (no plan, a style dsframework lacks,
    heads not divisible by tp), naming what works; None when both can. dsf train's pre-flight and the
    planner both meet it: through `check_architecture`, which `shard_model` and
    `check_model_parallelism` call (the planner counts a tensor rank's share with `shard_model`)."""
    plan = plan or architecture_plan(config)
    model_type = config.model_type
    if tp > 1 and plan.tp_problem:
        return UserError("parallel.tp", tp, f"cannot shard {model_type!r}: it {plan.tp_problem}",
                         f"use parallel.tp=1 ({plan.working})")
    if tp > 1:
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, field, None)
            if isinstance(heads, int) and heads % tp:
                return UserError("parallel.tp", tp, f"does not divide {model_type}'s {field}={heads}",
                                 f"choose tp among the divisors of {heads}")
    if pp > 1 and plan.pp_problem:
        return pipeline_refusal(model_type, plan.pp_problem, pp=pp, working=plan.working)
    return None


def check_architecture(config: HFConfig, *, tp: int = 1, pp: int = 1) -> ArchitecturePlan:
    """The plan of `config`'s model type; UserError in one line when `architecture_problem` has one."""
    plan = architecture_plan(config)
    problem = architecture_problem(config, tp=tp, pp=pp, plan=plan)
    if problem is not None:
        raise problem
    return plan


def pipeline_refusal(model_type: str, problem: str, *, pp: int | None = None,
                     working: str = WORKING_LAYOUTS) -> UserError:
    """The one-line error for an architecture the pipeline cannot cut (with the user's pp when known)."""
    field, value = ("parallel.pp", pp) if pp is not None else ("model.name", model_type)
    return UserError(field, value, f"cannot cut {model_type!r} into pipeline stages: it {problem}",
                     f"use parallel.pp=1 ({working})")


def sliding_window(config: HFConfig) -> int | None:
    """The attention window of the sliding layers, or None when no layer slides (Qwen 2 names a
    window but slides only where `layer_types` / `use_sliding_window` say)."""
    layer_types = getattr(config, "layer_types", None)
    if (layer_types and "sliding_attention" not in layer_types) or getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


def context_parallel_layout_problem(model_type: str, *, cp: int, seq_len: int | None, window: int | None,
                                    softcapped: bool, problem: str | None,
                                    router_loss: bool = False) -> UserError | None:
    """Why cp > 1 would compute another attention than the model's, or None: the one context-parallel
    rule, which dsf train's pre-flight applies to the config (`check_context_parallel`) and the
    planner to its description of the model (planner/search.py `cp_problem`). dsf's context
    parallelism (parallel/context.py) runs sdpa, causal over the whole gathered sequence, which knows
    neither a sliding `window` shorter than the sequence nor `softcapped` scores; `problem` is
    `context_parallel_problem`'s (a reason at any length), `router_loss` whether the model adds a
    router loss (what works then is said differently)."""
    if cp <= 1:
        return None
    if window is not None and (seq_len is None or window < seq_len):
        return UserError("parallel.cp", cp, f"cannot run {model_type!r}'s sliding-window attention ({window} tokens, "
                         f"sequences of {seq_len}): the context-parallel attention is causal over the whole sequence",
                         f"use parallel.cp=1 (tensor and pipeline parallelism, ZeRO), or data.seq_len <= {window}")
    if softcapped:
        return UserError("parallel.cp", cp, f"cannot run {model_type!r}'s softcapped attention scores "
                         "(attn_logit_softcapping): the context-parallel attention is sdpa's",
                         "use parallel.cp=1 (tensor and pipeline parallelism, ZeRO)")
    if problem:
        working = ROUTER_LOSS_LAYOUTS if router_loss else "tensor and pipeline parallelism, ZeRO"
        return UserError("parallel.cp", cp, f"cannot split {model_type!r}'s sequences: it {problem}",
                         f"use parallel.cp=1 ({working})")
    return None


def check_context_parallel(config: HFConfig, *, cp: int, seq_len: int | None) -> None:
    """UserError when cp > 1 would compute another attention than `config`'s model
    (`context_parallel_layout_problem` with what the config says)."""
    problem = context_parallel_layout_problem(
        config.model_type, cp=cp, seq_len=seq_len, window=sliding_window(config),
        softcapped=bool(getattr(config, "attn_logit_softcapping", None)), problem=context_parallel_problem(config),
        router_loss=router_loss_problem(config) is not None)
    if problem is not None:
        raise problem


# layer_types entries that are attention; any other (linear_attention, conv, mamba, hybrid) mixes tokens
# in a recurrence or a convolution, which context parallelism would run on each rank's sequence shard alone
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
# Measured (bench/architectures.py, cp2): DeepSpeed's Ulysses attention asserts position_ids in every call
CP_MEASURED_WRONG: dict[str, str] = {
    "cohere_compass_text": "calls its attention without position_ids, which DeepSpeed's Ulysses attention requires",
}


def context_parallel_problem(config: HFConfig) -> str | None:
    """Why context parallelism (Ulysses: attention sees every token, all else its rank's shard) would
    compute another model than `config`'s, whatever the sequence length; None when it would not."""
    mixers = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if mixers:
        return (f"has {', '.join(mixers)} layers, which mix tokens outside attention (a rank would see only "
                "its shard of the sequence)")
    if getattr(config, "kv_lora_rank", None):
        return ("uses multi-head latent attention (kv_lora_rank), whose query and value heads differ in size, "
                "which DeepSpeed's Ulysses attention does not take")
    router = router_loss_problem(config)
    if router:
        return f"{router} (a rank sees its shard of the tokens)"
    return CP_MEASURED_WRONG.get(config.model_type)
