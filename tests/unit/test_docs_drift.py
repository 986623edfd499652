"""What the prose of the repository names is still there: the docstrings and comments of every .py
file (dsframework/, bench/, tests/, launch/) and the Markdown of README.md and docs/.

Reads files only (`ast`, `tokenize`, regexes; nothing of the package is imported) and checks:
- every repository path named (`dsframework/...`, `bench/...`, `tests/...`, `launch/...`, `docs/...`,
  `ds_configs/...`, `setup.py`, and a short `models/build.py` meaning `dsframework/models/build.py`)
  exists;
- every dotted `dsframework.<module>.<name>` names a module, and a name defined at the top of it;
- every module of the package is named in the module table of docs/architecture.md.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dsframework"
CODE_FOLDERS = ("dsframework", "bench", "tests", "launch")
TOP_FOLDERS = ("dsframework", "bench", "tests", "launch", "docs", "ds_configs")
SUBPACKAGES = tuple(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
_START = r"(?<![\w./$~-])`?"  # a path starts the token: not the tail of another path, a URL or a variable
_END = r"[^\s`)\],:;'\"|>]*"
PATH = re.compile(rf"{_START}((?:{'|'.join(TOP_FOLDERS)})/{_END}|setup\.py\b)")
SHORT_PATH = re.compile(rf"{_START}((?:{'|'.join(SUBPACKAGES)})/[\w/]*\w\.py)\b")
DOTTED = re.compile(r"(?<![\w./])(dsframework(?:\.\w+)+)")
ELSEWHERE = {"docs/source/en/deepspeed.md"}  # transformers' DeepSpeed guide (bench/compare.py), not ours
TABLE_ROW = re.compile(r"^\|\s*(`dsframework/(\w+)/`|top level)\s*\|[^|]*\|(.*)\|\s*$")


def python_files() -> list[Path]:
    return sorted(path for folder in CODE_FOLDERS for path in (REPO / folder).rglob("*.py"))


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    """(first line, text) of the module's, every class's and every function's docstring."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.append((first.lineno, first.value.value))
    return found


def comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every `#` comment."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type == tokenize.COMMENT]


@cache
def prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of the prose of a file: a .py file's docstrings and comments, a page whole."""
    source = path.read_text()
    if path.suffix != ".py":
        return [(1, source)]
    return docstrings(ast.parse(source)) + comments(source)


def clean_path(token: str) -> str | None:
    """The repository path a token names, without its `#anchor` and trailing punctuation; None
    for a glob or a template (`*`, `{`, `<`)."""
    token = token.partition("#")[0].rstrip(".!?")
    return None if any(c in token for c in "*{<$") else token


def path_exists(path: str) -> bool:
    """From the repository root, or (a short module reference) from dsframework/."""
    return (REPO / path).exists() or (PACKAGE / path).exists()


def missing_paths(text: str) -> list[str]:
    """Every repository path `text` names that exists neither from the root nor from dsframework/."""
    tokens = PATH.findall(text) + SHORT_PATH.findall(text)
    return [path for path in map(clean_path, tokens) if path and path not in ELSEWHERE and not path_exists(path)]


@cache
def top_level_names(module: Path) -> set[str]:
    """What a module defines at its top (also inside a top-level if/try): defs, classes, assignments, imports."""
    names: set[str] = set()
    body = list(ast.parse(module.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body.extend([*node.body, *node.orelse, *getattr(node, "finalbody", []),
                         *(s for h in getattr(node, "handlers", []) for s in h.body)])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def module_file(parts: list[str]) -> Path | None:
    """The file of the module `parts` names (a package: its __init__.py), None when there is none."""
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_problem(reference: str) -> str | None:
    """Why a dotted `dsframework.<module>.<name>` resolves to nothing: its longest module prefix must define the
    next name at its top (what follows that name, a method or a field, is not checked)."""
    parts = reference.rstrip(".").split(".")
    depth = max(d for d in range(1, len(parts) + 1) if module_file(parts[:d]))
    if depth == len(parts):
        return None
    module, name = module_file(parts[:depth]), parts[depth]
    if name in top_level_names(module):
        return None
    return f"{reference}: {'.'.join(parts[:depth])} has no module or top-level name {name!r}"


def offenders(find) -> list[str]:
    """Every `file:line: what` that `find(text)` reports in the prose of every file (the line of
    the first place the text names it)."""
    found = []
    for path in python_files() + markdown_files():
        for first, text in prose(path):
            for item in find(text):
                line = first + text[:max(text.find(item.split(":", 1)[0]), 0)].count("\n")
                found.append(f"{path.relative_to(REPO)}:{line}: {item}")
    return found


def unresolved_dotted(text: str) -> list[str]:
    return [problem for problem in map(dotted_problem, DOTTED.findall(text)) if problem]


def architecture_table(page: Path = REPO / "docs" / "architecture.md") -> set[str]:
    """The modules the folder table names, as paths under dsframework/ (`train/hang.py`; a top-level
    module as `config.py`): each row's folder joined to every `name.py` of its last column."""
    named: set[str] = set()
    for line in page.read_text().splitlines():
        match = TABLE_ROW.match(line)
        if match:
            folder = f"{match.group(2)}/" if match.group(2) else ""
            named.update(folder + name for name in re.findall(r"`(\w+\.py)`", match.group(3)))
    return named


def package_modules() -> list[str]:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def test_every_path_the_prose_names_exists():
    """A renamed or deleted file leaves no docstring, comment or page pointing at it."""
    missing = offenders(missing_paths)
    assert not missing, "paths named in prose that do not exist:\n" + "\n".join(missing)


def test_every_dotted_reference_resolves():
    """A dotted `dsframework.<module>.<name>` in prose is a module and, after it, a name that module defines."""
    broken = offenders(unresolved_dotted)
    assert not broken, "dotted references that resolve to nothing:\n" + "\n".join(broken)


def test_every_module_is_in_the_architecture_table():
    """docs/architecture.md's folder table names every module of the package (and none that is gone)."""
    named = architecture_table()
    unnamed = [module for module in package_modules() if module not in named]
    gone = sorted(named - set(package_modules()))
    assert not unnamed, "modules docs/architecture.md's table does not name:\n" + "\n".join(unnamed)
    assert not gone, "modules docs/architecture.md's table names that do not exist:\n" + "\n".join(gone)


def test_the_checks_catch_a_missing_path_a_bad_reference_and_an_unnamed_module(tmp_path):
    """The checkers themselves: a stale path, a name a module lacks, a module not in the table."""
    text = ("see `dsframework/train/nowhere.py:12`, bench/gone.py#main and models/absent.py; "
            "fine: `dsframework/train/hang.py:3`, models/build.py, tests/unit/*.py, runs/x/tests/a.py.")
    assert missing_paths(text) == ["dsframework/train/nowhere.py", "bench/gone.py", "models/absent.py"]
    assert dotted_problem("dsframework.layout.ParallelDims.of") is None
    assert dotted_problem("dsframework.launching.hostfile") is None
    assert "'no_such_name'" in dotted_problem("dsframework.layout.no_such_name")
    assert "'launch'" in dotted_problem("dsframework.launching.launch.build_runner")
    page = tmp_path / "architecture.md"
    page.write_text("| folder | layer | what |\n|---|---:|---|\n| `dsframework/train/` | 3 | `hang.py` (x) |\n"
                    "| top level | 0 | `config.py` (the run config) |\n")
    assert architecture_table(page) == {"train/hang.py", "config.py"}
