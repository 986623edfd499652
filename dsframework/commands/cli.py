"""The `dsf` command line.

    dsf config --zero-stage 3 --offload-optimizer cpu --precision bf16 --world-size 8 \\
               --global-batch 256 --micro-batch 4 -o ds_config.json
    dsf config --zero-stage 3 --precision bf16 --world-size 8 --global-batch 256 \\
               --auto-knobs --model llama-7b --cluster h100-80gb --seq-len 4096   # knobs + micro-batch planned
    deepspeed --num_gpus 2 $(which dsf) train launch/examples/tiny.yaml --set train.steps=50
    dsf train launch/examples/tiny.yaml --resume          # a world of one, no launcher
    dsf export runs/tiny/checkpoints runs/tiny/hf
    dsf export runs/lora/checkpoints runs/lora/adapter --adapter-only   # a LoRA run's adapter alone
    dsf generate runs/tiny/hf --prompt "17,18,19,"          # or runs/tiny/checkpoints
    dsf plan --model llama-7b --cluster h100-80gb --nodes 2 --seq-len 4096 --global-batch 256
    dsf calibrate --ranks 2 -o cpu.json      # then: dsf plan --cluster cpu.json --gpus-per-node 2 ...
    dsf presets

Mistakes in input print one line on stderr (`dsf: error: <field>=<value>: <rule>; <fix>`) and
exit with code 2, with no traceback.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import cast

import click

from dsframework.errors import EXIT_USER_ERROR, UserError
from dsframework.launching.launchers import LAUNCHERS
from dsframework.protocol.exits import PREEMPTED, stop_signals


def _fail(message: str) -> None:
    click.echo(f"dsf: error: {' '.join(str(message).split())}", err=True)
    sys.exit(EXIT_USER_ERROR)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """dsframework: plan, configure and run DeepSpeed training of Hugging Face causal LMs."""


# --- dsf config ---------------------------------------------------------------------------------

@cli.command("config")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=0, show_default=True)
@click.option("--offload-optimizer", type=click.Choice(["none", "cpu", "nvme"]), default="none", show_default=True)
@click.option("--offload-param", type=click.Choice(["none", "cpu", "nvme"]), default="none", show_default=True,
              help="ZeRO-3 only")
@click.option("--nvme-path", default="/local_nvme", show_default=True)
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--micro-batch", type=int, help="sequences per rank per forward")
@click.option("--grad-accum", type=int, help="micro-batches per optimizer step")
@click.option("--global-batch", type=int, help="sequences per optimizer step over all ranks")
@click.option("--world-size", type=int, help="all ranks (dp = world / (tp * pp * cp)); without it "
              "train_batch_size is left out and DeepSpeed derives it at launch")
@click.option("--tp", type=int, default=1, show_default=True, help="tensor-parallel size")
@click.option("--pp", type=int, default=1, show_default=True, help="pipeline stages (ZeRO 0/1 only)")
@click.option("--cp", type=int, default=1, show_default=True, help="context-parallel size (DeepSpeed Ulysses)")
@click.option("--ep", type=int, default=1, show_default=True,
              help="expert-parallel size (DeepSpeed AutoEP, mixture-of-experts models; divides dp)")
@click.option("--zero-hpz", type=int, default=1, show_default=True,
              help="ZeRO-3 hpZ: secondary weight shards within groups of this many ranks")
@click.option("--optimizer", type=click.Choice(["adamw", "adam"]), default="adamw", show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True, help="0 disables clipping")
@click.option("--warmup-steps", type=int, default=0, show_default=True)
@click.option("--steps", type=int, default=200, show_default=True, help="total steps, for the lr schedule")
@click.option("--lr-schedule", type=click.Choice(["cosine", "linear", "constant"]), default="cosine",
              show_default=True)
@click.option("--auto-knobs", is_flag=True, help="choose ZeRO's bucket, persistence and prefetch sizes (and, "
              "with --global-batch alone, the largest micro-batch that fits) from the memory the planner predicts "
              "free; needs --model, --cluster, --seq-len and --world-size")
@click.option("--model", "model_name", help="--auto-knobs: preset, config.json or pretrained directory")
@click.option("--cluster", "cluster_name", help="--auto-knobs: a cluster preset or a dsf calibrate profile")
@click.option("--seq-len", type=click.IntRange(min=8), help="--auto-knobs: tokens per sequence")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True,
              help="--auto-knobs: ranks per node (the world fills nodes of this many)")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="file; stdout without")
@click.option("--force", is_flag=True, help="replace an existing --output file")
def config_cmd(world_size: int | None, output: Path | None, force: bool, auto_knobs: bool, model_name: str | None,
               cluster_name: str | None, seq_len: int | None, gpus_per_node: int, **flags: object) -> None:
    """Write a DeepSpeed JSON, checked by DeepSpeed's own DeepSpeedConfig at --world-size.

    Give any two of --micro-batch, --grad-accum, --global-batch (the third is derived; with
    --global-batch, --world-size is needed too). With --auto-knobs the planner chooses ZeRO's knobs
    for --model on --cluster at --seq-len (see `dsf plan`), and the micro-batch when only
    --global-batch is given.
    """
    from dsframework.config import build_run_config
    from dsframework.dsconfig import build_ds_config, dumps, validate_ds_config
    from dsframework.layout import ParallelDims, grid_problem

    _check_config_flags(world_size, cast("int | None", flags["global_batch"]), auto_knobs=auto_knobs,
                        needed=(("--model", model_name), ("--cluster", cluster_name), ("--seq-len", seq_len),
                                ("--world-size", world_size)))
    train_keys = ("micro_batch", "grad_accum", "global_batch", "optimizer", "lr", "weight_decay",
                  "grad_clip", "warmup_steps", "steps", "lr_schedule", "precision")
    parallel_keys = ("zero_stage", "offload_optimizer", "offload_param", "nvme_path", "tp", "pp", "cp", "zero_hpz",
                     "ep")
    sections = {"train": {k: flags[k] for k in train_keys if flags[k] is not None},
                "parallel": {k: flags[k] for k in parallel_keys}}
    if output is not None and output.exists() and not force:
        raise UserError("--output", str(output), "exists", "choose another file or pass --force")
    try:
        run = build_run_config(sections)
        model_parallel = run.parallel.tp * run.parallel.pp * run.parallel.cp
        dims = ParallelDims.of(run.parallel, world=world_size or model_parallel)
        problem = grid_problem(dims) if world_size else None  # the layout's rules that need no model
        if problem is not None:
            raise problem
        notes: list[str] = []
        if auto_knobs:  # _check_config_flags saw --model, --cluster and --seq-len given
            assert model_name is not None and cluster_name is not None and seq_len is not None
            notes = _auto_knobs(sections, run, dims, model_name=model_name, cluster_name=cluster_name,
                                seq_len=seq_len, gpus_per_node=gpus_per_node)
            run = build_run_config(sections)
        ds = build_ds_config(run.train, run.parallel, dp_size=dims.dp, checkpoint_writer=run.checkpoint.writer,
                             sequence_parallel=run.sequence_parallel)
    except UserError as err:  # name the flag the user typed, not the config field behind it
        raise UserError(_flag_for(err.field), err.value, err.rule, err.fix) from None
    if world_size is None:
        del ds["train_batch_size"]  # portable: DeepSpeed derives it from the world it starts in
        for dp_size in (1, 2, 8):
            validate_ds_config(ds, dp_size=dp_size)
    else:
        validate_ds_config(ds, dp_size=dims.dp)
    text = dumps(ds)
    for line in notes:  # stderr: stdout is the JSON
        click.echo(f"dsf: {line}", err=True)
    if output is None:
        click.echo(text, nl=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    layout = f"tp={dims.tp} pp={dims.pp} cp={dims.cp} dp={dims.dp if world_size else 'any'}"
    click.echo(f"dsf: wrote {output} (ZeRO-{run.parallel.zero_stage}, {layout})", err=True)


def _check_config_flags(world_size: int | None, global_batch: int | None, *, auto_knobs: bool,
                        needed: tuple[tuple[str, object], ...]) -> None:
    """`dsf config`'s flags that only make sense together (`needed`: what --auto-knobs needs)."""
    if world_size is not None and world_size < 1:
        raise UserError("--world-size", world_size, "must be >= 1", "pass the number of data-parallel ranks")
    if world_size is None and global_batch is not None:
        raise UserError("--global-batch", global_batch, "needs --world-size to derive the rest",
                        "pass --world-size, or give --micro-batch and --grad-accum instead")
    if auto_knobs:
        missing = next((flag for flag, value in needed if value is None), None)
        if missing is not None:
            raise click.UsageError(f"--auto-knobs needs {missing}: the knobs are planned for a model, a cluster, "
                                   "a sequence length and a world size; pass --model, --cluster, --seq-len and "
                                   "--world-size")


