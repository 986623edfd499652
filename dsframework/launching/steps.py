"""The launcher-independent steps of `dsf launch` (dsframework.commands.cli.launch_cmd runs them in this
order), each a function of the flags: the hosts, the layout they get, its memory. What differs
between launchers (their checks, their command, how they start) is in launchers.py.

    active = select_resources(resources(hostfile, num_gpus=-1), include="", exclude="")
    dims, config = layout(run, active)
    print(memory_check(run, config, dims, active, "h100-80gb", force=False))

Printing goes through click (stdout, warnings on stderr); mistakes are UserErrors.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import click

from dsframework.errors import UserError
from dsframework.launching.hostfile import parse_hostfile
from dsframework.layout import ParallelDims, check_model_layout
from dsframework.models.build import resolve_model
from dsframework.models.hf import check_positions
from dsframework.models.pipeline import check_model_parallelism
from dsframework.planner.cluster import load_cluster, local_cluster, local_gpu_preset
from dsframework.planner.count import model_counts
from dsframework.planner.run_fit import fit_run


def resources(hostfile: Path | None, num_gpus: int):
    """{host: slots} of the hostfile, or of this node (`--num-gpus` ranks) without one."""
    if hostfile is None:
        if num_gpus < 1:
            raise UserError("--num-gpus", num_gpus, "is needed without --hostfile", "pass the ranks to start here")
        return OrderedDict(localhost=num_gpus)
    if not hostfile.is_file():
        raise UserError("--hostfile", str(hostfile), "does not exist", "pass a file of `<host> slots=<n>` lines")
    return parse_hostfile(hostfile.read_text().splitlines(), origin=str(hostfile))


def layout(run, active):
    """tp x pp x cp x dp of the active slots, checked by the rules dsf train applies (data.seq_len
    within the model's positions too: models/hf.py check_positions), and the model config."""
    dims = ParallelDims.of(run.parallel, world=sum(len(slots) for slots in active.values()))
    config = resolve_model(run.model).config  # the same rules dsf train applies, before any node starts
    check_model_layout(dims, config, dp=run.parallel.dp, seq_len=run.data.seq_len,
                       ranks_per_node=min(len(slots) for slots in active.values()))
    check_model_parallelism(config, dims, seq_len=run.data.seq_len)
    warning = check_positions(model_counts(config).model, seq_len=run.data.seq_len)
    if warning:
        click.echo(f"dsf: warning: {warning}", err=True)
    return dims, config


def plan_cluster(cluster_name: str | None, run_cluster: str | None, *, on_gpu: bool) -> tuple[str, bool]:
    """The --cluster `dsf plan` should get in memory_check's fix, and whether it is a guess: `dsf launch
    --cluster`, else the run's own (logging.cluster, which `dsf plan -o` writes), else this node's GPU
    preset, else a placeholder (a node without a GPU, such as a login node, says nothing of the workers)."""
    if cluster_name or run_cluster:
        return str(cluster_name or run_cluster), False
    found = local_gpu_preset() if on_gpu else None
    return (found[0], False) if found else ("<your GPU preset, e.g. h100-80gb>", True)


def memory_check(run, config, dims, active, cluster_name: str | None, *, force: bool) -> str:
    """'predicted X GiB of Y GiB available (where Y comes from); host H GiB of R GiB per node'; a
    UserError when either does not fit (a warning with --force). The planner's memory model and fit
    rule for the run's own layout (planner/run_fit.py fit_run: the device per rank; a node's RAM to build,
    offload and export; a LoRA run's adapters alone), the rule `dsf train`'s pre-flight applies too."""
    ranks_per_node = max(len(slots) for slots in active.values())
    if cluster_name:
        cluster, source = load_cluster(cluster_name, nodes=len(active), gpus_per_node=ranks_per_node), cluster_name
    else:
        cluster, source = local_cluster(nodes=len(active), ranks_per_node=ranks_per_node)
    run_fit = fit_run(run, config, dims, cluster)
    summary = run_fit.summary(source)
    if run_fit.fit.fits:
        return summary
    preset, guessed = plan_cluster(cluster_name, run.logging.cluster, on_gpu=cluster.name == "local-gpu")
    budget = ("" if cluster_name or cluster.name == "local-gpu" else
              f"; this node has no GPU, so its RAM was the budget: launching for GPU nodes, pass --cluster "
              f"{preset if not guessed else '<their preset>'} to dsf launch")
    error = run_fit.refusal(run, source=source, preset=preset, nodes=len(active), ranks_per_node=ranks_per_node,
                            note=budget)
    assert error is not None  # (the run does not fit)
    if not force:
        raise error
    click.echo(f"dsf: warning: {error}; launching anyway (--force)", err=True)
    return f"{summary}; does not fit, launched anyway (--force)"
