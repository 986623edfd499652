"""bench/data_scale.py (the data path at 200M tokens) works end to end at 1.5M tokens: the corpus is
written and prepared as dsf train prepares it, the store holds at least the tokens asked for (and
exactly what its files hold), the preparing process stays under 2 GiB, and each of the 2 training
ranks grows by less than 100 MB from a tiny corpus to this one (about 80 s)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.distributed.launcher import REPO, rank_env

GiB = 2**30
TOKENS = 1_500_000


def test_data_scale_bench_small(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "data_scale.py"), "--tokens", str(TOKENS),
                           "--steps", "3", "--probe-rows", "8000", "--workdir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=rank_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    prepared = figures["prepare"]
    print(json.dumps({k: v for k, v in figures.items() if k not in ("corpus",)})[:3000])

    # the store holds the tokens asked for, and its files exactly the tokens it reports
    assert prepared["tokens"] >= TOKENS
    assert prepared["tokens"] == prepared["train"]["tokens"] + prepared["eval"]["tokens"]
    store = Path(prepared["store"])
    assert (store / "train.ids").stat().st_size == 2 * prepared["train"]["tokens"]  # uint16 ids (vocab 8192)
    assert prepared["train"]["rows"] == prepared["train"]["tokens"] // figures["seq_len"]
    assert figures["big_rows"] == prepared["train"]["rows"] > figures["tiny_rows"] > 0

    # memory: preparation under 2 GiB, a training rank's growth with the corpus under 100 MB
    assert prepared["vm_hwm"] < 2 * GiB and prepared["children_ru_maxrss"] < 2 * GiB, prepared
    assert len(figures["rank_growth"]) == 2
    assert all(growth < 100e6 for growth in figures["rank_growth"]), figures["rank_growth"]
    assert figures["tokenizer_alone"]["tokens"] > 0 and figures["tokenizer_alone"]["seconds"] > 0
    assert figures["read_probe"]["rows"] >= 8000 and figures["read_probe"]["points"]
    assert all(math.isfinite(rank["loss"]) for rank in figures["ranks_big"] + figures["ranks_tiny"])