def _auto_knobs(sections: dict, run, dims, *, model_name: str, cluster_name: str, seq_len: int,
                gpus_per_node: int) -> list[str]:
    """`dsf config --auto-knobs`: put the planner's knobs (and, given only the global batch, the
    largest micro-batch that fits) into `sections`, the raw run config; the lines to print."""
    from dsframework.config import ModelSpec
    from dsframework.dsconfig import resolve_batch
    from dsframework.models.build import resolve_model
    from dsframework.planner.cluster import GiB, load_cluster
    from dsframework.planner.fit import run_job, run_layout
    from dsframework.planner.knobs import largest_micro_batch, with_knobs
    from dsframework.planner.model import describe_model

    per_node = min(gpus_per_node, dims.world)
    cluster = load_cluster(cluster_name, nodes=-(-dims.world // per_node), gpus_per_node=per_node)
    desc = describe_model(resolve_model(ModelSpec(name=model_name)).config, name=model_name)
    train = run.train
    batch = resolve_batch(train.micro_batch, train.grad_accum, train.global_batch, dp_size=dims.dp)
    layout = run_layout(run.parallel, dims, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                        sequence_parallel=run.sequence_parallel)
    job = replace(run_job(run, global_batch=batch.global_batch), seq_len=seq_len)
    notes = []
    if train.global_batch is not None and train.micro_batch is None and train.grad_accum is None:
        micro = largest_micro_batch(desc, layout, job, cluster, per_replica=batch.global_batch // dims.dp)
        if micro is not None:
            layout = replace(layout, micro_batch=micro, grad_accum=batch.global_batch // dims.dp // micro)
            sections["train"]["micro_batch"] = micro
            notes.append(f"micro-batch {micro}: the largest that fits ({desc.name}, seq {seq_len}, {cluster.name})")
    layout, fit, choice = with_knobs(desc, layout, job, cluster)
    if choice is None:
        notes.append(f"knobs: dsf's defaults: {fit.why_not} for {desc.name} at micro-batch {layout.micro_batch}")
        return notes
    sections["parallel"]["zero_knobs"] = layout.knobs.changed(layout.dims.zero_stage)
    chosen = ", ".join(f"{k} {v:,}" for k, v in sections["parallel"]["zero_knobs"].items()) or "dsf's defaults"
    notes.append(f"knobs: {chosen} (predicted {fit.need / GiB:.1f} of {fit.available / GiB:.1f} GiB per rank)")
    return notes + [f"  {line}" for line in choice.why]


def _flag_for(field: str) -> str:
    """'train.global_batch' -> '--global-batch'; other fields unchanged."""
    name = field.rsplit(".", 1)[-1]
    if field == "world size":
        return "--world-size"
    return "--" + name.replace("_", "-") if field.startswith(("train.", "parallel.")) else field


# --- dsf plan -----------------------------------------------------------------------------------

@cli.command("plan")
@click.option("--model", "model_name", help="preset, config.json or pretrained directory (required without --run; "
              "with it, default: the run's model.name)")
@click.option("--cluster", "cluster_name", required=True,
              help="a100-40gb, a100-80gb, h100-80gb, h200-141gb, cpu-local, or a dsf calibrate profile")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), help="tokens per sequence (required without --run; "
              "with it, default: the run's data.seq_len)")
@click.option("--global-batch", type=click.IntRange(min=1), help="sequences per step (required without --run; "
              "with it, default: the run's train.global_batch)")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]),
              help="default: the --run config's train.precision, else bf16")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--tp", type=click.IntRange(min=1), help="pin the tensor-parallel size")
