#!/usr/bin/env bash
# A prepared smoke run of dsf on one NVIDIA GPU (issue 31, item 5): an H200 or H100 whose image has
# python 3.12, torch 2.11 + CUDA 13, transformers 5.17 and nvcc, but no DeepSpeed, no datasets, no
# pydantic and no network.
#
#   bash bench/fetch_gpu_wheels.sh      # here, once: the wheels into .whl/ (ignored by git; ~34 MiB)
#   bash bench/gpu_smoke.sh             # there, with .whl/ beside the checkout: installs them, runs the checks
#   bash bench/gpu_smoke.sh --dry-run   # anywhere, in seconds: every command it would run, each checked to
#                                       # parse (dsf: click's parser and the run config's schema; python:
#                                       # compile(); shell: bash -n); nothing is installed or trained
#
# The stack: our pinned one (launch/constraints.txt), not the image's transformers 5.17: .whl/ holds
# transformers 5.25.0 with its tokenizers / huggingface_hub / safetensors, deepspeed 0.19.8 (built
# here with its ops off), datasets 5.2.0, pydantic and the rest of the closure (bench/fetch_gpu_wheels.sh
# says which and why); the image keeps torch (its CUDA build), numpy, pyarrow and pandas. They go in
# with `pip install --no-index --no-deps --target $SITE` (SITE=/tmp/site), PYTHONPATH=$SITE:<this
# checkout> makes them and dsframework importable, and `dsf` is $WORK/bin/dsf: the console entry pip
# would write (dsframework.commands.cli:main) with a probe added (below). WHEELS=auto (the default)
# installs when .whl/ holds wheels and the python is 3.12; without them (a CPU rehearsal here:
# PYTHON=.venv/bin/python GPU_SH_ARGS=--dry-run bash bench/gpu_smoke.sh) it uses the python's own packages.
#
# Every run has DSF_CUDA_SYNC_DEBUG=warn (dsf train calls torch.cuda.set_sync_debug_mode with it) and
# PYTHONWARNINGS=always for torch's "called a synchronizing CUDA operation", so that each host sync is
# one warning in the run's log, not the first per call site.
#
# It prints one line per check, `ok <check>: <figures>` or `FAIL <check>: <why>`, goes on after a
# failure, and exits 1 when any check failed. The launches (logs and run directories in $WORK) and
# the checks read from them:
#
#   install        pip installs .whl/*.whl into $SITE                              check stack
#   tiny-straight  dsf train launch/examples/tiny.yaml as a world of one: bf16, 30 steps, logged every
#                  step, eval every 10, train.compile=auto, a checkpoint every 10 (sync writer)
#                                                           check bf16 tiny, logging, eval, compile auto
#   tiny-stopped   the same under `deepspeed --num_gpus 1`, checkpoint.writer=decoupled, train.stop_after=15
#   tiny-resumed   the same with --resume: steps 16-30
#                                          check checkpoint, exact resume (against tiny-straight), decoupled writer
#   sft            tiny-llama on a prompt/completion jsonl written here, ZeRO-3, 20 steps     check SFT
#   moe            a tiny Qwen3-MoE (4 experts, top 2), ZeRO-1: the world is 1, so ep is 1; AutoEP engages at
#                  ep 1 with parallel.autoep=true (its blocks, every expert on the one rank, no all-to-all),
#                  which the run's first line shows as "dp 1 (AutoEP)"                   check MoE AutoEP
#   gpu.sh         $GPU_SH_ENV bash bench/gpu.sh: llama-1b, its planned row compiled and the ZeRO-3 baseline
#                                                                                         check gpu.sh
#   and, over every training above: `sync debug <run>` (the sync warnings in its log, by call site),
#   `host RSS at model build` (each rank's peak while building its model, llama-1b's in gpu.sh's two rows),
#   `time` (the whole run against BUDGET_S).
#
# Host RSS: dsf's own `dsf: model built: ... host peak RSS ...` line where it prints one; else
# $WORK/bin/dsf's probe: it wraps train/setup.py's build_model_for_layout (/proc/self/clear_refs resets
# VmHWM; VmHWM after the build is the peak), and build_engine to print the engine's device, weight
# dtype and optimizer. The probe runs in the process the entry starts: a world of one (under a
# launcher dsf's watcher starts the trainer as `python -m dsframework.commands.cli`, without it).
# bench/gpu.sh gets PYTHON=$WORK/bin/python-rss, which sends its `python -m dsframework.commands.cli`
# through the entry.
#
# Time (under 8 minutes on an H200 in all; not yet timed on one): the tiny trainings are start-up bound.
# Rehearsed on this project's 2-core CPU machine (PYTHON=.venv/bin/python GPU_SH_ARGS=--dry-run), the
# whole script took 54 s: tiny-straight 6 s, tiny-stopped / tiny-resumed 12 s each under the launcher,
# SFT 6 s, MoE 5 s, gpu.sh --dry-run 13 s (dsf's start-up line: imports 3.1 s, deepspeed.initialize
# 0.8 s). On the GPU add CUDA and NCCL initialisation and the first import of the fresh $SITE (~10-20 s
# a launch): ~2 min for the five, ~15 s to install the wheels. bench/gpu.sh alone is 6-8 min in its
# full mode (30 steps a row); GPU_SH_ENV="STEPS=10 EVERY=5" keeps its model (llama-1b: the 1B build
# whose host RSS item 4 asks for, a real MFU reading, and inductor compiling a real model on the GPU,
# which nothing else here does: tiny-llama's compile=auto stays eager) and cuts its steps: ~3-4 min
# (two start-ups with the 1B model, the planned row's first compile 1-2 min, 10 steps a row, the
# second logging window timed). Its --dry-run (tiny-llama, 2 steps, eager) would take ~30 s but checks
# none of those. Over budget on a first run: add COMPILE=false to GPU_SH_ENV (saves the compile). Each
# launch has a time limit, and none runs past HARD_LIMIT_S (560 s: the device tool's command limit is
# 600 s), so every check line is printed whatever hangs; `time` fails past BUDGET_S (480 s).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_smoke.sh [--dry-run]" >&2; exit 2 ;;
esac
START=$SECONDS
BUDGET_S=${BUDGET_S:-480}
HARD_LIMIT_S=${HARD_LIMIT_S:-560}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-auto}
GPU_SH_ENV=${GPU_SH_ENV:-STEPS=10 EVERY=5}
GPU_SH_ARGS=${GPU_SH_ARGS:-}
RESULTS=${RESULTS:-${OUT:-}}  # the device tool's $OUT: the summary and a tarball of the logs come back there
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=$(command -v python3); fi
fi
case "$PY" in  # absolute (the files below name it), its folder resolved, not the link: a venv's python stays one
  /*) ;;
  */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;;
  *) PY=$(command -v "$PY") ;;
