"""Try the newest releases before they reach CI: a second virtual environment with the newest
versions of everything setup.py asks for, the fast tier and bench/architectures.py's table run in
it, and what changed against the pinned stack (launch/constraints.txt, installed in .venv).

    .venv/bin/python bench/newest_stack.py                        # newest of everything: venv, tests, table
    .venv/bin/python bench/newest_stack.py --with transformers==5.25.0   # only that one moved
    .venv/bin/python bench/newest_stack.py --no-table             # the fast tier and the plans only (~5 min)
    .venv/bin/python bench/newest_stack.py --types mixtral,llama  # the table on these types only
    .venv/bin/python bench/newest_stack.py --pin                  # clean? write its versions to the constraints

What it prints, each against the pinned stack:
  packages  every version that differs (pinned -> newest)
  tests     fast-tier tests that fail in the newest venv and pass in the pinned one
  types     causal LM types with a tensor-parallel plan added or gone (tests/pinned_model_types.json is
            the pinned list: a type new to it is reported by the tests, not failed)
  plans     per type, each plan entry whose style changed, was added or dropped; tp / pp newly
            refused or accepted (models/plans.check_architecture's reason); tiny builds that broke
  table     bench/architectures.py cells whose outcome changed: `table` a cell that passed and no
            longer does (a regression), `cell` any other (refused -> pass: a plan new in a version);
            the pinned table is cached per constraints file and commit under runs/newest_stack/
and last one line: `clean` (no failing test, no lost table cell: --pin writes the newest venv's
versions to launch/constraints.txt and its type list to tests/pinned_model_types.json) or the count
of regressions.

The newest venv is .venv-newest (--venv), made once and upgraded on each run; torch is the pinned
venv's own build (TORCH_SPEC to change it), never upgraded here.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "launch" / "constraints.txt"
PINNED_TYPES = REPO / "tests" / "pinned_model_types.json"
WORK = REPO / "runs" / "newest_stack"
# Not pinned by the constraints file: torch is the user's own build (setup_env.sh's TORCH_SPEC),
# dsframework is this checkout, and pip's own tools come with the venv.
UNPINNED = {"torch", "dsframework", "pip", "setuptools", "wheel"}


# --- facts of one environment (run as `python bench/newest_stack.py --facts` inside it) -----------

def facts() -> dict:
    """The installed stack's versions, and per causal LM type with a tp plan: the plans, whether
    dsf refuses tp 2 / pp 2 (and why), and whether its tiny model builds."""
    import importlib.metadata as md

    from dsframework.models.plans import architecture_plan
    from dsframework.models.tiny import causal_lm_types_with_tp_plan, default_config, tiny_config, unbuildable_types

    types = {}
    for model_type in causal_lm_types_with_tp_plan():
        config = default_config(model_type)
        plan = architecture_plan(config)
        types[model_type] = {"tp": dict(plan.tp), "ep": dict(getattr(config, "base_model_ep_plan", None) or {}),
                             "tp_problem": plan.tp_problem, "pp_problem": plan.pp_problem,
                             "tiny": _tiny_builds(model_type, tiny_config)}
    versions = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}
    return {"versions": versions, "types": types, "unbuildable": unbuildable_types()}


def _tiny_builds(model_type: str, tiny_config) -> str:
    try:
        import torch
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.randint(0, config.vocab_size, (1, 8))).logits
        return "ok" if torch.isfinite(logits).all() else "non-finite logits"
    except Exception as err:  # noqa: BLE001 - reported per type
        return f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:160] if str(err).strip() else ''}"


# --- the environments ---------------------------------------------------------------------------

def run(cmd: list[str], *, log: Path | None = None, check: bool = True, env: dict | None = None) -> int:
    print("$", " ".join(cmd), file=sys.stderr)
    with open(log, "w") if log else open(os.devnull, "w") as out:
        code = subprocess.call(cmd, cwd=REPO, stdout=out if log else None, stderr=subprocess.STDOUT if log else None,
                               env={**os.environ, **(env or {})})
    if check and code:
        raise SystemExit(f"newest_stack: {' '.join(cmd)} exited {code}" + (f"; see {log}" if log else ""))
    return code


def make_newest(venv: Path, pinned_python: Path, extra: list[str]) -> Path:
    """`venv` with the pinned venv's torch and the newest of everything else (`extra` pins some)."""
    python = venv / "bin" / "python"
    if not python.exists():
        run([sys.executable if not pinned_python.exists() else "python3", "-m", "venv", str(venv)])
        run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    torch = os.environ.get("TORCH_SPEC") or f"torch=={_version(pinned_python, 'torch').split('+')[0]}"
    run([str(python), "-m", "pip", "install", "-q", torch])
    wanted = WORK / "with.txt"
    wanted.parent.mkdir(parents=True, exist_ok=True)
    # torch stays the pinned venv's build: `--upgrade-strategy eager` would otherwise replace it (and
    # bring CUDA wheels) because dsframework requires it, and the comparison would be two torches.
    held = [torch] if "==" in torch else []  # (a TORCH_SPEC range is the user's to resolve)
    wanted.write_text("".join(f"{spec}\n" for spec in [*extra, *held]))
    run([str(python), "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-c", str(wanted),
         "-e", ".[dev]"], log=WORK / "pip-newest.log")
    return python


