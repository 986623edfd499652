"""Bad input gets one line on stderr, exit code 2, no traceback, and leaves existing output alone.

    python -m pytest tests/unit/test_bad_input.py -q

Each case runs the `dsf` command line (a world of one, no launcher) inside its own temporary
directory, after writing the files the case needs. Most run it in this process, as `dsf` does:
`cli._run_command(argv)` with stdout and stderr captured at the file descriptors, the environment
and working directory of a fresh `dsf` (restored after), and Python's default warning filters (a
warning Python would print counts as a stderr line). A case that would form a process group is
stopped there (FormsAProcessGroup) and must run the real `dsf` in a subprocess instead: those cases,
a launch that could start processes, and at least one case of each command as end-to-end proof
(the script's exit code and stderr) do, each saying why (`process=`). The contract, for every case:

- exit code 2;
- stderr is exactly one non-empty line, `dsf: error: ...`, naming the field (and the value, when
  there is one) and the fix -- nothing else: warnings that a library prints to stderr count too;
- "Traceback" appears in neither stdout nor stderr;
- every pre-existing output the case guards (an `-o` file, an export OUT_DIR, an output_dir with
  a previous run) is byte-for-byte unchanged, with no file added or removed; outputs the case
  names as absent are not created.

Only the cases that need a real checkpoint (export, resume) share one tiny run trained once per
module (~10 s); the rest fail while the config is read.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsframework.checkpoints.outputs import LOCK

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "launch" / "examples" / "tiny.yaml"
TIMEOUT_S = 180

# A tiny, fast run (a few seconds on one CPU rank). warmup_steps=1 keeps it independent of how
# warmup_steps=0 maps onto DeepSpeed's WarmupCosineLR (which rejects warmup_num_steps=0).
TINY_RUN = ("train.steps=2", "train.warmup_steps=1", "train.global_batch=4", "train.micro_batch=2",
            "data.num_examples=200", "data.seq_len=16", "logging.eval_every=0", "logging.progress=false",
            "checkpoint.every=0")
INLINE_TINY_YAML = """\
model: {name: tiny-llama}
data: {dataset: counting}
parallel: {zero_stage: 2}
"""


def dsf_command() -> list[str]:
    """The `dsf` console script of this interpreter's environment, else `python -m dsframework.commands.cli`."""
    script = Path(sys.executable).with_name("dsf")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "dsframework.commands.cli"]


