"""What a run owns in its output directory: an OS lock while it runs, the record of what it wrote,
and the rule that no command writes over another run's files.

    refuse_if_held(run.output_dir)                # rank 0, in pre-flight: UserError naming another holder
    lock = hold_output_dir(run.output_dir)        # then, after the other checks, the first thing written
    holder(run.output_dir)                        # 'host node0 pid 4242 (since 2026-12-06 23:50:01)', or None
    write_record(run.output_dir, written)         # the paths this run writes there, for a later --overwrite
    remove_written(run.output_dir, fallback)      # --overwrite: only what the record (else `fallback`) names
    check_export_target(out_dir, ckpt_dir)        # dsf export: never into, over or around a run's files

The lock is `fcntl.flock` on `<output_dir>/dsf.lock`, taken by rank 0 of `dsf train` (at the end of
pre-flight; for an output_dir that is not there yet, when it makes it) and held until the process ends: the kernel releases it when the holder dies, however it dies, so a crash leaves no
stale lock (the file stays, naming the last holder; a lock, not the file, is what refuses). A child
forked by the holder (a data worker, DeepSpeed's decoupled writer) closes its copy of the descriptor
at once, so it neither keeps the lock after the trainer ends nor can release it. On a shared
filesystem the lock holds across nodes where the filesystem gives `flock` (NFSv4 and Lustre with
`-o flock` do; Lustre's default `localflock` locks per node only).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Iterable

from dsframework.errors import UserError

LOCK = "dsf.lock"
RECORD = "dsf_run.json"
# What `dsf train` writes in output_dir, recorded in RECORD (a later --overwrite removes these alone):
# the checkpoints, metrics.jsonl, protocol/exits.PREEMPTED_MARKER and FINISHED_MARKER, protocol/goodput.CHECKPOINT_TIMES.
TRAINER_OUTPUTS = ("checkpoints", "metrics.jsonl", "preempted.json", "finished.json", "checkpoint_times.jsonl")
_held: dict[Path, int] = {}  # output directory (resolved) -> the descriptor holding its lock


def hold_output_dir(output_dir: str | Path) -> Path:
    """Take `output_dir`'s lock for this process (created if missing) and keep it until the process
    ends (or `release_output_dir`); the lock file then names this host and pid. UserError, nothing
    else touched, when another process holds it or the directory cannot be written."""
    directory = Path(output_dir).resolve()
    if directory in _held:
        return directory / LOCK
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise UserError("output_dir", str(output_dir), f"cannot be written ({err.strerror or err})",
                        "choose a writable directory (--set output_dir=DIR)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise UserError("output_dir", str(output_dir), f"is in use by another run ({holder_text(directory)})",
                        "wait for it to end, stop it, or --set output_dir=NEW_DIR") from None
    try:  # a disk already full refuses these ~80 bytes: one line, and the lock let go
        with contextlib.suppress(OSError):  # (a lock file that is a device cannot be truncated)
            os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode() + b"\n", 0)
    except OSError as err:
        os.close(fd)
        raise UserError("output_dir", str(output_dir), f"cannot be written ({err.strerror or err})",
                        "free space there, or set output_dir to a directory on another disk") from None
    _held[directory] = fd
    return directory / LOCK


def refuse_if_held(output_dir: str | Path) -> None:
    """UserError naming the holder when another process holds `output_dir`'s lock (reads only)."""
    who = holder(output_dir)
    if who is not None:
        raise UserError("output_dir", str(output_dir), f"is in use by another run ({who})",
                        "wait for it to end, stop it, or --set output_dir=NEW_DIR")


