"""Rules of the repository that no module checks for itself: one home for a free port, and an
installed stack inside the ranges setup.py declares (its floors are the versions the fast tier was
run on: README, Install)."""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.unit.test_docs_drift import REPO, python_files

PORTS = REPO / "dsframework" / "ports.py"


def test_one_free_port():
    """dsframework.ports.free_port is the one helper that asks the OS for a port: a copy elsewhere
    (there were five in bench/ and tests/) is a socket bound to port 0 or a function of that name."""
    copies = []
    for path in python_files():
        if path == PORTS or path == Path(__file__).resolve():
            continue
        text = path.read_text()
        defines = any(isinstance(node, ast.FunctionDef) and "free_port" in node.name
                      for node in ast.walk(ast.parse(text)))
        if defines or re.search(r"\.bind\(\(\s*['\"][\d.]+['\"],\s*0\s*\)\)", text):
            copies.append(str(path.relative_to(REPO)))
    assert not copies, f"use dsframework.ports.free_port instead of a copy in {copies}"


def constraint_pins() -> dict[str, str]:
    """{package (canonical name): version} of launch/constraints.txt, what CI installs."""
    lines = (REPO / "launch/constraints.txt").read_text().splitlines()
    return {canonicalize_name(name): version for name, _, version in
            (line.partition("==") for line in lines if "==" in line and not line.startswith("#"))}


def install_requires() -> list[Requirement]:
    """setup.py's install_requires, read from its AST."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setup")
    listed = next(kw.value for kw in call.keywords if kw.arg == "install_requires")
    return [Requirement(ast.literal_eval(item)) for item in listed.elts]


def test_the_installed_stack_is_inside_setup_pys_ranges():
    """Every requirement of setup.py is installed at a version its range allows (torch's local tag,
    +cpu or +cu130, aside): a floor above what runs here, or a bound below it, fails."""
    outside = []
    for requirement in install_requires():
        installed = Version(md.version(requirement.name))
        if not requirement.specifier.contains(Version(installed.public), prereleases=True):
            outside.append(f"{requirement.name} {installed} not in {requirement.specifier}")
    assert not outside, outside


def test_the_pins_are_inside_setup_pys_ranges():
    """launch/constraints.txt (what CI installs) and setup.py (what `pip install dsframework` accepts)
    agree: every pinned requirement of setup.py sits inside its range, floor and bound."""
    pins = constraint_pins()
    checked = 0
    for requirement in install_requires():
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is not None:
            assert requirement.specifier.contains(pinned), f"launch/constraints.txt pins {requirement.name}=={pinned}"
            checked += 1
    assert checked >= 10  # every requirement but torch (the user's build) is pinned