esac
if [ "$DRY" = 1 ]; then
  WORK=$(mktemp -d /tmp/dsf-gpu-smoke-dry.XXXXXX)
  trap '[ -n "${KEEP_DRY:-}" ] || rm -rf "$WORK"' EXIT  # KEEP_DRY=1 keeps its files
else
  WORK=${SMOKE_DIR:-$(mktemp -d /tmp/dsf-gpu-smoke.XXXXXX)}
fi
mkdir -p "$WORK/bin" "$WORK/runs"
DSF=$WORK/bin/dsf
FAILED=0

# The tiny trio's settings, read by the checks too.
export TINY_STEPS=30 TINY_STOP=15 TINY_EVAL=10 SFT_STEPS=20 MOE_STEPS=20
export SMOKE_BUDGET_S=$BUDGET_S
export HF_HOME=$WORK/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 DSF_CUDA_SYNC_DEBUG=warn
export PYTHONWARNINGS="always:called a synchronizing CUDA operation"

# --- the files the steps run (written in both modes; the dry run compiles them) -----------------

cat > "$DSF" <<EOF
#!$PY
EOF
cat >> "$DSF" <<'EOF'
"""bench/gpu_smoke.sh's `dsf`: the console entry pip writes for dsframework (dsframework.commands.cli:main),
and for `dsf train` two lines per rank that the smoke run's checks read:

    gpu_smoke: rank R host RSS while building the model: peak P GiB during the build (B GiB before it)
    gpu_smoke: rank R engine on DEVICE, weights DTYPE, optimizer OUTER(INNER)

The peak is models/construct.host_peak's over train/setup.py's build_model_for_layout (VmHWM, reset
through /proc/self/clear_refs as it begins): dsf's own `model built` line prints it for rank 0 only.
"""
import os
import sys