@click.option("--pp", type=click.IntRange(min=1), help="pin the pipeline size")
@click.option("--cp", type=click.IntRange(min=1), help="pin the context-parallel size")
@click.option("--ep", type=click.IntRange(min=1), help="pin the expert-parallel size (mixture-of-experts models)")
@click.option("--zero-stage", type=click.IntRange(0, 3), help="pin the ZeRO stage")
@click.option("--json", "as_json", is_flag=True, help="every candidate as JSON (schema in docs/planner.md)")
@click.option("--run", "run_yaml", type=click.Path(dir_okay=False, path_type=Path),
              help="plan this run config (its model, overrides, data format, LoRA); -o writes it back with only "
              "the plan's fields changed (layout, batch split, ZeRO settings), every other line as it is")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="write run.yaml, ds_config.json and README.txt of the best layout here")
@click.option("--force", is_flag=True, help="replace files already in --output-dir")
@click.option("--explain", "explain_layout", metavar="LAYOUT",
              help="the step split and MFU of the layout named, e.g. 'tp=8 pp=8 zero=1 micro=1 ckpt=full' "
              "(keys tp pp cp ep dp zero hpz micro ckpt offload; the rest: the fastest that has them)")
def plan_cmd(model_name: str | None, cluster_name: str, nodes: int, gpus_per_node: int, seq_len: int | None,
             global_batch: int | None, precision: str | None, top: int, tp: int | None, pp: int | None,
             cp: int | None, ep: int | None, zero_stage: int | None, as_json: bool, run_yaml: Path | None,
             output_dir: Path | None, force: bool, explain_layout: str | None) -> None:
    """Rank the layouts that fit MODEL on the cluster by predicted tokens/s, with memory per GPU."""
    from dsframework.planner.cluster import load_cluster
    from dsframework.planner.explain import parse_layout
    from dsframework.planner.report import plan_table
    from dsframework.planner.search import search

    wanted = parse_layout(explain_layout) if explain_layout is not None else None
    user = _UserRun.read(run_yaml) if run_yaml is not None else None
    cluster = load_cluster(cluster_name, nodes=nodes, gpus_per_node=gpus_per_node)
    if output_dir is not None and not force:
        taken = [name for name in PLAN_FILES if (output_dir / name).exists()]
        if taken:
            raise UserError("--output-dir", str(output_dir), f"already holds {taken[0]}",
                            "choose another directory or pass --force")
    flags = {"--model": model_name, "--seq-len": seq_len, "--global-batch": global_batch, "--precision": precision}
    desc, job, pins, cache = _plan_job(flags, user)
    pinned = {**pins, **{name: size for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if size}}
    plan = search(desc, cluster, job, tp=pinned.get("tp"), pp=pinned.get("pp"), cp=pinned.get("cp"),
                  ep=pinned.get("ep"), zero_stage=zero_stage)
    explained = (_explain(plan, wanted, explain_layout or "", pinned=pinned, zero_stage=zero_stage)
                 if wanted is not None else None)
    if as_json:
        extra = {"explain": {"layout": explain_layout, **explained.as_dict()}} if explained is not None else {}
        click.echo(json.dumps({"model": desc.name, "cluster": cluster.to_dict(), "seq_len": job.seq_len,
                               "global_batch": job.global_batch, "precision": job.precision,
                               "candidates": [c.as_dict() for c in plan.candidates], **extra}, indent=1))
    else:
        click.echo(plan_table(plan, top=top))
        if explained is not None:
            from dsframework.planner.explain import explain_line

            click.echo("")
            click.echo(explain_line(explained, f"explain {explain_layout}"))
    if cache is not None:
        cache.save(desc)  # the next `dsf plan` of this model imports neither torch nor transformers
    if output_dir is not None:
        if plan.best is None:
            raise UserError("--output-dir", str(output_dir), "has nothing to hold: no layout fits",
                            "follow the advice above (more GPUs, offload, smaller micro-batch)")
        _write_plan_files(plan, output_dir, model_name=desc.name, cluster_name=cluster_name, user=user)


