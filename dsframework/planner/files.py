"""The files `dsf plan -o DIR` writes, as text, and the commands that train them. Pure: the command
reads `--run` and writes the files.

    fields = plan_fields(plan.best, plan, model_name="llama-70b", cluster_field="h100-80gb")
    placeholder_run_yaml(run.model_dump(mode="json"), fields, header=...)  # no --run: the rest marked placeholders
    merged_run_yaml(text, written, current, fields, source="my.yaml")      # --run: my.yaml, the plan's fields set
    start_lines(plan.cluster, world=128, run_yaml="plans/70b/run.yaml", cluster_field="h100-80gb")
    readme_text(plan, files_note=..., start=start_lines(...))

Without `--run` every field the plan did not choose (the data, steps, lr, vocabulary...) carries a
`# placeholder` comment. With `--run MY.yaml` the file is MY.yaml's own text (its comments kept)
with only the plan's fields changed or added, each such line marked `# dsf plan`; when the text
cannot be edited line by line (flow-style sections), MY.yaml's values are written out instead, the
header says so. ds_config.json stays plain JSON as DeepSpeed reads it (DeepSpeedConfig refuses
unknown keys inside its sections, and JSON has no comments): README.txt says what each file is.
"""
from __future__ import annotations

import copy
import json
import re
import shlex
import textwrap
from collections.abc import Callable
from typing import Any

import yaml

from dsframework.config import parse_yaml
from dsframework.errors import UserError
from dsframework.planner.cluster import Cluster
from dsframework.planner.report import run_config_dict
from dsframework.planner.search import Candidate, Plan, family_of

PLAN_MARK = "# dsf plan"
DEFAULT_NOTE = "placeholder: dsf's default, not chosen by the plan"
PLACEHOLDER_NOTES = {
    "data.dataset": "placeholder: set your data (addition is dsf's built-in toy task)",
    "data.tokenizer_vocab_size": DEFAULT_NOTE + " (the vocabulary of a tokenizer trained on your data)",
    "train.steps": "placeholder: set your run's length (" + DEFAULT_NOTE.removeprefix("placeholder: ") + ")",
    "train.lr": "placeholder: set your learning rate (" + DEFAULT_NOTE.removeprefix("placeholder: ") + ")",
    "output_dir": "placeholder: where the run writes (beside the plan); set yours",
}
# flag of `dsf plan` -> the run config field it plans for (with --run the flag defaults to the field).
JOB_FIELDS = {"--model": "model.name", "--seq-len": "data.seq_len", "--global-batch": "train.global_batch",
              "--precision": "train.precision"}


def job_values(flags: dict[str, Any], *, written: dict[str, Any] | None, current: dict[str, Any] | None,
               source: str | None) -> dict[str, Any]:
    """{flag: value} of the model, seq_len, global batch and precision to plan for: the flag, else (with
    --run) what the run config `source` trains (`current`: its validated dump, dsf's defaults included),
    else bf16 for --precision. A UserError when a flag differs from a field the file writes (`written`:
    its raw mapping), or nothing gives a value."""
    out: dict[str, Any] = {}
    for flag, field in JOB_FIELDS.items():
        section, key = field.split(".")
        given, in_file = flags.get(flag), (current or {}).get(section, {}).get(key)
        if given is not None and key in ((written or {}).get(section) or {}) and given != in_file:
            raise UserError(flag, given, f"differs from {field}={in_file} in {source}",
                            f"drop {flag} to plan {source}'s, or change {field} there")
        value = given if given is not None else in_file
        if value is None and flag == "--precision":
            value = "bf16"
        if value is None:
            raise UserError(flag, None, "is required" + (f": {source} sets no {field}" if source else ""),
                            f"pass {flag}" + (f" or set {field} in {source}" if source else " (or --run RUN.yaml)"))
        out[flag] = value
    return out


