"""bench/scale.py (the largest model this machine trains at tp2 x pp2) works end to end:
`--dry-run --json` trains a ~20M Llama 3 steps on 4 CPU ranks, its losses are finite, and each
rank materialised exactly its stage's share as the planner counts it. (The memory figures are
the benchmark's to report, not a test's to time.)"""
from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.distributed.launcher import REPO, rank_env


def test_scale_bench_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--dry-run", "--json",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=rank_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((next(tmp_path.rglob("figures.json"))).read_text())
    print(json.dumps(figures)[:2000])
    assert len(figures["losses"]) == 3 and all(math.isfinite(x) for x in figures["losses"])
    ranks = figures["ranks"]
    assert len(ranks) == 4
    for rank in ranks:
        assert rank["materialized_elements"] == rank["planner_stage_elements"], rank
