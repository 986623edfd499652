"""Why a layout takes the time it does, in numbers: its step split into parts, and its MFU.

    print("\n".join(step_split_lines(plan)))      # the first choice and the runner-up, one line each
    wanted = parse_layout("tp=8 pp=8 zero=1 micro=1 ckpt=full")   # UserError naming a bad key or value
    print(explain_line(named_candidate(plan, wanted, "tp=8 pp=8 ...")))

A line reads

    1st, tp 8 x pp 8 x cp 1 x dp 16, ZeRO-1, micro-batch 1 x 96, checkpointing full: step 12.3 s =
    matmul and attention 8.1 s (66%) + memory-bound 0.9 s (7%) + tensor all-reduces 1.1 s (9%) + ...; MFU 45.2%

(on one line). Collectives are the exposed part: what the speed model hides behind compute
(planner/speed.py's overlaps) is not in them; the parts add up to the step.
"""
from __future__ import annotations

from dsframework.errors import UserError
from dsframework.planner.search import Candidate, Plan, family_of

# (StepTime field, what it is in the plan's words), in the order a step spends them
PARTS = (("compute", "matmul and attention"), ("memory_bound", "memory-bound (norms, residuals, loss)"),
         ("tp_comm", "tensor all-reduces"), ("cp_comm", "Ulysses all-to-alls"), ("ep_comm", "expert all-to-alls"),
         ("dp_comm", "ZeRO collectives (exposed)"), ("pp_bubble", "pipeline bubble"), ("pp_comm", "pipeline sends"),
         ("offload", "offload"), ("overhead", "host overhead (exposed)"))
# --explain's keys: what the user writes -> the candidate's value it names
KEYS = {"tp": lambda c: c.layout.dims.tp, "pp": lambda c: c.layout.dims.pp, "cp": lambda c: c.layout.dims.cp,
        "ep": lambda c: c.layout.dims.ep, "dp": lambda c: c.layout.dims.dp,
        "zero": lambda c: c.layout.dims.zero_stage, "hpz": lambda c: c.layout.dims.zero_hpz,
        "micro": lambda c: c.layout.micro_batch, "ckpt": lambda c: c.layout.activation_checkpointing,
        "offload": lambda c: "+".join(w for w, on in (("opt", c.layout.offload_optimizer),
                                                      ("param", c.layout.offload_param)) if on) or "none"}
TEXT_KEYS = {"ckpt": ("none", "full"), "offload": ("none", "opt", "opt+param")}
EXAMPLE = "tp=8 pp=8 zero=1 micro=1 ckpt=full"


def step_parts(candidate: Candidate) -> dict[str, float]:
    """{StepTime field: seconds} of the parts that cost anything, in PARTS' order."""
    return {field: getattr(candidate.time, field) for field, _ in PARTS if getattr(candidate.time, field) > 0}


def explain_line(candidate: Candidate, label: str = "") -> str:
    """One line: the layout, its step split into parts (seconds and share) and its MFU; why it does
    not fit, when it does not."""
    lay, total = candidate.layout, candidate.time.total
    names = dict(PARTS)
    split = " + ".join(f"{names[field]} {seconds:.3g} s ({seconds / total:.0%})"
                       for field, seconds in step_parts(candidate).items())
    head = (f"{label + ', ' if label else ''}{lay.dims}, {family_of(lay)}, micro-batch {lay.micro_batch} x "
            f"{lay.grad_accum}, checkpointing {lay.activation_checkpointing}")
    fit = "" if candidate.fits else f" [does not fit: needs {candidate.why_not}]"
    return f"{head}: step {total:.3g} s = {split}; MFU {candidate.mfu:.1%}{fit}"


def step_split_lines(plan: Plan) -> list[str]:
    """The first choice and the runner-up, each with its step split (nothing when nothing fits)."""
    ranked = plan.fitting[:2]
    if not ranked:
        return []
    return ["why, in numbers (one optimizer step of the busiest rank):"] + [
        "  " + explain_line(c, label) for c, label in zip(ranked, ("1st", "2nd"))]


def parse_layout(text: str) -> dict[str, int | str]:
    """`--explain`'s LAYOUT: `key=value` pairs (spaces or commas between) of KEYS; the rest free."""
    wanted: dict[str, int | str] = {}
    for pair in text.replace(",", " ").split():
        key, sep, value = pair.partition("=")
        if not sep or key not in KEYS:
            raise UserError("--explain", text, f"has {pair!r}, not key=value with a key of {', '.join(KEYS)}",
                            f"name the layout like '{EXAMPLE}'")
        if key in TEXT_KEYS:
            if value not in TEXT_KEYS[key]:
                raise UserError("--explain", text, f"gives {key}={value}", f"use {key}={' or '.join(TEXT_KEYS[key])}")
            wanted[key] = value
        elif value.isdigit() and (int(value) <= 3 if key == "zero" else int(value) > 0):
            wanted[key] = int(value)
        else:
            raise UserError("--explain", text, f"gives {key}={value}",
                            f"use {'a ZeRO stage, 0-3' if key == 'zero' else 'a positive whole number'} for {key}")
    if not wanted:
        raise UserError("--explain", text, "names no size", f"name the layout like '{EXAMPLE}'")
    return wanted


def named_candidate(plan: Plan, wanted: dict[str, int | str], text: str) -> Candidate:
    """The plan's candidate that has every named value: the fastest that fits, else the closest miss;
    UserError when the plan considered none (the rules refuse it, or the batch does not split so)."""
    matching = [c for c in plan.candidates if all(KEYS[k](c) == v for k, v in wanted.items())]
    if not matching:
        raise UserError("--explain", text, f"matches none of the {len(plan.candidates)} layouts dsf considers "
                        f"for {plan.cluster.world} GPUs and global batch {plan.job.global_batch} (the rules under "
                        "'dropped' refuse it, or its sizes do not divide the GPUs or the batch)",
                        "name fewer fields, or sizes from the table")
    fitting = [c for c in matching if c.fits]
    return max(fitting, key=lambda c: c.tokens_per_s) if fitting else min(matching, key=lambda c: c.over)
