"""Start real multi-process runs from tests: CPU ranks with gloo, started as `deepspeed --num_gpus N` starts them.

    metrics = train_run(tmp_path / "z2", ["parallel.zero_stage=2"], num_ranks=2)
    [m["loss"] for m in metrics if "loss" in m]
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from dsframework.ports import free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "launch" / "examples" / "tiny.yaml"

# A tiny, fast, exactly reproducible run: fp32, no dropout, 1 thread per rank.
BASE_OVERRIDES = [
    "model.name=tiny-llama", "data.dataset=counting", "data.num_examples=2000", "data.seq_len=32",
    "train.steps=8", "train.global_batch=8", "train.micro_batch=null", "train.grad_accum=null", "train.lr=3e-3", "train.warmup_steps=2",
    "train.weight_decay=0.1", "train.grad_clip=1.0", "train.precision=fp32",
    "logging.every=1", "logging.eval_every=0", "logging.progress=false",
    "checkpoint.every=0", "checkpoint.save_final=false",
    # Eager: runs of "100000 steps" cut short (faults, preemption) would otherwise compile at step 4
    # (train.compile=auto); compiled training is test_compile.py's.
    "train.compile=false",
]


def rank_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None)
    return env


def launch(script_and_args: list[str], *, num_ranks: int, timeout: int = 600,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run `<script> <args>` on N ranks of this node; fail the test with its output if it fails
    (unless not `check`: a fault test judges the exit code and output itself).

    Each rank is started as DeepSpeed's per-node launcher (`deepspeed.launcher.launch`, what
    `deepspeed --num_gpus N` runs on a node) starts it: `python -u <script> --local_rank=<r> <args>`
    with its environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE,
    MASTER_ADDR/PORT, CUDA_VISIBLE_DEVICES); when a rank fails the others are ended, as that
    launcher does. Started from here, a launch does not first import deepspeed (and torch) in a
    launcher process before any rank starts: 5-7 s of every one of ~70 launches. The real runner
    and per-node launcher start the quickstart and fault tests, and every job across nodes in
    tests/cluster.
    """
    script, *args = script_and_args
    common = dict(rank_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(num_ranks),
                  LOCAL_SIZE=str(num_ranks), CROSS_RANK="0", CROSS_SIZE="1",
                  CUDA_VISIBLE_DEVICES=",".join(map(str, range(num_ranks))))
    cmd = [sys.executable, "-u", script, *args]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        ranks = [subprocess.Popen([sys.executable, "-u", script, f"--local_rank={rank}", *args], cwd=REPO,
                                  env=dict(common, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=stdout, stderr=stderr)
                 for rank in range(num_ranks)]
        returncode = _wait_all(ranks, timeout=timeout, cmd=cmd)
        stdout.seek(0)
        stderr.seek(0)
        proc = subprocess.CompletedProcess(cmd, returncode, stdout.read(), stderr.read())
    assert proc.returncode == 0 or not check, (f"{' '.join(cmd)} on {num_ranks} ranks failed:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _wait_all(ranks: list[subprocess.Popen], *, timeout: float, cmd: list[str]) -> int:
    """0 when every rank exits 0; else the first non-zero exit code, the other ranks (and anything
    they started) ended, as deepspeed's launcher ends them. Past `timeout`: all ended, TimeoutExpired."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            break
        if time.monotonic() > deadline:
            _end(ranks)
            raise subprocess.TimeoutExpired(cmd, timeout)
        time.sleep(0.1)
    _end(ranks)
    return failed[0] if failed else 0


def _end(ranks: list[subprocess.Popen]) -> None:
    for rank in ranks:
        if rank.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(rank.pid).children(recursive=True):
                    child.kill()
            rank.kill()
        rank.wait()


def dsf(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `dsf ARGS` as a single process; fail the test with its output if it fails.

    `dsf export` runs in this process instead (click's CliRunner on the same command): it is one
    process either way, and this one has already imported torch and transformers, which a new
    process pays 10-15 s for, a dozen times a suite. Its exit codes and one-line errors as a
    process are test_bad_input's."""
    if args[0] == "export":
        return _dsf_in_process(args)
    proc = subprocess.run([str(BIN / "dsf"), *args], capture_output=True, text=True, timeout=timeout,
                          env=rank_env(), cwd=REPO)
    assert proc.returncode == 0, f"dsf {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def dsf_started(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """One `dsf` process (no launcher: world 1), started now; `one_line` collects a refused one."""
    return subprocess.Popen([str(BIN / "dsf"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**rank_env(), **(env or {})})


def train_args(output_dir: Path, overrides: list[str], *flags: str) -> list[str]:
    """`dsf train`'s arguments for the tiny run into `output_dir` (BASE_OVERRIDES, then `overrides`)."""
    return ["train", str(TINY_YAML), *[a for o in run_overrides(output_dir, overrides) for a in ("--set", o)], *flags]


def one_line(proc: subprocess.Popen, *, timeout: int = 180) -> str:
    """The one `dsf: error:` line of a process that exits 2 without a traceback."""
    out, err = proc.communicate(timeout=timeout)
    report = f"exit {proc.returncode}\n--- stdout ---\n{out[-2000:]}\n--- stderr ---\n{err[-3000:]}"
    assert proc.returncode == 2 and "Traceback" not in err, report
    lines = {line for line in err.splitlines() if line.startswith("dsf: error: ")}
    assert len(lines) == 1, report
    return lines.pop()


def _dsf_in_process(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    import deepspeed  # noqa: F401 - before CliRunner swaps sys.stdout: deepspeed's logger binds the real one
    from click.testing import CliRunner

    from dsframework.commands.cli import cli

    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, f"dsf {' '.join(args)} failed ({result.exit_code}):\n{result.output[-4000:]}"
    return subprocess.CompletedProcess(["dsf", *args], result.exit_code, result.output, "")


def _not_json(constant: str) -> None:
    raise ValueError(f"metrics.jsonl holds {constant}, which is not JSON")


def read_metrics(output_dir: Path) -> list[dict]:
    """The records of `<output_dir>/metrics.jsonl`, parsed as strict JSON (no NaN or Infinity)."""
    text = (Path(output_dir) / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=_not_json) for line in text.splitlines() if line]


def losses(output_dir: Path) -> dict[int, float]:
    """step -> training loss, from metrics.jsonl."""
    return {m["step"]: m["loss"] for m in read_metrics(output_dir) if "loss" in m}


def last_logged_step(metrics: Path) -> int:
    """The last step a running job's metrics.jsonl logged (0: none yet); a line the trainer is still
    writing is skipped, so a poll never fails on it (dsf launch's own poll: protocol/goodput.py)."""
    from dsframework.protocol.goodput import last_step

    return last_step(metrics)


def run_overrides(output_dir: Path, overrides: list[str] = ()) -> list[str]:
    return [*BASE_OVERRIDES, f"output_dir={output_dir}", *overrides]


def train_run(output_dir: Path, overrides: list[str] = (), *, num_ranks: int = 2,
              flags: tuple[str, ...] = ()) -> dict[int, float]:
    """`deepspeed --num_gpus N dsf train tiny.yaml --set ...`; returns step -> loss."""
    train_launch(output_dir, overrides, num_ranks=num_ranks, flags=flags)
    return losses(output_dir)


def train_launch(output_dir: Path, overrides: list[str] = (), *, num_ranks: int = 2,
                 flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`train_run`'s launch, returning the process (its stdout holds rank 0's lines)."""
    sets = [arg for o in run_overrides(output_dir, overrides) for arg in ("--set", o)]
    return launch([str(BIN / "dsf"), "train", str(TINY_YAML), *sets, *flags], num_ranks=num_ranks)


def startup_breakdown(stdout: str) -> tuple[float, dict[str, float]]:
    """(total, phase -> seconds) of the run's `dsf: start-up T s = imports a + ... + restore z` line,
    which must be there exactly once (rank 0 prints it when the engine is ready)."""
    lines = [line for line in stdout.splitlines() if line.startswith("dsf: start-up ")]
    assert len(lines) == 1, f"expected one start-up line, found {lines}\n{stdout[-3000:]}"
    match = re.fullmatch(r"dsf: start-up (\d+\.\d) s = (.+)", lines[0])
    assert match, lines[0]
    parts = {}
    for part in match.group(2).split(" + "):
        name, seconds = part.rsplit(" ", 1)
        parts[name] = float(seconds)
    return float(match.group(1)), parts


MATRIX = REPO / "tests" / "distributed" / "workers" / "train_matrix.py"


def train_runs(root: Path, runs: dict[str, list[str]], *, num_ranks: int = 2, resumed: tuple[str, ...] = (),
               timeout: int = 900) -> dict[str, dict[int, float]]:
    """Several runs in one launch: train_run(root / name, overrides, num_ranks=...) for each, in order,
    in one process group (workers/train_matrix.py), which saves every run after the first its start
    (~10-20 s). Returns name -> (step -> loss). The runs named in `resumed` continue from their
    directory's latest checkpoint (`dsf train --resume`), in a process that has trained before; the
    resume tests that must start a fresh process group (test_resume, test_faults) launch their own.

        got = train_runs(root, {"zero1": ["parallel.zero_stage=1"], "zero3": ["parallel.zero_stage=3"]})
    """
    specs = [f"{name}|eager|{';'.join(overrides)}" + ("|resume" if name in resumed else "")
             for name, overrides in runs.items()]
    launch([str(MATRIX), str(root), *specs], num_ranks=num_ranks, timeout=timeout)
    return {name: losses(root / name) for name in runs}


class Prefixed:
    """A module's runs in conftest.shared_runs' root, whose names it prefixed: `runs / "zero3"` is
    `root / "export-zero3"`."""

    def __init__(self, root: Path, prefix: str):
        self.root, self.prefix = root, prefix

    def __truediv__(self, name: str) -> Path:
        return self.root / f"{self.prefix}{name}"


def assert_close(got: dict[int, float], want: dict[int, float], *, rtol: float, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: steps {sorted(got)} != {sorted(want)}"
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rtol, f"{what}: max relative loss difference {worst:.3g} > {rtol:g}\n{got}\n{want}"


def forget_previous_run() -> None:
    """DeepSpeed keeps the last engine's parallel groups in module globals (deepspeed.utils.groups:
    the mpu a tp, pp or cp run passed, hpZ's group, AutoEP's expert groups), and an engine built
    without an mpu reads the old one (a tp=2 model-parallel size for a ZeRO-2 run after a tp2 run).
    `dsf train` builds one engine per process; a run here starts as in a fresh process.

    transformers likewise keeps the HfDeepSpeedConfig of a ZeRO-3 pretrained load (the last run's
    model holds it) in a module global, and builds every later model under zero.Init while it lives:
    a meta-device build after a ZeRO-3 LoRA run then failed ("Cannot copy out of meta tensor")."""
    import gc

    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    groups.mpu = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    # AutoEP's expert groups, by ep size: a universal load slices the experts by the largest one's rank
    for expert_groups in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                          groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        expert_groups.clear()
    unset_hf_deepspeed_config()
    gc.collect()