PLAN_FILES = ("ds_config.json", "run.yaml", "README.txt")


def _explain(plan, wanted: dict, text: str, *, pinned: dict, zero_stage: int | None):
    """`dsf plan --explain`: the named layout (a Candidate). The plan already holds it unless the
    name contradicts a pinned size or ZeRO stage; then it is searched with its own sizes pinned."""
    from dsframework.planner.explain import named_candidate
    from dsframework.planner.search import search

    named = {k: wanted[k] for k in ("tp", "pp", "cp", "ep") if k in wanted}
    zero = wanted.get("zero", zero_stage)
    if any(pinned.get(k, size) != size for k, size in named.items()) or zero != zero_stage and zero_stage is not None:
        sizes = {**pinned, **named}
        plan = search(plan.desc, plan.cluster, plan.job, tp=sizes.get("tp"), pp=sizes.get("pp"), cp=sizes.get("cp"),
                      ep=sizes.get("ep"), zero_stage=zero, suggest=False)
    return named_candidate(plan, wanted, text)


class _UserRun:
    """`dsf plan --run`'s run config: its text, its raw mapping, its validated dump (RunConfig)."""

    def __init__(self, path: Path, text: str, written: dict, run) -> None:
        self.path, self.text, self.written, self.run = path, text, written, run
        self.current = run.model_dump(mode="json")

    @classmethod
    def read(cls, path: Path) -> "_UserRun":
        from dsframework.config import build_run_config, read_yaml

        written = read_yaml(path)  # the run-config loader's own errors: one line naming the field
        return cls(path, path.read_text(), written, build_run_config(written))


