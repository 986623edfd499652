"""The run configs in launch/examples load and validate; python-stdlib.yaml's data resolves to the
standard library of this interpreter (sysconfig), and nothing installed into it (site-packages)."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from dsframework.config import load_run_config
from dsframework.data.sources import data_files

EXAMPLES = Path(__file__).resolve().parents[2] / "launch" / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_loads(path):
    run = load_run_config(path)
    assert run.train.steps > 0 and run.output_dir


def test_python_stdlib_example_reads_the_standard_library():
    run = load_run_config(EXAMPLES / "python-stdlib.yaml")
    assert run.data.dataset == "{stdlib}/**/*.py" and run.data.format == "text"
    assert run.data.text_unit == "document" and run.model.tokenizer is None  # a BPE trained on the files
    builder, files = data_files(run.data)
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert builder == "text"
    assert len(files) > 500  # CPython's own modules: ~1,800 files in 3.11
    assert all(Path(f).resolve().is_relative_to(stdlib) and f.endswith(".py") for f in files)
    assert not [f for f in files if {"site-packages", "dist-packages"} & set(Path(f).parts)]
    names = {str(Path(f).resolve().relative_to(stdlib)) for f in files}
    assert {"os.py", "json/__init__.py", "asyncio/events.py"} <= names  # top level and packages (**)
