"""Files that readers see whole or not at all: write to a temporary name, then rename.

    with written_then_renamed(ckpt_dir / "latest", durable=True) as tmp:
        tmp.write_text("global_step8")

A rename within one directory is atomic in POSIX, so a reader (another rank, a resumed run, a
job killed halfway through the write) finds the old file or the new one, never a torn one.
"""
from __future__ import annotations

import contextlib
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