def _plan_job(flags: dict, user: "_UserRun | None"):
    """(the model described, the Workload, pinned sizes, its DescCache or None) of `dsf plan`: from the
    flags, and with --run from the run config too (its model and overrides; its loss chunk; LoRA's
    adapters, at tp = pp = cp = ep = 1; a chat or prompt/completion format at pp = cp = 1). A model
    described as `_plan_model` says."""
    from dsframework.config import ModelSpec
    from dsframework.planner.files import job_values
    from dsframework.planner.memory import Workload

    run = user.run if user is not None else None
    values = (job_values(flags, written=user.written, current=user.current, source=str(user.path)) if user
              else job_values(flags, written=None, current=None, source=None))
    spec = (run.model.model_copy(update={"name": values["--model"]}) if run is not None
            else ModelSpec(name=values["--model"]))

    @functools.cache
    def load_config():
        from dsframework.models.build import resolve_model

        return resolve_model(spec).config

    job = Workload(seq_len=values["--seq-len"], global_batch=values["--global-batch"],
                   precision=values["--precision"], loss_chunk_tokens=run.train.loss_chunk_tokens if run else None)
    pins: dict[str, int] = {}
    if run is not None and run.data.format != "text":
        pins.update(pp=1, cp=1)
    if run is not None and run.model.lora is not None:
        from dsframework.models.lora import count_lora_parameters

        count = count_lora_parameters(load_config(), run.model.lora)
        job = replace(job, trainable_params=count.trainable, trainable_persistent=count.persistent)
        pins.update(tp=1, pp=1, cp=1, ep=1)
    desc, cache = _plan_model(spec, values["--model"], load_config)
    return desc, job, pins, cache


def _plan_model(spec, name: str, load_config):
    """(the model `spec` names, described; its DescCache or None) for `dsf plan`. Described before: read
    back from planner/desc_cache.py's file; a plain dense model (Llama, Mistral, Qwen2, Qwen3): counted
    from its config alone (planner/analytic.py), neither importing torch nor transformers; any other:
    counted on the model built on the meta device (planner/model.py, `load_config()` its config)."""
    from dsframework.models.presets import config_fields
    from dsframework.planner.analytic import analytic_desc
    from dsframework.planner.desc_cache import DescCache

    @functools.cache
    def analytic():
        fields = config_fields(spec.name)
        return analytic_desc(fields, name=name, overrides=spec.overrides) if fields is not None else None

    def counts():  # a tp the file lacks: from the config where it can be, else on the model (torch)
        from dsframework.planner.count import model_counts

        quick = analytic()
        return quick.counts if quick is not None and quick.counts is not None else model_counts(load_config())

    cache = DescCache.for_spec({**spec.model_dump(mode="json"), "--model": name})
    desc = (cache.load(load_counts=counts) if cache is not None else None) or analytic()
    if desc is None:
        from dsframework.planner.model import describe_model

        desc = describe_model(load_config(), name=name)
    return desc, cache


def _write_plan_files(plan, output_dir: Path, *, model_name: str, cluster_name: str, user: "_UserRun | None") -> None:
    """run.yaml (the defaults' placeholders marked, or --run's file with the plan's fields set),
    ds_config.json (DeepSpeed's plain JSON) and README.txt (what each is; how to run it)."""
    from dsframework.config import build_run_config
    from dsframework.dsconfig import build_ds_config, dumps, validate_ds_config
    from dsframework.planner.files import readme_text, start_lines

    best = plan.best
    cluster_field = cluster_name if not Path(cluster_name).suffix else str(Path(cluster_name).resolve())
    if user is not None:
        text, data, run_note, said = _merged_run(plan, user, model_name=model_name, cluster_field=cluster_field)
    else:
        text, data, run_note, said = _placeholder_run(plan, output_dir, model_name=model_name,
                                                      cluster_field=cluster_field)
    run = build_run_config(data)
    ds = build_ds_config(run.train, run.parallel, dp_size=best.layout.dims.dp, sequence_parallel=run.sequence_parallel)
    validate_ds_config(ds, dp_size=best.layout.dims.dp)
    start = start_lines(plan.cluster, world=best.layout.dims.world, run_yaml=str(output_dir / "run.yaml"),
                        cluster_field=cluster_field)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "run.yaml").write_text(text)
    (output_dir / "ds_config.json").write_text(dumps(ds))
    (output_dir / "README.txt").write_text(readme_text(plan, model_name=model_name, run_note=run_note, start=start))
    for name, what in (("run.yaml", said),
                       ("ds_config.json", "DeepSpeed's JSON as dsf train builds it from run.yaml, to read or for your "
                        "own deepspeed.initialize; plain JSON, no comments; dsf train does not read it"),
                       ("README.txt", "what each file is, and how to run it")):
        click.echo(f"dsf: wrote {output_dir / name} ({what})", err=True)
    click.echo(f"dsf: train it {f'on {plan.cluster.nodes} nodes' if plan.cluster.nodes > 1 else 'on one node'}:",
               err=True)
    for line in start:
        click.echo(f"  {line}", err=True)


