"""A run's layout for the world left after a restart (`dsf launch --max-restarts`, launching/restarts.py).

    overrides, dims = replan(run, active, cluster_name=None, was=ParallelDims(world=4, tp=2, pp=2))
    # ['parallel.tp=2', 'parallel.pp=1', ..., 'train.global_batch=32', 'train.micro_batch=8', ...], tp 2 x pp 1 ...

The same world keeps the run's layout (no overrides). Another world is planned with dsf's planner
(planner/search.py) under the rules a restart keeps:
- the same global batch: gradient accumulation absorbs the change of data-parallel ranks;
- the same ZeRO stage, offload and activation checkpointing;
- tp pinned by the run config (parallel.tp > 1) is kept when it still fits (it divides the world
  and stays within a node), else the restart stops in one line; pp, cp and ep are the planner's;
- the layout must fit the memory of the cluster (`--cluster`, else this node's), like `dsf launch`'s
  own check; none fitting stops the restart in one line naming the hosts left.
The fastest fitting layout wins; its micro-batch is the run's (as resolved at the old world) when
that still divides the batch per data-parallel rank, else the planner's. `dsf train --resume` then
reshards the checkpoint to it (docs/checkpoints.md).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from dsframework.dsconfig import resolve_batch
from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.models.build import resolve_model
from dsframework.planner.cluster import load_cluster, local_cluster
from dsframework.planner.fit import run_job
from dsframework.planner.model import describe_model
from dsframework.planner.search import search


def replan(run: Any, active: "OrderedDict[str, list[int]]", *, cluster_name: str | None,
           was: ParallelDims) -> tuple[list[str], ParallelDims]:
    """(the --set overrides that put the run at its new layout, that layout) on `active`'s slots."""
    world = sum(len(slots) for slots in active.values())
    if world == was.world:
        return [], was
    per_node = min(len(slots) for slots in active.values())
    hosts = ", ".join(f"{host} ({len(slots)})" for host, slots in active.items())
    tp = run.parallel.tp
    if tp > 1 and (world % tp or tp > per_node):
        raise UserError("parallel.tp", tp, f"does not fit the {world} ranks left on {hosts} (tp must divide the "
                        f"world and stay within a node of {per_node} ranks)", "restart by hand with a parallel.tp "
                        "that fits, or bring the nodes back")
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=was.dp)
    global_batch = batch.global_batch
    config = resolve_model(run.model).config
    cluster = (load_cluster(cluster_name, nodes=len(active), gpus_per_node=per_node) if cluster_name
               else local_cluster(nodes=len(active), ranks_per_node=per_node)[0])
    plan = search(describe_model(config, name=run.model.name), cluster, run_job(run, global_batch=global_batch),
                  tp=tp if tp > 1 else None, zero_stage=was.zero_stage, suggest=False, knobs=False)
    kept = [c for c in plan.fitting if _keeps_the_run(c.layout, run)]
    if not kept:
        raise UserError("--max-restarts", None, f"cannot restart: the {world} ranks left on {hosts} hold the model "
                        f"at no layout with ZeRO-{was.zero_stage} and global batch {global_batch}",
                        "bring nodes back (edit the hostfile) and dsf launch --resume")
    best = kept[0].layout
    per_replica = global_batch // best.dims.dp  # the planner's layouts divide the global batch
    micro = batch.micro_batch if per_replica % batch.micro_batch == 0 else best.micro_batch
    dims = ParallelDims.of(run.parallel.model_copy(update={"tp": best.dims.tp, "pp": best.dims.pp,
                                                           "cp": best.dims.cp, "ep": best.dims.ep, "dp": None}),
                           world=world)
    return [f"parallel.tp={dims.tp}", f"parallel.pp={dims.pp}", f"parallel.cp={dims.cp}", f"parallel.ep={dims.ep}",
            "parallel.dp=null", f"train.global_batch={global_batch}", f"train.micro_batch={micro}",
            "train.grad_accum=null"], dims


def _keeps_the_run(layout: Any, run: Any) -> bool:
    """Whether a planned layout keeps what a restart does not change: offload, checkpointing, hpZ."""
    parallel = run.parallel
    return (layout.offload_optimizer == (parallel.offload_optimizer != "none")
            and layout.offload_param == (parallel.offload_param != "none")
            and layout.activation_checkpointing == parallel.activation_checkpointing
            and layout.dims.zero_hpz == 1)
