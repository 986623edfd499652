"""The package's shape: one-way dependencies between its folders and no import cycle.

Walks the AST of every module of dsframework (no import is executed) and checks:
- every import of another dsframework module goes down or sideways in LAYERS, never up;
- the module graph (every import, at the top or inside a function) has no cycle;
- imports inside functions are of libraries in LAZY only (heavy ones that `dsf plan` and
  `dsf --help` must not pay for), or, in the command dispatcher alone, of the command's module.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dsframework"

# Higher layers may import lower ones and their own; never higher ones. The top-level modules are
# what every layer uses (errors, files, the run config, the layout, the DeepSpeed JSON, runtime facts).
# protocol/ (the files a running job writes for its launcher: heartbeat, goodput, exit codes) sits
# below train/ and launching/, which both import it, so neither imports the other.
LAYERS = {"commands": 4, "train": 3, "launching": 3, "checkpoints": 2, "protocol": 2,
          "models": 1, "parallel": 1, "data": 1, "planner": 1}
TOP = 0
# Libraries imported inside functions: each costs seconds to import (torch, deepspeed, transformers
# and what they pull in) or is optional (metric sinks, plotting), and `dsf plan`, `dsf config`,
# `dsf --help` and the launcher's watcher must start without them.
LAZY = {"torch", "deepspeed", "transformers", "datasets", "peft", "safetensors", "tokenizers", "numpy",
        "accelerate", "matplotlib", "tensorboard", "torch_tb_profiler", "wandb", "tqdm", "huggingface_hub",
        "psutil", "pyarrow", "cpuinfo", "yaml", "click", "rich"}
# The dispatcher imports a subcommand's module only when that subcommand runs (each pulls torch in).
LAZY_DSF_IMPORTERS = {"dsframework.commands.cli"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else TOP


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import in `module`."""
    tree = ast.parse(MODULES[module].read_text())
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, nested) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for alias in child.names:  # `from pkg import mod` imports the module pkg.mod
                    sub = f"{child.module}.{alias.name}"
                    found.append((sub if sub in MODULES else child.module, child.lineno, nested))
            visit(child, inner)

    visit(tree, False)
    return found


def _dsf_edges() -> dict[str, set[str]]:
    """module -> the dsframework modules importing it runs: each one named, and the packages above
    them (Python runs a package's __init__ before any module in it)."""
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        targets = edges.setdefault(module, set())
        for name, _, _ in _imports(module):
            parts = name.split(".")
            if parts[0] != "dsframework":
                continue
            for depth in range(2, len(parts) + 1):
                target = ".".join(parts[:depth])
                if target in MODULES and target != module and not module.startswith(target + "."):
                    targets.add(target)
    return edges


def test_the_package_has_its_folders():
    assert set(LAYERS) <= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    flat = sorted(m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in LAYERS)
    assert len(flat) <= 9, f"the top level holds {flat}: group them by concern"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    upward = [f"{module}:{line} imports {name}" for name, line, _ in _imports(module)
              if name.split(".")[0] == "dsframework" and name in MODULES and _layer(name) > _layer(module)]
    assert not upward, "; ".join(upward)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_inside_functions_are_of_heavy_libraries(module):
    odd = []
    for name, line, nested in _imports(module):
        root = name.split(".")[0]
        if not nested or root in LAZY or (root == "dsframework" and module in LAZY_DSF_IMPORTERS):
            continue
        odd.append(f"{module}:{line} imports {name} inside a function")
    assert not odd, "; ".join(odd)


def test_no_import_cycle():
    edges = _dsf_edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := walk(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := walk(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None


def folder_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the other folders of its own layer it imports (models -> parallel, ...)."""
    out: dict[str, set[str]] = {}
    for module, targets in edges.items():
        source = _folder(module)
        for target in targets:
            folder = _folder(target)
            if source and folder and folder != source and LAYERS[folder] == LAYERS[source]:
                out.setdefault(source, set()).add(folder)
    return out


def folder_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """Two folders of one layer that import each other (directly), or None."""
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if source in edges.get(target, set()):
                return [source, target, source]
    return None


def test_no_two_folders_of_a_layer_import_each_other():
    """Sideways imports run one way: parallel/ holds primitives (tensor-parallel layers, Ulysses,
    the topology) that models/ adapts a transformers model with, never the reverse."""
    cycle = folder_cycle(folder_edges(_dsf_edges()))
    assert cycle is None, "folders import each other: " + " -> ".join(cycle)


def test_the_checker_sees_two_folders_importing_each_other():
    edges = {"dsframework.models.a": {"dsframework.parallel.b"}, "dsframework.parallel.b": {"dsframework.models.c"}}
    assert folder_cycle(folder_edges(edges)) == ["models", "parallel", "models"]
    assert folder_cycle(folder_edges({"dsframework.models.a": {"dsframework.parallel.b"}})) is None


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    """The walk itself: a function-local upward import is found, with its line."""
    module = "dsframework.models.build"
    assert any(name.startswith("dsframework.") for name, _, _ in _imports(module))
    assert _layer("dsframework.commands.cli") > _layer("dsframework.train.engine") > _layer("dsframework.models.build")
    assert _layer("dsframework.models.build") > _layer("dsframework.errors")
