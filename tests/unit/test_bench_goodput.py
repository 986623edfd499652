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


def test_the_stall_summary_splits_the_first_the_mid_run_and_the_last_checkpoint():
    run = {"writer": "decoupled", "stalls": {6: 0.9, 2: 3.0, 4: 0.1}, "tokens_per_s": [100.0, 300.0, 200.0]}
    assert goodput.stall_summary(run) == {"writer": "decoupled", "checkpoints": 3, "first_s": 3.0, "mid_s": 0.1,
                                          "last_s": 0.9, "tokens_per_s": 200.0}


def test_the_stall_table_has_a_row_per_writer_and_their_ratios():
    sync = {"writer": "sync", "checkpoints": 6, "first_s": 2.0, "mid_s": 2.0, "last_s": 2.0, "tokens_per_s": 900.0}
    decoupled = {**sync, "writer": "decoupled", "first_s": 4.0, "mid_s": 0.25, "last_s": 2.0, "tokens_per_s": 1000.0}
    lines = goodput.stall_table([sync, decoupled]).splitlines()
    assert len(lines) == 5 and all(line.count("|") == 7 for line in lines)
    assert lines[3] == "| decoupled | 6 | 4.000 | 0.250 | 2.000 | 1000 |"
    assert lines[4] == "| sync / decoupled | | 0.5x | 8.0x | 1.0x | 0.90x |"