def dsf_env(home: Path) -> dict[str, str]:
    """A clean single-process environment: no launcher variables, no hub, one thread."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HOME=str(home))
    return env


def run_dsf(args: list[str], *, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(dsf_command() + args, cwd=cwd, env=dsf_env(home), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


class FormsAProcessGroup(BaseException):
    """Raised where an in-process case would form a process group (a BaseException, so that no
    `except Exception` on the way can turn it into something else)."""


def _python_default_warning_filters() -> None:
    """The filters of a `python` started without -W or PYTHONWARNINGS (pytest installs its own)."""
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def run_dsf_in_process(args: list[str], *, cwd: Path, home: Path, capfd: pytest.CaptureFixture,
                       monkeypatch: pytest.MonkeyPatch,
                       env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`dsf ARGS` as `dsf` runs it (cli._run_command; main() would os._exit after torch.distributed is
    imported), in this process: exit code, stdout, stderr (with the warnings Python would print).
    `env` is added to dsf_env(home).

    No state outlives the call: the environment and cwd are restored, and forming a process group
    raises FormsAProcessGroup instead (a case that gets that far runs as a subprocess)."""
    import deepspeed
    import deepspeed.comm
    import huggingface_hub.constants
    import torch.distributed

    from dsframework.commands import cli

    def refuse(*_args, **_kwargs):
        raise FormsAProcessGroup(f"dsf {' '.join(args)} forms a process group: give its Case process=...")

    for owner, name in ((deepspeed, "init_distributed"), (deepspeed.comm, "init_distributed"),
                        (torch.distributed, "init_process_group")):
        monkeypatch.setattr(owner, name, refuse)
    # HF_HUB_OFFLINE (dsf_env) is read when huggingface_hub is imported, long before this case.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    saved_env, saved_cwd, fresh_env = dict(os.environ), os.getcwd(), {**dsf_env(home), **(env or {})}
    os.environ.clear()
    os.environ.update(fresh_env)
    os.chdir(cwd)
    capfd.readouterr()  # only what the command writes
    try:
        with warnings.catch_warnings(record=True) as shown:
            _python_default_warning_filters()
            try:
                cli._run_command(args)
                code: int | str | None = 0
            except SystemExit as stop:
                code = stop.code
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    out, err = capfd.readouterr()
    err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in shown)
    if isinstance(code, str):  # sys.exit("message"): Python prints it and exits 1
        err, code = err + code + "\n", 1
    return subprocess.CompletedProcess(args, 0 if code is None else code, out, err)


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Every file under `path` (or the file itself) with its bytes; None when it does not exist."""
    if not path.exists():
        return None
    if path.is_file():
        return {".": path.read_bytes()}
    # (but the lock a run that got past pre-flight takes on an existing output_dir: checkpoints/outputs.py)
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != LOCK}


# --- the trained run, shared by the cases that need a real checkpoint ----------------------------

@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, hf_home: Path) -> Path:
    """output_dir of a 2-step tiny run (ZeRO-2, world of one), trained once for the module."""
    root = tmp_path_factory.mktemp("trained")
    yaml_path = TINY_YAML if TINY_YAML.is_file() else root / "tiny.yaml"
    if not TINY_YAML.is_file():
        yaml_path.write_text(INLINE_TINY_YAML)
    out = root / "run"
    args = ["train", str(yaml_path)] + [a for kv in TINY_RUN + (f"output_dir={out}",) for a in ("--set", kv)]
    proc = run_dsf(args, cwd=root, home=hf_home)
    assert proc.returncode == 0, f"tiny training run failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / "checkpoints" / "latest").is_file(), "tiny training run wrote no checkpoint"
    return out


# --- the cases -----------------------------------------------------------------------------------

# A previous run in output_dir: the sentinels a bad input must never touch.
PRIOR_RUN = {
    "out/checkpoints/latest": "global_step100\n",
    "out/checkpoints/global_step100/mp_rank_00_model_states.pt": "sentinel weights\n",
    "out/checkpoints/run.yaml": "sentinel: run config\n",
    "out/metrics.jsonl": '{"step": 100, "loss": 1.25}\n',
}
# An output_dir that exists but holds no run (so the run gets past the output-dir check).
NOT_A_RUN = {"out/notes.txt": "keep me\n"}
# Why a case runs the real `dsf` in a subprocess (the others run in this process: run_dsf_in_process).
AFTER_GROUP = "named after the process group forms (the batch at the group's world, the checkpoint, the data)"
END_TO_END = "the real `dsf` script's exit code and stderr, for a command no other subprocess case runs"


@dataclass(frozen=True)
class Case:
    """One bad input: the dsf arguments, the files to create first, what the error line must say.

    Strings in `args` and `files` may use {tmp} (the case's directory), {ckpt} (the shared trained
    run's checkpoints dir) and {run} (a private copy of the trained run's output_dir).
    """

    id: str
    args: tuple[str, ...]
    expect: tuple[str | tuple[str, ...], ...]  # each item: a substring, or a tuple of alternatives
    files: dict[str, str] = field(default_factory=dict)
    guard: tuple[str, ...] = ()     # paths (relative to {tmp}, or {ckpt}/{run}) that must not change
    absent: tuple[str, ...] = ()    # paths (relative to {tmp}) that must not be created
    needs_ckpt: bool = False        # uses {ckpt}
    needs_run_copy: bool = False    # uses {run}
    process: str | None = None      # why it runs the real `dsf` in a subprocess (default: in this process)
    xfail: str | None = None        # a known source bug: the reason
    skipif: str | None = None       # a condition (evaluated in this module) under which it cannot fail


def train_case(id: str, yaml_text: str | None, *extra: str, files: dict[str, str] | None = None,
               guard: tuple[str, ...] = ("out",), **kw) -> Case:
    """A `dsf train {tmp}/run.yaml ...` case; `yaml_text` None means no run.yaml is written."""
    all_files = dict(files or {})
    if yaml_text is not None:
        all_files["run.yaml"] = yaml_text
    return Case(id, ("train", "{tmp}/run.yaml", *extra), files=all_files, guard=guard, **kw)


def sets(*assignments: str) -> tuple[str, ...]:
    return tuple(a for kv in assignments for a in ("--set", kv))


OUT = "output_dir: {tmp}/out\n"
PLAN_ARGS = ("plan", "--model", "llama-7b", "--seq-len", "2048", "--global-batch", "64")
# TINY_RUN as YAML, for cases that get as far as building the engine.
TINY_YAML_SETTINGS = """\
data: {num_examples: 200, seq_len: 16}
train: {steps: 2, warmup_steps: 1, global_batch: 4, micro_batch: 2}
logging: {eval_every: 0, progress: false}
"""
TWO_HOSTS = "worker-0 slots=2\nworker-1 slots=2\n"
# Chat / prompt-completion data that gets as far as tokenizing (the errors are in the rows).
SFT_YAML = """\
data:
  dataset: {{tmp}}/{data}
  format: {fmt}
  chat_template: {{tmp}}/t.jinja
  seq_len: 16
