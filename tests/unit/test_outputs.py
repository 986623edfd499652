"""What a run owns on disk, without training: the output directory's lock across processes, the record
a later --overwrite removes, where `dsf export` may write, how many checkpoints a run keeps, the
checksums that catch a file changed in place, and what counts as a full disk. (The same faults,
injected into real runs: tests/distributed/test_nothing_lost.py.)"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsframework.checkpoints import integrity, outputs, space
from dsframework.checkpoints.manifest import MANIFEST, Manifest
from dsframework.errors import UserError
from dsframework.files import disk_full
from dsframework.protocol.exits import FINISHED_MARKER, PREEMPTED_MARKER
from dsframework.protocol.goodput import CHECKPOINT_TIMES

HOLD = """
import sys, time
from dsframework.checkpoints.outputs import hold_output_dir
hold_output_dir(sys.argv[1]); print("held", flush=True); time.sleep(60)
"""


def holding(directory: Path) -> subprocess.Popen:
    """Another process holding `directory`'s lock (until killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.distributed  # (other processes: the fast tier starts none)
def test_the_lock_refuses_a_second_holder_names_it_and_dies_with_its_holder(tmp_path):
    run = tmp_path / "run"
    proc = holding(run)
    try:
        who = outputs.holder(run)
        assert who is not None and f"pid {proc.pid}" in who
        with pytest.raises(UserError, match=rf"output_dir='{run}': is in use by another run \(host .+ pid {proc.pid}"):
            outputs.hold_output_dir(run)
        with pytest.raises(UserError, match=f"pid {proc.pid}"):
            outputs.refuse_if_held(run)
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: the kernel releases the lock, no stale lock is left
        proc.wait()
    assert outputs.holder(run) is None
    outputs.hold_output_dir(run)
    try:
        assert outputs.holder(run) is None, "this process's own lock is not another run's"
        child = os.fork()
        if child == 0:  # a forked child (a data worker) neither keeps nor releases the parent's lock
            os._exit(0)
        os.waitpid(child, 0)
        other = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(60)", ""), str(run)],
                               capture_output=True, text=True)
        assert other.returncode != 0 and "is in use by another run" in other.stderr
    finally:
        outputs.release_output_dir(run)
    assert outputs.holder(run) is None


def test_a_lock_that_cannot_be_written_is_one_line_and_not_held(tmp_path):
    """A disk already full: the lock file (here /dev/full, which answers every write with ENOSPC)
    refuses its holder's name; one line naming output_dir, and the lock is let go."""
    run = tmp_path / "run"
    run.mkdir()
    (run / outputs.LOCK).symlink_to("/dev/full")
    with pytest.raises(UserError, match=rf"output_dir='{run}': cannot be written \(No space left on device\)"):
        outputs.hold_output_dir(run)
    assert outputs.holder(run) is None and run.resolve() not in outputs._held


def test_the_trainer_outputs_are_the_protocols_file_names():
    assert {PREEMPTED_MARKER, FINISHED_MARKER, CHECKPOINT_TIMES} <= set(outputs.TRAINER_OUTPUTS)


def test_overwrite_removes_what_the_record_names_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "my_notes.txt").write_text("the user's")
    (run / "data").mkdir()
    outputs.write_record(run, [run / name for name in outputs.TRAINER_OUTPUTS])
    removed = outputs.remove_written(run, fallback=["data"])
    assert sorted(p.name for p in removed) == ["checkpoints", "metrics.jsonl"]
    assert sorted(p.name for p in run.iterdir()) == ["data", outputs.RECORD, "my_notes.txt"]
    (run / outputs.RECORD).unlink()  # a run of a dsf before records: what this version writes
    (run / "metrics.jsonl").write_text("{}\n")
    assert [p.name for p in outputs.remove_written(run, fallback=outputs.TRAINER_OUTPUTS)] == ["metrics.jsonl"]


def run_dir(root: Path) -> Path:
    """A finished run's output_dir as dsf train leaves it."""
    (root / "checkpoints" / "global_step2").mkdir(parents=True)
    (root / "checkpoints" / "latest").write_text("global_step2")
    (root / "metrics.jsonl").write_text("{}\n")
    outputs.write_record(root, [root / name for name in outputs.TRAINER_OUTPUTS])
    return root


