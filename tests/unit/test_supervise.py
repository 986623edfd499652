"""The rank watcher's process plumbing: how a rank that ran collectives leaves (supervise.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dsframework.launching.supervise import under_launcher

EXIT = "from dsframework.launching.supervise import exit_process; import sys; {body}"


def run_python(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", EXIT.format(body=body)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("code, want", [(0, 0), (3, 3), (None, 0), (143, 143)])
@pytest.mark.distributed
def test_exit_process_keeps_the_code_and_flushes_piped_output(code, want):
    # Piped stdout is block-buffered: without the flush, os._exit would drop both lines.
    proc = run_python(f"print('out', end=''); print('err', file=sys.stderr, end=''); exit_process({code!r})")
    assert (proc.returncode, proc.stdout, proc.stderr) == (want, "out", "err")


@pytest.mark.distributed
def test_exit_process_with_a_message_prints_it_and_exits_1():
    proc = run_python("exit_process('dsf: stopped')")
    assert (proc.returncode, proc.stderr.strip()) == (1, "dsf: stopped")


def test_only_train_under_a_launcher_is_watched(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("DSF_RANK_TRAINER", raising=False)
    assert under_launcher(["train", "run.yaml"])
    assert not under_launcher(["export", "ckpt", "out"])
    monkeypatch.setenv("DSF_RANK_TRAINER", "1")  # the trainer child itself
    assert not under_launcher(["train", "run.yaml"])
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("DSF_RANK_TRAINER")
    assert not under_launcher(["train", "run.yaml"])


def test_sigterm_is_always_a_stop_signal_and_an_inherited_ignore_of_the_others_is_kept():
    """dsf's srun line starts deepspeed's runner with SIGTERM ignored (every process below inherits
    it): the ranks must still checkpoint on it. `nohup`'s SIGHUP and a background SIGINT stay ignored."""
    import signal

    from dsframework.protocol.exits import stop_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        for sig in before:
            signal.signal(sig, signal.SIG_IGN)
        assert stop_signals() == (signal.SIGTERM,)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert set(stop_signals()) == {signal.SIGTERM, signal.SIGINT}
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