train: {{steps: 2, warmup_steps: 1, global_batch: 4, micro_batch: 2}}
logging: {{eval_every: 0, progress: false}}
"""
CHAT_TEMPLATE_FILE = {"t.jinja": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}<assistant>{% endif %}"}


def launch_case(id: str, *extra: str, expect: tuple, hosts: str | None = TWO_HOSTS, dry_run: bool = True,
                files: dict[str, str] | None = None, guard: tuple[str, ...] = ("hosts",),
                process: str | None = None) -> Case:
    """A `dsf launch TINY_YAML [--hostfile {tmp}/hosts] [--dry-run] ...` case; nothing may be started."""
    hostfile = ("--hostfile", "{tmp}/hosts") if hosts else ()
    return Case(id, ("launch", str(TINY_YAML), *hostfile, *(("--dry-run",) if dry_run else ()), *extra),
                expect=expect, files={**({"hosts": hosts} if hosts else {}), **(files or {})},
                guard=guard if hosts else (), process=process)


CASES = [
    # --- dsf train: the run config itself -------------------------------------------------------
    train_case("train-broken-yaml", OUT + "model:\n  name: [unclosed\ntrain: {steps: 3\n",
               expect=("run config", "run.yaml", "YAML"), files=PRIOR_RUN),
    train_case("train-yaml-not-a-mapping", "- model\n- train\n",
               expect=("run config", "run.yaml", "mapping"), files=PRIOR_RUN),
    train_case("train-unknown-top-level-key", OUT + "epochs: 3\n",
               expect=("epochs", "unknown key"), files=PRIOR_RUN),
    train_case("train-mistyped-nested-key", OUT + "train:\n  stpes: 3\n",
               expect=("train.stpes", "'steps'"), files=PRIOR_RUN),
    train_case("train-missing-run-config", None,
               expect=("run config", "run.yaml", "no such file"), files=PRIOR_RUN),
    train_case("train-wrong-value-type", OUT + "train:\n  steps: many\n",
               expect=("train.steps", "many"), files=PRIOR_RUN),
    train_case("train-offload-param-below-stage3", OUT + "parallel:\n  zero_stage: 2\n  offload_param: cpu\n",
               expect=("offload_param", "cpu", "zero_stage"), files=PRIOR_RUN),
    train_case("train-warmup-exceeds-steps", OUT + "train:\n  steps: 5\n  warmup_steps: 10\n",
               expect=("warmup_steps", "10"), files=PRIOR_RUN),
    # --- dsf train: --set overrides ---------------------------------------------------------------
    train_case("train-negative-lr", OUT, *sets("train.lr=-0.1"),
               expect=("train.lr", "-0.1"), files=PRIOR_RUN),
    train_case("train-set-without-equals", OUT, *sets("train.steps"),
               expect=("--set", "train.steps", "key=value"), files=PRIOR_RUN),
    train_case("train-set-unknown-key", OUT, *sets("train.stepz=3"),
               expect=("--set", "train.stepz", "'steps'"), files=PRIOR_RUN),
    train_case("train-set-into-a-value", OUT, *sets("train.lr.peak=1"),
               expect=("--set", "train.lr"), files=PRIOR_RUN),
    train_case("train-set-zero-stage-5", OUT, *sets("parallel.zero_stage=5"),
               expect=("parallel.zero_stage", "5"), files=PRIOR_RUN),
    train_case("train-set-compile-not-a-choice", OUT, *sets("train.compile=sometimes"),
               expect=("train.compile", "sometimes"), files=PRIOR_RUN),
    train_case("train-unknown-flag", OUT, "--resum",
               expect=("--resum",), files=PRIOR_RUN),
    # --- dsf train: the output directory ----------------------------------------------------------
    train_case("train-existing-run-without-resume-or-overwrite", OUT,
               expect=("output_dir", "{tmp}/out", "--resume", "--overwrite"), files=PRIOR_RUN),
    train_case("train-resume-and-overwrite", OUT, "--resume", "--overwrite",
               expect=("--resume", "--overwrite"), files=PRIOR_RUN),
    train_case("train-resume-without-checkpoint", OUT, "--resume",
               expect=("output_dir", "{tmp}/out", "no checkpoint"), files=NOT_A_RUN),
    train_case("train-resume-latest-names-missing-tag", OUT + TINY_YAML_SETTINGS, "--resume",
               expect=("checkpoint", "global_step100"),
               files={"out/checkpoints/latest": "global_step100\n", "out/metrics.jsonl": '{"step": 100}\n'}),
    train_case("train-overwrite-with-bad-batch-triple",
               OUT + "train: {micro_batch: 4, grad_accum: 2, global_batch: 7}\n", "--overwrite",
               expect=("train.global_batch", "7"), files=PRIOR_RUN, process=AFTER_GROUP),
    Case("train-resume-with-mismatched-model",
         ("train", "{run}/checkpoints/run.yaml", "--resume",
          *sets("model.overrides.num_hidden_layers=3", "output_dir={run}")),
         expect=("num_hidden_layers", "3", "differs from the checkpoint"), guard=("{run}",), needs_run_copy=True,
         process=AFTER_GROUP),
    Case("train-resume-with-another-zero-stage",  # tp, pp and dp may change on resume; the ZeRO stage not
         ("train", "{run}/checkpoints/run.yaml", "--resume", *sets("parallel.zero_stage=1", "output_dir={run}")),
         expect=("parallel.zero_stage=1", "differs from the checkpoint's 2", "parallel.zero_stage=2"),
         guard=("{run}",), needs_run_copy=True, process=AFTER_GROUP),
    Case("train-resume-with-an-empty-latest",  # the real save's manifest verifies: named, not --overwrite
         ("train", "{run}/checkpoints/run.yaml", "--resume", *sets("output_dir={run}")),
         expect=("{run}/checkpoints/latest", "is empty", "echo global_step2 > {run}/checkpoints/latest"),
         files={"run/checkpoints/latest": ""}, guard=("{run}",), needs_run_copy=True),
    # --- dsf train: model and data ----------------------------------------------------------------
    train_case("train-tp-larger-than-world", OUT + "parallel: {tp: 2}\n",
               expect=("world size", "1", "tp*pp", "{1}"), files=NOT_A_RUN),
    train_case("train-pipeline-with-zero3", OUT + "parallel: {pp: 2, zero_stage: 3}\n",
               expect=("parallel.pp", "2", "zero_stage 0 or 1"), files=NOT_A_RUN),
    train_case("train-dp-not-world-over-tp-pp", OUT + "parallel: {dp: 2}\n",
               expect=("parallel.dp", "2", "world 1"), files=NOT_A_RUN),
    train_case("train-sequence-parallel-without-tp", OUT + "parallel: {sequence_parallel: true}\n",
               expect=("parallel.sequence_parallel=True", "parallel.tp is 1", "parallel.sequence_parallel=auto"),
               files=NOT_A_RUN),
    train_case("train-sequence-parallel-sequence-not-split", OUT + "data: {seq_len: 30}\n"
               "parallel: {tp: 4, sequence_parallel: true}\n",
               expect=("parallel.sequence_parallel=True", "does not divide data.seq_len=30", "multiple of 4"),
               files=NOT_A_RUN),
    # This CPU has no fp16 (DeepSpeed's CPU accelerator says so; its own check is a traceback per rank).
    # train.tf32=true needs CUDA (auto is off here): named in pre-flight, before the rendezvous.
    train_case("train-tf32-without-cuda", OUT + "train: {tf32: true}\n",
               expect=("train.tf32=True", "needs a CUDA device", "train.tf32=auto"), files=NOT_A_RUN,
               skipif="cuda_is_here()"),
    train_case("train-fp16-on-a-cpu-without-it", OUT + "train: {precision: fp16}\n",
               expect=("train.precision", "fp16", "not supported", "bf16"), files=NOT_A_RUN,
               skipif="cpu_has_fp16()"),
    train_case("train-unknown-preset", OUT + "model:\n  name: tiny-lama\n",
               expect=("model.name", "tiny-lama", "'tiny-llama'"), files=NOT_A_RUN),
    train_case("train-unknown-model-type", OUT + "model:\n  name: {tmp}/config.json\n",
               expect=("model.name", "config.json", "lama", "'llama'"),
               files={**NOT_A_RUN, "config.json": '{"model_type": "lama", "hidden_size": 64}\n'}),
    train_case("train-unknown-model-override", OUT, *sets("model.overrides.hiden_size=32"),
               expect=("model.overrides.hiden_size", "32", "'hidden_size'"), files=NOT_A_RUN),
    train_case("train-inconsistent-batch-triple",
               OUT + "train:\n  micro_batch: 4\n  grad_accum: 2\n  global_batch: 7\n",
               expect=("global_batch", "7"), files=NOT_A_RUN, process=AFTER_GROUP),
    train_case("train-missing-dataset", OUT + "data:\n  dataset: {tmp}/nope.jsonl\n",
               expect=("data.dataset", "nope.jsonl"), files=NOT_A_RUN, process=AFTER_GROUP),
    train_case("train-text-field-not-a-column",
               OUT + "data:\n  dataset: {tmp}/docs.jsonl\n  text_field: contnet\n",
               expect=("data.text_field", "contnet", "'content'"),
               files={**NOT_A_RUN, "docs.jsonl": "".join(f'{{"id": {i}, "content": "document number {i}"}}\n'
                                                         for i in range(20))}, process=AFTER_GROUP),
    train_case("train-malformed-jsonl", OUT + "data:\n  dataset: {tmp}/bad.jsonl\n",
               expect=("data.dataset", "bad.jsonl"),
               files={**NOT_A_RUN, "bad.jsonl": '{"text": "a"\n{broken\n'}, process=AFTER_GROUP),
    # --- dsf config -------------------------------------------------------------------------------
    Case("config-offload-param-below-stage3",
         ("config", "--offload-param", "cpu", "--zero-stage", "2", "-o", "{tmp}/ds.json"),
         expect=(("--offload-param", "offload_param"), "cpu"), absent=("ds.json",)),
    Case("config-offload-optimizer-at-stage0", ("config", "--offload-optimizer", "cpu", "-o", "{tmp}/ds.json"),
         expect=(("--offload-optimizer", "offload_optimizer"), "cpu"), absent=("ds.json",)),
    Case("config-inconsistent-batch-triple",
         ("config", "--micro-batch", "4", "--grad-accum", "2", "--global-batch", "7", "--world-size", "2",
          "-o", "{tmp}/ds.json"),
         expect=(("--global-batch", "global_batch"), "7"), absent=("ds.json",)),
    Case("config-global-batch-not-divisible",
         ("config", "--micro-batch", "4", "--global-batch", "6", "--world-size", "2", "-o", "{tmp}/ds.json"),
         expect=(("--global-batch", "global_batch"), "6"), absent=("ds.json",)),
    Case("config-negative-lr", ("config", "--lr", "-1", "-o", "{tmp}/ds.json"),
         expect=("--lr", "-1"), absent=("ds.json",)),
    Case("config-zero-stage-5", ("config", "--zero-stage", "5", "-o", "{tmp}/ds.json"),
         expect=("--zero-stage", "5"), absent=("ds.json",)),
    Case("config-world-size-0", ("config", "--world-size", "0", "-o", "{tmp}/ds.json"),
         expect=("--world-size", "0"), absent=("ds.json",)),
    Case("config-warmup-exceeds-steps", ("config", "--warmup-steps", "5", "--steps", "2", "-o", "{tmp}/ds.json"),
         expect=("warmup_steps", "5"), absent=("ds.json",)),
    Case("config-output-exists-without-force", ("config", "--zero-stage", "2", "-o", "{tmp}/ds.json"),
         expect=("--output", "ds.json", "--force"), files={"ds.json": '{"sentinel": true}\n'},
         guard=("ds.json",), process=END_TO_END),
    Case("config-unknown-flag", ("config", "--zero-stag", "2"), expect=("--zero-stag",)),
    Case("config-tp-does-not-divide-world", ("config", "--tp", "3", "--world-size", "8", "-o", "{tmp}/ds.json"),
         expect=("--world-size", "8", "tp*pp", "{1, 2, 4, 8}"), absent=("ds.json",)),
    Case("config-pipeline-with-zero2", ("config", "--pp", "2", "--zero-stage", "2", "-o", "{tmp}/ds.json"),
         expect=("--pp", "2", "zero_stage 0 or 1"), absent=("ds.json",)),
    Case("config-unknown-partition-method-is-a-train-key", ("config", "--partition-method", "best"),
         expect=("--partition-method",)),
    # --- dsf export -------------------------------------------------------------------------------
    Case("export-empty-ckpt-dir", ("export", "{tmp}/empty", "{tmp}/hf"),
         expect=("CKPT_DIR", "empty"), files={"empty/.keep": ""}, absent=("hf",)),
    Case("export-ckpt-dir-of-random-files", ("export", "{tmp}/junk", "{tmp}/hf"),
         expect=("CKPT_DIR", "junk"), files={"junk/notes.txt": "hello\n", "junk/data.bin": "xyz"},
         guard=("junk",), absent=("hf",)),
    Case("export-missing-ckpt-dir", ("export", "{tmp}/nowhere", "{tmp}/hf"),
         expect=("CKPT_DIR", "nowhere"), absent=("hf",)),
    Case("export-latest-names-missing-tag", ("export", "{tmp}/ck", "{tmp}/hf"),
         expect=("CKPT_DIR", "global_step7"), files={"ck/latest": "global_step7\n", "hf/sentinel": "keep\n"},
         guard=("ck", "hf")),
    Case("export-unknown-tag", ("export", "{ckpt}", "{tmp}/hf", "--tag", "global_step99"),
         expect=("CKPT_DIR", "global_step99"), guard=("{ckpt}",), absent=("hf",), needs_ckpt=True),
    Case("export-out-dir-not-empty", ("export", "{ckpt}", "{tmp}/hf"),
         expect=("OUT_DIR", "hf", "--overwrite"), files={"hf/sentinel.txt": "keep me\n", "hf/config.json": "{}\n"},
         guard=("hf", "{ckpt}"), needs_ckpt=True, process=END_TO_END),
    Case("export-out-dir-is-a-file", ("export", "{ckpt}", "{tmp}/hf.bin"),
         expect=("OUT_DIR", "hf.bin"), files={"hf.bin": "not a directory\n"}, guard=("hf.bin", "{ckpt}"),
         needs_ckpt=True),
    # --- dsf plan -------------------------------------------------------------------------------
    Case("plan-unknown-cluster", PLAN_ARGS + ("--cluster", "h100-40gb"), expect=("--cluster", "h100-40gb", "h100-80gb")),
    Case("plan-corrupt-cluster-profile", PLAN_ARGS + ("--cluster", "{tmp}/cpu.json"),
         expect=("--cluster", "cpu.json", "JSON"), files={"cpu.json": '{"name": "cpu", "memory_per_gpu": '},
         guard=("cpu.json",), process=END_TO_END),
    Case("plan-profile-unknown-field", PLAN_ARGS + ("--cluster", "{tmp}/cpu.json"),
         expect=("cpu.json", "memory_per_gpus", "memory_per_gpu"),
         files={"cpu.json": '{"name": "cpu", "memory_per_gpus": 1e9, "peak_flops": {"fp32": 1e9}}'},
         guard=("cpu.json",)),
    Case("plan-unknown-model", ("plan", "--model", "llama-8x", "--cluster", "h100-80gb", "--seq-len", "2048",
                                "--global-batch", "64"), expect=("model.name", "llama-8x")),
    Case("plan-output-dir-holds-a-plan", PLAN_ARGS + ("--cluster", "h100-80gb", "-o", "{tmp}/plan"),
         expect=("--output-dir", "ds_config.json", "--force"),
         files={"plan/run.yaml": "sentinel\n", "plan/ds_config.json": "{}\n"}, guard=("plan",)),
    Case("plan-nothing-fits-with-output-dir", ("plan", "--model", "llama-70b", "--cluster", "a100-40gb",
                                               "--gpus-per-node", "2", "--seq-len", "4096", "--global-batch", "8",
                                               "-o", "{tmp}/plan"),
         expect=("--output-dir", "no layout fits"), absent=("plan",)),
    Case("plan-explain-unknown-key", PLAN_ARGS + ("--cluster", "h100-80gb", "--explain", "tp=2 zero_stage=1"),
         expect=("--explain", "zero_stage=1", "key=value", "tp=8 pp=8")),
    Case("plan-explain-bad-value", PLAN_ARGS + ("--cluster", "h100-80gb", "--explain", "tp=2 ckpt=some"),
         expect=("--explain", "ckpt=some", "none or full")),
    Case("plan-explain-zero-stage", PLAN_ARGS + ("--cluster", "h100-80gb", "--explain", "zero=4"),
         expect=("--explain", "zero=4", "a ZeRO stage, 0-3")),
    Case("plan-explain-no-such-layout", PLAN_ARGS + ("--cluster", "h100-80gb", "--explain", "tp=3"),
         expect=("--explain", "tp=3", "matches none of the", "dropped")),
    Case("plan-run-bad-field", ("plan", "--run", "{tmp}/my.yaml", "--cluster", "h100-80gb", "-o", "{tmp}/plan"),
         expect=("train.lr", "-1", "greater than 0"), files={"my.yaml": "model: {name: llama-7b}\ntrain: {lr: -1}\n"},
         guard=("my.yaml",), absent=("plan",)),
    Case("plan-run-unknown-key", ("plan", "--run", "{tmp}/my.yaml", "--cluster", "h100-80gb", "-o", "{tmp}/plan"),
         expect=("train.stpes", "'steps'"), files={"my.yaml": "train:\n  stpes: 10\n"}, absent=("plan",)),
    Case("plan-run-no-such-file", ("plan", "--run", "{tmp}/nope.yaml", "--cluster", "h100-80gb"),
         expect=("nope.yaml", "no such file")),
    Case("plan-run-flag-differs-from-the-file", PLAN_ARGS + ("--run", "{tmp}/my.yaml", "--cluster", "h100-80gb"),
         expect=("--seq-len", "2048", "data.seq_len=4096", "my.yaml"),
         files={"my.yaml": "model: {name: llama-7b}\ndata: {seq_len: 4096}\n"}),
    Case("plan-run-without-global-batch", ("plan", "--run", "{tmp}/my.yaml", "--cluster", "h100-80gb"),
         expect=("--global-batch", "train.global_batch", "my.yaml"), files={"my.yaml": "model: {name: llama-7b}\n"}),
    # --- dsf launch -----------------------------------------------------------------------------
    Case("launch-duplicate-host", ("launch", str(TINY_YAML), "--hostfile", "{tmp}/hosts", "--dry-run"),
         expect=("hosts:2", "worker-0", "twice"), files={"hosts": "worker-0 slots=2\nworker-0 slots=2\n"},
         guard=("hosts",)),
    Case("launch-include-unknown-host", ("launch", str(TINY_YAML), "--hostfile", "{tmp}/hosts", "--include",
                                         "worker-7", "--dry-run"),
         expect=("--include", "worker-7", "worker-0"), files={"hosts": "worker-0 slots=2\nworker-1 slots=2\n"},
         guard=("hosts",)),
    launch_case("launch-slurm-without-hostfile", "--num-gpus", "2", "--launcher", "slurm",
                expect=("--launcher", "slurm", "--hostfile"), hosts=None),
    launch_case("launch-node-rank-without-no-ssh", "--node-rank", "1",
                expect=("--node-rank", "1", "no_ssh")),
    launch_case("launch-node-rank-out-of-range", "--launcher", "no_ssh", "--node-rank", "2",
                expect=("--node-rank", "2", "0..1")),
    launch_case("launch-no-ssh-two-nodes-without-node-rank", "--launcher", "no_ssh", dry_run=False,
                expect=("--node-rank", "no_ssh", "worker-1"),
                process="not a dry run: were the check to regress, the launcher would start"),
    launch_case("launch-openmpi-with-include", "--launcher", "openmpi", "--include", "worker-0",
                expect=("--launcher", "openmpi", "include")),
    launch_case("launch-slurm-slot-ids", "--launcher", "slurm", "--include", "worker-0:1@worker-1:1",
                expect=("--include", "worker-0:1@worker-1:1", "slurm", "device ids")),
    launch_case("launch-negative-max-restarts", "--max-restarts", "-1", expect=("--max-restarts", "-1")),
    launch_case("launch-openmpi-cannot-restart", "--launcher", "openmpi", "--max-restarts", "2",
                expect=("--max-restarts", "openmpi", "does not say which node failed", "slurm")),
    launch_case("launch-env-shell-expansion", "--env", "DATA=$HOME/data", expect=("--env", "DATA", "'$'")),
    launch_case("launch-env-newline", "--env", "NOTE=a\nb", expect=("--env", "NOTE", "newline")),
    launch_case("launch-env-not-a-name", "--env", "MY-VAR=1", expect=("--env", "MY-VAR", "variable name")),
    launch_case("launch-env-clashes-with-deepspeed-env", "--env", "FOO=2",
                expect=("--env", "FOO=2", ".deepspeed_env", "FOO=1"),
                files={".deepspeed_env": "FOO=1\n"}, guard=("hosts", ".deepspeed_env")),
    launch_case("launch-memory-does-not-fit", "--num-gpus", "2", "--cluster", "cpu-local",
                *sets("model.name=llama-7b", "parallel.zero_stage=0", "parallel.tp=1", "parallel.pp=1"),
                expect=("memory per rank", "GiB per rank >", "10.0 GiB available", "dsf plan", "--force"),
                hosts=None),
    # --- dsf train: chat and prompt/completion data, adapters, tokenized data --------------------
    train_case("train-chat-messages-not-a-list", OUT + SFT_YAML.format(fmt="chat", data="chats.jsonl"),
               expect=("row 1", "messages", "list of {role, content}"),
               files={**NOT_A_RUN, **CHAT_TEMPLATE_FILE,
                      "chats.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                                     '"content": "yo"}]}\n{"messages": "hello"}\n' * 10}, absent=("out/checkpoints",),
               process=AFTER_GROUP),
    train_case("train-chat-unknown-role", OUT + SFT_YAML.format(fmt="chat", data="chats.jsonl"),
               expect=("assitant", "'assistant'"),
               files={**NOT_A_RUN, **CHAT_TEMPLATE_FILE,
                      "chats.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assitant", '
                                     '"content": "yo"}]}\n' * 20}, absent=("out/checkpoints",),
               process=AFTER_GROUP),
    train_case("train-chat-no-assistant-turn-left", OUT + SFT_YAML.format(fmt="chat", data="chats.jsonl"),
               expect=("data.dataset", "assistant"),
               files={**NOT_A_RUN, **CHAT_TEMPLATE_FILE,
                      "chats.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n' * 20},
               absent=("out/checkpoints",), process=AFTER_GROUP),
    train_case("train-chat-tokenizer-without-template", OUT + SFT_YAML.format(fmt="chat", data="chats.jsonl").replace(
                   "  chat_template: {tmp}/t.jinja\n", ""),
               expect=("chat_template", "data.chat_template"),
               files={**NOT_A_RUN, "chats.jsonl": '{"messages": [{"role": "user", "content": "hi"}, '
                                                  '{"role": "assistant", "content": "yo"}]}\n' * 20},
               absent=("out/checkpoints",), process=AFTER_GROUP),
    train_case("train-prompt-completion-columns-missing", OUT + SFT_YAML.format(fmt="prompt_completion", data="qa.jsonl"),
               expect=("data.prompt_field='prompt'", "question, answer"),
               files={**NOT_A_RUN, **CHAT_TEMPLATE_FILE, "qa.jsonl": '{"question": "1+1", "answer": "2"}\n' * 20},
               absent=("out/checkpoints",), process=AFTER_GROUP),
    train_case("train-lora-with-tensor-parallelism", OUT + "model:\n  lora: {r: 4}\nparallel:\n  tp: 2\n",
               expect=("model.lora", "tp = pp = cp = 1", "tp=2"), files=PRIOR_RUN),
    train_case("train-chat-with-pipeline", OUT + "data:\n  format: chat\nparallel:\n  pp: 2\n  zero_stage: 1\n",
               expect=("data.format", "chat", "pp=2"), files=PRIOR_RUN),
    train_case("train-input-ids-beyond-the-vocabulary", OUT + "model:\n  tokenizer: {ckpt}/tokenizer\n"
               + SFT_YAML.format(fmt="text", data="ids.jsonl"),
               expect=("data.dataset=99999", "outside the tokenizer's vocabulary"),
               files={**NOT_A_RUN, **CHAT_TEMPLATE_FILE, "ids.jsonl": '{"input_ids": [1, 2, 3, 4]}\n{"input_ids": [5, 99999]}\n' * 20},
               needs_ckpt=True, absent=("out/checkpoints",), process=AFTER_GROUP),
    # --- the command line itself ------------------------------------------------------------------
    Case("unknown-subcommand", ("trian", "run.yaml"), expect=("trian",), process=END_TO_END),
]


def cuda_is_here() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_has_fp16() -> bool:
    """DeepSpeed's CPU accelerator's own test (AVX512-FP16 / AMX-FP16 through oneDNN)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    marks += [pytest.mark.skipif(case.skipif, reason=case.skipif)] if case.skipif else []
    # A real `dsf` process, or the module's trained run (one `dsf train`): the full tier's.
    marks += [pytest.mark.distributed] if case.process or case.needs_ckpt or case.needs_run_copy else []
    return pytest.param(case, id=case.id, marks=marks)