def _placeholder_run(plan, output_dir: Path, *, model_name: str, cluster_field: str):
    """(run.yaml's text, its mapping, a note) without --run: dsf's defaults, the plan's fields set,
    the rest marked `# placeholder`."""
    from dsframework.config import build_run_config
    from dsframework.planner.files import RUN_YAML_PLACEHOLDERS, placeholder_run_yaml, plan_fields, run_yaml_header

    chosen = plan_fields(plan.best, plan, model_name=model_name, cluster_field=cluster_field)
    nested: dict = {"output_dir": str(output_dir / "run")}
    for field, value in chosen.items():
        section, key = field.split(".")
        nested.setdefault(section, {})[key] = value
    data = build_run_config(nested).model_dump(mode="json")
    header = run_yaml_header(plan, model_name=model_name, source=None)
    said = "the run config: lines marked `# placeholder` are dsf's defaults, not chosen by the plan: set your data, "\
        "steps and lr"
    return placeholder_run_yaml(data, chosen, header=header), data, RUN_YAML_PLACEHOLDERS, said


def _merged_run(plan, user: "_UserRun", *, model_name: str, cluster_field: str):
    """(run.yaml's text, its mapping, a note) with --run: the user's file with only the plan's fields set."""
    from dsframework.planner.files import changed_fields, merged_data, merged_run_yaml, plan_fields, run_yaml_header

    fields = plan_fields(plan.best, plan, model_name=model_name, cluster_field=cluster_field, written=user.written)
    changes = changed_fields(fields, user.current)
    source = str(user.path)
    said = f"{source} with the plan's fields set, lines marked `# dsf plan`: {', '.join(changes) or 'none'}"
    note = f"{said}; every other field as {source} has it."
    header = run_yaml_header(plan, model_name=model_name, source=source)
    text = merged_run_yaml(user.text, user.written, changes, header=header)
    return text, merged_data(user.written, changes), note, said


# --- dsf calibrate ------------------------------------------------------------------------------

@cli.command("calibrate")
@click.option("--ranks", type=click.IntRange(min=1), default=2, show_default=True,
              help="ranks this machine runs (CPU: each gets cores / ranks threads)")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("cluster.json"),
              show_default=True)
@click.option("--force", is_flag=True, help="replace an existing --output file")
def calibrate_cmd(ranks: int, output: Path, force: bool) -> None:
    """Measure matmul FLOP/s, all-reduce bandwidth and memory; write a --cluster profile."""
    from dsframework.commands.calibrate import calibrate

    if output.exists() and not force:
        raise UserError("--output", str(output), "exists", "choose another file or pass --force")
    profile = calibrate(ranks=ranks)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(profile, indent=2) + "\n")
    flops = ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in profile["peak_flops"].items())
    click.echo(f"dsf: wrote {output}: {flops} per rank; all-reduce {profile['intra_node_bandwidth'] / 1e9:.2f} GB/s "
               f"across {ranks} ranks; {profile['memory_per_gpu'] / 2 ** 30:.1f} GiB per rank")


# --- dsf launch ---------------------------------------------------------------------------------

@cli.command("launch")
@click.argument("run_yaml", type=click.Path(path_type=Path))
@click.option("--hostfile", type=click.Path(path_type=Path), help="`<host> slots=<n>` per line (deepspeed's format)")
@click.option("--include", default="", help="deepspeed filter, e.g. worker-0:0,1@worker-1")
@click.option("--exclude", default="", help="deepspeed filter, e.g. worker-1:3")
@click.option("--num-nodes", type=int, default=-1, help="use the first N hosts")
@click.option("--num-gpus", type=int, default=-1, help="use the first N slots of each host")
@click.option("--master-addr", help="default: the first host (localhost without a hostfile)")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True)
@click.option("--launcher", type=click.Choice(list(LAUNCHERS)), default="pdsh",
              show_default=True, help="how the nodes are started (see docs/launching.md)")
@click.option("--node-rank", type=int, help="no_ssh: this node's rank in the hostfile's active hosts")
@click.option("--env", "env_flags", multiple=True, metavar="KEY=VALUE", help="set on every node (repeatable)")
@click.option("--cluster", "cluster_name", help="memory check against a preset or dsf calibrate profile "
              "(default: this node's GPU, else its RAM / ranks per node)")
