"""A bad data row found by rank 0 while it prepares the data (the other ranks waiting for it) ends
every rank with the same one line and no traceback, on a real 2-rank launch."""
from __future__ import annotations

import subprocess
import sys

from deepspeed.launcher.runner import encode_world_info

from tests.distributed.launcher import BIN, REPO, TINY_YAML, free_port, rank_env, run_overrides


def test_rank_zeros_data_error_is_every_ranks_one_line(tmp_path):
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                          '{"role": "assitant", "content": "yo"}]}\n' * 20)
    overrides = [f"data.dataset={tmp_path / 'chats.jsonl'}", "data.format=chat",
                 "data.chat_template={% for m in messages %}{{ m['content'] }}{% endfor %}"]
    sets = [a for o in run_overrides(tmp_path / "run", overrides) for a in ("--set", o)]
    world_info = encode_world_info({"localhost": [0, 1]})
    proc = subprocess.run([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(BIN / "dsf"), "train",
                           str(TINY_YAML), *sets], capture_output=True, text=True, timeout=300, env=rank_env(), cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("dsf: error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, output[-3000:]  # one per rank, the same
    assert "row 0 messages[1].role='assitant'" in errors[0] and "did you mean 'assistant'?" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