def test_enough_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 15


def test_an_in_process_run_stops_at_the_process_group_and_leaves_no_state(tmp_path: Path, hf_home: Path,
                                                                          capfd: pytest.CaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """A good run goes as far as the process group, where run_dsf_in_process stops it; the environment
    (which dsf's world of one fills with RANK, MASTER_PORT, ...) and cwd are as before."""
    import deepspeed  # noqa: F401  (importing it sets PYTORCH_NVML_BASED_CUDA_CHECK once per process)

    env, cwd = dict(os.environ), os.getcwd()
    with pytest.raises(FormsAProcessGroup):
        run_dsf_in_process(["train", str(TINY_YAML), *sets(f"output_dir={tmp_path / 'out'}")], cwd=tmp_path,
                           home=hf_home, capfd=capfd, monkeypatch=monkeypatch)
    assert dict(os.environ) == env and os.getcwd() == cwd


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_outputs_alone(case: Case, tmp_path: Path, hf_home: Path,
                                                                request: pytest.FixtureRequest,
                                                                capfd: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch):
    places = {"{tmp}": str(tmp_path)}
    if case.needs_ckpt:
        places["{ckpt}"] = str(request.getfixturevalue("trained_run") / "checkpoints")
    if case.needs_run_copy:
        places["{run}"] = str(tmp_path / "run")
        shutil.copytree(request.getfixturevalue("trained_run"), tmp_path / "run")

    def fill(text: str) -> str:
        for placeholder, value in places.items():
            text = text.replace(placeholder, value)
        return text

    for rel, text in case.files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fill(text))
    guarded = [Path(fill(g)) if g.startswith("{") else tmp_path / g for g in case.guard]
    before = {str(p): snapshot(p) for p in guarded}
    assert all(v is not None for v in before.values()), "a guarded path was not set up"

    args = [fill(a) for a in case.args]
    if case.process:
        proc = run_dsf(args, cwd=tmp_path, home=hf_home)
    else:
        proc = run_dsf_in_process(args, cwd=tmp_path, home=hf_home, capfd=capfd, monkeypatch=monkeypatch)

    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stdout and "Traceback" not in proc.stderr, report
    assert proc.returncode == 2, report
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"stderr is not exactly one line\n{report}"
    line = lines[0]
    assert line.startswith("dsf: error: "), report
    for expected in case.expect:
        options = (expected,) if isinstance(expected, str) else expected
        options = tuple(fill(o) for o in options)
        assert any(o in line for o in options), f"{' or '.join(map(repr, options))} not in: {line}"
    for path in guarded:
        assert snapshot(path) == before[str(path)], f"{path} changed\n{report}"
    for rel in case.absent:
        assert not (tmp_path / rel).exists(), f"{rel} was created\n{report}"


