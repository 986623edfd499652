"""bench/gpu_smoke.sh and bench/fetch_gpu_wheels.sh, with no GPU and no network: the smoke run's
--dry-run lists every check, prints every command and finds each one parses (and fails when one
does not); the wheels the fetch script carries, with what the GPU machine's image holds, are
exactly the requirement closure of dsframework's install_requires and cover every third-party
module dsframework imports. Quick: two dry runs (a few python starts each: seconds; they start
`bash`, so they are marked `distributed`, tests/conftest.py's rule) and package metadata (in
process); nothing installs, downloads or trains."""
from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.unit.test_hygiene import constraint_pins, install_requires

ROOT = Path(__file__).resolve().parents[2]
SMOKE, FETCH = ROOT / "bench" / "gpu_smoke.sh", ROOT / "bench" / "fetch_gpu_wheels.sh"
CHECKS = ["stack", "bf16 tiny", "logging", "eval", "compile auto", "checkpoint", "exact resume", "decoupled writer",
          "SFT", "MoE AutoEP", "gpu.sh", "host RSS at model build", "time"]
RUNS = ["tiny-straight", "tiny-stopped", "tiny-resumed", "sft", "moe", "gpu.sh planned", "gpu.sh baseline"]
STEPS = ["install", "tiny-straight", "tiny-stopped", "tiny-resumed", "sft-data", "sft", "moe", "gpu.sh"]
# The GPU machine: CPython 3.12 on Linux x86_64 (requirement markers are read for it, not for this python).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# Imported only when a run config names their sink (logging.tensorboard / wandb, `dsf plot`); the smoke run names none.
METRIC_SINKS = {"wandb", "matplotlib", "tensorboard"}


def dry_run(script: str | None = None) -> subprocess.CompletedProcess:
    """`bash bench/gpu_smoke.sh --dry-run`, or the same with `script` as its text (read from stdin,
    run from bench/ so that the script's own `cd "$(dirname "$0")/.."` lands in the repository)."""
    env = {**os.environ, "PYTHON": sys.executable}
    if script is None:
        return subprocess.run(["bash", str(SMOKE), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    return subprocess.run(["bash", "-s", "--", "--dry-run"], cwd=ROOT / "bench", env=env, input=script,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def dry() -> subprocess.CompletedProcess:
    return dry_run()


@pytest.mark.distributed
def test_the_dry_run_lists_every_check_and_every_command_parses(dry):
    out = dry.stdout
    assert dry.returncode == 0, out[-4000:] + dry.stderr[-4000:]
    for label in CHECKS:
        assert f"\ncheck {label}: " in out, f"no `check {label}:` line"
    for run in RUNS:
        assert f"\ncheck sync debug {run}: " in out, f"no sync count for {run}"
    steps = re.findall(r"^\+ \[([^\]]+)\] ", out, re.M)
    assert steps == STEPS
    assert set(steps) <= set(re.findall(r"^parses \[([^\]]+)\]: ", out, re.M))
    assert "FAIL" not in out
    assert re.search(r"^dry run: \d+ steps and files, 5 dsf commands; every one parses$", out, re.M)


@pytest.mark.distributed
def test_the_runs_are_the_ones_the_issue_asks_for(dry):
    """bf16 everywhere, a world of one and the deepspeed launcher, the stop / resume with the decoupled writer,
    SFT data, AutoEP at ep 1, and bench/gpu.sh shortened with its python routed through the RSS probe."""
    lines = {name: line for name, line in re.findall(r"^\+ \[([^\]]+)\] (.*)$", dry.stdout, re.M)}
    for name in ("tiny-straight", "tiny-stopped", "tiny-resumed", "sft", "moe"):
        assert "/dsf train " in lines[name] and "train.precision=bf16" in lines[name], name
    assert "deepspeed.launcher" not in lines["tiny-straight"]
    for name in ("tiny-stopped", "tiny-resumed"):
        assert "-m deepspeed.launcher.runner --num_gpus 1" in lines[name], name
    assert "train.compile=auto" in lines["tiny-straight"] and "logging.eval_every=10" in lines["tiny-straight"]
    assert "checkpoint.writer=decoupled" in lines["tiny-stopped"] and "train.stop_after=15" in lines["tiny-stopped"]
    assert "checkpoint.writer=decoupled" in lines["tiny-resumed"]
    assert lines["tiny-resumed"].rstrip().endswith("--resume")
    assert "data.format=prompt_completion" in lines["sft"] and "sft.jsonl" in lines["sft"]
    assert "parallel.autoep=true" in lines["moe"] and "parallel.ep=1" in lines["moe"]
    assert "STEPS=10" in lines["gpu.sh"] and "python-rss" in lines["gpu.sh"] and "bench/gpu.sh" in lines["gpu.sh"]
    assert "--no-index --no-deps" in lines["install"] and "--target /tmp/site" in lines["install"]


@pytest.mark.distributed
def test_the_dry_run_fails_on_a_command_that_does_not_parse():
    """The parse check is not vacuous: a misspelled config key fails the dry run, naming the step."""
    script = SMOKE.read_text().replace("--set train.compile=auto", "--set train.compiel=auto", 1)
    done = dry_run(script)
    assert done.returncode == 1, done.stdout[-3000:]
    assert re.search(r"^FAIL \[tiny-straight\]: run config: .*compiel", done.stdout, re.M), done.stdout[-3000:]


def bash_array(name: str) -> list[str]:
    match = re.search(rf"^{name}=\(([^)]*)\)", FETCH.read_text(), re.M)
    assert match, f"no {name}=(...) in {FETCH}"
    return [canonicalize_name(word) for line in match.group(1).splitlines()
            for word in line.split("#", 1)[0].split()]


def closure(roots: list[str], *, leaves: set[str]) -> set[str]:
    """Every distribution `roots` require, transitively, for TARGET (installed metadata); `leaves`
    are not descended into."""
    seen, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in leaves:
            continue
        for line in md.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(TARGET):
                todo.append(canonicalize_name(req.name))
    return seen


def test_the_carried_wheels_are_the_closure_of_what_dsf_needs_beside_the_image():
    pins = constraint_pins()
    if md.version("transformers") != pins["transformers"]:  # the closure is read from what is installed
        pytest.skip(f"transformers {md.version('transformers')} installed; CARRY is the pinned "
                    f"{pins['transformers']}'s closure (bench/newest_stack.py's venvs)")
    carry, image = bash_array("CARRY"), bash_array("IMAGE")
    assert not set(carry) & set(image) and len(set(carry)) == len(carry)
    needed = closure([requirement.name for requirement in install_requires()], leaves=set(image))
    assert needed - set(image) == set(carry), (
        f"not carried: {sorted(needed - set(image) - set(carry))}; carried but not needed: "
        f"{sorted(set(carry) - needed)}")
    assert set(carry) <= set(pins), f"carried without a pin in launch/constraints.txt: {sorted(set(carry) - set(pins))}"


def test_every_module_dsframework_imports_is_carried_or_in_the_image():
    carry, image = set(bash_array("CARRY")), set(bash_array("IMAGE"))
    modules = set()
    for path in (ROOT / "dsframework").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    third_party = modules - set(sys.stdlib_module_names) - {"dsframework", "__future__"} - METRIC_SINKS
    owners = md.packages_distributions()
    for module in sorted(third_party):
        dists = {canonicalize_name(d) for d in owners.get(module, [])}
        assert dists, f"dsframework imports {module}, which no installed distribution provides"
        assert dists & (carry | image), f"dsframework imports {module} ({sorted(dists)}): neither carried nor in IMAGE"
