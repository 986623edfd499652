"""A Plan as text (the `dsf plan` table), as JSON records, and as files `dsf train` runs.

    print(plan_table(plan, top=5))
    records = [c.as_dict() for c in plan.candidates]          # --json
    run_config_dict(plan.best, model_name="llama-7b", seq_len=4096, global_batch=512, precision="bf16")
    knobs_lines(plan.best)                                    # ZeRO's knobs the plan chose, and why
    headroom_line(plan, plan.best)    # one line when its peak leaves under 10% of the usable memory free

The table ends with the best layout, the step split of the first choice and the runner-up
(planner/explain.py) and the knobs:

    best: ZeRO-3, tp 1 pp 1 dp 8, micro-batch 2 x 4, checkpointing none: 9,321 tokens/s predicted
    why, in numbers (one optimizer step of the busiest rank):
      1st, tp 1 x pp 1 x cp 1 x dp 8, ZeRO-3, ...: step 3.52 s = matmul and attention 2.9 s (82%) + ...; MFU 41.0%
      2nd, ...
    knobs: persistence_threshold 16,777,216, prefetch_bucket 270,532,608, max_live_parameters ..., reduce_bucket ...
      43.13 GiB free per rank; the knobs may take 50% of it, 7.19 GiB each
      persistence threshold 16,777,216: tensors of <= 16,777,216 elements stay whole on every rank (+4.00 GiB) ...
"""
from __future__ import annotations

from typing import Any

from dsframework.planner.cluster import GiB
from dsframework.planner.explain import step_split_lines
from dsframework.planner.fit import usable_gpu_memory
from dsframework.planner.memory import loss_chunk
from dsframework.planner.search import Candidate, Plan, family_of


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def candidate_row(rank: int, c: Candidate) -> list[str]:
    lay, mem = c.layout, c.memory
    offload = "+".join(w for w, on in (("opt", lay.offload_optimizer), ("param", lay.offload_param)) if on) or "-"
    zero = f"{lay.dims.zero_stage} hpZ{lay.dims.zero_hpz}" if lay.dims.zero_hpz > 1 else str(lay.dims.zero_stage)
    dp = f"{lay.dims.dp} ep{lay.dims.ep}" if lay.dims.ep > 1 else str(lay.dims.dp)  # (as hpZ beside ZeRO)
    return [str(rank), str(lay.dims.tp), str(lay.dims.pp), str(lay.dims.cp), dp, zero, offload,
            f"{lay.micro_batch}x{lay.grad_accum}", lay.activation_checkpointing,
            _gib(mem.params), _gib(mem.grads), _gib(mem.optimizer), _gib(mem.activations), _gib(mem.buffers),
            _gib(mem.total), _gib(mem.cpu_per_rank), _gib(c.host.peak) if c.host else "-", f"{c.time.total:.3g}",
            f"{c.tokens_per_s:,.0f}", f"{c.mfu:.2f}"]


HEADER = ["#", "tp", "pp", "cp", "dp", "ZeRO", "offload", "micro x accum", "ckpt", "params", "grads", "optim",
          "activ", "buffers", "total GiB", "cpu GiB", "host GiB", "step s", "tokens/s", "MFU"]