LAYOUT_ERRORS = {  # (world, settings, the one line)
    "pipeline-deeper-than-the-model": (2, ("parallel.zero_stage=1", "parallel.pp=2", "model.overrides.num_hidden_layers=1"),
                                       "parallel.pp=2: exceeds num_hidden_layers=1; choose pp in 1..1"),
    "cp-not-dividing-seq-len": (2, ("parallel.cp=2", "data.seq_len=63"),
                                "parallel.cp=2: does not divide data.seq_len=63; choose data.seq_len a multiple of 2"),
    "cp-not-dividing-heads": (3, ("parallel.cp=3",),
                              "parallel.cp=3: does not divide the 4 attention heads; choose cp in {1, 2, 4}"),
    "cp-not-dividing-kv-heads": (3, ("parallel.cp=3", "model.overrides.num_attention_heads=6",
                                     "model.overrides.hidden_size=48"),
                                 "parallel.cp=3: neither divides nor is a multiple of the 2 key/value heads; "
                                 "choose cp in {1, 2} or a multiple of 2"),
    "hpz-not-dividing-dp": (2, ("parallel.zero_stage=3", "parallel.zero_hpz=4"),
                            "parallel.zero_hpz=4: does not divide the 2 ranks ZeRO shards across (dp=2 x cp=1); "
                            "choose zero_hpz in {1, 2}"),
    "hpz-below-zero-3": (2, ("parallel.zero_stage=2", "parallel.zero_hpz=2"),
                         "parallel.zero_hpz=2: needs zero_stage=3 (hpZ partitions ZeRO-3's weights), got zero_stage=2; "
                         "set parallel.zero_stage=3 or parallel.zero_hpz=1"),
    "chunked-loss-with-pp": (2, ("parallel.zero_stage=1", "parallel.pp=2", "train.chunked_loss=true"),
                             "train.chunked_loss=True: is not offered with parallel.pp=2: the pipeline's last stage "
                             "gets its logits from its head layer (a LayerSpec), not from a loss that calls the head; "
                             "set train.chunked_loss=auto (whole logits with pp) or false, or use parallel.tp"),
    "ep-on-a-dense-model": (2, ("parallel.ep=2",),
                            "parallel.ep=2: needs a mixture-of-experts model; 'llama' has no routed experts; "
                            "set parallel.ep=1 (dense models train with dp, tp, pp, cp and ZeRO)"),
    "ep-not-dividing-dp": (2, ("parallel.ep=4",),
                           "parallel.ep=4: does not divide the 2 data-parallel ranks (world 2 / tp*pp*cp = 1); "
                           "choose ep in {1, 2}"),
    "cp-with-pp": (4, ("parallel.zero_stage=1", "parallel.pp=2", "parallel.cp=2"),
                   "parallel.cp=2: does not compose with parallel.pp=2: DeepSpeed's Ulysses runs in its plain engine, "
                   "not the pipeline engine; supported: tp x pp x dp with ZeRO 0-1; tp x cp x dp with ZeRO 0-3; "
                   "zero_hpz with ZeRO-3 over cp x dp (tp = pp = 1); ep within dp with ZeRO 0-3 (tp = pp = cp = 1)"),
}


