"""`dsf plot` and `dsf env`, run as the real command line in a subprocess.

    python -m pytest tests/unit/test_plot_env.py -q

dsf plot: the PNG is written, decodes and is not blank, for one run and for two overlaid runs
(small metrics.jsonl files written here: no training); each bad input is one line, exit 2.
dsf env: exits 0 and names the versions of the libraries imported here and the accelerator.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_bad_input import dsf_command, dsf_env

TIMEOUT_S = 120


pytestmark = pytest.mark.distributed  # every test runs the real `dsf` in a subprocess


def dsf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*dsf_command(), *args], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd,
                          env=dsf_env(cwd / "home"))


def write_run(run_dir: Path, *, steps: int = 30, scale: float = 1.0, partial_line: bool = False) -> Path:
    """A metrics.jsonl as dsf train writes it: the step-0 eval, then every step, an eval every 10."""
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval_loss": 3.0 * scale}]
    for step in range(1, steps + 1):
        row = {"step": step, "loss": scale * 3.0 * math.exp(-step / 10), "lr": 1e-3 * min(1.0, step / 5),
               "tokens_per_s": 5000.0 + 100 * (step % 3), "tflops_per_rank": 0.5, "mfu": 0.02 * scale}
        if step == 7:
            row["loss"] = None  # a step fp16's loss scaler skipped: null in metrics.jsonl
        if step % 10 == 0:
            row["eval_loss"] = scale * 3.2 * math.exp(-step / 10)
        rows.append(row)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + ('{"step": 31, "lo' if partial_line else ""))
    return run_dir


def assert_png_drawn(path: Path) -> None:
    """Decodes as a PNG of a plausible size and is not one flat colour."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 300, pixels.shape
    assert pixels.std() > 10, "the image is (nearly) one colour"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10, "more than a few colours: lines, text, axes"


# --- dsf plot -------------------------------------------------------------------------------------

