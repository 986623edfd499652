"""No function in dsframework is over 60 lines: a longer one does several jobs, and each should
be a function with a name (the training setup's phases, the loop's step, window and checkpoint).

Walks the AST of every module (nothing is imported) and measures each function from its `def`
line (decorators excluded) to its last line, docstring and comments included.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dsframework"
LIMIT = 60
ALLOWED: set[str] = set()  # "folder/module.py:function" entries, each with the reason in docs/architecture.md


def long_functions(root: Path = PACKAGE, limit: int = LIMIT) -> dict[str, int]:
    """{"folder/module.py:function": lines} for every function under `root` longer than `limit`."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found[f"{path.relative_to(root).as_posix()}:{node.name}"] = lines
    return found


def test_no_function_over_60_lines():
    long = {name: lines for name, lines in long_functions().items() if name not in ALLOWED}
    assert not long, f"functions over {LIMIT} lines (split each into named steps): {long}"


def test_the_walk_measures_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path) == {"m.py:long": LIMIT + 1}
