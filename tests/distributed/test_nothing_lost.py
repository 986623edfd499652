"""Nothing lost: faults injected for real into 2-rank runs (CPU, gloo) and the commands a user runs
next to them, each judged by its one line, its exit code, what is left on disk and what still runs.

- (a second `dsf train` and `dsf export` onto a live run: test_faults.py, in its first stopped job);
- a byte flipped inside a saved optimizer file (same size): resume and export name the file and the
  newest checkpoint that checks; checkpoint.fallback=previous resumes from it, exactly;
- `dsf export` onto its own checkpoints, or onto the run's output_dir: refused, nothing changed;
- a tmpfs too small for the second checkpoint: the run stops before it in one line, `latest` on the
  first (the very checkpoint an undisturbed run saved); one too small for the first: the disk fills
  during the save, the partial checkpoint is removed on every rank, one line; `dsf export` and the
  token store's build on a full disk: one line, nothing partial.

"Exactly" is 1e-6 relative against one uninterrupted run of the same config (the shared launch's
`faults-common`). The lock, checksums and disk rules without training: tests/unit/test_outputs.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsframework.checkpoints.manifest import MANIFEST, Manifest
from dsframework.checkpoints.outputs import LOCK

from dsframework.checkpoints.export import export_checkpoint
from dsframework.errors import UserError

from tests.distributed.launcher import (BIN, TINY_YAML, assert_close, dsf_started, launch, losses, one_line,
                                        run_overrides, train_args, train_launch)
from tests.distributed.test_faults import COMMON



def shared_specs(ranks: int, root: Path) -> list[str]:
    """None of its own: the undisturbed run is test_faults' `faults-common` (COMMON, checkpoints 2, 4,
    6), in the same shared launch (conftest.NEEDS)."""
    return []


@pytest.fixture(scope="module")
def straight(shared_runs) -> tuple[Path, dict[int, float]]:
    out = shared_runs(2)[0] / "faults-common"
    return out, losses(out)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` and its bytes, but the lock file a run that got past pre-flight takes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK}


def export_refusal(ckpt_dir: Path, out: Path) -> str:
    """dsf export's one line (in this process: the CLI prints a UserError as one line, exit 2)."""
    with pytest.raises(UserError) as refused:
        export_checkpoint(ckpt_dir, out, overwrite=True)
    return str(refused.value)