@click.option("--force", is_flag=True, help="launch even when the predicted memory does not fit")
@click.option("--check", is_flag=True, help="check ssh to every host and the launcher's tools, then exit")
@click.option("--dry-run", is_flag=True, help="print what each launcher would run and exit")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="passed on to dsf train")
@click.option("--resume", is_flag=True, help="passed on to dsf train: continue from the latest checkpoint")
@click.option("--overwrite", is_flag=True, help="passed on to dsf train: replace the output_dir of an earlier run")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="restart a failed job from its latest checkpoint on the nodes that pass a pre-flight check, "
              "re-planned for them, up to N times (docs/launching.md)")
def launch_cmd(run_yaml: Path, hostfile: Path | None, include: str, exclude: str, num_nodes: int, num_gpus: int,
               master_addr: str | None, master_port: int, launcher: str, node_rank: int | None,
               env_flags: tuple[str, ...], cluster_name: str | None, force: bool, check: bool, dry_run: bool,
               overrides: tuple[str, ...], resume: bool, overwrite: bool, max_restarts: int) -> None:
    """Check the hostfile, layout and memory of RUN_YAML, then start `deepspeed` on every node."""
    from dsframework.config import load_run_config
    from dsframework.launching import hostfile as launch
    from dsframework.launching import steps
    from dsframework.launching.launchers import LaunchJob
    from dsframework.launching.restarts import check_can_restart, run_with_restarts

    run = load_run_config(run_yaml, overrides)
    how = LAUNCHERS[launcher]()
    how.check_flags(hostfile=hostfile is not None, node_rank=node_rank)
    check_can_restart(how, max_restarts)
    resources = steps.resources(hostfile, num_gpus)
    active = launch.select_resources(resources, include=include, exclude=exclude, num_nodes=num_nodes,
                                     num_gpus=num_gpus)
    dims, config = steps.layout(run, active)
    explicit = launch.parse_env(env_flags)
    env, skipped = launch.node_env(os.environ, explicit)
    job = LaunchJob(run_yaml=run_yaml, overrides=overrides, hostfile=hostfile, resources=resources, active=active,
              master=master_addr or next(iter(active)), master_port=master_port, env=env, explicit=explicit,
              include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus, node_rank=node_rank,
              skipped=skipped, train_flags=(("--resume",) if resume else ()) + (("--overwrite",) if overwrite else ())
              + (("--force",) if force else ()),  # each rank's own memory check (dsf train's pre-flight) too
              output_dir=run.output_dir)
    how.prepare(job, starting=not (dry_run or check))
    memory = steps.memory_check(run, config, dims, active, cluster_name, force=force)
    if check:
        return how.check(job)
    if dry_run:
        click.echo(f"# {dims.world} ranks = {dims} on {len(active)} node(s); "
                   f"master {job.master}:{master_port}; launcher {launcher}")
        click.echo(f"# memory per rank: {memory}")
        for line in how.dry_run(job):
            click.echo(line)
        return
    if max_restarts:
        sys.exit(run_with_restarts(how, job, run, max_restarts=max_restarts, cluster_name=cluster_name))
    sys.exit(how.start(job))


# --- dsf train ----------------------------------------------------------------------------------

@cli.command("train", context_settings={"ignore_unknown_options": False})
@click.argument("run_yaml", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key, e.g. --set train.steps=20 (repeatable)")
@click.option("--resume", is_flag=True, help="continue from the latest checkpoint in output_dir")
@click.option("--overwrite", is_flag=True, help="replace the run already in output_dir")
@click.option("--force", is_flag=True, help="train even when the predicted memory does not fit this node")
def train_cmd(run_yaml: Path, overrides: tuple[str, ...], resume: bool, overwrite: bool, force: bool) -> None:
    """Train RUN_YAML; run under `deepspeed --num_gpus N $(which dsf) train ...` for N ranks."""
    from dsframework.config import load_run_config

    run = load_run_config(run_yaml, overrides)  # config errors before torch is even imported
    for signum in stop_signals():  # until the loop's StopRequest: start-up ends at once, wherever it blocks
        signal.signal(signum, signal.SIG_DFL)
    from dsframework.train.engine import Preempted, train
    from dsframework.train.world import shutdown_distributed

    try:
        train(run, resume=resume, overwrite=overwrite, force=force)
    except Preempted:
        shutdown_distributed()
        sys.exit(PREEMPTED)  # stopped, not finished; the checkpoint is saved (protocol/exits.py)
    except UserError:
        shutdown_distributed(wait_s=10)  # the ranks usually fail together (a NaN, a bad checkpoint)
        raise
    shutdown_distributed()


# --- dsf export ---------------------------------------------------------------------------------

@cli.command("export")
@click.argument("ckpt_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--tag", help="checkpoint tag (default: latest)")
@click.option("--overwrite", is_flag=True, help="replace a non-empty OUT_DIR")
@click.option("--max-shard-size", metavar="SIZE", help="largest weights file, e.g. 5GB or 500MB, as "
              "save_pretrained's max_shard_size (default: its default, 50GB); more weights are split into "
              "model-0000i-of-0000n.safetensors with model.safetensors.index.json")
@click.option("--adapter-only", is_flag=True, help="a LoRA run (model.lora): write the adapter alone "
              "(PeftModel.save_pretrained) instead of merging it into the base weights")
def export_cmd(ckpt_dir: Path, out_dir: Path, tag: str | None, overwrite: bool, max_shard_size: str | None,
               adapter_only: bool) -> None:
    """Merge a checkpoint (any layout) into a transformers directory at OUT_DIR, one shard at a time.
    A LoRA run's adapters are merged into the base weights (or, with --adapter-only, written alone)."""
    from dsframework.checkpoints.export import export_checkpoint

    path = export_checkpoint(ckpt_dir, out_dir, tag=tag, overwrite=overwrite, max_shard_size=max_shard_size,
                             adapter_only=adapter_only)
    how = ("PeftModel.from_pretrained(base, OUT_DIR)" if adapter_only
           else "AutoModelForCausalLM.from_pretrained")
    click.echo(f"dsf: exported {ckpt_dir} -> {path} (load with {how})")


# --- dsf generate -------------------------------------------------------------------------------

@cli.command("generate")
@click.argument("model_dir", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="text to continue (a chat model: the user's turn)")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="tokens generated, at most")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy; > 0: sample")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="nucleus sampling mass (sampling only)")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the sampling (reproducible runs)")
@click.option("--num-samples", type=int, default=1, show_default=True,
              help="independent samples (sampling only)")
