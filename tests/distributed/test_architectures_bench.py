"""bench/architectures.py (which architectures dsf shards, pipelines, trains and exports) runs end
to end: `--dry-run --json` checks gpt2 (whose plan is dsf's own data) at tp2, pp2, tp2 x pp2, cp2,
sliced loading and export in two launches, and every cell passes (tests/distributed/
test_architectures.py trains nine more at tp2 x pp2; the rest are the benchmark's to report)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.distributed.launcher import REPO, rank_env


def test_architectures_bench_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "architectures.py"), "--dry-run", "--json",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=rank_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["type"] for r in rows] == ["gpt2"]
    for r in rows:
        assert all(cell == "pass" for column, cell in r.items() if column != "type"), r