def flip(path: Path, *, at: float = 0.5, length: int = 4096) -> None:
    """`length` bytes inverted inside `path`, its size unchanged (a bad disk, a partial copy)."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start:start + length] = bytes(b ^ 0xFF for b in data[start:start + length])
    path.write_bytes(bytes(data))


def test_a_changed_byte_is_named_and_fallback_resumes_exactly(tmp_path, straight):
    run = tmp_path / "run"
    shutil.copytree(straight[0] / "checkpoints", run / "checkpoints")
    shutil.copy(straight[0] / "metrics.jsonl", run / "metrics.jsonl")
    victim = run / "checkpoints" / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip(victim)
    before = snapshot(run)
    resume = dsf_started(*train_args(run, COMMON, "--resume"))
    lines = {name: export_refusal(run / "checkpoints", out) for name, out in
             (("export", tmp_path / "hf"), ("onto-checkpoints", run / "checkpoints"), ("onto-run", run))}
    lines["resume"] = one_line(resume).removeprefix("dsf: error: ")
    assert snapshot(run) == before and not (tmp_path / "hf").exists(), "nothing written or deleted"
    for name in ("resume", "export"):
        assert lines[name].startswith(f"checkpoint file='{victim}': has changed since it was saved (crc32:"), lines
        assert "resume from global_step4, the newest checkpoint that checks" in lines[name], lines[name]
    assert "is a checkpoint directory" in lines["onto-checkpoints"], lines["onto-checkpoints"]
    assert "is a run's output_dir" in lines["onto-run"], lines["onto-run"]

    proc = train_launch(run, [*COMMON, "checkpoint.fallback=previous"], flags=("--resume",))
    first = next(line for line in proc.stdout.splitlines() if line.startswith("dsf: "))
    assert first.startswith(f"dsf: resuming from {run / 'checkpoints' / 'global_step4'} (step 4), the newest that "
                            "checks (checkpoint.fallback=previous)"), proc.stdout[-3000:]
    resumed = {step: loss for step, loss in losses(run).items() if step > 4}
    assert_close(resumed, {s: v for s, v in straight[1].items() if s > 4}, rtol=1e-6, what="fallback resume vs straight")
    assert (run / "checkpoints" / "latest").read_text() == "global_step6"
    assert Manifest.read(run / "checkpoints" / "global_step6" / MANIFEST).checksums, "the new step 6 is summed"


class Tmpfs:
    """A tmpfs of `size` mounted at `path` while the block runs (the tests run as root)."""

    def __init__(self, path: Path, size: str):
        self.path, self.size = path, size

    def __enter__(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)], check=True)
        return self.path

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def job(output_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """`dsf train` on 2 ranks (as DeepSpeed's per-node launcher starts them), to its end, however it ends."""
    sets = [a for o in run_overrides(output_dir, overrides) for a in ("--set", o)]
    return launch([str(BIN / "dsf"), "train", str(TINY_YAML), *sets], num_ranks=2, timeout=300, check=False)


def error_lines(proc: subprocess.CompletedProcess) -> set[str]:
    return {line.split("dsf: error: ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines()
            if "dsf: error: " in line}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")
def test_a_full_disk_costs_no_checkpoint(tmp_path, straight):
    with Tmpfs(tmp_path / "small", "3m") as small:  # holds one checkpoint (~1.6 MB), not two
        stopped = job(small / "run", COMMON)
        ckpts = small / "run" / "checkpoints"
        assert stopped.returncode != 0 and "Traceback" not in stopped.stdout + stopped.stderr, stopped.stderr[-3000:]
        lines = error_lines(stopped)
        assert len(lines) == 1, (stopped.stdout + stopped.stderr)[-3000:]
        assert f"checkpoint: not saved: {ckpts} has " in next(iter(lines)), lines
        assert "free and the last checkpoint took" in next(iter(lines)) and "global_step2" in next(iter(lines))
        assert (ckpts / "latest").read_text() == "global_step2" and not list(ckpts.glob("*.partial"))
        saved = Manifest.read(ckpts / "global_step2" / MANIFEST).checksums
        assert saved == Manifest.read(straight[0] / "checkpoints" / "global_step2" / MANIFEST).checksums, \
            "the last good checkpoint is, byte for byte, the one an undisturbed run saved"
    with Tmpfs(tmp_path / "tiny", "1m") as tiny:  # fills during the first save
        filled = job(tiny / "run", COMMON)
        ckpts = tiny / "run" / "checkpoints"
        lines = error_lines(filled)
        assert filled.returncode != 0 and len(lines) == 1, (filled.stdout + filled.stderr)[-3000:]
        assert f"checkpoint='{ckpts / 'global_step2.partial'}': could not be written: the disk is full (" \
            in next(iter(lines)), lines
        assert not (ckpts / "latest").exists() and not list(ckpts.glob("global_step*")), "nothing partial is left"
        assert "Traceback" not in filled.stdout + filled.stderr, filled.stderr[-3000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")
def test_export_and_the_token_store_on_a_full_disk_are_one_line(tmp_path, straight):
    with Tmpfs(tmp_path / "small", "64k") as small:
        store = dsf_started(*train_args(tmp_path / "run", COMMON), env={"HF_DATASETS_CACHE": str(small / "cache")})
        export = export_refusal(straight[0] / "checkpoints", small / "hf")
        line = one_line(store)
        assert export.startswith(f"OUT_DIR='{small / 'hf'}': could not be written: the disk is full ("), export
        assert f"HF_DATASETS_CACHE='{small / 'cache' / 'dsframework-stores'}': could not hold the token store: " \
               "the disk is full" in line, line
        left = sorted(str(p.relative_to(small)) for p in small.rglob("*"))
        assert left in ([], ["cache"], ["cache", "cache/dsframework-stores"]), f"something partial is left: {left}"