def test_plot_one_run_default_output(tmp_path):
    run = write_run(tmp_path / "tiny", partial_line=True)  # a run still writing its last line
    proc = dsf("plot", str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dsf: wrote {run / 'metrics.png'} (tiny: 31 logged steps)"
    assert_png_drawn(run / "metrics.png")


def test_plot_two_runs_overlaid(tmp_path):
    a, b = write_run(tmp_path / "zero2"), write_run(tmp_path / "zero3", steps=20, scale=1.5)
    proc = dsf("plot", str(a), str(b), "-o", str(tmp_path / "cmp.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "zero2: 31 logged steps, zero3: 21 logged steps" in proc.stdout
    assert_png_drawn(tmp_path / "cmp.png")
    # the second run adds its own lines: the overlay differs from the first run drawn alone
    dsf("plot", str(a), "-o", str(tmp_path / "alone.png"), cwd=tmp_path)
    assert (tmp_path / "cmp.png").read_bytes() != (tmp_path / "alone.png").read_bytes()
    assert not (a / "metrics.png").exists(), "with -o nothing else is written"


def test_plot_several_runs_default_to_the_current_directory(tmp_path):
    write_run(tmp_path / "a")
    write_run(tmp_path / "b")
    proc = dsf("plot", "a", "b", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_png_drawn(tmp_path / "metrics.png")


@pytest.mark.parametrize("case, args, expected", [
    ("no metrics.jsonl", ["empty"], "dsf: error: RUN_DIR='empty': holds no metrics.jsonl; pass a dsf train "
                                    "output_dir (the directory that holds metrics.jsonl)"),
    ("not a directory", ["nowhere"], "dsf: error: RUN_DIR='nowhere': is not a directory; pass a dsf train "
                                     "output_dir (the directory that holds metrics.jsonl)"),
    ("garbage line", ["garbage"], "dsf: error: RUN_DIR='garbage': metrics.jsonl line 2 is not JSON; fix or "
                                  "delete that line (dsf train writes one JSON object per line)"),
    ("not png", ["run", "-o", "plot.jpg"], "dsf: error: -o/--output='plot.jpg': must be a .png file (dsf plot "
                                           "draws PNG); write e.g. -o plot.png"),
    ("directory", ["run", "-o", "run"], "dsf: error: -o/--output='run': must be a .png file (dsf plot draws PNG); "
                                        "write e.g. -o run.png"),
    ("png directory", ["run", "-o", "dir.png"], "dsf: error: -o/--output='dir.png': is a directory; write e.g. "
                                                "-o dir.png/metrics.png"),
    ("missing parent", ["run", "-o", "no/such/x.png"], "dsf: error: -o/--output='no/such/x.png': is in no/such, "
                                                       "which is not a directory; create that directory first, or "
                                                       "choose another path"),
    ("parent is a file", ["run", "-o", "run/metrics.jsonl/x.png"],
     "dsf: error: -o/--output='run/metrics.jsonl/x.png': is in run/metrics.jsonl, which is not a directory; "
     "create that directory first, or choose another path"),
    ("no run", [], "dsf: error: Missing argument 'RUN_DIR...'."),
])
def test_plot_bad_input_is_one_line_exit_2(tmp_path, case, args, expected):
    write_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 3.0}\nnot json\n{"step": 1}\n')
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "home" not in p.parts)
    proc = dsf("plot", *args, cwd=tmp_path)
    assert proc.returncode == 2, (case, proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == [expected], case
    assert "Traceback" not in proc.stdout + proc.stderr
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "home" not in p.parts)
    assert after == before, f"{case}: nothing written"


def test_plot_unwritable_output_is_one_line_exit_2(tmp_path):
    run = write_run(tmp_path / "run")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    target = locked / "x.png"
    try:
        (locked / "probe").touch()
        (locked / "probe").unlink()
        target = Path("/sys/dsf-plot-test.png")  # root ignores the mode bits; sysfs refuses every new file
        if not Path("/sys").is_dir():
            pytest.skip("running as root without a sysfs: no unwritable directory to try")
    except PermissionError:
        pass
    proc = dsf("plot", str(run), "-o", str(target), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"dsf: error: -o/--output='{target}': cannot be written (Permission denied); "
                                        "choose a path in a directory you can write"]
    assert not target.exists()


# --- dsf env --------------------------------------------------------------------------------------

def test_env_names_the_installed_versions_and_the_accelerator(tmp_path):
    import datasets
    import deepspeed
    import torch
    import transformers
    from deepspeed.accelerator import get_accelerator

    proc = dsf("env", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def value(name: str) -> str:
        found = [m.group(1) for line in lines if (m := re.fullmatch(rf"{re.escape(name)} \.+ (.*)", line))]
        assert len(found) == 1, f"no single `{name}` line in:\n{proc.stdout}"
        return found[0]

    assert value("torch").split()[0] == torch.__version__
    assert value("deepspeed").split()[0] == deepspeed.__version__
    assert value("transformers") == transformers.__version__
    assert value("datasets") == datasets.__version__
    accelerator = get_accelerator()
    assert value("accelerator").split()[0] == accelerator.device_name()
    assert value("distributed backend") == accelerator.communication_backend_name()
    assert value("ranks per node").split()[0] == str(accelerator.device_count())
    if accelerator.device_name() == "cuda":
        assert value("cuda:0").startswith(torch.cuda.get_device_name(0))
    for tool in ("pdsh", "mpirun", "srun", "ssh"):
        value(tool)
    # every op builder of this accelerator has a line (ds_report's list, less its placeholder)
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    for op in ALL_OPS:
        if op != "deepspeed_not_implemented":
            assert value(op).startswith(("compatible", "not compatible")), op


def test_plot_draws_the_experts_panels_of_a_mixture_of_experts(tmp_path):
    """A run that logged its router's figures (train/expert_load.py) gets a third row: the aux loss
    and the expert load; the picture is taller and differs from the same run without them."""
    from PIL import Image

    dense = write_run(tmp_path / "dense")
    moe = write_run(tmp_path / "moe")
    rows = [json.loads(line) for line in (moe / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.update(aux_loss=2.0 + 0.1 / (1 + row["step"]), expert_load_cv=0.4 - 0.01 * row["step"],
                   expert_load_max_share=0.5 - 0.005 * row["step"])
    (moe / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for run in (dense, moe):
        assert dsf("plot", str(run), cwd=tmp_path).returncode == 0
    assert_png_drawn(moe / "metrics.png")
    with Image.open(dense / "metrics.png") as a, Image.open(moe / "metrics.png") as b:
        assert b.size[1] > a.size[1] * 1.3 and b.size[0] == a.size[0]


def test_plot_marks_the_steps_a_run_restarted_from(tmp_path):
    """restarts.jsonl (dsf launch --max-restarts) -> a dotted vertical line on the loss panel at
    each checkpoint step a restart resumed from (0: a restart from the start); none without it."""
    from dsframework.commands.plot import draw, read_metrics, read_restarts

    run = write_run(tmp_path / "run")
    assert read_restarts(run) == []
    (run / "restarts.jsonl").write_text(json.dumps({"restart": 1, "resumes": "global_step10"}) + "\n"
                                        + json.dumps({"restart": 2, "resumes": None}) + "\n")
    assert read_restarts(run) == [10, 0]
    fig = draw({"run": read_metrics(run)}, tmp_path / "m.png", restarts={"run": read_restarts(run)})
    marks = [line for line in fig.axes[0].lines if line.get_linestyle() == ":"]
    assert sorted(line.get_xdata()[0] for line in marks) == [0, 10]
    assert [line.get_label() for line in marks][0] == "restart"
    assert_png_drawn(tmp_path / "m.png")
    assert dsf("plot", str(run), cwd=tmp_path).returncode == 0