@pytest.mark.parametrize("out,overwrite,expect", [
    ("run", True, "is a run's output_dir"),
    ("run/checkpoints", True, "is a checkpoint directory"),
    ("run/checkpoints/global_step2", True, "which is a checkpoint directory"),
    ("run/checkpoints/hf", False, "which is a checkpoint directory"),
    (".", True, "holds the checkpoints it exports"),
    ("parent", True, "holds a run's output_dir"),
    ("junk", True, "is not an earlier export"),
    ("run/hf", True, None),  # beside the run's files: where the docs export to
    ("old_export", True, None),
    ("new", False, None),
])
def test_export_never_writes_over_into_or_around_a_run(tmp_path, out, overwrite, expect):
    run = run_dir(tmp_path / "run")
    run_dir(tmp_path / "parent" / "deeper" / "run")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "thesis.tex").write_text("x")
    (tmp_path / "old_export").mkdir()
    (tmp_path / "old_export" / "config.json").write_text("{}")
    if expect is None:
        outputs.check_export_target(tmp_path / out, run / "checkpoints", overwrite=overwrite)
        return
    with pytest.raises(UserError, match=expect):
        outputs.check_export_target(tmp_path / out, run / "checkpoints", overwrite=overwrite)


def tag(ckpt_dir: Path, step: int, files: dict[str, bytes]) -> Path:
    """A committed checkpoint of `files`, with its manifest (sizes and checksums)."""
    folder = ckpt_dir / f"global_step{step}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    sums = {name: integrity.checksum(folder / name) for name in files}
    Manifest(step, None, {n: len(d) for n, d in files.items()}, checksums=sums).write(folder / MANIFEST)
    return folder


def test_a_byte_changed_in_place_is_caught_by_its_checksum_and_the_newest_intact_tag_named(tmp_path):
    files = {"optim.pt": os.urandom(50_000), "rng_rank0.pt": b"r" * 100}
    for step in (2, 4, 6):
        tag(tmp_path, step, files)
    victim = tmp_path / "global_step6" / "optim.pt"
    data = bytearray(victim.read_bytes())
    data[20_000] ^= 0xFF  # same size: a bad disk, a partial copy over an old file
    victim.write_bytes(bytes(data))
    manifest = Manifest.read(tmp_path / "global_step6" / MANIFEST)
    assert integrity.problem(tmp_path / "global_step6", manifest, sorted(manifest.files), sums=False) is None
    name, what = integrity.problem(tmp_path / "global_step6", manifest, sorted(manifest.files))
    assert name == "optim.pt" and what.startswith("has changed since it was saved (crc32:")
    (tmp_path / "global_step4" / "rng_rank0.pt").write_bytes(b"x" * 100)
    assert integrity.newest_intact(tmp_path, before="global_step6") == "global_step2"
    assert integrity.newest_intact(tmp_path, before="global_step6", sums=False) == "global_step4"


def test_keep_removes_the_oldest_and_keeps_every_mth(tmp_path):
    for step in range(10, 70, 10):
        tag(tmp_path, step, {"a.pt": b"a"})
    (tmp_path / "global_step20.universal").mkdir()
    (tmp_path / "latest").write_text("global_step60")
    assert space.prune(tmp_path, keep=0) == []
    assert space.prune(tmp_path, keep=2, keep_every=20) == ["global_step10", "global_step30"]
    assert integrity.step_tags(tmp_path) == ["global_step20", "global_step40", "global_step50", "global_step60"]
    assert (tmp_path / "global_step20.universal").is_dir()
    assert space.prune(tmp_path, keep=1) == ["global_step20", "global_step40", "global_step50"]
    assert integrity.step_tags(tmp_path) == ["global_step60"] and not (tmp_path / "global_step20.universal").exists()


def test_low_space_compares_the_free_space_with_the_last_checkpoint(tmp_path):
    assert space.low_space_line(tmp_path) is None, "nothing saved yet: nothing to compare"
    tag(tmp_path, 2, {"a.pt": b"a" * 1000})
    assert space.last_save_bytes(tmp_path) == 1000 and space.low_space_line(tmp_path) is None
    huge = tag(tmp_path, 4, {"b.pt": b""})
    Manifest(4, None, {"b.pt": 2**60}).write(huge / MANIFEST)  # a checkpoint no disk holds
    line = space.low_space_line(tmp_path)
    assert line is not None and "free and the last checkpoint took" in line and "global_step4" in line


@pytest.mark.parametrize("err,full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1114"), True),
    (OSError(errno.EACCES, "Permission denied"), False),
    (RuntimeError("CUDA out of memory"), False),
])
def test_what_counts_as_a_full_disk(err, full):
    assert disk_full(err) is full
    wrapped = RuntimeError("while saving")
    wrapped.__cause__ = err
    assert disk_full(wrapped) is full, "found through what it was raised from"


def test_old_manifests_without_checksums_still_read(tmp_path):
    Manifest(4, None, {"a.pt": 1}).write(tmp_path / MANIFEST)
    assert Manifest.read(tmp_path / MANIFEST).checksums is None
    (tmp_path / "a.pt").write_bytes(b"z")
    assert integrity.problem(tmp_path, Manifest.read(tmp_path / MANIFEST), ["a.pt"]) is None  # (sizes alone)
