"""Every valid layout of a job on a cluster, checked against memory and ranked by speed.

    plan = search(desc, cluster, Workload(seq_len=4096, global_batch=512, precision="bf16"))
    plan.best                        # the fastest candidate that fits (None if none does)
    plan.fitting[:5]                 # ranked by predicted tokens/s
    plan.dropped_families            # {"ZeRO-2": "needs 92.1 GiB > 80.0 GiB per GPU at best ...", ...}
                                     # and the splits the model refuses: {"tp=2": "tensor parallelism refused: ..."}
    plan.suggestions                 # when nothing fits: what would

The rules are the functions dsf train's pre-flight calls: the model's own (models/plans.py
`architecture_problem`, met through shard_model and the pipeline adapter, and
`context_parallel_layout_problem`; models/experts.py `expert_parallel_problem`; layout.py
`chunked_loss_problem`) and layout.layout_problem's (dp * tp * pp * cp = world;
tp divides the attention and key/value heads and stays within a node; cp divides the heads per
tensor rank and the sequence, and divides or is a multiple of the kv heads; pp <= layers; the
pipeline only with ZeRO 0/1 and without cp; hpZ only with ZeRO-3, tp = 1, dividing dp * cp), plus
the search's own: micro_batch * grad_accum * dp = global batch; parameter offload only with
ZeRO-3 and optimizer offload; optimizer offload with ZeRO 1-3; hpZ groups within a node and
smaller than the ZeRO group (a group of all of them is plain ZeRO-3 with a second copy). A candidate fits when its busiest rank, plus the safety
margin, stays within the GPU's memory, and a node's host memory holds what the run puts there:
its ranks' shares while they are built plus their offloaded states, and `dsf export`.
Every layout that fits gets ZeRO's knobs from the memory it leaves free (planner/knobs.py), and
is ranked with them: `plan.best.knobs.why` says what was chosen and why.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Iterator

from dsframework.errors import UserError
from dsframework.layout import ParallelDims, chunked_loss_problem, grid_problem, layout_problem
from dsframework.models.experts import expert_parallel_problem
from dsframework.models.plans import context_parallel_layout_problem
from dsframework.planner.cluster import Cluster, GiB, resize
from dsframework.planner.fit import check_fit
from dsframework.planner.knobs import KnobChoice, with_knobs
from dsframework.planner.memory import HostMemory, Workload, Layout, Memory
from dsframework.planner.desc import ModelDesc
from dsframework.planner.speed import StepTime, step_time
from dsframework.runtime_facts import sequence_parallel_auto

MAX_MICRO_BATCH = 64


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    why_not: str = ""  # when it does not fit
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    host: HostMemory | None = None  # one node's host memory: build, offload, export
    over: float = 0.0  # need / available on the tighter side, device or host (> 1: does not fit)
    knobs: KnobChoice | None = None  # ZeRO's knobs chosen from the free memory (layout.knobs), and why

    @property
    def family(self) -> str:
        return family_of(self.layout)

    def as_dict(self) -> dict:
        """The `dsf plan --json` record (schema in docs/planner.md)."""
        lay = self.layout
        return {"dp": lay.dims.dp, "tp": lay.dims.tp, "pp": lay.dims.pp, "cp": lay.dims.cp, "zero_stage": lay.dims.zero_stage,
                "zero_hpz": lay.dims.zero_hpz,
                "offload_optimizer": "cpu" if lay.offload_optimizer else "none",
                "offload_param": "cpu" if lay.offload_param else "none",
                "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
                "activation_checkpointing": lay.activation_checkpointing, "sequence_parallel": lay.sequence_parallel,
                "fits": self.fits,
                "memory": self.memory.as_dict(), "cpu_memory": self.memory.cpu_per_rank * self._ranks_per_node,
                "host_memory": self.host.as_dict() if self.host else None,
                "zero_knobs": lay.knobs.changed(lay.dims.zero_stage),
                "step_time_s": self.time.total, "step_parts_s": asdict(self.time), "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu}

    _ranks_per_node: int = field(default=1, compare=False)


@dataclass
class Plan:
    desc: ModelDesc
    cluster: Cluster
    job: Workload
    candidates: list[Candidate]
    dropped_families: dict[str, str]
    suggestions: list[str]

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    @property
    def best(self) -> Candidate | None:
        fitting = self.fitting
        return fitting[0] if fitting else None


def family_of(layout: Layout) -> str:
    """'ZeRO-2', 'ZeRO-3 + hpZ', 'ZeRO-3 + offload (optimizer, params)', ... for the
    dropped-families report."""
    name = (f"ZeRO-{layout.dims.zero_stage}" + (" + hpZ" if layout.dims.zero_hpz > 1 else "")
            + (" + ep" if layout.dims.ep > 1 else ""))
    offloaded = [what for what, on in (("optimizer", layout.offload_optimizer), ("params", layout.offload_param)) if on]
    return name + (f" + offload ({', '.join(offloaded)})" if offloaded else "")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def cp_problem(desc: ModelDesc, seq_len: int | None) -> UserError | None:
    """Why context parallelism would change this model's attention, or None: models/plans.py's
    `context_parallel_layout_problem`, the rule dsf train's pre-flight applies, on the description."""
    return context_parallel_layout_problem(desc.model_type, cp=2, seq_len=seq_len, window=desc.sliding_window,
                                           softcapped=desc.attn_softcapping, problem=desc.cp_problem)


