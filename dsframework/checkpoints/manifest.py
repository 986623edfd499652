"""The checkpoint manifest: `dsf_manifest.json` in each checkpoint folder, read and written here alone.

    manifest = Manifest(step=100, layout=dims.as_dict(), files={"mp_rank_00_model_states.pt": 1234})
    manifest.write(partial / MANIFEST)            # rank 0, last into `<tag>.partial` (atomically)
    manifest = Manifest.read(tag_dir / MANIFEST)  # UserError when it is not a manifest
    manifest.saved_layout(zero_stage=1)           # the ParallelDims it was saved at (None: not recorded)
    manifest.files                                # {path in the tag folder: size in bytes}
    manifest.checksums                            # {path in the tag folder: 'crc32:...'} (None: before dsf summed)
    manifest.trainable                            # {name: shape} of a run with frozen parameters, else None

The JSON keeps the keys every dsframework wrote, {"step", "layout", "files"}, "trainable" only
for a run with frozen parameters and "checksums" since checkpoints carry them, so older and newer versions read each other's checkpoints: the
layout is stored as written (`ParallelDims.as_dict`, or one of its older forms, which
`ParallelDims.from_dict` reads), and a key this version does not know is ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsframework.errors import UserError
from dsframework.files import written_then_renamed
from dsframework.layout import ParallelDims

MANIFEST = "dsf_manifest.json"


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds and how it was saved, as its `dsf_manifest.json` records it."""

    step: int  # the optimizer step it was saved at
    layout: dict[str, Any] | None  # the layout, as stored (ParallelDims.as_dict or an older form); None: none
    files: dict[str, int]  # every file of the checkpoint folder (its path there) with its size in bytes
    trainable: dict[str, list[int]] | None = None  # {name: shape} saved when parameters are frozen (LoRA)
    checksums: dict[str, str] | None = None  # {path: 'crc32:...'} of every file (checkpoints/integrity.py)

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """The manifest in the file `path`, in any form a dsframework wrote; UserError in one line when
        it is not JSON or not a manifest."""
        try:
            data = json.loads(Path(path).read_text())
        except ValueError:
            raise UserError("checkpoint file", str(path), "is corrupt (not JSON)",
                            "restore it, or point latest at an earlier checkpoint") from None
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or "step" not in data:
            raise UserError("checkpoint file", str(path), "is corrupt (not a dsf manifest: no step or files)",
                            "restore it, or point latest at an earlier checkpoint")
        sums = data.get("checksums")
        return cls(step=data["step"], layout=data.get("layout"), files=data["files"], trainable=data.get("trainable"),
                   checksums=sums if isinstance(sums, dict) else None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object as stored: "trainable" only when parameters are frozen, "checksums" when summed."""
        return {"step": self.step, "layout": self.layout, "files": self.files,
                **({"trainable": self.trainable} if self.trainable is not None else {}),
                **({"checksums": self.checksums} if self.checksums is not None else {})}

    def write(self, path: Path) -> None:
        """Into the file `path`: readers see the old content or the new, and it is on disk before the rename."""
        with written_then_renamed(Path(path), durable=True) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=1))

    def saved_layout(self, *, zero_stage: int = 0) -> ParallelDims | None:
        """The layout it was saved at (None when none is recorded); a ZeRO stage the manifest lacks (one
        written before the stage was recorded) is `zero_stage`, the caller's.

            manifest.saved_layout(zero_stage=dims.zero_stage)   # ParallelDims(world=4, tp=1, ..., zero_stage=1)
        """
        return None if self.layout is None else ParallelDims.from_dict(self.layout, zero_stage=zero_stage)
