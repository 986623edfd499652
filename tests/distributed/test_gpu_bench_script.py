"""bench/gpu.sh (the prepared single-GPU benchmark) works end to end before a GPU is at hand:
`--dry-run` trains tiny-llama 2 steps with ZeRO-2 and ZeRO-3 in bf16 on this machine's device
and prints the tokens/s, TFLOP/s and MFU table against the bf16 matmul peak it measured."""
from __future__ import annotations

import sys
import re
import subprocess

from tests.distributed.launcher import REPO, rank_env


def test_gpu_bench_dry_run(tmp_path):
    env = {**rank_env(), "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "--dry-run"], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"measured bf16 matmul peak on \S+: [\d.]+ TFLOP/s", proc.stdout)
    rows = {int(m.group(1)): m.groups()[1:] for m in
            re.finditer(r"^\| (\d) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+)% \| \d+ \|$", proc.stdout, re.M)}
    assert sorted(rows) == [2, 3], proc.stdout
    for tokens, tflops, mfu in rows.values():
        assert int(tokens.replace(",", "")) > 0 and 0 < float(mfu) < 100
    assert (tmp_path / "peak.json").is_file() and (tmp_path / "zero3" / "metrics.jsonl").is_file()