def probe():
    import dsframework.train.setup as setup
    from dsframework.models.construct import host_peak  # what dsf's own rank-0 line measures

    rank = os.environ.get("RANK", "0")
    build_model, build_engine = setup.build_model_for_layout, setup.build_engine

    def measured(*args, **kwargs):
        with host_peak() as peak:  # VmHWM reset through /proc/self/clear_refs as the build begins
            model = build_model(*args, **kwargs)
        since = "during the build" if peak.reset else "since the process started (clear_refs refused)"
        print(f"gpu_smoke: rank {rank} host RSS while building the model: peak {peak.peak / 2**30:.2f} GiB "
              f"{since} ({peak.before / 2**30:.2f} GiB before it)", flush=True)
        return model

    def described(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        weights = next(iter(engine.module.parameters()), None)
        inner = getattr(engine.optimizer, "optimizer", None)
        print(f"gpu_smoke: rank {rank} engine on {engine.device}, weights {getattr(weights, 'dtype', None)}, "
              f"optimizer {type(engine.optimizer).__name__}"
              + (f"({type(inner).__name__})" if inner is not None else ""), flush=True)
        return engine

    setup.build_model_for_layout, setup.build_engine = measured, described


if "train" in [a for a in sys.argv[1:] if not a.startswith("--local_rank")][:1]:  # (deepspeed's launch.py adds it)
    probe()
from dsframework.commands.cli import main  # noqa: E402

sys.exit(main())
EOF
chmod +x "$DSF"

cat > "$WORK/bin/python-rss" <<EOF
#!/usr/bin/env bash
# bench/gpu.sh's PYTHON: its \`python -m dsframework.commands.cli ...\` goes through $DSF (the RSS probe).
if [ "\${1:-}" = -m ] && [ "\${2:-}" = dsframework.commands.cli ]; then
  shift 2
  exec $(printf '%q' "$PY") $(printf '%q' "$DSF") "\$@"
fi
exec $(printf '%q' "$PY") "\$@"
EOF
chmod +x "$WORK/bin/python-rss"

cat > "$WORK/sft_data.py" <<'EOF'
"""The SFT run's data: N prompt/completion rows of arithmetic (docs/fine-tuning.md's format)."""
import json
import random
import sys

path, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
with open(path, "w") as f:
    for _ in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        f.write(json.dumps({"prompt": f"{'please ' * rng.randrange(3)}{a}+{b}=", "completion": f"{a + b}"}) + "\n")
EOF

# The MoE run's model: tiny Qwen3-MoE (models/tiny.py's sizes; AutoEP has a preset for qwen3_moe).
cat > "$WORK/moe.json" <<'EOF'
{"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
 "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256,
 "tie_word_embeddings": false, "router_aux_loss_coef": 0.01, "decoder_sparse_step": 1, "mlp_only_layers": []}
EOF

cat > "$WORK/analyze.py" <<'EOF'
"""bench/gpu_smoke.sh's checks, each one line: `ok <check>: <figures>` or `FAIL <check>: <why>`.

    python analyze.py WORK REPO CHECK...        # exit 1 when any failed
    python analyze.py --describe CHECK...       # what each checks (the dry run)
"""
import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

SYNC = "called a synchronizing CUDA operation"
TOL = 1e-5
DRIFT = 1e-3  # bf16 noise after the first resumed steps may reach this; a state restored wrong shows far above it
EXACT_STEPS = 2  # the resumed steps that must equal the straight run's: the restored weights, then the optimizer's
ENV = {k: int(os.environ.get(k, d)) for k, d in
       (("TINY_STEPS", 30), ("TINY_STOP", 15), ("TINY_EVAL", 10), ("SFT_STEPS", 20), ("MOE_STEPS", 20))}
# the trainings, by step name: (log, run directory) relative to WORK
RUNS = {"tiny-straight": ("tiny-straight.log", "runs/tiny-straight"),
        "tiny-stopped": ("tiny-stopped.log", "runs/tiny-resume"),
        "tiny-resumed": ("tiny-resumed.log", "runs/tiny-resume"),
        "sft": ("sft.log", "runs/sft"), "moe": ("moe.log", "runs/moe"),
        "gpu.sh planned": ("gpu/planned.log", "gpu/planned"), "gpu.sh baseline": ("gpu/baseline.log", "gpu/baseline")}


class Failed(Exception):
    pass


def status(work, name):
    """(exit status, seconds) of step `name`; None when it never ran."""
    path = work / f"{name}.rc"
    if not path.exists():
        return None
    rc, seconds = path.read_text().split()
    return int(rc), int(seconds)


def text(path):
    return path.read_text(errors="replace") if path.exists() else ""


def first_error(log):
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for pattern in (r"^dsf: error:", r"^[\w.]+(Error|Exception|Interrupt)\b", r"\b(Error|error|FAIL)"):
        hits = [line for line in lines if re.search(pattern, line) and SYNC not in line]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "no output"


REPORTED = set()  # failed steps already described in full by this process


def ran(work, name):
    """Seconds step `name` took; Failed unless it exited 0."""
    st = status(work, name)
    if st is None:
        raise Failed(f"{name} did not run")
    rc, seconds = st
    if rc and name in REPORTED:
        raise Failed(f"{name} failed (above)")
    if rc:
        REPORTED.add(name)
        what = {124: "ran out of time", 137: "was killed at its time limit", 125: "was not started: no time left"}
        raise Failed(f"{name} {what.get(rc, f'exited {rc}')} after {seconds} s: "
                     f"{first_error(text(work / f'{name}.log'))} (log: {work / name}.log)")
    return seconds


def records(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise Failed(f"no {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(recs, key):
    """step -> value (NaN for a logged null)."""
    return {r["step"]: (math.nan if r[key] is None else r[key]) for r in recs if key in r}


def finite(values, what):
    bad = [step for step, v in sorted(values.items()) if not math.isfinite(v)]
    if bad:
        raise Failed(f"{what} not finite at steps {bad[:5]}")


def engine_line(log, rank="0"):
    match = re.search(rf"gpu_smoke: rank {rank} engine on (\S+), weights (\S+), optimizer (\S+)", log)
    return match.groups() if match else None


def on_cuda(work):
    """Whether the runs had a GPU (the stack check's torch.cuda.is_available())."""
    return text(work / "device.txt") == "cuda"


def dsf_line(log, prefix):
    match = re.search(rf"^{re.escape(prefix)}.*$", log, re.M)
    return match.group(0) if match else None


def tags(ckpt_dir):
    """{step: tag directory} of the checkpoints with a manifest, and the latest tag."""
    found = {}
    for tag in sorted(ckpt_dir.glob("global_step*")):
        if (tag / "dsf_manifest.json").exists() and tag.name.removeprefix("global_step").isdigit():
            found[int(tag.name.removeprefix("global_step"))] = tag
    latest = text(ckpt_dir / "latest").strip()
    return found, latest


def size_mb(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


# --- the checks ---------------------------------------------------------------------------------

def check_stack(work, repo):
    """The carried wheels installed and found first; each one's requirements met by what is
    importable (the image's numpy, pyarrow, pandas and torch included); torch's device; `dsf --help`."""
    import importlib.metadata as md
    from packaging.requirements import Requirement
    from packaging.version import Version

    install = status(work, "install")
    if install is not None and install[0]:
        ran(work, "install")
    carried = [line.split() for line in text(work / "carried.txt").splitlines() if line.strip()]
    names = [name for name, _ in carried] or [Requirement(r).name for r in (md.requires("dsframework") or [])]
    problems = []
    for name, version in carried:
        try:
            found = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{name} not found after the install")
            continue
        if Version(found) != Version(version):
            problems.append(f"{name} {found} is found before the carried {version}")
    for name in names:
        for line in md.requires(name) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} needs {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}, found {req.name} {have}")
    import torch

    cuda = torch.cuda.is_available()
    device = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, bf16 "
              f"{'yes' if torch.cuda.is_bf16_supported() else 'no'})" if cuda else "no GPU")
    (work / "device.txt").write_text("cuda" if cuda else "cpu")
    if os.environ.get("REQUIRE_GPU") == "1" and not cuda:
        problems.append("torch sees no GPU (nvidia-smi is here)")
    helped = subprocess.run([str(work / "bin" / "dsf"), "--help"], capture_output=True, text=True, timeout=120)
    if helped.returncode or "Usage" not in helped.stdout:
        problems.append(f"`dsf --help` exited {helped.returncode}: {first_error(helped.stderr)}")
    if problems:
        raise Failed("; ".join(problems))
    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "none"

    image = ", ".join(f"{n} {version(n)}" for n in ("numpy", "pyarrow", "pandas"))
    where = (f"{len(carried)} carried wheels ({install[1]} s to install) found first" if carried
             else "the python's own packages (no wheels installed)")
    return (f"python {sys.version.split()[0]}, torch {torch.__version__} on {device}; {where}: transformers "
            f"{version('transformers')}, deepspeed {version('deepspeed')}, datasets {version('datasets')}, pydantic "
            f"{version('pydantic')}; with {image}; every requirement met; the dsf entry answers")


def check_tiny(work, repo):
    """bf16 on the GPU: the straight run finished, every step's loss finite, the run config's precision
    bf16, the engine's weights bfloat16 on cuda (the probe's line; dsf's `model built` line without it)."""
    seconds = ran(work, "tiny-straight")
    log = text(work / "tiny-straight.log")
    run = work / "runs/tiny-straight"
    losses = series(records(run), "loss")
    finite(losses, "the loss")
    if sorted(losses) != list(range(1, ENV["TINY_STEPS"] + 1)):
        raise Failed(f"logged steps {sorted(losses)[:3]}...{sorted(losses)[-3:]}, not 1-{ENV['TINY_STEPS']}")
    if "precision: bf16" not in text(run / "checkpoints/run.yaml"):
        raise Failed(f"{run}/checkpoints/run.yaml does not say precision: bf16")
    engine = engine_line(log)
    built = re.search(r"^dsf: model built: parameters on (\S+) in (\w+)", log, re.M)
    if engine is None and built is None:
        raise Failed("neither the probe's `gpu_smoke: rank 0 engine ...` line nor dsf's `dsf: model built: ...`")
    device, dtype, optimizer = engine or (built.group(1), f"torch.{built.group(2)}", "?")
    if text(work / "device.txt") == "cuda" and not device.startswith("cuda"):
        raise Failed(f"the {'engine' if engine else 'model'} is on {device}, not the GPU")
    if dtype != "torch.bfloat16":
        raise Failed(f"the {'engine' if engine else 'model'}'s weights are {dtype}, not torch.bfloat16")
    speed = series(records(run), "tokens_per_s")
    mean = sum(list(speed.values())[1:]) / max(1, len(speed) - 1)
    return (f"{ENV['TINY_STEPS']} steps, loss {losses[1]:.3f} -> {losses[max(losses)]:.3f}, {mean:,.0f} tokens/s "
            f"after step 1; {'engine' if engine else 'model'} on {device}, weights {dtype}, optimizer {optimizer}; "
            f"{seconds} s as a world of one")


def check_logging(work, repo):
    """metrics.jsonl has loss, lr, tokens/s and MFU for every step; rank 0 printed its start-up and
    summary lines."""
    ran(work, "tiny-straight")
    log = text(work / "tiny-straight.log")
    recs = [r for r in records(work / "runs/tiny-straight") if "loss" in r]
    missing = {key for r in recs for key in ("loss", "lr", "tokens_per_s", "mfu") if key not in r}
    if missing or len(recs) != ENV["TINY_STEPS"]:
        raise Failed(f"{len(recs)} step records; missing keys {sorted(missing)}")
    startup, summary = dsf_line(log, "dsf: start-up"), re.search(r"^dsf: [\d,]+ parameters.*$", log, re.M)
    if not startup or not summary:
        raise Failed("no `dsf: start-up` or `dsf: N parameters` line in the log")
    mfu = sum(r["mfu"] for r in recs[1:]) / max(1, len(recs) - 1)
    return f"{len(recs)} step records (loss, lr, tokens/s, MFU {mfu:.2%}); {startup[len('dsf: '):][:150]}"


def check_eval(work, repo):
    """eval_loss at step 0 and every {TINY_EVAL} steps, finite, lower at the end than at the start."""
    ran(work, "tiny-straight")
    evals = series(records(work / "runs/tiny-straight"), "eval_loss")
    want = list(range(0, ENV["TINY_STEPS"] + 1, ENV["TINY_EVAL"]))
    finite(evals, "eval_loss")
    if sorted(evals) != want:
        raise Failed(f"eval_loss at steps {sorted(evals)}, expected {want}")
    if not evals[want[-1]] < evals[0]:
        raise Failed(f"eval loss did not fall: {evals[0]:.4f} -> {evals[want[-1]]:.4f}")
    return "eval loss " + " -> ".join(f"{evals[s]:.3f}" for s in want) + f" at steps {', '.join(map(str, want))}"


def check_compile(work, repo):
    """train.compile=auto decided after its probe steps (and, compiling, said how long it took)."""
    ran(work, "tiny-straight")
    log = text(work / "tiny-straight.log")
    line = dsf_line(log, "dsf: train.compile=auto:")
    if line is None:
        raise Failed("no `dsf: train.compile=auto: ...` decision in the log")
    compiled = dsf_line(log, "dsf: compiled the model in")
    if line.endswith("compiling") and compiled is None:
        raise Failed(f"{line}, but no `dsf: compiled the model in ...` line")
    return line[len("dsf: train.compile=auto: "):] + (f"; {compiled[len('dsf: '):]}" if compiled else "")


def check_checkpoint(work, repo):
    """The straight run saved every {TINY_EVAL} steps (sync writer), the stopped one at step {TINY_STOP},
    each tag with its manifest and `latest` naming the last."""
    ran(work, "tiny-straight")
    found, latest = tags(work / "runs/tiny-straight/checkpoints")
    want = list(range(ENV["TINY_EVAL"], ENV["TINY_STEPS"] + 1, ENV["TINY_EVAL"]))
    if sorted(found) != want or latest != f"global_step{want[-1]}":
        raise Failed(f"tiny-straight's checkpoints {sorted(found)} (latest {latest or 'none'}), expected {want}")
    ran(work, "tiny-stopped")
    stopped = series(records(work / "runs/tiny-resume"), "loss")
    if max(stopped) < ENV["TINY_STOP"]:
        raise Failed(f"tiny-stopped logged up to step {max(stopped)}, not {ENV['TINY_STOP']}")
    tag = work / f"runs/tiny-resume/checkpoints/global_step{ENV['TINY_STOP']}"
    if not (tag / "dsf_manifest.json").exists():
        raise Failed(f"tiny-stopped saved no checkpoint at its stop ({tag} has no manifest)")
    stall = sum(r.get("checkpoint_s", 0) for r in records(work / "runs/tiny-straight"))
    return (f"tiny-straight saved steps {', '.join(map(str, want))} ({size_mb(found[want[-1]]):.1f} MB each, "
            f"{stall:.2f} s of stall in all, sync writer); tiny-stopped saved step {ENV['TINY_STOP']} at its stop")


def check_resume(work, repo):
    """tiny-resumed against tiny-straight: its first {EXACT_STEPS} steps (restored weights, data position,
    then the optimizer state's first update) within {TOL:g} (bitwise where the kernels are deterministic),
    every later loss and eval loss within {DRIFT:g} (bf16 sums in another order drift; a state restored
    wrong shows far above it); the drift of two fresh runs (tiny-stopped vs tiny-straight) beside it."""
    for name in ("tiny-straight", "tiny-stopped", "tiny-resumed"):
        ran(work, name)
    straight, resumed = records(work / "runs/tiny-straight"), records(work / "runs/tiny-resume")
    stop, first = ENV["TINY_STOP"], ENV["TINY_STOP"] + EXACT_STEPS
    diffs = {}  # (key, step) -> relative difference
    for key in ("loss", "eval_loss"):
        a, b = series(straight, key), series(resumed, key)
        for step in sorted(s for s in a if s > stop):
            if step not in b:
                raise Failed(f"tiny-resumed logged no {key} at step {step}")
            diffs[key, step] = abs(a[step] - b[step]) / max(abs(a[step]), 1e-12)
    if not diffs:
        raise Failed("nothing after the stop to compare")
    exact = {k: d for k, d in diffs.items() if k[0] == "loss" and k[1] <= first}
    bad = [k for k, d in exact.items() if not d <= TOL]
    if bad:
        raise Failed(f"step {bad[0][1]}, the {bad[0][1] - stop}th after the resume: relative difference "
                     f"{exact[bad[0]]:.2e} > {TOL:g} (the restored state is not the saved one)")
    worst = max(diffs, key=diffs.get)
    if not diffs[worst] <= DRIFT:
        raise Failed(f"{worst[0]} at step {worst[1]}: relative difference {diffs[worst]:.2e} > {DRIFT:g}")
    fresh_a, fresh_b = series(straight, "loss"), series(records(work / "runs/tiny-resume"), "loss")
    fresh = max((abs(fresh_a[s] - fresh_b[s]) / max(abs(fresh_a[s]), 1e-12) for s in range(1, stop + 1)
                 if s in fresh_a and s in fresh_b), default=math.nan)
    span = f"steps {stop + 1}-{ENV['TINY_STEPS']} after a stop at {stop} and --resume"
    if diffs[worst] == 0:
        return f"{span}: {len(diffs)} losses and eval losses bitwise equal to the straight run's"
    if diffs[worst] <= TOL:
        return f"{span}: {len(diffs)} losses and eval losses within {TOL:g} (largest {diffs[worst]:.2e})"
    drift_from = min(step for (key, step), d in diffs.items() if d > TOL)
    return (f"{span}: steps {stop + 1}-{first} {'bitwise' if max(exact.values()) == 0 else f'within {TOL:g}'} "
            f"(restored weights, data position, optimizer state); from step {drift_from} bf16 drift above "
            f"{TOL:g}, up to "
            f"{diffs[worst]:.1e} ({worst[0]} at {worst[1]}) <= {DRIFT:g}; two fresh runs (stopped vs straight) differ "
            f"by {fresh:.1e} over steps 1-{stop}")


def check_decoupled(work, repo):
    """checkpoint.writer=decoupled in the stopped and resumed runs: every checkpoint committed with
    its manifest, the resume read the stop's, and the stall the loop saw."""
    for name in ("tiny-stopped", "tiny-resumed"):
        ran(work, name)
    run = work / "runs/tiny-resume"
    if "writer: decoupled" not in text(run / "checkpoints/run.yaml"):
        raise Failed(f"{run}/checkpoints/run.yaml does not say writer: decoupled")
    found, latest = tags(run / "checkpoints")
    want = sorted({*range(ENV["TINY_EVAL"], ENV["TINY_STEPS"] + 1, ENV["TINY_EVAL"]), ENV["TINY_STOP"]})
    if sorted(found) != want or latest != f"global_step{want[-1]}":
        raise Failed(f"checkpoints {sorted(found)} (latest {latest or 'none'}), expected {want}")
    decoupled = sum(r.get("checkpoint_s", 0) for r in records(run))
    straight = sum(r.get("checkpoint_s", 0) for r in records(work / "runs/tiny-straight")) \
        if (work / "runs/tiny-straight/metrics.jsonl").exists() else math.nan
    return (f"checkpoints {', '.join(map(str, want))} written by DeepSpeed's background writer, each committed with "
            f"its manifest, the resume from step {ENV['TINY_STOP']}'s; the loop's stall {decoupled:.2f} s for "
            f"{len(want)} saves (the sync writer's: {straight:.2f} s for {len(want) - 1})")


def check_sft(work, repo):
    """A prompt/completion jsonl trained: losses finite, eval loss lower at the end."""
    seconds = ran(work, "sft")
    log = text(work / "sft.log")
    recs = records(work / "runs/sft")
    losses, evals = series(recs, "loss"), series(recs, "eval_loss")
    finite(losses, "the loss")
    finite(evals, "eval_loss")
    if max(losses, default=0) != ENV["SFT_STEPS"] or 0 not in evals or ENV["SFT_STEPS"] not in evals:
        raise Failed(f"steps logged up to {max(losses, default=0)}, evals at {sorted(evals)}")
    if not evals[ENV["SFT_STEPS"]] < evals[0]:
        raise Failed(f"eval loss did not fall: {evals[0]:.4f} -> {evals[ENV['SFT_STEPS']]:.4f}")
    data = dsf_line(log, "dsf: data") or "dsf: data (no line)"
    summary = re.search(r"\| (ZeRO-\d) \|", log)
    return (f"prompt/completion jsonl, {summary.group(1) if summary else 'ZeRO-?'}: eval loss {evals[0]:.3f} -> "
            f"{evals[ENV['SFT_STEPS']]:.3f} over {ENV['SFT_STEPS']} steps, {seconds} s; {data[len('dsf: '):][:160]}")


def check_moe(work, repo):
    """The tiny MoE trained in AutoEP's blocks at ep 1 ("(AutoEP)" in the first line), with the
    router's figures logged."""
    seconds = ran(work, "moe")
    log = text(work / "moe.log")
    summary = re.search(r"^dsf: [\d,]+ parameters.*$", log, re.M)
    if summary is None:
        raise Failed("no `dsf: N parameters ...` line")
    if "(AutoEP)" not in summary.group(0) and ", ep " not in summary.group(0):
        raise Failed(f"AutoEP did not engage at ep 1 (parallel.autoep=true): {summary.group(0)[:200]}")
    recs = records(work / "runs/moe")
    losses = series(recs, "loss")
    finite(losses, "the loss")
    router = [r for r in recs if "aux_loss" in r and "expert_load_cv" in r]
    if not router:
        raise Failed("no aux_loss / expert_load_cv in metrics.jsonl")
    layout = re.search(r"world \d+ = ([^|]+)\|", summary.group(0))
    experts = re.search(r"parameters \(([^)]*)\)", summary.group(0))
    return (f"ep 1 (world 1) with parallel.autoep=true: AutoEP engaged, {layout.group(1).strip() if layout else '?'}"
            f" ({experts.group(1) if experts else 'experts ?'}); loss {losses[min(losses)]:.3f} -> "
            f"{losses[max(losses)]:.3f}, aux_loss {router[-1]['aux_loss']:.4f}, expert_load_cv "
            f"{router[-1]['expert_load_cv']:.3f}; {seconds} s")


def check_gpush(work, repo):
    """bench/gpu.sh finished; its table's rows."""
    seconds = ran(work, "gpu.sh")
    out = text(work / "gpu.sh.log")
    rows = [line for line in out.splitlines() if re.match(r"^\| (planned|baseline) \|", line)]
    if len(rows) != 2:
        raise Failed(f"{len(rows)} table rows in its output, not 2: {first_error(out)}")
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    peak = re.search(r"measured bf16 matmul peak on (.*)$", out, re.M)
    head = re.search(r"^# dsf GPU bench: ([^;]*)", out, re.M)
    parts = [f"{c[0]} ZeRO-{c[1]} {c[2]}, compile {c[3]} s, {c[4]} tokens/s, {c[5]} TFLOP/s, MFU {c[6]}" for c in cells]
    return (f"{head.group(1) if head else '?'}: " + "; ".join(parts)
            + f" (peak {peak.group(1) if peak else '?'}); {seconds} s")


def check_sync(work, repo, run):
    """The synchronizing CUDA operations torch reported in the run's log, by call site."""
    log_name, _ = RUNS[run]
    log = text(work / log_name)
    if not log:
        raise Failed(f"no log {work / log_name}")
    if not on_cuda(work):
        return "not on a GPU: torch reports no syncs"
    code = "\n".join(p.read_text(errors="replace") for p in Path(repo, "dsframework").rglob("*.py"))
    if "set_sync_debug_mode" not in code:
        raise Failed("dsframework never calls torch.cuda.set_sync_debug_mode: DSF_CUDA_SYNC_DEBUG is not read")
    lines = [line for line in log.splitlines() if SYNC in line]
    sites = Counter()
    for line in lines:
        match = re.search(r"(\S+\.py):(\d+): \w*Warning: " + SYNC, line)
        sites["/".join(Path(match.group(1)).parts[-2:]) + f":{match.group(2)}" if match else "c++"] += 1
    top = ", ".join(f"{site} x{count}" for site, count in sites.most_common(5))
    st = status(work, run.split()[0])  # gpu.sh's two rows: its step
    failed = " (the run failed: its log up to there)" if st is not None and st[0] else ""
    return f"{len(lines)} sync warnings at {len(sites)} sites" + (f": {top}" if top else "") + failed


def check_rss(work, repo):
    """Each rank's host peak RSS while building its model, per run (gpu.sh's rows build llama-1b):
    dsf's own `dsf: ... RSS ...` line where it prints one, else the dsf entry's probe."""
    figures = []
    for run, (log_name, _) in RUNS.items():
        log = text(work / log_name)
        own = re.findall(r"^dsf:.*\bRSS\b.*$", log, re.M)
        probe = re.findall(r"gpu_smoke: rank (\d+) host RSS while building the model: peak (\S+) GiB "
                           r"(during the build|since)", log)
        if own:  # `dsf: model built: parameters on cuda in bfloat16; host peak RSS 0.49 GiB while building (+0.02 GiB)`
            figures += [f"{run}: {line[len('dsf: '):][:140]}" for line in own]
        else:
            figures += [f"{run} rank {rank} {peak} GiB (probe"
                        + (")" if since.startswith("during") else ", since start)") for rank, peak, since in probe]
    if not figures:
        raise Failed("no run printed its host RSS (neither a `dsf: ... RSS` line nor the probe's)")
    if not any(f.startswith("gpu.sh") for f in figures):
        figures.append("gpu.sh: none (it built no model)")
    return "; ".join(figures)


def check_time(work, repo):
    """The whole run against BUDGET_S (480 s unless set), and each step's seconds."""
    elapsed, budget = int(os.environ["SMOKE_ELAPSED_S"]), int(os.environ["SMOKE_BUDGET_S"])
    steps = []
    for name in ("install", "sft-data", "tiny-straight", "tiny-stopped", "tiny-resumed", "sft", "moe", "gpu.sh"):
        st = status(work, name)
        if st is not None:
            steps.append(f"{name} {st[1]}")
    line = f"{elapsed} s of {budget} s (" + ", ".join(steps) + ")"
    if elapsed > budget:
        raise Failed(line)
    return line


CHECKS = {"stack": ("stack", check_stack), "tiny": ("bf16 tiny", check_tiny), "logging": ("logging", check_logging),
          "eval": ("eval", check_eval), "compile": ("compile auto", check_compile),
          "checkpoint": ("checkpoint", check_checkpoint), "resume": ("exact resume", check_resume),
          "decoupled": ("decoupled writer", check_decoupled), "sft": ("SFT", check_sft),
          "moe": ("MoE AutoEP", check_moe), "gpush": ("gpu.sh", check_gpush),
          "rss": ("host RSS at model build", check_rss), "time": ("time", check_time)}


def resolve(key):
    """(label, function, extra argument) of a check key; `sync:<run>` is one run's sync count."""
    if key.startswith("sync:"):
        return f"sync debug {key[5:]}", check_sync, key[5:]
    label, function = CHECKS[key]
    return label, function, None


def main(argv):
    if argv[0] == "--describe":
        for key in argv[1:]:
            label, function, _ = resolve(key)
            print(f"check {label}: {' '.join(function.__doc__.format(**globals(), **ENV).split())}")
        return 0
    work, repo, failed = Path(argv[0]), Path(argv[1]), False
    for key in argv[2:]:
        label, function, extra = resolve(key)
        try:
            figures = function(work, repo) if extra is None else function(work, repo, extra)
            print(f"ok {label}: {figures}", flush=True)
        except Failed as err:
            print(f"FAIL {label}: {err}", flush=True)
            failed = True
        except Exception as err:  # noqa: BLE001 - a check's own bug is one failed line, not a traceback
            print(f"FAIL {label}: the check itself raised {type(err).__name__}: {err}", flush=True)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
EOF

cat > "$WORK/dryrun_check.py" <<'EOF'
"""bench/gpu_smoke.sh --dry-run: every recorded command checked to parse, nothing run.
dsf: click's parser (as tests/unit/test_docs.py checks the docs' commands), and for `dsf train` the
run config too (launch/examples/tiny.yaml with the --set overrides, through the real schema);
python: compile(); shell: bash -n."""
import subprocess
import sys
from pathlib import Path

work, repo = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(repo))
import click  # noqa: E402

from dsframework.commands.cli import cli  # noqa: E402
from dsframework.config import load_run_config  # noqa: E402
from dsframework.errors import UserError  # noqa: E402

commands, current = [], None
for line in (work / "commands.txt").read_text().splitlines():
    if line.startswith("@@ "):
        kind, name = line[3:].split(" ", 1)
        current = (kind, name, [])
        commands.append(current)
    else:
        current[2].append(line)


def dsf_args(argv):
    for i, word in enumerate(argv):
        if word == "dsf" or word.endswith("/dsf"):
            return argv[i + 1:]
        if word == "-m" and argv[i + 1:i + 2] == ["dsframework.commands.cli"]:
            return argv[i + 2:]
    return None


def dsf_problem(args):
    if not args:
        return "no dsf arguments found"
    command = cli.get_command(click.Context(cli), args[0])
    if command is None:
        return f"no subcommand {args[0]!r}"
    try:
        ctx = command.make_context(f"dsf {args[0]}", list(args[1:]))
    except click.ClickException as err:
        return err.format_message()
    if args[0] == "train":
        try:
            load_run_config(ctx.params["run_yaml"], ctx.params["overrides"])
        except UserError as err:
            return f"run config: {err}"
    return None


failed = 0
for kind, name, argv in commands:
    if kind == "dsf":
        problem, how = dsf_problem(dsf_args(argv) or []), "click parses it; its run config validates"
    elif kind in ("py", "py-file"):
        path = Path(argv[-1] if kind == "py-file" else next(a for a in argv if a.endswith(".py")))
        try:
            compile(path.read_text(), str(path), "exec")
            problem, how = None, f"python compiles {path.name}"
        except SyntaxError as err:
            problem = f"{path}: {err}"
    elif kind in ("sh", "sh-file"):
        path = argv[-1] if kind == "sh-file" else next(a for a in argv if a.endswith(".sh"))
        done = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        problem, how = (done.stderr.strip() or None) if done.returncode else None, f"bash -n {Path(path).name}"
    else:
        problem, how = None, f"{kind}: not parsed here (its own tool's flags)"
    print(f"{'parses' if problem is None else 'FAIL'} [{name}]: {how if problem is None else problem}")
    failed += problem is not None
dsf_count = sum(kind == "dsf" for kind, _, _ in commands)
print(f"dry run: {len(commands)} steps and files, {dsf_count} dsf commands; "
      + ("every one parses" if not failed else f"{failed} do not parse"))
sys.exit(1 if failed else 0)
EOF

# --- running steps and checks -------------------------------------------------------------------

step() {  # NAME KIND LIMIT_S ARGV...: one command, its output in $WORK/NAME.log, `rc seconds` in NAME.rc
  local name=$1 kind=$2 limit=$3 rc=0 t0 left
  shift 3
  if [ "$DRY" = 1 ]; then
    echo "+ [$name] $(printf '%q ' "$@")"
    { echo "@@ $kind $name"; printf '%s\n' "$@"; } >> "$WORK/commands.txt"
    return 0
  fi
  t0=$SECONDS
  left=$((HARD_LIMIT_S - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "not started: $((SECONDS - START)) s of HARD_LIMIT_S=$HARD_LIMIT_S gone" > "$WORK/$name.log"
    rc=125
  else
    timeout -k 15 "$limit" "$@" > "$WORK/$name.log" 2>&1 || rc=$?
  fi
  echo "$rc $((SECONDS - t0))" > "$WORK/$name.rc"
  return "$rc"
}

record_file() {  # KIND NAME PATH: in the dry run, a file the steps run, checked like a step
  [ "$DRY" = 1 ] && { echo "@@ $1 $2"; echo "$3"; } >> "$WORK/commands.txt"
  return 0
}

check() {  # CHECK...: the checks' lines (the dry run: listed at the end, with what each checks)
  if [ "$DRY" = 1 ]; then
    printf '%s\n' "$@" >> "$WORK/checks.txt"
  else
    SMOKE_ELAPSED_S=$((SECONDS - START)) "$PY" "$WORK/analyze.py" "$WORK" "$REPO" "$@" | tee -a "$WORK/summary.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || FAILED=1
  fi
}

record_file py-file "dsf entry" "$DSF"
record_file sh-file "gpu.sh's python" "$WORK/bin/python-rss"
record_file py-file checks "$WORK/analyze.py"

echo "# dsf GPU smoke run$([ "$DRY" = 1 ] && echo ' (dry run: nothing is installed or trained)');" \
  "python $PY; work $WORK"

# 1. the wheels
install=0
if [ "$WHEELS" = yes ] || { [ "$WHEELS" = auto ] && ls .whl/*.whl > /dev/null 2>&1 \
     && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; }; then
  install=1
fi
if [ "$install" = 1 ] || [ "$DRY" = 1 ]; then
  [ "$DRY" = 1 ] && [ "$install" = 0 ] \
    && echo "# (the install runs on the GPU machine; not here: no .whl/ wheels, or not python 3.12)"
  step install pip 180 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
  for wheel in .whl/*.whl; do  # `name version` of each, for the stack check
    [ -e "$wheel" ] && basename "$wheel" | awk -F- '{print $1, $2}'
  done > "$WORK/carried.txt"
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
else
  : > "$WORK/carried.txt"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export PATH="$WORK/bin:$PATH"
if [ -z "${REQUIRE_GPU:-}" ]; then
  if command -v nvidia-smi > /dev/null; then export REQUIRE_GPU=1; else export REQUIRE_GPU=0; fi
fi
check stack

# 2. the tiny example: straight, then stopped and resumed with the decoupled writer
# The straight run is a world of one (plain `dsf train`); the stopped and resumed ones run under the
# deepspeed launcher, as users run several GPUs (LOCAL_RANK -> the rank's device, dsf's rank watcher).
# They need it for the decoupled writer too: as a world of one, checkpoint.writer=decoupled fails in
# deepspeed.initialize with KeyError 'CROSS_SIZE' (DeepSpeed's writer config reads CROSS_SIZE /
# CROSS_RANK, which its launcher sets and dsf's world of one, train/world.py, does not).
PORTS=(29500 29501)
[ "$DRY" = 1 ] || read -r -a PORTS <<< "$("$PY" -c 'import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')"
launcher() { LAUNCH=("$PY" -m deepspeed.launcher.runner --num_gpus 1 --master_port "${PORTS[$1]}"); }
TINY=(launch/examples/tiny.yaml --set train.precision=bf16 --set "train.steps=$TINY_STEPS" --set train.compile=auto
      --set data.num_examples=4000 --set logging.every=1 --set "logging.eval_every=$TINY_EVAL"
      --set logging.progress=false --set "checkpoint.every=$TINY_EVAL")
step tiny-straight dsf 150 "$DSF" train "${TINY[@]}" --set checkpoint.writer=sync \
  --set "output_dir=$WORK/runs/tiny-straight" --overwrite
check tiny logging eval compile
launcher 0
step tiny-stopped dsf 150 "${LAUNCH[@]}" "$DSF" train "${TINY[@]}" --set checkpoint.writer=decoupled \
  --set "train.stop_after=$TINY_STOP" --set "output_dir=$WORK/runs/tiny-resume" --overwrite
launcher 1
step tiny-resumed dsf 150 "${LAUNCH[@]}" "$DSF" train "${TINY[@]}" --set checkpoint.writer=decoupled \
  --set "output_dir=$WORK/runs/tiny-resume" --resume
check checkpoint resume decoupled

# 3. SFT: a prompt/completion jsonl (tests/distributed/test_sft.py's data), ZeRO-3
record_file py-file "sft data" "$WORK/sft_data.py"
step sft-data py 30 "$PY" "$WORK/sft_data.py" "$WORK/sft.jsonl" 1000
step sft dsf 150 "$DSF" train launch/examples/tiny.yaml --set train.precision=bf16 \
  --set "data.dataset=$WORK/sft.jsonl" \
  --set data.format=prompt_completion --set data.seq_len=32 --set data.tokenizer_vocab_size=300 \
  --set data.eval_fraction=0.1 --set parallel.zero_stage=3 --set train.global_batch=8 --set train.micro_batch=4 \
  --set "train.steps=$SFT_STEPS" --set train.warmup_steps=2 --set logging.every=5 \
  --set "logging.eval_every=$SFT_STEPS" --set logging.progress=false --set checkpoint.every=0 \
  --set "output_dir=$WORK/runs/sft" --overwrite
check sft

# 4. a tiny mixture of experts in AutoEP's blocks at ep 1 (one GPU: world 1)
step moe dsf 150 "$DSF" train launch/examples/tiny.yaml --set train.precision=bf16 --set "model.name=$WORK/moe.json" \
  --set parallel.autoep=true --set parallel.ep=1 --set parallel.zero_stage=1 --set data.num_examples=4000 \
  --set "train.steps=$MOE_STEPS" --set train.warmup_steps=2 --set logging.every=5 \
  --set "logging.eval_every=$MOE_STEPS" \
  --set logging.progress=false --set checkpoint.every=0 --set "output_dir=$WORK/runs/moe" --overwrite
check moe

# 5. bench/gpu.sh, shortened (see the header)
read -r -a GPU_ENV <<< "$GPU_SH_ENV"
read -r -a GPU_ARGS <<< "$GPU_SH_ARGS"
step gpu.sh sh 360 env "${GPU_ENV[@]}" "OUT=$WORK/gpu" "PYTHON=$WORK/bin/python-rss" bash bench/gpu.sh "${GPU_ARGS[@]}"
check gpush
[ "$DRY" = 1 ] || grep -E '^\| |^# (plan|measured|MFU)' "$WORK/gpu.sh.log" 2>/dev/null | sed 's/^/#   /'

# 6. over every run: the host syncs torch reported, the host RSS at model build, the time
check "sync:tiny-straight" "sync:tiny-stopped" "sync:tiny-resumed" sync:sft sync:moe "sync:gpu.sh planned" \
  "sync:gpu.sh baseline" rss time

if [ "$DRY" = 1 ]; then
  mapfile -t CHECKS < "$WORK/checks.txt"
  "$PY" "$WORK/analyze.py" --describe "${CHECKS[@]}" || FAILED=1
  "$PY" "$WORK/dryrun_check.py" "$WORK" "$REPO" || FAILED=1
elif [ -n "$RESULTS" ] && [ -d "$RESULTS" ]; then
  cp "$WORK/summary.txt" "$RESULTS/gpu_smoke_summary.txt" 2>/dev/null
  (cd "$WORK" && find . -maxdepth 3 \( -name '*.log' -o -name '*.rc' -o -name metrics.jsonl -o -name plan.txt \
     -o -name summary.txt \) -print0 | tar -czf "$RESULTS/gpu_smoke_logs.tgz" --null -T -) 2>/dev/null
fi
echo "# $([ "$FAILED" = 0 ] && echo 'all checks passed' || echo 'some checks FAILED');" \
  "$((SECONDS - START)) s; work $WORK"
exit "$FAILED"
