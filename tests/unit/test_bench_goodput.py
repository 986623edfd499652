"""bench/goodput.py's pure parts (its runs need the namespaced nodes: the benchmark reports them):
the by-hand counterfactual adds a person's reaction per restart and the collective's timeout per
hang to the same timeline, and the table shows each interval's split and both ETTRs."""
from __future__ import annotations

import importlib.util

import pytest

from tests.distributed.launcher import REPO

spec = importlib.util.spec_from_file_location("bench_goodput", REPO / "bench" / "goodput.py")
goodput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(goodput)

MEASURED = {"total_s": 200.0, "startup_s": 20.0, "restarting_s": 30.0, "lost_s": 15.0, "checkpoint_s": 5.0,
            "training_s": 130.0, "ettr": 0.65, "restarts": 2, "per_restart": []}


def test_by_hand_adds_the_reaction_per_restart_and_the_collective_timeout_per_hang():
    hand = goodput.by_hand(MEASURED, hangs=1)
    assert hand["total_s"] == 200.0 + 2 * goodput.REACTION_S + goodput.HANG_BY_HAND_S - goodput.HANG_TIMEOUT
    assert hand["ettr"] == pytest.approx(130.0 / hand["total_s"]) and hand["ettr"] < MEASURED["ettr"]
    assert goodput.by_hand({**MEASURED, "restarts": 0}, hangs=0) == {"total_s": 200.0, "ettr": 0.65}


def test_the_table_has_a_row_per_interval():
    rows = [{"every": every, "steps": 120, "goodput": MEASURED, "by_hand": goodput.by_hand(MEASURED, hangs=1),
             "stall_s": 0.5} for every in (10, 40)]
    lines = goodput.table(rows).splitlines()
    assert len(lines) == 4 and all(line.count("|") == 14 for line in lines)
    assert lines[2] == "| 10 | 120 | 2 | 200 | 130 | 20 | 30 | 15 | 5.0 | 0.50 | 22 / 1218 | 0.650 | 0.050 |"