def _markdown(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.rjust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plan_table(plan: Plan, *, top: int = 5) -> str:
    """Heading, the top fitting layouts with their memory per GPU, dropped families, advice."""
    desc, cluster, job = plan.desc, plan.cluster, plan.job
    out = [f"{desc.name}: {desc.total_params / 1e9:.3g} B parameters ({desc.layers} layers, hidden {desc.hidden}, "
           f"{desc.heads} heads / {desc.kv_heads} kv); {cluster.name}: {cluster.nodes} x {cluster.gpus_per_node} "
           f"GPUs of {_gib(cluster.memory_per_gpu)} GiB; seq {job.seq_len}, global batch {job.global_batch}, "
           f"{job.precision}; {len(plan.candidates)} layouts, {len(plan.fitting)} fit",
           "(memory per GPU of the busiest rank, GiB; cpu: offloaded per rank; host: per node of "
           f"{_gib(cluster.cpu_memory_per_node)} GiB RAM, its ranks building their shares + offloaded, or dsf export)",
           ""]
    fitting = plan.fitting[:top]
    if fitting:
        out.append(_markdown([HEADER] + [candidate_row(i + 1, c) for i, c in enumerate(fitting)]))
    else:
        out.append("nothing fits.")
    if plan.dropped_families:
        out.append("")
        out.append("dropped:")
        out += [f"  {family}: {why}" for family, why in plan.dropped_families.items()]
    if plan.suggestions:
        out.append("")
        out.append("what would fit:")
        out += [f"  {line}" for line in plan.suggestions]
    best = plan.best
    if best is not None:
        out.append("")
        out.append(f"best: {family_of(best.layout)}, {best.layout.dims}, "
                   f"micro-batch {best.layout.micro_batch} x {best.layout.grad_accum}, checkpointing "
                   f"{best.layout.activation_checkpointing}: {best.tokens_per_s:,.0f} tokens/s predicted")
        if best.layout.dims.cp > 1:
            flat = next((c for c in plan.fitting if c.layout.dims.cp == 1), None)
            if flat is not None:  # (when none fits, `dropped` says why)
                out.append(f"  fastest without context parallelism: {flat.layout.dims}, "
                           f"{flat.tokens_per_s:,.0f} tokens/s ({flat.tokens_per_s / best.tokens_per_s:.0%} of the best)")
        if best.layout.dims.ep > 1:
            out.append(expert_parallel_reason(plan, best))
        tight = headroom_line(plan, best)
        if tight:
            out.append(tight)
        out += step_split_lines(plan)
        out += knobs_lines(best)
    return "\n".join(out)


TIGHT_HEADROOM = 0.10  # below this share of the usable memory left free, the plan says so


def headroom_line(plan: Plan, candidate: Candidate) -> str | None:
    """One line when `candidate`'s predicted peak leaves under 10% of the usable memory per GPU free
    (the fit rule's 10% margin is on the peak, so a first choice can come this close): the figures, and
    what to try if the first steps run out of memory. None otherwise."""
    usable, peak, lay = usable_gpu_memory(plan.cluster), candidate.memory.total, candidate.layout
    headroom = 1 - peak / usable
    if headroom >= TIGHT_HEADROOM:
        return None
    tries = [f"a smaller micro-batch (train.micro_batch {lay.micro_batch // 2}, the global batch kept)"
             ] if lay.micro_batch > 1 else []
    if lay.activation_checkpointing == "none":
        tries.append("activation checkpointing (parallel.activation_checkpointing full)")
    tries.append("the next layout of the table")
    return (f"  under {TIGHT_HEADROOM:.0%} memory headroom: predicted peak {_gib(peak)} GiB of {_gib(usable)} GiB "
            f"usable per GPU ({headroom:.1%} free); if the first steps run out of memory, try "
            + (", ".join(tries[:-1]) + " or " if len(tries) > 1 else "") + tries[-1])


def expert_parallel_reason(plan: Plan, best: Candidate) -> str:
    """One line: why the best layout splits the experts (what a rank holds and what the all-to-alls
    cost), beside the best layout that trains them as dense weights and tensor parallelism's fate."""
    ep, experts = best.layout.dims.ep, plan.desc.experts
    states, host = best.memory.params + best.memory.grads + best.memory.optimizer, best.memory.cpu_per_rank
    line = (f"  why ep {ep}: a rank holds {experts // ep} of the {experts} experts, {_gib(states)} GiB of model "
            f"states" + (f" (+ {_gib(host)} GiB in host memory)" if host else "")
            + f", for all-to-alls of {best.time.ep_comm:.2f} s in a {best.time.total:.2f} s step")
    dense = next((c for c in plan.fitting if c.layout.dims.ep == 1), None)
    line += (f"; the experts dense (ep 1) at best: {dense.layout.dims}, {dense.tokens_per_s:,.0f} tokens/s "
             f"({dense.tokens_per_s / best.tokens_per_s:.0%})" if dense
             else "; with the experts dense (ep 1) nothing fits")
    if plan.desc.tp_problem(2):
        return line + "; tensor parallelism: refused (see dropped)"
    if not plan.desc.experts_unsplit:
        return line
    split = next((c for c in plan.fitting if c.layout.dims.tp > 1), None)
    return line + (f"; tensor parallelism keeps all {experts} experts whole on each tensor rank" +
                   (f" (at best {split.layout.dims}, {split.tokens_per_s / best.tokens_per_s:.0%})" if split else
                    ": no such layout fits"))


def knobs_lines(candidate: Candidate) -> list[str]:
    """'knobs: name value, ...' (the ones that differ from dsf's defaults) and the reasons, indented."""
    choice, lay = candidate.knobs, candidate.layout
    if choice is None:
        return []
    changed = lay.knobs.changed(lay.dims.zero_stage)
    head = ", ".join(f"{k} {v:,}" for k, v in changed.items()) or "dsf's defaults"
    return [f"knobs: {head}"] + [f"  {line}" for line in choice.why]


def run_config_dict(candidate: Candidate, *, model_name: str, seq_len: int, global_batch: int,
                    precision: str, output_dir: str = "runs/planned", plan: Plan | None = None) -> dict[str, Any]:
    """The run config (as `dsf train` reads it) of a candidate: its layout, its ZeRO knobs where they
    differ from dsf's defaults, and train.chunked_loss true where the plan counted a chunked loss
    (`plan` gives the model and job to decide that; without it the run keeps `auto`)."""
    lay = candidate.layout
    train: dict[str, Any] = {"global_batch": global_batch, "micro_batch": lay.micro_batch, "grad_accum": None,
                             "precision": precision}
    if plan is not None and loss_chunk(plan.desc, lay, plan.job) is not None:
        train["chunked_loss"] = True
    parallel_knobs = lay.knobs.changed(lay.dims.zero_stage)
    return {
        "model": {"name": model_name},
        "data": {"seq_len": seq_len},
        "train": train,
        "parallel": {"tp": lay.dims.tp, "pp": lay.dims.pp, "cp": lay.dims.cp, "zero_stage": lay.dims.zero_stage,
                     "zero_hpz": lay.dims.zero_hpz, "ep": lay.dims.ep,
                     "offload_optimizer": "cpu" if lay.offload_optimizer else "none",
                     "offload_param": "cpu" if lay.offload_param else "none",
                     "activation_checkpointing": lay.activation_checkpointing,
                     **({"zero_knobs": parallel_knobs} if parallel_knobs else {})},
        "output_dir": output_dir,
    }