def plan_fields(candidate: Candidate, plan: Plan, *, model_name: str, cluster_field: str | None = None,
                written: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"section.key": value} of every field `dsf plan -o` sets: the model, seq_len, global batch and
    precision planned for; the layout (parallel.tp/pp/cp/ep, ZeRO stage, hpZ), offload, activation
    checkpointing, the ZeRO knobs (the whole parallel.zero_knobs section), the micro-batch, the
    chunked loss where the plan counted it, and logging.cluster (the plan's --cluster, for MFU and
    `dsf launch`'s memory fix); without `written`, also parallel.dp (derived) and train.chunked_loss
    `auto` where the plan counted what auto does. `written` (--run's raw mapping): its train.grad_accum
    and parallel.dp, where it sets them, get the plan's values (else they stay derived), and its
    logging.cluster stays."""
    job, lay, given, written = plan.job, candidate.layout, written is not None, written or {}
    nested = run_config_dict(candidate, model_name=model_name, seq_len=job.seq_len, global_batch=job.global_batch,
                             precision=job.precision, plan=plan)
    fields = {f"{section}.{key}": value for section, values in nested.items() if isinstance(values, dict)
              for key, value in values.items()}
    fields.setdefault("parallel.zero_knobs", {})
    if given:
        del fields["train.grad_accum"]  # derived from the rest, unless the file gives it
    else:  # what the plan counted too: dp derived from the world, the loss chunked as `auto` decides
        fields["parallel.dp"] = None
        fields.setdefault("train.chunked_loss", "auto")
    if "grad_accum" in (written.get("train") or {}):
        fields["train.grad_accum"] = lay.grad_accum
    if "dp" in (written.get("parallel") or {}):
        fields["parallel.dp"] = lay.dims.dp
    if cluster_field and not (written.get("logging") or {}).get("cluster"):
        fields["logging.cluster"] = cluster_field
    return fields


# --- run.yaml ----------------------------------------------------------------------------------

def _flow(key: str, value: Any) -> str:
    """`key: value` on one line (flow style for lists and mappings)."""
    text = yaml.safe_dump({key: value}, default_flow_style=True, sort_keys=False, width=1 << 30).strip()[1:-1]
    if "\n" in text:  # a string with line breaks: JSON's escapes are YAML's double-quoted ones
        text = f"{key}: {json.dumps(value)}"
    return text


def _render(data: dict[str, Any], note: Callable[[str], str | None], prefix: str = "", indent: int = 0) -> list[str]:
    lines = []
    for key, value in data.items():
        path = prefix + key
        if isinstance(value, dict) and value:
            lines.append(" " * indent + f"{key}:")
            lines += _render(value, note, path + ".", indent + 2)
        else:
            comment = note(path)
            lines.append(" " * indent + _flow(key, value) + (f"  # {comment}" if comment else ""))
    return lines


def placeholder_run_yaml(data: dict[str, Any], chosen: dict[str, Any], *, header: list[str]) -> str:
    """A whole run config (`data`: RunConfig.model_dump(mode="json")) as YAML, each field the plan did not
    choose (nor the flags give: not in `chosen`, nor under a chosen section) commented as a placeholder."""
    def note(path: str) -> str | None:
        if any(path == field or path.startswith(field + ".") for field in chosen):
            return None
        return PLACEHOLDER_NOTES.get(path, DEFAULT_NOTE)

    text = "\n".join([f"# {line}" if line else "#" for line in header] + _render(data, note)) + "\n"
    assert parse_yaml(text) == data, "the placeholder run.yaml does not read back as the run config"
    return text


def _comparable(value: Any) -> Any:
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def changed_fields(fields: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The plan's fields whose values differ from the run config's (`current`: its validated dump)."""
    return {field: value for field, value in fields.items()
            if _comparable(value) != _comparable(current.get(field.split(".")[0], {}).get(field.split(".")[1]))}


def merged_data(written: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """The run config's raw mapping with `changes` ({"section.key": value}) set."""
    data = copy.deepcopy(written)
    for field, value in changes.items():
        section, key = field.split(".")
        if not isinstance(data.get(section), dict):
            data[section] = {}
        data[section][key] = value
    return data


def merged_run_yaml(text: str, written: dict[str, Any], changes: dict[str, Any], *, header: list[str]) -> str:
    """The run config's `text` with `changes` set line by line (comments and order kept, each changed or
    added line marked `# dsf plan`); its values written out again (header saying so) where that cannot be."""
    expected = merged_data(written, changes)
    lines: list[str] | None = text.splitlines()
    for field, value in changes.items():
        if lines is not None:
            section, key = field.split(".")
            lines = _set_line(lines, section, key, value, present=key in (written.get(section) or {}))
    head = [f"# {line}" if line else "#" for line in header]
    if lines is not None:
        edited = "\n".join(head + lines) + "\n"
        try:
            if parse_yaml(edited) == expected:
                return edited
        except yaml.YAMLError:
            pass
    head.append("# (its text could not be edited line by line, so its values are written out: comments are lost)")
    return "\n".join(head) + "\n" + yaml.safe_dump(expected, sort_keys=False)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _set_line(lines: list[str], section: str, key: str, value: Any, *, present: bool) -> list[str] | None:
    """`lines` with `section.key` set to `value` in a block-style section (added when absent), or None."""
    starts = [i for i, line in enumerate(lines) if re.match(rf"{re.escape(section)}\s*:", line)]
    if not starts:
        return None if present else lines + [f"{section}:", f"  {_flow(key, value)}  {PLAN_MARK}"]
    head = starts[0]
    if len(starts) > 1 or _content(lines[head].split(":", 1)[1]):
        return None  # a flow-style section (`parallel: {tp: 2}`), or a repeated one
    end = next((i for i in range(head + 1, len(lines)) if _content(lines[i]) and _indent(lines[i]) == 0), len(lines))
    body = [i for i in range(head + 1, end) if _content(lines[i])]
    indent = _indent(lines[body[0]]) if body else 2
    new = " " * indent + f"{_flow(key, value)}  {PLAN_MARK}"
    at = next((i for i in body if _indent(lines[i]) == indent and re.match(rf"\s*{re.escape(key)}\s*:", lines[i])),
              None)
    if at is None:
        if present:
            return None  # written in a form this edit does not find (quoted, flow)
        last = body[-1] if body else head
        return lines[:last + 1] + [new] + lines[last + 1:]
    stop = at + 1
    while stop < end and (not lines[stop].strip() or _indent(lines[stop]) > indent):
        stop += 1
    while stop > at + 1 and not lines[stop - 1].strip():
        stop -= 1
    return lines[:at] + [new] + lines[stop:]


# --- how to run it, and what the files are -------------------------------------------------------

def start_lines(cluster: Cluster, *, world: int, run_yaml: str, cluster_field: str | None) -> list[str]:
    """The commands that train the plan: on one node deepspeed's launcher; on more, `dsf launch` with a
    hostfile and SLURM's `sbatch launch/slurm.sbatch` (its `dsf launch` flags after the run config)."""
    path = shlex.quote(run_yaml)
    if cluster.nodes == 1:
        return [f"deepspeed --num_gpus {world} $(which dsf) train {path}"]
    check = f" --cluster {shlex.quote(cluster_field)}" if cluster_field else ""
    slots = cluster.gpus_per_node
    sbatch = (f"GPUS_PER_NODE={slots} sbatch --nodes={cluster.nodes} --gpus-per-node=0" if cluster.is_cpu
              else f"sbatch --nodes={cluster.nodes} --gpus-per-node={slots}")
    return [f"dsf launch {path} --hostfile HOSTFILE{check}   # HOSTFILE: one `<host> slots={slots}` line per node",
            f"{sbatch} launch/slurm.sbatch {path}{check}   # on SLURM, from the dsframework checkout"]


def describe_job(plan: Plan, model_name: str) -> str:
    """'llama-70b on 16 x 8 h100-80gb GPUs, seq 4096, global batch 512, bf16'."""
    cluster, job = plan.cluster, plan.job
    return (f"{model_name} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.name} "
            f"{'ranks' if cluster.is_cpu else 'GPUs'}, seq {job.seq_len}, global batch {job.global_batch}, "
            f"{job.precision}")


def run_yaml_header(plan: Plan, *, model_name: str, source: str | None) -> list[str]:
    """run.yaml's first lines (without the `# `): what wrote it, for what, and which lines are whose."""
    if source is None:
        return [f"run.yaml of `dsf plan` for {describe_job(plan, model_name)}.",
                *textwrap.wrap(RUN_YAML_PLACEHOLDERS, 100)]
    return textwrap.wrap(f"{source} with the layout, batch split and ZeRO settings of `dsf plan` for "
                         f"{describe_job(plan, model_name)} (lines marked `{PLAN_MARK}`); every other line as "
                         f"{source} has it.", 100)


RUN_YAML_PLACEHOLDERS = ("The plan chose the layout (parallel.*), the batch split (train.micro_batch, grad_accum) "
                         "and ZeRO's settings; lines marked `# placeholder` are dsf's defaults, not chosen by the "
                         "plan (the data, steps, lr, vocabulary...): set them before training, or plan your own "
                         "run config with `dsf plan --run MY.yaml ...`.")
DS_CONFIG_NOTE = ("The DeepSpeed config (plain JSON, as deepspeed.initialize and DeepSpeedConfig read it; JSON has no "
                  "comments, so this note is here) that dsf train builds from run.yaml at dp {dp}, checked by "
                  "DeepSpeedConfig: to read and compare, or for a script of your own "
                  "(deepspeed.initialize(config=\"ds_config.json\")). dsf train does not read it: it builds the same "
                  "JSON from run.yaml when it starts, so edits to run.yaml win.")


def readme_text(plan: Plan, *, model_name: str, run_note: str, start: list[str]) -> str:
    """README.txt: what the plan is, what run.yaml and ds_config.json are, and how to start the run."""
    best = plan.best
    assert best is not None, "no file is written for a plan where nothing fits"
    lay, wrap = best.layout, _wrap
    lines = [f"dsf plan: {describe_job(plan, model_name)}",
             f"best: {family_of(lay)}, {lay.dims}, micro-batch {lay.micro_batch} x {lay.grad_accum}, "
             f"checkpointing {lay.activation_checkpointing}: {best.tokens_per_s:,.0f} tokens/s predicted", "",
             "run.yaml", *wrap(run_note), "", "ds_config.json", *wrap(DS_CONFIG_NOTE.format(dp=lay.dims.dp)), "",
             "README.txt", *wrap("This note."), "",
             "To train it" + (f" on {plan.cluster.nodes} nodes" if plan.cluster.nodes > 1 else "") + ":",
             *[f"  {line}" for line in start]]
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int = 100) -> list[str]:
    return textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="  ")
