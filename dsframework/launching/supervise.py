"""Each rank of `dsf train` under a launcher runs as a child of a small watcher that names it
when it dies.

    # done by `dsf` itself when RANK is set by a launcher; by hand it would be:
    exit_code = run_rank(["train", "run.yaml"])

DeepSpeed's per-node launcher notices a rank that exited within a second and stops the others,
but a rank killed by a signal (the kernel's OOM killer, `kill -9`, a segfault) prints nothing,
and the launcher's own message shows the command of the last rank it started, not the one that
failed. The watcher imports nothing heavy, waits for its trainer, and when the trainer dies by a
signal it prints which rank, host and pid died and how, then exits 128 + signal so the launcher
tears the job down. The trainer gets SIGKILL if the watcher itself is killed (no orphans), what
the trainer leaves behind when it dies (a checkpoint writer process) is ended with it, and
SIGTERM/SIGINT/SIGHUP reach the trainer, which checkpoints on each (train/guards.py StopRequest).

A launcher must not outlive the job it was started for: SIGTERM, SIGINT or SIGHUP to `deepspeed`'s
runner (what `kill`, a supervisor or a scheduler sends to the pid it knows) ends the runner at once
and leaves DeepSpeed's per-node launcher running, orphaned, with its ranks. The watcher notices
(the per-node launcher's parent changed: `LauncherWatch`) and stops its trainer as SIGTERM would: a
checkpoint, then an exit, which ends the per-node launcher and, through the lost peers' collective,
every node.

The watcher also reads the trainer's heartbeat (protocol/heartbeat.py, faults.hang_timeout): a
trainer that makes no progress for longer than its phase allows (stuck in a collective, stopped,
deadlocked) is named -- rank, host, phase, step -- and killed, and the watcher exits HUNG_EXIT, so
the launcher stops the job within seconds instead of at the collective's timeout (30 minutes). The
rank to blame is the one that stopped first: its peers stall a moment later, waiting for it in the
next collective. A stopped process (SIGSTOP, a frozen node) is named at its limit; a running one
HANG_GRACE_S later, which lets the stopped rank's own watcher speak first.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from typing import Callable, NoReturn

from dsframework.protocol.exits import stop_signals
from dsframework.protocol.heartbeat import ENV as HEARTBEAT_ENV
from dsframework.protocol.heartbeat import Pulse, Stall

CHILD_MARK = "DSF_RANK_TRAINER"  # set in the trainer's environment: it is the rank, not the watcher
HUNG_EXIT = 124  # a rank the watcher found hung (timeout(1)'s code for a command that ran out of time)
HANG_GRACE_S = 5.0  # a running rank past its limit waits this much longer (see the module docstring)
POLL_S = 1.0
HINTS = {signal.SIGKILL: " (out of memory? see `dmesg`; or killed by hand)", signal.SIGSEGV: " (a crash in native code)"}


def under_launcher(argv: list[str]) -> bool:
    """True for `dsf train` started by a launcher (RANK set) and not yet watched."""
    return bool(argv) and argv[0] == "train" and "RANK" in os.environ and CHILD_MARK not in os.environ


def _die_with_parent() -> None:  # runs in the child between fork and exec
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _adopt_orphans() -> None:
    """Make this watcher the subreaper of its trainer's descendants: what the trainer started and left
    behind when it died (DeepSpeed's decoupled checkpoint writer, which would wait for work forever)
    becomes the watcher's child, for `_end_orphans`."""
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def _parent_of(pid: int | str) -> int | None:
    """`pid`'s parent, from /proc; None when it is gone (or there is no /proc)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


class LauncherWatch:
    """Whether this rank's launcher (DeepSpeed's per-node launcher, the watcher's parent) has lost its
    own parent -- the `deepspeed` runner, or the ssh session pdsh started it in -- since the watcher
    started: the job was signalled there, and nothing will stop this node's ranks but themselves.

        launcher = LauncherWatch()
        if launcher.orphaned(): stop the trainer (once: it answers True once)
    """

    def __init__(self) -> None:
        self.launcher = os.getppid()
        self.parent = _parent_of(self.launcher)
        self.told = self.parent in (None, 0, 1)  # nothing to watch: started by init, or no /proc

    def orphaned(self) -> bool:
        if self.told:
            return False
        now = _parent_of(self.launcher)
        self.told = now is not None and now != self.parent  # (gone: PR_SET_PDEATHSIG ends this watcher)
        return self.told


def _end_orphans() -> None:
    """SIGKILL and reap the watcher's children still alive once its trainer has exited."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _parent_of(entry) == me:
            try:
                os.kill(int(entry), signal.SIGKILL)
                os.waitpid(int(entry), 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def run_rank(argv: list[str]) -> int:
    """Run `dsf ARGV` as this rank's trainer; its exit code, or 128 + the signal that killed it."""
    if sys.platform == "linux":  # a launcher killed in a teardown (dsf launch's sweep) takes its ranks along
        _die_with_parent()
        _adopt_orphans()
    pulse = Pulse.create()
    try:
        child = subprocess.Popen([sys.executable, "-m", "dsframework.commands.cli", *argv],
                                 env={**os.environ, CHILD_MARK: "1", HEARTBEAT_ENV: str(pulse.path)},
                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        told_to_stop: list[int] = []

        def forward(signum: int, frame: object) -> None:
            told_to_stop.append(signum)
            child.send_signal(signum)

        for signum in stop_signals():  # (one the job was started with ignored, nohup's SIGHUP, stays so)
            signal.signal(signum, forward)
        code = _wait_watching(child, pulse, stop=forward)
    finally:
        pulse.close()
        if sys.platform == "linux":
            _end_orphans()
    if code is None:
        return HUNG_EXIT
    if code >= 0:
        return code
    sig = signal.Signals(-code)
    if not told_to_stop:  # not part of a shutdown the launcher or the user started: a rank died
        print(f"dsf: rank {os.environ.get('RANK')} (local rank {os.environ.get('LOCAL_RANK', '?')} on "
              f"{socket.gethostname()}, pid {child.pid}) was killed by {sig.name}{HINTS.get(sig, '')}; "
              f"the launcher stops the other ranks", file=sys.stderr, flush=True)
    return 128 + sig.value


def _wait_watching(child: subprocess.Popen, pulse: Pulse, *, stop: Callable[[int, object], None]) -> int | None:
    """The trainer's exit code, or None once it was found hung, named and killed. `stop(SIGTERM, None)`
    when the launcher is found orphaned (LauncherWatch)."""
    launcher = LauncherWatch()
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if launcher.orphaned():
            if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node
                print(f"dsf: the launcher of this node's ranks (pid {launcher.launcher}) lost its parent (pid "
                      f"{launcher.parent}: the `deepspeed` runner, or pdsh's ssh session, was stopped); stopping "
                      f"the job on {socket.gethostname()} as for SIGTERM (a checkpoint, then an exit)",
                      file=sys.stderr, flush=True)
            stop(signal.SIGTERM, None)
        stall = pulse.stalled()
        if stall is None:
            continue
        stopped = _is_stopped(child.pid)
        if not stopped and stall.seconds < stall.limit + HANG_GRACE_S:
            continue
        _name_hung_rank(child.pid, stall, stopped=stopped)
        child.kill()  # SIGKILL: a stopped or stuck process handles nothing else
        child.wait()
        return None


def _is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (state T or t: SIGSTOP, SIGTSTP, a debugger)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("T", "t")


def _name_hung_rank(pid: int, stall: Stall, *, stopped: bool) -> None:
    print(f"dsf: rank {os.environ.get('RANK')} (local rank {os.environ.get('LOCAL_RANK', '?')} on "
          f"{socket.gethostname()}, pid {pid}) hung: {stall.describe()}"
          + ("; its process is stopped (SIGSTOP, or a frozen node)" if stopped else "")
          + "; killing it, the launcher stops the other ranks (faults.hang_timeout)", file=sys.stderr, flush=True)


def exit_process(code: int | str | None = 0) -> NoReturn:
    """End a process that ran collectives with exit `code`, skipping the interpreter's teardown.

        shutdown_distributed()   # dsframework.train.world: every rank leaves the group together
        exit_process(0)

    destroy_process_group leaves gloo's worker threads and rank 0's TCP store thread running
    while DeepSpeed's engine (reference cycles, collected only at teardown) still holds its
    groups; the teardown then destroys them in no set order, and now and then a std::thread goes
    joinable: a rank that trained and saved everything dies with `terminate called without an
    active exception` (SIGABRT) and fails the launch (about 1 launch in 20 with ZeRO-2 offload
    here). Whatever dsf writes is closed by the time this runs; stdout and stderr are flushed.
    """
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): the message, exit 1
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it anyway
            pass
    os._exit(code)