def _close_in_child() -> None:
    """In a forked child: its copies of the held locks' descriptors, closed (the parent's locks stay)."""
    for fd in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def release_output_dir(output_dir: str | Path) -> None:
    """Let go of `output_dir`'s lock (a process that trains twice, as the tests do)."""
    fd = _held.pop(Path(output_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # (closing the last descriptor of the open file releases the flock)


def holder(output_dir: str | Path) -> str | None:
    """Who holds `output_dir`'s lock ('host H pid P (since T)'), or None when no process does
    (this one holding it counts: a run's own export or resume is not another run's)."""
    directory = Path(output_dir).resolve()
    path = directory / LOCK
    if directory in _held or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return holder_text(directory)
    finally:
        os.close(fd)  # (also drops the shared lock, when it was taken)
    return None


def holder_text(directory: Path) -> str:
    """'host H pid P (since T)' from the lock file, as its holder wrote it."""
    try:
        who = json.loads((directory / LOCK).read_text())
        return f"host {who['host']} pid {who['pid']} (since {who['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def write_record(output_dir: str | Path, written: Iterable[str | Path]) -> None:
    """Note the paths this run writes (relative to `output_dir` when inside it), for a later --overwrite."""
    directory = Path(output_dir)
    paths = sorted({_relative(directory, Path(p)) for p in written})
    (directory / RECORD).write_text(json.dumps({"written": paths}, indent=1) + "\n")


def _relative(directory: Path, path: Path) -> str:
    try:
        return str(path.resolve().relative_to(directory.resolve()))
    except ValueError:
        return str(path.resolve())


def recorded(output_dir: str | Path) -> list[Path] | None:
    """The paths the last run in `output_dir` recorded writing, or None (no record: before dsf kept one)."""
    directory = Path(output_dir)
    try:
        written = json.loads((directory / RECORD).read_text())["written"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [directory / p for p in written if isinstance(p, str) and p not in ("", ".", LOCK)]


def remove_written(output_dir: str | Path, fallback: Iterable[str | Path]) -> list[Path]:
    """--overwrite: remove what the previous run recorded writing (without a record, `fallback`: what
    this version writes), nothing else of `output_dir`; returns what was removed."""
    directory = Path(output_dir)
    paths = recorded(directory)
    if paths is None:
        paths = [directory / p for p in fallback]
    removed = []
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(path)
    return removed


# --- dsf export's target ------------------------------------------------------------------------

def run_kind(path: Path) -> str | None:
    """'a checkpoint directory' or 'a run's output_dir' when `path` is one (by the files dsf writes
    there), else None."""
    if (path / "latest").is_file() or (path / "hf_config" / "config.json").is_file() \
            or any(path.glob("global_step*")):
        return "a checkpoint directory"
    if any((path / name).exists() for name in (LOCK, RECORD, "metrics.jsonl", "checkpoints/latest")):
        return "a run's output_dir"
    return None


def check_export_target(out_dir: Path, ckpt_dir: Path, *, overwrite: bool, depth: int = 3) -> None:
    """UserError unless `out_dir` is a place `dsf export` may write (and, with --overwrite, replace):
    not a checkpoint directory or a run's output_dir, not inside one, not holding one (to `depth`
    levels, and never the checkpoints it exports), and with --overwrite an earlier export or empty."""
    out, source = out_dir.resolve(), ckpt_dir.resolve()
    fix = "export to a directory of its own, e.g. OUT_DIR=<output_dir>/hf"
    for place in (out, *out.parents):
        kind = run_kind(place) if place.is_dir() else None
        if kind is None:
            continue
        if place == out:
            who = holder(place)
            raise UserError("OUT_DIR", str(out_dir), f"is {kind}" + (f", in use by {who}" if who else ""), fix)
        owned = _run_outputs(place) if kind == "a run's output_dir" else [place]
        inside = next((p for p in owned if p == out or p in out.parents), None)
        if inside is not None:  # (a new folder beside the run's own files, <output_dir>/hf, is the docs' place)
            what = kind if inside == place else f"what the run in {place} wrote"
            raise UserError("OUT_DIR", str(out_dir), f"lies inside {inside}, which is {what}", fix)
    if source == out or out in source.parents:
        raise UserError("OUT_DIR", str(out_dir), f"holds the checkpoints it exports ({ckpt_dir})", fix)
    if not out.is_dir():
        return
    inside = _run_below(out, depth)
    if inside is not None:
        raise UserError("OUT_DIR", str(out_dir), f"holds {run_kind(inside)} ({inside})", fix)
    exported = any((out / name).is_file() for name in ("config.json", "adapter_config.json"))
    if overwrite and any(out.iterdir()) and not exported:
        raise UserError("OUT_DIR", str(out_dir), "is not an earlier export (no config.json), and --overwrite "
                        "replaces only those", "choose a new directory, or empty this one yourself")


def _run_outputs(output_dir: Path) -> list[Path]:
    """What a run wrote in `output_dir`: its record, else TRAINER_OUTPUTS (resolved)."""
    paths = recorded(output_dir) or [output_dir / name for name in TRAINER_OUTPUTS]
    return [p.resolve() for p in paths]


def _run_below(root: Path, depth: int) -> Path | None:
    """The first directory below `root` (to `depth` levels) that is a checkpoint directory or an output_dir."""
    level = [root]
    for _ in range(depth):
        level = [child for parent in level for child in _subdirectories(parent)]
        for child in level:
            if run_kind(child) is not None:
                return child
    return None


def _subdirectories(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