def unavailable(desc: ModelDesc, cluster: Cluster, *, tp: int | None = None,
                pp: int | None = None, seq_len: int | None = None) -> dict[str, str]:
    """{'tp=2': why, 'pp > 1': why, 'cp > 1': why}: the splits the model's own adapters refuse
    (shard_model has no plan for the architecture, the pipeline no adapter, context parallelism
    another attention), among those the cluster would allow."""
    refused = {f"tp={t}": f"tensor parallelism refused: {desc.tp_problem(t)}" for t in _divisors(cluster.gpus_per_node)
               if (tp is None or t == tp) and cluster.world % t == 0 and desc.heads % t == 0
               and desc.tp_problem(t) is not None}
    if (pp is None or pp > 1) and cluster.world > 1 and desc.layers > 1 and desc.pp_problem is not None:
        refused["pp > 1"] = f"pipeline parallelism refused: {desc.pp_problem}"
    cp_refusal = cp_problem(desc, seq_len) if seq_len is not None and cluster.world > 1 else None
    if cp_refusal is not None:
        refused["cp > 1"] = f"context parallelism refused: {cp_refusal.rule}"
    return refused


def expert_sizes(desc: ModelDesc, dims: ParallelDims, ep: int | None) -> list[int]:
    """The ep sizes of a grid: 1, and every ep > 1 that the model's expert rule (models/experts.py
    `expert_parallel_problem`, which dsf train's pre-flight applies) and the grid's (layout.py
    `grid_problem`: ep divides dp, composes with dp and ZeRO only) allow (`ep` pins one)."""
    sizes = [1] + [e for e in _divisors(dims.dp) if e > 1
                   and expert_parallel_problem(desc.model_type, desc.experts, ep=e) is None
                   and grid_problem(replace(dims, ep=e)) is None]
    return [e for e in sizes if ep is None or e == ep]


