"""The checkpoint manifest (checkpoints/manifest.py): every form an older dsframework wrote still reads,
what this one writes is the JSON older versions read (the same keys, byte for byte), and the checks
that read it (verify, saved_layout) go through `Manifest`. Nothing here needs a process group."""
from __future__ import annotations

import json

import pytest

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.checkpoints.manifest import MANIFEST, Manifest
from dsframework.errors import UserError
from dsframework.layout import ParallelDims

FILES = {"mp_rank_00_model_states.pt": 3, "rng_rank0.pt": 2}


@pytest.mark.parametrize("old,want", [
    # the first manifests (issue 5): the layout as {world, tp, pp, dp, zero_stage}
    ({"step": 4, "layout": {"world": 4, "tp": 2, "pp": 1, "dp": 2, "zero_stage": 1}, "files": FILES},
     ParallelDims(world=4, tp=2, zero_stage=1)),
    # a layout without its ZeRO stage: the reader's (a resume's own)
    ({"step": 4, "layout": {"world": 4, "tp": 1, "pp": 1, "dp": 4}, "files": FILES}, ParallelDims(world=4, zero_stage=2)),
    # with cp and hpZ, before ep and AutoEP's blocks
    ({"step": 4, "layout": {"world": 4, "tp": 1, "pp": 1, "cp": 1, "dp": 4, "zero_stage": 3, "zero_hpz": 2},
      "files": FILES}, ParallelDims(world=4, zero_stage=3, zero_hpz=2)),
    # no layout recorded
    ({"step": 4, "layout": None, "files": FILES}, None),
    ({"step": 4, "files": FILES}, None),
])
def test_older_manifests_still_read(tmp_path, old, want):
    (tmp_path / MANIFEST).write_text(json.dumps(old, indent=1))
    manifest = Manifest.read(tmp_path / MANIFEST)
    assert (manifest.step, manifest.files, manifest.trainable) == (4, FILES, None)
    assert manifest.saved_layout(zero_stage=2) == want


def test_a_lora_manifest_reads_its_trainable_names_and_a_newer_key_is_ignored(tmp_path):
    trainable = {"q_proj.lora_A.weight": [8, 64]}
    written = {"step": 2, "layout": ParallelDims(world=2, zero_stage=1).as_dict(), "files": FILES,
               "trainable": trainable, "from_a_newer_dsframework": 1}
    (tmp_path / MANIFEST).write_text(json.dumps(written))
    manifest = Manifest.read(tmp_path / MANIFEST)
    assert manifest.trainable == trainable and manifest.saved_layout() == ParallelDims(world=2, zero_stage=1)


@pytest.mark.parametrize("trainable", [None, {"q_proj.lora_A.weight": [8, 64]}])
def test_the_writer_writes_the_json_older_versions_read(tmp_path, trainable):
    """The bytes the writer wrote before Manifest existed: step, layout, files, then trainable only
    with frozen parameters; read back, the same manifest."""
    dims = ParallelDims(world=8, tp=2, pp=2, zero_stage=1)
    before = json.dumps({"step": 100, "layout": dims.as_dict(), "files": FILES,
                         **({"trainable": trainable} if trainable is not None else {})}, indent=1)
    manifest = Manifest(100, dims.as_dict(), FILES, trainable)
    manifest.write(tmp_path / MANIFEST)
    assert (tmp_path / MANIFEST).read_text() == before
    assert Manifest.read(tmp_path / MANIFEST) == manifest and manifest.saved_layout() == dims


def test_a_commit_writes_the_manifest_of_every_file(tmp_path):
    partial = tmp_path / ("global_step4" + ckpt.PARTIAL)
    partial.mkdir()
    for name, size in FILES.items():
        (partial / name).write_bytes(b"x" * size)
    dims = ParallelDims(world=1, zero_stage=2)
    ckpt._publish(ckpt.Pending(tmp_path, "global_step4", 4, dims, trainable=None, seconds=0.0), None)
    assert ckpt.latest_tag(tmp_path) == "global_step4"
    assert ckpt.verify(tmp_path, "global_step4") == Manifest(4, dims.as_dict(), FILES)
    assert ckpt.saved_layout(ckpt.read_manifest(tmp_path, "global_step4")) == dims


def test_verify_names_a_truncated_file_and_reads_no_manifest_as_none(tmp_path):
    tag = tmp_path / "global_step4"
    tag.mkdir()
    assert ckpt.verify(tmp_path, "global_step4") is None and ckpt.saved_layout(None) is None
    (tag / "rng_rank0.pt").write_bytes(b"x")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"xxx")
    Manifest(4, None, FILES).write(tag / MANIFEST)
    with pytest.raises(UserError, match=r"rng_rank0.pt'?: is truncated or altered \(1 bytes, 2 when saved\)"):
        ckpt.verify(tmp_path, "global_step4")


@pytest.mark.parametrize("text,what", [("{", "not JSON"), ("[1]", "not a dsf manifest"),
                                       ('{"step": 4}', "not a dsf manifest")])
def test_a_corrupt_manifest_is_one_line(tmp_path, text, what):
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / MANIFEST).write_text(text)
    with pytest.raises(UserError, match=f"is corrupt \\({what}"):
        ckpt.read_manifest(tmp_path, "global_step4")
