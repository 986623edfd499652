"""Will a run config fit at its own layout? planner/fit.py's rule asked of the model the run names,
counted on a meta model (torch: the one part of the fit rule `dsf plan`'s cached second run does not
import): `dsf launch` asks it of the one layout the run config names before any node starts, and
`dsf train`'s pre-flight on every rank (a GPU rank: its host memory alone).

    run_fit = fit_run(run, config, dims, cluster)           # a run config at its layout
    error = run_fit.refusal(run, source="h100-80gb", preset="h100-80gb", nodes=2, ranks_per_node=8)
    error = run_fit.refusal(..., device=False, verb="train")   # a GPU rank: the host's memory alone

A LoRA run counts gradients and optimizer states of its adapters alone (models/lora.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dsframework.dsconfig import resolve_batch
from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.models.lora import count_lora_parameters
from dsframework.planner.cluster import Cluster, GiB
from dsframework.planner.fit import Fit, check_fit, run_job, run_layout
from dsframework.planner.memory import Layout, Workload
from dsframework.planner.model import describe_model


@dataclass(frozen=True)
class RunFit:
    """A run config's Fit at its own layout, with what it was asked with (for its one-line refusal)."""

    fit: Fit
    layout: Layout
    job: Workload
    lora: str  # '; LoRA: 103,546,880 of 69,... parameters train', or '' for full fine-tuning

    def summary(self, source: str) -> str:
        """'predicted X GiB of Y GiB available (source); host H GiB of R GiB per node[; LoRA: ...]'."""
        fit = self.fit
        return (f"predicted {fit.need / GiB:.2f} GiB of {fit.available / GiB:.1f} GiB available ({source}); "
                f"host {fit.host_need / GiB:.2f} GiB of {fit.host_available / GiB:.1f} GiB per node{self.lora}")

    def refusal(self, run: Any, *, source: str, preset: str, nodes: int, ranks_per_node: int, device: bool = True,
                note: str = "", verb: str = "launch") -> UserError | None:
        """The one line when the run does not fit, else None: the busiest rank's memory and a node's
        host memory, or with device=False (a GPU rank in `dsf train`: its device is not the host) the
        host's alone. The fix is the `dsf plan` that finds a layout that fits, on `preset`."""
        fit, layout, job = self.fit, self.layout, self.job
        on_device = device and fit.need > fit.available
        if not on_device and fit.host_fits:
            return None
        plan = (f"dsf plan --model {run.model.name} --cluster {preset} --nodes {nodes} "
                f"--gpus-per-node {ranks_per_node} --seq-len {job.seq_len} --global-batch {job.global_batch} "
                f"--precision {job.precision}")
        return UserError("memory per rank" if on_device else "host memory per node", None,
                         f"{fit.why_not if on_device else fit.host_why_not} ({source}) for {layout.dims}, "
                         f"ZeRO-{layout.dims.zero_stage}, micro-batch {layout.micro_batch}",
                         f"find a layout that fits with `{plan}`"
                         + (" (it plans full fine-tuning: LoRA needs less)" if self.lora else "")
                         + note + f", or pass --force to {verb} anyway")


def fit_run(run: Any, config: Any, dims: ParallelDims, cluster: Cluster) -> RunFit:
    """check_fit of a run config (its batch, layout and job) at `dims` on `cluster`; a LoRA run
    (model.lora) counts gradients and optimizer states of its adapters alone (count_lora_parameters)."""
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=dims.dp)
    layout = run_layout(run.parallel, dims, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                        sequence_parallel=run.sequence_parallel)
    job = run_job(run, global_batch=batch.global_batch)
    lora = ""
    if run.model.lora is not None:  # only the adapters have gradients and optimizer states
        count = count_lora_parameters(config, run.model.lora)
        job = replace(job, trainable_params=count.trainable, trainable_persistent=count.persistent)
        lora = f"; LoRA: {count.trainable:,} of {count.total:,} parameters train"
    fit = check_fit(describe_model(config, name=run.model.name), layout, job, cluster)
    return RunFit(fit, layout, job, lora)
