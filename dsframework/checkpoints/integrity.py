"""Checkpoints that prove they are intact: a CRC-32 of every file, computed when it is saved by the
rank that wrote it, kept in the manifest, and checked when a resume or an export reads it.

    mine = own_checksums(partial, [...paths this rank saved...])   # this rank (in a thread)
    sums = gather_checksums(partial, mine)   # every rank; rank 0 gets them all
    problem(tag_dir, manifest, names)        # ('x.pt', 'has changed since it was saved (...)') for the first bad one
    bad = first_problem_of_ranks(tag_dir, manifest)   # the same, every rank a share of the files
    newest_intact(ckpt_dir, before="global_step6")    # the newest earlier tag whose files all check, or None

A size check alone misses a file changed in place (a bad disk, a partial copy over an old one): the
run then loads it and fails steps later with a wrong diagnosis ("loss is not finite"). zlib's CRC-32
reads at a few GB/s and releases the GIL, so each rank sums its own files in threads, right after
they are on disk (the sync writer: at the save's commit; the decoupled writer: in a background
thread during the step after its files are written, published after that step, off the step's
path). A manifest without checksums (a dsf before them) is checked by size alone.
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from dsframework.checkpoints.manifest import MANIFEST, Manifest
from dsframework.parallel.host import host_group

CHUNK = 4 << 20  # read into one buffer per file: a few MiB of memory per thread, whatever the file's size


def checksum(path: Path) -> str:
    """'crc32:1a2b3c4d' of the file at `path`."""
    crc, buffer = 0, bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
    return f"crc32:{crc:08x}"


def checksums(paths: Iterable[Path], *, threads: int = 4) -> dict[Path, str]:
    """{path: checksum} of every file, `threads` at a time (zlib releases the GIL while it sums)."""
    paths = list(paths)
    if len(paths) <= 1:
        return {p: checksum(p) for p in paths}
    with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as pool:
        return dict(zip(paths, pool.map(checksum, paths)))


def own_checksums(partial: Path, own: Iterable[Path]) -> dict[str, str]:
    """{name in `partial`: checksum} of the files this rank saved there (`own`); run in a thread."""
    return {str(p.relative_to(partial)): s for p, s in checksums(p for p in own if p.is_file()).items()}


def gather_checksums(partial: Path, mine: dict[str, str]) -> dict[str, str] | None:
    """Every rank, once every rank's files are in `partial`: the checksums each summed of its own
    files (`mine`, own_checksums) gathered on the host group; rank 0 also sums every file no rank
    claimed (DeepSpeed's copied zero_to_fp32.py, or all of them from an engine whose writer does not
    record what it saved). Rank 0 gets {name in partial: checksum}, the others None."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=host_group())  # pickled: host-side
    if dist.get_rank() != 0:
        return None
    merged = {name: s for sums in everyone for name, s in sums.items()}
    rest = [p for p in sorted(partial.rglob("*"))
            if p.is_file() and p.name != MANIFEST and str(p.relative_to(partial)) not in merged]
    merged.update({str(p.relative_to(partial)): s for p, s in checksums(rest).items()})
    return dict(sorted(merged.items()))


def problem(tag_dir: Path, manifest: Manifest, names: Iterable[str], *, sums: bool = True) -> tuple[str, str] | None:
    """(name, what is wrong) of the first of `names` (files of `tag_dir` its manifest lists) that is
    missing, of another size, or (with `sums` and checksums in the manifest) of another checksum;
    None when all check."""
    names = list(names)
    for name in names:
        path = tag_dir / name
        if not path.is_file():
            return name, "is missing"
        actual, size = path.stat().st_size, manifest.files[name]
        if actual != size:
            return name, f"is truncated or altered ({actual:,} bytes, {size:,} when saved)"
    saved = manifest.checksums or {}
    todo = [n for n in names if sums and n in saved]
    found = checksums(tag_dir / n for n in todo)
    for name in todo:
        if found[tag_dir / name] != saved[name]:
            return name, f"has changed since it was saved ({found[tag_dir / name]}, {saved[name]} when saved)"
    return None


def first_problem_of_ranks(tag_dir: Path, manifest: Manifest) -> tuple[str, str] | None:
    """`problem` over every file of the checkpoint, each rank reading a share (every rank calls it
    and gets the same answer: the first bad file in name order, or None)."""
    import torch.distributed as dist

    names = sorted(manifest.files)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = problem(tag_dir, manifest, names[rank::world])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=host_group())  # pickled: host-side
    return min((p for p in everyone if p), default=None)


def step_of(tag: str) -> int:
    """global_stepN -> N; -1 for any other name (checkpoint.step_of, which imports this module)."""
    number = tag.removeprefix("global_step")
    return int(number) if number.isdigit() else -1


def step_tags(ckpt_dir: Path) -> list[str]:
    """The committed checkpoints in `ckpt_dir` (its global_stepN folders; a save in flight is
    global_stepN.partial), oldest first: what a prune, a fallback and a resume without `latest` look through."""
    return sorted((p.name for p in Path(ckpt_dir).glob("global_step*") if p.is_dir() and step_of(p.name) >= 0),
                  key=step_of)


def tags_before(ckpt_dir: Path, tag: str) -> list[str]:
    """The complete checkpoints (a folder with a manifest) older than `tag`, newest first."""
    return [t for t in reversed(step_tags(ckpt_dir))
            if step_of(t) < step_of(tag) and (Path(ckpt_dir) / t / MANIFEST).is_file()]


def newest_intact(ckpt_dir: Path, *, before: str, sums: bool = True) -> str | None:
    """The newest checkpoint older than `before` whose files all check, by size and with `sums` by
    checksum (one process reads them)."""
    for tag in tags_before(ckpt_dir, before):
        manifest = Manifest.read(Path(ckpt_dir) / tag / MANIFEST)
        if problem(Path(ckpt_dir) / tag, manifest, sorted(manifest.files), sums=sums) is None:
            return tag
    return None