def enumerate_layouts(desc: ModelDesc, cluster: Cluster, job: Workload, *, tp: int | None = None,
                      pp: int | None = None, zero_stage: int | None = None, cp: int | None = None,
                      ep: int | None = None) -> Iterator[Layout]:
    """Every layout the rules allow (pin tp, pp, cp, ep or zero_stage to restrict), within what the
    model's adapters can split (`unavailable`)."""
    world, per_node = cluster.world, cluster.gpus_per_node
    for t in _divisors(per_node):
        if (tp is not None and t != tp) or world % t or (desc.heads % t == 0 and desc.tp_problem(t)):
            continue
        for p in _divisors(world // t):
            pipeline_refused = p > 1 and (desc.pp_problem or chunked_loss_problem(job.chunked_loss, pp=p))
            if (pp is not None and p != pp) or pipeline_refused:
                continue
            for c in _divisors(world // (t * p)):
                if (cp is not None and c != cp) or (c > 1 and cp_problem(desc, job.seq_len)):
                    continue
                dims = ParallelDims(world=world, tp=t, pp=p, cp=c)
                if layout_problem(dims, num_heads=desc.heads, num_kv_heads=desc.kv_heads, num_layers=desc.layers,
                                  seq_len=job.seq_len, ranks_per_node=per_node) is not None:
                    continue
                d = dims.dp
                if job.global_batch % d:
                    continue
                per_replica = job.global_batch // d
                for stage in ((0, 1) if p > 1 else (0, 1, 2, 3)):
                    if zero_stage is not None and stage != zero_stage:
                        continue
                    hpz_sizes = [1] + ([n for n in _divisors(dims.zero_ranks) if 1 < n < dims.zero_ranks
                                        and n <= per_node] if stage == 3 and t == 1 else [])
                    offloads = [(False, False)] + ([(True, False)] if stage >= 1 else []) + (
                        [(True, True)] if stage == 3 else [])
                    grids = [ParallelDims(world=world, tp=t, pp=p, cp=c, zero_stage=stage, zero_hpz=hpz, ep=e)
                             for hpz in hpz_sizes
                             for e in expert_sizes(desc, ParallelDims(world=world, tp=t, pp=p, cp=c, zero_hpz=hpz), ep)]
                    for grid in grids:
                        assert layout_problem(grid, num_heads=desc.heads,
                                              num_kv_heads=desc.kv_heads, num_layers=desc.layers) is None
                        for offload_optimizer, offload_param in offloads:
                            for micro in _divisors(per_replica):
                                if micro > MAX_MICRO_BATCH:
                                    break
                                for checkpointing in ("none", "full"):
                                    yield Layout(grid, offload_optimizer=offload_optimizer, offload_param=offload_param,
                                                 micro_batch=micro, grad_accum=per_replica // micro,
                                                 activation_checkpointing=checkpointing,
                                                 sequence_parallel=sequence_parallel_auto(
                                                     tp=grid.tp, cp=grid.cp, seq_len=job.seq_len, experts=desc.experts))


def evaluate(desc: ModelDesc, layout: Layout, job: Workload, cluster: Cluster, *, knobs: bool = True) -> Candidate:
    """Memory, time and fit of one layout; with `knobs`, one that fits gets ZeRO's knobs chosen from
    the memory it leaves free (knobs.with_knobs) and is priced with them."""
    choice = None
    if knobs:
        layout, fit, choice = with_knobs(desc, layout, job, cluster)
    else:
        fit = check_fit(desc, layout, job, cluster)
    memory, time = fit.memory, step_time(desc, layout, job, cluster)
    ranks_per_node = min(cluster.gpus_per_node, cluster.world)
    why = ""
    if fit.need > fit.available:
        why = f"{fit.need / GiB:.1f} GiB > {fit.available / GiB:.1f} GiB per GPU"
    elif fit.host_need > fit.host_available:
        why = (f"{fit.host_need / GiB:.1f} GiB of host memory per node {fit.host.phase} > "
               f"{fit.host_available / GiB:.1f} GiB")
    tokens_per_s = job.global_batch * job.seq_len / time.total
    peak = cluster.flops(job.precision) * cluster.world
    mfu = tokens_per_s * desc.flops_per_token(job.seq_len) / peak
    over = max(fit.need / fit.available, fit.host_need / fit.host_available)
    return Candidate(layout, memory, time, fits=not why, why_not=why, tokens_per_s=tokens_per_s, mfu=mfu,
                     host=fit.host, over=over, knobs=choice, _ranks_per_node=ranks_per_node)


def _describe(layout: Layout) -> str:
    return f"{layout.dims}, micro-batch {layout.micro_batch}, checkpointing {layout.activation_checkpointing}"


NO_CONTEXT_PARALLEL = "cp 1 (no context parallelism)"


def search(desc: ModelDesc, cluster: Cluster, job: Workload, *, tp: int | None = None, pp: int | None = None,
           zero_stage: int | None = None, cp: int | None = None, ep: int | None = None, suggest: bool = True,
           knobs: bool = True) -> Plan:
    """All candidates, fitting ones first by predicted tokens/s, then the rest by memory.

    `dropped_families` gives, for each family (ZeRO stage, hpZ, offload) none of whose layouts
    fits, its closest miss; and when only context-parallel layouts fit, the closest miss without
    (key NO_CONTEXT_PARALLEL): why the plan splits the sequence. `knobs`: choose ZeRO's knobs for
    each fitting layout (evaluate); without, dsf's defaults (what fits is the same either way)."""
    candidates = [evaluate(desc, layout, job, cluster, knobs=knobs)
                  for layout in enumerate_layouts(desc, cluster, job, tp=tp, pp=pp, zero_stage=zero_stage, cp=cp,
                                                  ep=ep)]
    candidates.sort(key=lambda c: (not c.fits, -c.tokens_per_s if c.fits else 0, c.memory.total))
    dropped: dict[str, str] = {}
    fitting_families = {c.family for c in candidates if c.fits}
    for c in sorted(candidates, key=lambda c: c.over):  # the closest miss of each family that never fits
        if not c.fits and c.family not in fitting_families and c.family not in dropped:
            dropped[c.family] = f"needs {c.why_not} at best ({_describe(c.layout)})"
    if fitting_families and not any(c.fits for c in candidates if c.layout.dims.cp == 1):
        misses = [c for c in candidates if c.layout.dims.cp == 1]
        if misses:
            c = min(misses, key=lambda c: c.over)
            dropped[NO_CONTEXT_PARALLEL] = f"needs {c.why_not} at best ({family_of(c.layout)}, {_describe(c.layout)})"
    dropped.update(unavailable(desc, cluster, tp=tp, pp=pp, seq_len=job.seq_len))
    plan = Plan(desc, cluster, job, candidates, dropped, [])
    if suggest and not plan.fitting:
        plan.suggestions = suggestions(desc, cluster, job, candidates, tp=tp, pp=pp, zero_stage=zero_stage, cp=cp,
                                       ep=ep)
    return plan


def suggestions(desc: ModelDesc, cluster: Cluster, job: Workload, candidates: list[Candidate], **pins) -> list[str]:
    """What would make something fit: more nodes, unpinning, and the closest candidate's gap."""
    out = []
    if not candidates:
        return [f"no layout satisfies the rules for {cluster.world} GPUs and global batch {job.global_batch}: "
                "choose a global batch divisible by the data-parallel sizes, or unpin --tp/--pp/--cp/--zero-stage"]
    closest = min(candidates, key=lambda c: c.over)
    out.append(f"closest: {family_of(closest.layout)} ({_describe(closest.layout)}) needs {closest.why_not}")
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = resize(cluster, nodes=cluster.nodes * factor)
        if search(desc, bigger, job, suggest=False, knobs=False, **pins).fitting:
            out.append(f"{bigger.nodes} nodes ({bigger.world} GPUs) would fit")
            break
    if any(pins.values()):
        if search(desc, cluster, job, suggest=False, knobs=False).fitting:
            out.append("unpinning --tp/--pp/--cp/--zero-stage would fit")
    return out


__all__ = ["Candidate", "Plan", "search", "evaluate", "enumerate_layouts", "family_of", "unavailable",
           "NO_CONTEXT_PARALLEL"]
