"""Files that readers see whole or not at all: write to a temporary name, then rename.

    with written_then_renamed(ckpt_dir / "latest", durable=True) as tmp:
        tmp.write_text("global_step8")

A rename within one directory is atomic in POSIX, so a reader (another rank, a resumed run, a
job killed halfway through the write) finds the old file or the new one, never a torn one.

And the words for a disk that filled: `disk_full(err)` (ENOSPC/EDQUOT, or torch's zip writer's and
safetensors' own messages for it), `free_bytes(path)`, `gib(n)`.
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def written_then_renamed(path: Path, *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an error it becomes `path`.

    The temporary name carries the pid, so ranks writing the same file together never share one.
    `durable` flushes it to disk before the rename (a `latest` that survives a power cut).
    An error in the block leaves `path` as it was and removes the temporary file.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


FULL_DISK_TEXT = ("No space left on device", "unexpected pos", "failed writing file", "Disk quota exceeded")


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on `path`'s filesystem (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def disk_full(err: BaseException) -> bool:
    """Whether `err` (or what it was raised from) is a write that ran out of space: ENOSPC/EDQUOT, or
    torch's zip writer's and safetensors' own words for it."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen) for text in FULL_DISK_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