def generate_cmd(model_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_p: float, seed: int,
                 num_samples: int) -> None:
    """Sample from DIR: a dsf export OUT_DIR, or a checkpoint (exported to a temporary directory)."""
    from dsframework.commands.generate import SampleSpec, generate, load, model_directory

    spec = SampleSpec(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                      num_samples=num_samples)  # flags checked before any model is read
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stdout is the sample; stderr stays quiet
    with model_directory(model_dir) as hf_dir:
        model, tokenizer = load(hf_dir)
    samples = generate(model, tokenizer, prompt, spec)
    for index, sample in enumerate(samples):
        if len(samples) > 1:
            click.echo(f"--- sample {index + 1} of {len(samples)} ---")
        click.echo(sample.text)


# --- dsf presets --------------------------------------------------------------------------------

@cli.command("presets")
def presets_cmd() -> None:
    """List the built-in model presets."""
    from dsframework.models.presets import PRESETS

    for name, fields in PRESETS.items():
        shape = {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "n_embd", "n_layer") if k in fields}
        click.echo(f"{name:12s} {fields['model_type']:6s} " + " ".join(f"{k}={v}" for k, v in shape.items()))


def _register_commands() -> None:
    """Commands that live in their own modules (each imports its heavy libraries when it runs)."""
    from dsframework.commands.env_report import env_cmd
    from dsframework.commands.plot import plot_cmd

    cli.add_command(plot_cmd)
    cli.add_command(env_cmd)


_register_commands()


def _strip_local_rank(argv: list[str]) -> list[str]:
    """Drop the `--local_rank=N` the deepspeed launcher puts before the subcommand.

    The launcher also exports LOCAL_RANK, which is what dsf reads.
    """
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `dsf` console script."""
    argv = _strip_local_rank(sys.argv[1:] if argv is None else list(argv))
    from dsframework.launching.supervise import exit_process, run_rank, under_launcher

    if under_launcher(argv):  # this process watches; a child is the rank (names it if it dies)
        sys.exit(run_rank(argv))
    try:
        _run_command(argv)
        code: int | str | None = 0
    except SystemExit as stop:
        code = stop.code
    except Exception:  # a bug: its traceback, then the same way out as every other end
        if "torch.distributed" not in sys.modules:
            raise

        traceback.print_exc()
        code = 1
    if "torch.distributed" in sys.modules:  # a process group ran here (train, or config's world of one)
        exit_process(code)
    sys.exit(code)


def _run_command(argv: list[str]) -> None:
    try:
        cli.main(args=argv, prog_name="dsf", standalone_mode=False)
    except UserError as err:
        _fail(str(err))
    except click.exceptions.NoArgsIsHelpError as err:  # bare `dsf`: the help, not an error
        click.echo(err.ctx.get_help() if err.ctx else "dsf --help")
    except click.exceptions.Abort:
        _fail("aborted")
    except click.ClickException as err:  # bad flag or argument: one line, not the usage block
        _fail(err.format_message())
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
