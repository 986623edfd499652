"""ruff over the package, the tests, the benchmarks and launch/ (in the fast tier, so in CI): the
pyflakes rules (an undefined name, like the `host_group` resharding.py once used without importing
it, an unused import or variable, a redefinition), statements (E4, E7 but lambda assignments) and
syntax (E9), pylint's error rules (PLE). The rules are chosen here, no configuration file: ruff
comes with the dev extra, pinned in launch/constraints.txt."""
from __future__ import annotations

import subprocess
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