def _version(python: Path, package: str) -> str:
    return subprocess.check_output([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                                   text=True).strip()


def env_facts(python: Path, name: str) -> dict:
    out = WORK / f"facts-{name}.json"
    with open(out, "w") as f:
        subprocess.check_call([str(python), str(Path(__file__)), "--facts"], cwd=REPO, stdout=f,
                              stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def fast_tier_failures(python: Path, name: str) -> tuple[set[str], str]:
    """(ids of failing fast-tier tests, pytest's last line)."""
    xml = WORK / f"fast-{name}.xml"
    run([str(python), "-m", "pytest", "-q", "-m", "not distributed", "tests", "-p", "no:cacheprovider",
         f"--junitxml={xml}"], log=WORK / f"fast-{name}.log", check=False)
    failed = set()
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(f"{case.get('classname')}::{case.get('name')}")
    last = (WORK / f"fast-{name}.log").read_text().strip().splitlines()[-1]
    return failed, last


def table(python: Path, name: str, types: str | None) -> dict[str, dict]:
    out = WORK / f"table-{name}"
    cmd = [str(python), "bench/architectures.py", "--json", "--out", str(out)] + (["--types", types] if types else [])
    run(cmd, log=WORK / f"table-{name}.log")
    return {r["type"]: r for r in json.loads((out / "rows.json").read_text())}


def pinned_table(python: Path, types: str | None) -> dict[str, dict]:
    """The pinned stack's table, cached per constraints file, commit and types (it takes a while)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    key = hashlib.sha256(f"{CONSTRAINTS.read_text()}|{head}|{types}".encode()).hexdigest()[:16]
    cache = WORK / f"table-pinned-{key}.json"
    if not cache.exists():
        cache.write_text(json.dumps(table(python, "pinned", types)))
    return json.loads(cache.read_text())


# --- what changed -------------------------------------------------------------------------------

def changes(pinned: dict, newest: dict) -> list[str]:
    """One line per difference between the two environments' facts."""
    lines = []
    for package in sorted(set(pinned["versions"]) | set(newest["versions"])):
        old, new = pinned["versions"].get(package), newest["versions"].get(package)
        if old != new and package not in UNPINNED:
            lines.append(f"package  {package}: {old or '-'} -> {new or '-'}")
    old_types, new_types = pinned["types"], newest["types"]
    for model_type in sorted(set(new_types) - set(old_types)):
        tiny = new_types[model_type]["tiny"]
        lines.append(f"type     {model_type}: added" + ("" if tiny == "ok" else f"; its tiny model fails: {tiny}"))
    for model_type in sorted(set(old_types) - set(new_types)):
        lines.append(f"type     {model_type}: gone (no causal LM with a tensor-parallel plan)")
    for model_type in sorted(set(old_types) & set(new_types)):
        lines += [f"plan     {model_type}: {line}" for line in plan_changes(old_types[model_type], new_types[model_type])]
    return lines


def plan_changes(old: dict, new: dict) -> list[str]:
    lines = []
    for kind in ("tp", "ep"):
        for pattern in sorted(set(old[kind]) | set(new[kind])):
            before, after = old[kind].get(pattern), new[kind].get(pattern)
            if before != after:
                lines.append(f"{kind} {pattern}: {before or '-'} -> {after or '-'}")
    for axis in ("tp", "pp"):
        before, after = old[f"{axis}_problem"], new[f"{axis}_problem"]
        if bool(before) != bool(after):
            lines.append(f"{axis} 2 now refused: {after}" if after else f"{axis} 2 now accepted (was: {before})")
    if old["tiny"] != new["tiny"]:
        lines.append(f"tiny model: {old['tiny']} -> {new['tiny']}")
    return lines


def table_changes(pinned: dict[str, dict], newest: dict[str, dict]) -> list[str]:
    """One line per table cell that changed its outcome (pass / refused / FAIL; the words of a
    refusal may change freely): `table` for a cell that passed and no longer does, `cell` otherwise."""
    lines = []
    for model_type in sorted(set(pinned) | set(newest)):
        old, new = pinned.get(model_type, {}), newest.get(model_type, {})
        for column in [c for c in {**old, **new} if c != "type"]:
            before, after = _outcome(old.get(column)), _outcome(new.get(column))
            if before != after:
                kind = "table   " if before == "pass" else "cell    "
                lines.append(f"{kind} {model_type} {column}: {old.get(column, '-')} -> {new.get(column, '-')}")
    return lines


def _outcome(cell: str | None) -> str:
    return "-" if cell is None else cell.split()[0].rstrip(":")


def pin(python: Path, newest: dict) -> None:
    """The newest venv's versions become launch/constraints.txt; its type list the pinned one."""
    freeze = subprocess.check_output([str(python), "-m", "pip", "freeze", "--exclude-editable"], text=True)
    lines = [line for line in freeze.splitlines()
             if "==" in line and line.split("==")[0].lower().replace("_", "-") not in UNPINNED]
    head = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("#")]
    CONSTRAINTS.write_text("\n".join(head + sorted(lines, key=str.lower)) + "\n")
    write_pinned_types(newest)
    print(f"newest_stack: pinned {len(lines)} packages in {CONSTRAINTS.relative_to(REPO)} and "
          f"{len(newest['types'])} types in {PINNED_TYPES.relative_to(REPO)}; now: bash launch/setup_env.sh")


def write_pinned_types(stack: dict) -> None:
    PINNED_TYPES.write_text(json.dumps({
        "transformers": stack["versions"]["transformers"],
        "causal_lm_types_with_tp_plan": sorted(stack["types"]),
        "unbuildable": sorted(stack["unbuildable"]),
    }, indent=1) + "\n")


# --- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--with", dest="extra", action="append", default=[],
                        help="a requirement for the newest venv (transformers==5.25.0); repeatable")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-newest", help="the newest venv (made once)")
    parser.add_argument("--pinned-python", type=Path, default=REPO / ".venv" / "bin" / "python")
    parser.add_argument("--no-table", action="store_true", help="skip bench/architectures.py's table")
    parser.add_argument("--types", help="the table on these comma-separated types only")
    parser.add_argument("--pin", action="store_true", help="when clean, write the newest versions to the constraints")
    parser.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)  # inside one venv: print its facts
    parser.add_argument("--write-pinned-types", action="store_true", help=argparse.SUPPRESS)  # from this venv
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.facts or args.write_pinned_types:
        sys.path.insert(0, str(REPO))
        stack = facts()
        if args.write_pinned_types:
            write_pinned_types(stack)
        else:
            print(json.dumps(stack))
        return 0
    start = time.perf_counter()
    WORK.mkdir(parents=True, exist_ok=True)
    newest_python = make_newest(args.venv.resolve(), args.pinned_python, args.extra)
    pinned, newest = env_facts(args.pinned_python, "pinned"), env_facts(newest_python, "newest")
    lines = changes(pinned, newest)
    failed_pinned, last_pinned = fast_tier_failures(args.pinned_python, "pinned")
    failed_newest, last_newest = fast_tier_failures(newest_python, "newest")
    lines += [f"test     fails: {test}" for test in sorted(failed_newest - failed_pinned)]
    if not args.no_table:
        lines += table_changes(pinned_table(args.pinned_python, args.types), table(newest_python, "newest", args.types))
    print(*lines, sep="\n")
    print(f"fast tier: pinned {last_pinned}; newest {last_newest}")
    regressions = [line for line in lines if line.startswith(("test", "table"))]
    verdict = "clean" if not regressions else f"{len(regressions)} regressions (tests, table)"
    print(f"newest_stack: {len(lines)} changes, {verdict}; {time.perf_counter() - start:.0f} s; work: {WORK}")
    if args.pin and not regressions:
        pin(newest_python, newest)
    return 0 if not regressions else 1


if __name__ == "__main__":
    sys.exit(main())
