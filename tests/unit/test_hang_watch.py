"""Hang detection (faults.hang_timeout): the heartbeat a trainer writes and its watcher reads
(protocol/heartbeat.py), the limits each phase gets (train/hang.py), and the watcher's verdict on a
real child process that stops beating (launching/supervise.py): a stopped process is named at its
limit, a running one HANG_GRACE_S later, a beating one never. The cluster test (tests/cluster/
test_failures.py) stops a rank of a real two-node job."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from dsframework.config import build_run_config
from dsframework.errors import UserError
from dsframework.launching import supervise
from dsframework.protocol.heartbeat import ENV, Beat, Pulse
from dsframework.train.hang import AUTO_MIN_S, LONG_MIN_S, HangWatch


@pytest.fixture
def pulse():
    pulse = Pulse.create()
    yield pulse
    pulse.close()


def test_a_beat_is_read_back_and_a_stall_measured_from_it(pulse):
    assert pulse.read() == ("start-up", 0, 0.0, 0.0) and pulse.stalled() is None  # limit 0: not watched
    beat = Beat(str(pulse.path))
    beat.beat("backward", step=7, limit=30.0)
    phase, step, when, limit = pulse.read()
    assert (phase, step, limit) == ("backward", 7, 30.0) and abs(when - time.monotonic()) < 5
    assert pulse.stalled() is None
    stall = pulse.stalled(now=when + 31)
    assert (stall.phase, stall.step, stall.limit) == ("backward", 7, 30.0) and stall.seconds == pytest.approx(31)
    assert stall.describe() == "no progress for 31 s in the backward of step 7 (limit 30 s)"
    beat.beat("forward")  # step and limit carry over
    assert pulse.read()[:2] == ("forward", 7)
    beat.beat("done", limit=0.0)
    assert pulse.stalled(now=when + 1e6) is None
    Beat(None).beat("forward", step=1, limit=1.0)  # no watcher: nothing to write, no error


def test_a_record_caught_mid_write_is_not_read(pulse):
    beat = Beat(str(pulse.path))
    beat.beat("forward", step=3, limit=10.0)
    beat._seq += 1  # a writer that stopped between its two sequence numbers
    pulse._map[0:8] = beat._seq.to_bytes(8, "little")
    assert pulse.read() is None and pulse.stalled() is None


def test_limits_per_phase():
    fixed = HangWatch(20.0, beat=Beat(None))
    assert fixed.limit("forward") == LONG_MIN_S  # the first step: kernels, caches, allocators warm up
    fixed.step_done(seconds=50.0)  # not a step time: the first step of the session
    assert not fixed.recent and fixed.limit("forward") == 20.0 and fixed.limit("data") == 20.0
    assert fixed.limit("checkpoint") == fixed.limit("eval") == LONG_MIN_S and fixed.limit("done") == 0
    fixed.compiled()
    assert fixed.limit("backward") == LONG_MIN_S
    auto = HangWatch("auto", beat=Beat(None))
    auto.step_done(seconds=100.0)
    assert auto.limit("forward") == LONG_MIN_S  # no step time yet
    for seconds in (2.0, 9.0, 8.0):
        auto.step_done(seconds=seconds)
    assert auto.limit("forward") == 10 * 8.0 and auto.limit("eval") == max(LONG_MIN_S, 800.0)
    quick = HangWatch("auto", beat=Beat(None))
    for seconds in (1.0, 0.2, 0.3):
        quick.step_done(seconds=seconds)
    assert quick.limit("optimizer step") == AUTO_MIN_S
    off = HangWatch(0.0, beat=Beat(None))
    off.step_done(seconds=1.0)
    assert off.limit("forward") == off.limit("checkpoint") == 0.0


def test_a_timeout_below_the_step_time_is_refused_in_one_line():
    with pytest.raises(UserError) as info:
        HangWatch(5.0, beat=Beat(None)).check_setting(7.5)
    assert str(info.value) == ("faults.hang_timeout=5.0: is below the measured step time of 7.5 s: every step would "
                               "count as a hang; set it to at least 75 or to auto")
    HangWatch(10.0, beat=Beat(None)).check_setting(7.5)
    HangWatch("auto", beat=Beat(None)).check_setting(700.0)


@pytest.mark.parametrize("value, want", [("10", 10.0), ("auto", "auto"), ("off", 0.0), ("0", 0.0)])
def test_the_setting(value, want):
    assert build_run_config({}, [f"faults.hang_timeout={value}"]).faults.hang_timeout == want


def test_a_negative_setting_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^faults.hang_timeout=-3: must be positive seconds, auto, or 0 / off"):
        build_run_config({}, ["faults.hang_timeout=-3"])


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from dsframework.protocol.heartbeat import Beat
    beat = Beat.from_env()
    for step in range(1, 4):
        beat.beat("forward", step=step, limit=1.0)
        time.sleep(0.1)
    beat.beat("backward", step=4)
    if sys.argv[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif sys.argv[1] == "stuck":
        time.sleep(60)
    else:
        for _ in range(30):
            beat.beat("forward")
            time.sleep(0.1)
""")


@pytest.mark.distributed  # a child process (stdlib only: under 10 s for the three)
@pytest.mark.parametrize("how, named_after", [("stop", 1.0), ("stuck", 1.0 + supervise.HANG_GRACE_S),
                                              ("beating", None)])
def test_the_watcher_names_and_kills_a_rank_that_stops_beating(pulse, how, named_after, capfd, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    child = subprocess.Popen([sys.executable, "-c", CHILD, how], env={**os.environ, ENV: str(pulse.path)})
    started = time.monotonic()
    code = supervise._wait_watching(child, pulse, stop=lambda signum, frame: child.send_signal(signum))
    took = time.monotonic() - started
    err = capfd.readouterr().err
    if named_after is None:
        assert code == 0 and "hung" not in err
        return
    assert code is None and child.returncode == -9, (code, child.returncode)
    assert named_after + 0.3 < took < named_after + 3 + 2 * supervise.POLL_S, took
    line = next(line for line in err.splitlines() if "hung" in line)
    assert line.startswith("dsf: rank 3 (local rank 1 on ") and f"pid {child.pid}) hung: no progress for " in line
    assert "in the backward of step 4 (limit 1 s)" in line
    assert ("its process is stopped" in line) == (how == "stop")
