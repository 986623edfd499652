"""The disk a run's checkpoints take: how many it keeps, the free space before a save, and a disk
that fills during one. A full disk costs no data: `latest` always names a complete checkpoint.

    prune(ckpt_dir, keep=3, keep_every=1000)     # rank 0, after a commit: the newest 3 (and every 1000th) stay
    space_before_save(ckpt_dir, on_low_space="stop")   # every rank: 'ok', or a UserError / 'skip' with its line
    disk_full_error("checkpoint", partial, ...)  # a full disk's one line: the path, bytes free and needed, what is kept

`checkpoint.keep` bounds the checkpoints a run keeps (default 0: every one, as DeepSpeed does; a
checkpoint every 10 steps of a 2,000-step run then keeps 200). Before each save, rank 0 compares the
free space of the checkpoint directory with the size of the last checkpoint (its manifest); too
little stops the run with the last good checkpoint `latest` (checkpoint.on_low_space=stop) or skips
this save (skip), every rank told on the host group. A write that still runs out of space (another
process filled the disk) removes the partial checkpoint on every rank and ends the run in one line.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from dsframework.checkpoints.integrity import step_of, step_tags
from dsframework.checkpoints.manifest import MANIFEST, Manifest
from dsframework.errors import UserError
from dsframework.files import free_bytes, gib

def last_save_bytes(ckpt_dir: Path) -> int | None:
    """The size of the newest committed checkpoint, from its manifest (None: none yet)."""
    for tag in reversed(step_tags(ckpt_dir)):
        path = Path(ckpt_dir) / tag / MANIFEST
        if path.is_file():
            return sum(Manifest.read(path).files.values())
    return None


def prune(ckpt_dir: Path, *, keep: int, keep_every: int = 0) -> list[str]:
    """Rank 0, after a commit: remove the checkpoints beyond the newest `keep` (0: none removed), except
    those whose step is a multiple of `keep_every`, with their universal conversions; returns the tags
    removed. The one `latest` names is always among the newest."""
    if keep <= 0:
        return []
    ckpt_dir = Path(ckpt_dir)
    tags = step_tags(ckpt_dir)
    latest = (ckpt_dir / "latest").read_text().strip() if (ckpt_dir / "latest").is_file() else None
    old = [t for t in tags[:-keep] if t != latest and not (keep_every and step_of(t) % keep_every == 0)]
    for tag in old:
        for path in [ckpt_dir / tag, *ckpt_dir.glob(tag + ".universal*")]:
            shutil.rmtree(path, ignore_errors=True)
    return old


def low_space_line(ckpt_dir: Path) -> str | None:
    """Rank 0 before a save: why the disk cannot hold another checkpoint like the last, or None."""
    needed, free = last_save_bytes(ckpt_dir), free_bytes(ckpt_dir)
    if needed is None or free >= needed:
        return None
    return (f"{ckpt_dir} has {gib(free)} free and the last checkpoint took {gib(needed)} "
            f"(last good checkpoint: {step_tags(ckpt_dir)[-1]})")


def low_space_error(line: str) -> UserError:
    return UserError("checkpoint", None, f"not saved: {line}",
                     "free space there or set checkpoint.keep=N, then continue with --resume "
                     "(checkpoint.on_low_space=skip trains on without saving)")


def disk_full_error(what: str, path: Path, *, needed: int | None, last_good: str | None,
                    fix: str) -> UserError:
    """The one line for a write that ran out of space: what, where, bytes free and needed, and what is kept."""
    need = f", about {gib(needed)} needed" if needed else ""
    kept = f"; the last good checkpoint {last_good} is kept" if last_good else ""
    return UserError(what, str(path), f"could not be written: the disk is full ({gib(free_bytes(path))} free{need})"
                     f"{kept}, nothing partial is left", fix)

