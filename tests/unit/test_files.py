"""written_then_renamed: a reader sees the old file or the new one, never a torn one or a leftover."""
from __future__ import annotations

import pytest

from dsframework.files import written_then_renamed


@pytest.mark.parametrize("durable", [False, True])
def test_the_new_content_replaces_the_old_in_one_rename(tmp_path, durable):
    path = tmp_path / "latest"
    path.write_text("global_step2")
    with written_then_renamed(path, durable=durable) as tmp:
        tmp.write_text("global_step4")
        assert path.read_text() == "global_step2", "the old content stays until the block ends"
    assert path.read_text() == "global_step4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_an_error_while_writing_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "latest"
    path.write_text("global_step2")
    with pytest.raises(RuntimeError), written_then_renamed(path) as tmp:
        tmp.write_text("glob")
        raise RuntimeError("killed halfway")
    assert path.read_text() == "global_step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_new_file_appears_whole(tmp_path):
    path = tmp_path / "cache" / "blocks.json"
    path.parent.mkdir()
    with written_then_renamed(path) as tmp:
        tmp.write_text("{}")
    assert path.read_text() == "{}"