@pytest.mark.parametrize("case", LAYOUT_ERRORS)
def test_a_layout_error_is_named_before_the_rendezvous(tmp_path: Path, hf_home: Path, case: str,
                                                       capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """Rank 0 of a world started alone (the other ranks never come): a layout that cannot run is
    named at once, not after waiting for the others where the process group forms (30 minutes by
    default). In this process, where forming the group raises FormsAProcessGroup: the error comes first."""
    from tests.distributed.launcher import free_port

    world, settings, line = LAYOUT_ERRORS[case]
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = ["train", str(TINY_YAML), *sets(f"output_dir={tmp_path / 'out'}", *settings)]
    proc = run_dsf_in_process(args, cwd=tmp_path, home=hf_home, capfd=capfd, monkeypatch=monkeypatch, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"dsf: error: {line}"], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["index-names-a-missing-shard", "shard-shapes-differ-from-config"])
def test_a_broken_pretrained_directory_is_one_line_exit_2(tmp_path: Path, hf_home: Path, damage: str,
                                                          capfd: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch):
    """A local pretrained directory saved as several safetensors files, then damaged: the file is
    named before any rank starts (safetensors headers only; in this process, where forming the
    process group would raise), and nothing in it is touched."""
    import json

    from tests.unit.test_construct import save_pretrained

    pretrained = tmp_path / "pretrained"
    save_pretrained("llama", pretrained)
    if damage == "index-names-a-missing-shard":
        victim = sorted(set(json.loads((pretrained / "model.safetensors.index.json").read_text())
                            ["weight_map"].values()))[1]
        (pretrained / victim).unlink()
        expect = (str(pretrained / victim), "is named by model.safetensors.index.json but is not there",
                  "copy the missing shard")
    else:
        config = json.loads((pretrained / "config.json").read_text())
        (pretrained / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
        expect = ("model.name", ".safetensors", "has shape [96, 64], the config gives [128, 64]",
                  "use the config.json saved with these weights")
    before = snapshot(pretrained)
    (tmp_path / "run.yaml").write_text(OUT.replace("{tmp}", str(tmp_path)) + TINY_YAML_SETTINGS)
    proc = run_dsf_in_process(["train", str(tmp_path / "run.yaml"), *sets(f"model.name={pretrained}")],
                              cwd=tmp_path, home=hf_home, capfd=capfd, monkeypatch=monkeypatch)
    report = f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, report
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsf: error: "), report
    assert all(part in lines[0] for part in expect), (expect, lines[0])
    assert snapshot(pretrained) == before, "the pretrained directory is left as it was"
    assert not (tmp_path / "out").exists()
