"""The steps of `dsf launch` (dsframework.cli.launch_cmd runs them in this order), each a
function of the flags: the hosts, the layout they get, its memory, the variables every node
needs, then a pre-flight check, a dry run, or the launcher itself.

    active = select_resources(resources(hostfile, num_gpus=-1), include="", exclude="")
    dims, config = layout(run, active)
    print(memory_check(run, config, dims, active, "h100-80gb", force=False))

Printing goes through click (stdout, warnings on stderr); mistakes are UserErrors.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from dsframework.errors import UserError


def resources(hostfile: Path | None, num_gpus: int):
    """{host: slots} of the hostfile, or of this node (`--num-gpus` ranks) without one."""
    from collections import OrderedDict

    from dsframework.launch import parse_hostfile

    if hostfile is None:
        if num_gpus < 1:
            raise UserError("--num-gpus", num_gpus, "is needed without --hostfile", "pass the ranks to start here")
        return OrderedDict(localhost=num_gpus)
    if not hostfile.is_file():
        raise UserError("--hostfile", str(hostfile), "does not exist", "pass a file of `<host> slots=<n>` lines")
    return parse_hostfile(hostfile.read_text().splitlines(), origin=str(hostfile))


def layout(run, active):
    """tp x pp x cp x dp of the active slots, checked by the rules dsf train applies, and the model config."""
    from dsframework.models import resolve_model
    from dsframework.parallel.topology import ParallelDims, check_model_layout

    dims = ParallelDims.of(run.parallel, world=sum(len(slots) for slots in active.values()))
    config = resolve_model(run.model).config  # the same rules dsf train applies, before any node starts
    check_model_layout(dims, config, dp=run.parallel.dp, seq_len=run.data.seq_len,
                       ranks_per_node=min(len(slots) for slots in active.values()))
    return dims, config


def memory_check(run, config, dims, active, cluster_name: str | None, *, force: bool) -> str:
    """'predicted X GiB of Y GiB available (where Y comes from); host H GiB of R GiB per node'; a
    UserError when either does not fit (a warning with --force). The planner's memory model and fit
    rule (planner/fit.py: the device per rank; a node's RAM to build, offload and export), for the
    run's own layout; a LoRA run (model.lora) counts gradients and optimizer states of its adapters
    alone (models/lora.py count_lora_parameters, on a meta model)."""
    from dsframework.dsconfig import resolve_batch
    from dsframework.launch import local_cluster
    from dsframework.planner.cluster import GiB, load_cluster
    from dsframework.planner.fit import check_fit, run_layout
    from dsframework.planner.memory import Job
    from dsframework.planner.model import describe_model

    ranks_per_node = max(len(slots) for slots in active.values())
    if cluster_name:
        cluster, source = load_cluster(cluster_name, nodes=len(active), gpus_per_node=ranks_per_node), cluster_name
    else:
        cluster, source = local_cluster(nodes=len(active), ranks_per_node=ranks_per_node)
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=dims.dp)
    layout = run_layout(run.parallel, dp=dims.dp, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum)
    job = Job(seq_len=run.data.seq_len, global_batch=batch.global_batch, precision=run.train.precision)
    lora = ""
    if run.model.lora is not None:  # only the adapters have gradients and optimizer states
        from dataclasses import replace

        from dsframework.models.lora import count_lora_parameters

        count = count_lora_parameters(config, run.model.lora)
        job = replace(job, trainable_params=count.trainable, trainable_persistent=count.persistent)
        lora = f"; LoRA: {count.trainable:,} of {count.total:,} parameters train"
    fit = check_fit(describe_model(config, name=run.model.name), layout, job, cluster)
    summary = (f"predicted {fit.need / GiB:.2f} GiB of {fit.available / GiB:.1f} GiB available ({source}); "
               f"host {fit.host_need / GiB:.2f} GiB of {fit.host_available / GiB:.1f} GiB per node{lora}")
    if fit.fits:
        return summary
    preset = cluster_name or ("cpu-local" if cluster.name == "cpu-local" else "CLUSTER")
    plan = (f"dsf plan --model {run.model.name} --cluster {preset} --nodes {len(active)} "
            f"--gpus-per-node {ranks_per_node} --seq-len {job.seq_len} --global-batch {job.global_batch} "
            f"--precision {job.precision}")
    error = UserError("memory per rank" if fit.need > fit.available else "host memory per node", None,
                      f"{fit.why_not} ({source}) for tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp {layout.dp}, "
                      f"ZeRO-{layout.zero_stage}, micro-batch {layout.micro_batch}",
                      f"find a layout that fits with `{plan}`"
                      + (" (it plans full fine-tuning: LoRA needs less)" if lora else "")
                      + ", or pass --force to launch anyway")
    if not force:
        raise error
    click.echo(f"dsf: warning: {error}; launching anyway (--force)", err=True)
    return f"{summary}; does not fit, launched anyway (--force)"


def env_file_lines(env, explicit) -> tuple[Path, dict[str, str]]:
    """The .deepspeed_env deepspeed's runner reads here, and the lines dsf would append to it."""
    from dsframework.launch import env_file_path, merge_env_file, read_env_file

    home = env_file_path(home=True)  # deepspeed's runner reads it too, and fails on a line it cannot split
    if home.is_file():
        read_env_file(home.read_text(), origin=str(home))
    path = env_file_path()
    existing = read_env_file(path.read_text(), origin=str(path)) if path.is_file() else None
    return path, merge_env_file(existing, env, explicit=explicit, origin=str(path))


def print_runner_dry_run(runner, active, master, master_port, program, explicit, env_file, env_new) -> None:
    """pdsh / openmpi / mvapich: each node's deepspeed.launcher.launch line (pdsh and one-node runs),
    the pdsh or mpirun line from deepspeed's own runner, and the .deepspeed_env it would read."""
    import os
    import shlex

    from dsframework.launch import (env_file_path, node_commands, read_env_file, runner_command, runner_exports,
                                    shell_line)

    if runner is None or runner.name == "pdsh":
        for host, argv in node_commands(active, master_addr=master, master_port=master_port, program=program):
            click.echo(f"{host}: {shell_line(argv, explicit if runner is None else None)}")
    if runner is None:
        return
    old = env_file.read_text() if env_file.is_file() else ""
    old += "\n" if old and not old.endswith("\n") else ""  # as _launch_exec appends
    new = "".join(f"{k}={v}\n" for k, v in env_new.items())
    home = env_file_path(home=True)  # read first, as deepspeed's runner does
    files = [home.read_text()] if home.is_file() and home.resolve() != env_file.resolve() else []
    files = [read_env_file(text, origin=str(env_file)) for text in [*files, old + new]]
    cmd = runner_command(runner, active, exports=runner_exports(os.environ, files))
    click.echo(f"{'pdsh' if runner.name == 'pdsh' else 'mpirun'}: {shlex.join(cmd)}")
    click.echo(f"# {env_file}: {f'would append {len(env_new)} line(s)' if new else 'unchanged'}")
    for line in (old + new).splitlines():
        click.echo(f"{env_file}: {line}")


def run_checks(launcher: str, active, *, need_tools: bool) -> None:
    """--check: each host (ssh, or its name for no_ssh/slurm) and, when the launch needs them, the
    launcher's tools; exit 2 naming the first failure."""
    import os

    from dsframework.launch import check_hosts, check_tools, local_names

    tools = check_tools(launcher, os.environ) if need_tools else []
    hosts = check_hosts(active, launcher=launcher)
    for host in active:
        if host in local_names():
            click.echo(f"{host}: this node, not checked")
    for name, why in tools + hosts:
        click.echo(f"{name}: {'ok' if why is None else why}")
    failed = [(name, why) for name, why in hosts + tools if why is not None]
    if not failed:
        return click.echo(f"# {launcher}: every check passed")
    name, why = failed[0]
    if name not in active:
        fix = f"install {name} on this node, or choose another --launcher" if name != "SLURM_JOB_ID" else \
            "run dsf launch inside the job (launch/slurm.sbatch) or an salloc shell"
    elif launcher in ("no_ssh", "slurm"):
        fix = "write a name or address every node resolves in the hostfile"
    else:
        fix = f"set up passwordless ssh from this node (ssh-copy-id {name}) and check the name resolves"
    raise UserError("--check", name, why, fix)


def exec_launcher(launcher, runner, active, env_file, env_new, explicit, deepspeed, flags, program) -> None:
    """Replace this process with the launcher (its exit code is the command's)."""
    import os
    import shutil
    import warnings

    from dsframework.launch import SLURM_NODEID, check_tools, srun_command

    env = {**os.environ, **explicit}
    if launcher == "slurm":
        for name, why in check_tools("slurm", os.environ):
            if why is not None:
                raise UserError("--launcher", "slurm", f"{name} {why}",
                                "run inside the allocation: sbatch launch/slurm.sbatch, or salloc")
        argv = srun_command([deepspeed, *flags(SLURM_NODEID), *program], active)
        argv[0] = shutil.which("srun")
    else:
        if runner is not None:
            with warnings.catch_warnings():  # MVAPICHRunner warns on stderr when mpiname is missing
                warnings.simplefilter("ignore")
                if not runner.backend_exists():
                    raise UserError("--launcher", launcher, f"is not installed on this node ({runner.name} backend "
                                    "not found)", "install it, or choose another --launcher (no_ssh, slurm)")
        if env_new:  # append, never rewrite: the user's lines stay as they are
            old = env_file.read_text() if env_file.is_file() else ""
            with env_file.open("a") as out:
                out.write(("\n" if old and not old.endswith("\n") else "") +
                          "".join(f"{k}={v}\n" for k, v in env_new.items()))
            click.echo(f"dsf: added {', '.join(env_new)} to {env_file}", err=True)
        argv = [deepspeed, *flags(), *program]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
