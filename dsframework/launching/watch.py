"""`dsf launch --launcher pdsh` watches deepspeed's runner and stops the whole job when one node fails.

    code = watch_runner(["deepspeed", "--hostfile", "H", "--launcher", "pdsh", ..., "dsf", "train", "run.yaml"],
                        env=os.environ, hosts=["node0", "node1"], world_info=hostfile.world_info(active))

pdsh waits for every node: when a rank dies on one node, that node's launcher stops its ranks and
exits, pdsh prints `pdsh@here: node1: ssh exited with exit code 137` and goes on waiting for the
others, whose ranks may sit in a collective until its timeout (minutes) -- the job neither
finishes nor fails (DeepSpeed issues #4907, #1722). dsf reads the runner's output as it passes
it on (pdsh puts `host: ` before each line a node prints) and, at the first node that exits
non-zero, waits a moment for the other nodes' lines, prints one line naming the node and the
cause (the rank watcher's `dsf: rank N ... was killed by SIGKILL`, a `dsf: error:` line, ssh's
complaint, a Python exception, else that node's last line), and stops the job: SIGTERM to
deepspeed's runner (which interrupts pdsh and runs its own `pkill` on every node), then a sweep
that kills what is left of this job's per-node launchers on every node (their ranks follow: a
rank watcher dies with its launcher, a rank with its watcher).
"""
from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dsframework.protocol.exits import stop_signals

NODE_EXIT = re.compile(r"^pdsh@[^:\s]+: (?P<host>[^:\s]+): ssh exited with exit code (?P<code>\d+)")
NODE_LINE = re.compile(r"^(?:pdsh@[^:\s]+: )?(?P<host>[^:\s]+): (?P<text>.*\S)")
# The most telling line a failed node printed, best first.
CAUSES = (re.compile(r"dsf: rank \d+ .*(killed by|died|hung)"), re.compile(r"^dsf: error: "),
          re.compile(r"^ssh: |Connection refused|Permission denied|Could not resolve|No route to host"),
          re.compile(r"No such file or directory|command not found|does not exist"),
          re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b"))
# A rank that lost its peer: a symptom of another node's failure, telling less than any cause.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash|remote process exited")
GRACE_S = 3.0  # after the first failed node: time for the others' lines (the cause may be elsewhere)
STOP_S = 20.0  # deepspeed's runner gets this long to stop pdsh and run its pkill
# After a stop signal: the ranks' checkpoint and exit (DeepSpeed's per-node launcher kills its ranks
# 30 s after it passed the signal on), then what is left is killed: nothing of the job past ~50 s.
STOP_GRACE_S = 45.0


@dataclass
class NodeFailure:
    host: str
    code: int
    cause: str

    def line(self) -> str:
        return f"{self.host} failed (exit {self.code}): {self.cause}"


class NodeLines:
    """What each node printed, kept short: the lines that can name a cause, and the last line.
    `local`: one node started here, whose lines carry no `host: ` prefix (all are its own)."""

    def __init__(self, hosts: list[str], *, local: bool = False) -> None:
        self.hosts, self.local = set(hosts), local
        self.telling: dict[str, list[tuple[int, str]]] = {}
        self.last: dict[str, str] = {}

    def add(self, line: str) -> tuple[str, int] | None:
        """Record `line`; (host, code) when it says a node exited non-zero."""
        exited = NODE_EXIT.match(line)
        if exited:
            code = int(exited["code"])
            return (exited["host"], code) if code else None
        match = NODE_LINE.match(line)
        if self.local and line.strip():
            host, text = next(iter(self.hosts)), line.strip()
        elif match and match["host"] in self.hosts:
            host, text = match["host"], match["text"].strip()
        else:
            return None
        self.last[host] = text
        rank = len(CAUSES) if PEER_LOST.search(text) else next(
            (i for i, pattern in enumerate(CAUSES) if pattern.search(text)), None)
        if rank is not None:
            self.telling.setdefault(host, []).append((rank, text))
        return None

    def cause(self, host: str) -> tuple[int, str]:
        """(rank of the cause, its text) for `host`: the best kind, the latest of that kind."""
        lines = self.telling.get(host, [])
        if lines:
            best = min(rank for rank, _ in lines)
            return best, [text for rank, text in lines if rank == best][-1]
        return len(CAUSES), self.last.get(host, "it printed nothing")

    def blame(self, failed: dict[str, int]) -> NodeFailure:
        """The node whose cause tells most (the first to fail among equals): a failed node, or one
        whose rank watcher saw a rank die. srun stops every task when the first one exits, and that
        may be a peer's (`Connection closed by peer`): the node of the killed rank then never
        counts as failed, yet it is the one to blame, and to leave out after its second failure."""
        suspects = dict(failed)  # dicts keep the order nodes failed in
        for host in self.telling:
            if host not in suspects and self.cause(host)[0] == 0:
                suspects[host] = next(iter(failed.values()))  # the step's code: its own was not reported
        host = min(suspects, key=lambda h: self.cause(h)[0])
        cause = self.cause(host)[1]
        if cause.startswith("dsf: error: "):
            cause = cause[len("dsf: error: "):]
        return NodeFailure(host, suspects[host], cause)


@dataclass
class Outcome:
    """How a watched job ended: its exit code, and the node that failed (None: it finished, or was
    stopped by a signal to dsf launch, `stopped`)."""

    code: int
    failure: NodeFailure | None = None
    stopped: bool = False


def watch_runner(argv: list[str], *, env: Mapping[str, str], hosts: list[str], world_info: str) -> int:
    """Run deepspeed's pdsh runner, passing its output on; its exit code, or non-zero when a node failed."""
    return watch_job(argv, env=env, hosts=hosts, world_info=world_info).code


def watch_job(argv: list[str], *, env: Mapping[str, str], hosts: list[str], world_info: str,
              local: bool = False) -> Outcome:
    """`watch_runner`'s Outcome. `local`: deepspeed runs one node here (no pdsh): its exit code is
    the job's, and the telling line of its output names the cause (`dsf launch --max-restarts`)."""
    env = {**env, "PYTHONUNBUFFERED": "1"}  # the runner's own lines in order with pdsh's
    runner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                              errors="replace", bufsize=1, start_new_session=True)
    stop = JobStop(runner, local=local, sweep=None if local else (env, hosts, world_info))
    old = {sig: signal.signal(sig, stop.forward) for sig in stop_signals()}
    lines: "queue.Queue[str | None]" = queue.Queue()
    threading.Thread(target=_pump, args=(runner, lines), daemon=True).start()
    nodes, failed = NodeLines(hosts, local=local), {}
    deadline = None
    try:
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:  # the runner closed its output: it is done
                break
            exited = nodes.add(line) if line else None
            if exited and exited[0] not in failed and not stop.signum:  # (stopping: every node exits so)
                failed[exited[0]] = exited[1]
                deadline = deadline or time.monotonic() + GRACE_S
            if stop.overdue() or (deadline is not None and time.monotonic() > deadline):
                break
        if failed and not stop.signum:
            _drain(lines, nodes, failed)
            failure = nodes.blame(failed)
            print(f"dsf: error: {failure.line()}; stopping the job on every node", file=sys.stderr, flush=True)
            _stop(runner, env, hosts, world_info)
            return Outcome(failure.code if 0 < failure.code < 256 else 1, failure)
        if stop.overdue():
            stop.kill()  # the grace is over: whatever is left of the job, on every node
        code = runner.wait()
        code = code if code >= 0 else 128 - code
        if code and local and not stop.signum:
            return Outcome(code, nodes.blame({hosts[0]: code}))
        return Outcome(code, stopped=bool(stop.signum))
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if runner.poll() is None:
            _kill_group(runner)


class JobStop:
    """How `dsf launch` ends the job it watches on SIGINT, SIGTERM or SIGHUP, and when someone else
    signals deepspeed's runner (which ends it at once, and leaves its per-node launchers running).

    The signal goes to every process of the job: on one node, to the runner's process group (the
    runner, DeepSpeed's per-node launcher, which passes it on to each rank's tree as SIGTERM, and
    the ranks: `local`); across nodes with pdsh, SIGTERM to every node's per-node launcher by dsf's
    own `sweep` over pdsh (signalled, deepspeed's runner would abort pdsh, and the closing ssh
    sessions would end the ranks before they save); with srun, SIGTERM to srun, which signals every
    task of its step. The ranks agree on a step, save a checkpoint and exit; after STOP_GRACE_S what
    is left is killed, everywhere.

        stop = JobStop(runner, local=True)      # sweep=(env, hosts, world_info) across nodes
        signal.signal(signal.SIGTERM, stop.forward)
        ... each poll: if stop.overdue(): stop.kill()
    """

    def __init__(self, runner: subprocess.Popen, *, local: bool,
                 sweep: tuple[Mapping[str, str], list[str], str] | None = None) -> None:
        self.runner, self.local, self.sweep = runner, local, sweep
        self.name = Path(str(runner.args[0] if isinstance(runner.args, list) else runner.args)).name  # for the one line
        self.signum: int | None = None  # the first stop signal, dsf launch's or the runner's
        self.deadline = 0.0

    def forward(self, signum: int, frame: object = None) -> None:
        if self.signum is None:
            self.signum, self.deadline = signum, time.monotonic() + STOP_GRACE_S
        if self.sweep is not None:  # pdsh across nodes: SIGTERM to every node's per-node launcher, which passes
            _sweep(*self.sweep, kill=False)  # it on to its ranks. (Not to deepspeed's runner: it aborts pdsh,
            return                           # whose ssh sessions close and take the ranks down unsaved.)
        if not self.local and self.runner.poll() is None:
            self.runner.send_signal(signal.SIGTERM)  # (srun signals every task of its step)
            return
        _signal_group(self.runner, signum)

    def overdue(self) -> bool:
        """Past the grace after a stop signal. A runner found dead of a signal it was sent by
        someone else (not by dsf: it would have been forwarded) starts the stop as SIGTERM."""
        code = self.runner.poll()
        if self.signum is None and code is not None and code < 0:
            print(f"dsf: {self.name} (pid {self.runner.pid}) was killed by "
                  f"{signal.Signals(-code).name}; stopping the job on every node", file=sys.stderr, flush=True)
            self.forward(signal.SIGTERM)
        return self.signum is not None and time.monotonic() > self.deadline

    def kill(self) -> None:
        _kill_group(self.runner)
        if self.sweep is not None:
            _sweep(*self.sweep, kill=True)

    def wait(self) -> int:
        """The runner's exit code (128 + N for signal N), killing the job once the grace is over."""
        while True:
            try:
                code = self.runner.wait(timeout=0.5)
                return code if code >= 0 else 128 - code
            except subprocess.TimeoutExpired:
                if self.overdue():
                    self.kill()


SRUN_NODE = "dsf-node: "  # the first line each srun task prints: `dsf-node: $SLURMD_NODENAME`
SRUN_TASK_LINE = re.compile(r"^\s*(?P<task>\d+): (?P<text>.*)$")  # srun --label (padded past 9 tasks)
SRUN_TASK_END = re.compile(r"^srun: error: (?P<host>[^:\s]+): tasks? [\d,-]+: (?P<how>.*)$")
SRUN_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<host>[^:\s]+)")


class SrunLines:
    """srun's --label output as `host: text` lines for NodeLines: each task first says which node
    it runs on (SRUN_NODE); srun's own `srun: error: node1: task 1: Exited with exit code 3` (or
    `Node failure on node1`) says which node ended, in the order they did."""

    def __init__(self, nodes: NodeLines) -> None:
        self.nodes, self.host_of = nodes, {}

    def add(self, line: str) -> tuple[str, int] | None:
        ended = SRUN_TASK_END.match(line) or SRUN_NODE_FAILURE.match(line)
        if ended and ended["host"] in self.nodes.hosts:
            how = ended.groupdict().get("how") or "node failure"
            self.nodes.add(f"{ended['host']}: {line}")
            code = re.search(r"exit code (\d+)", how)
            return ended["host"], int(code.group(1)) if code else 1
        labelled = SRUN_TASK_LINE.match(line)
        if labelled is None:
            return None
        task, text = int(labelled["task"]), labelled["text"]
        if text.startswith(SRUN_NODE):
            self.host_of[task] = text[len(SRUN_NODE):].strip()
        elif task in self.host_of:
            self.nodes.add(f"{self.host_of[task]}: {text}")
        return None


def watch_srun(argv: list[str], *, env: Mapping[str, str], hosts: list[str]) -> Outcome:
    """Run an `srun --label --kill-on-bad-exit` job step to its end (srun stops the other tasks when
    one fails), passing its output on; its Outcome names the node that failed first with its most
    telling line (`dsf launch --launcher slurm --max-restarts`)."""
    env = {**env, "PYTHONUNBUFFERED": "1"}
    srun = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace", bufsize=1)
    stop = JobStop(srun, local=False)  # SIGTERM to srun signals every task (one SIGINT only reports)
    old = {sig: signal.signal(sig, stop.forward) for sig in stop_signals()}
    lines: "queue.Queue[str | None]" = queue.Queue()
    threading.Thread(target=_pump, args=(srun, lines), daemon=True).start()
    nodes = NodeLines(hosts)
    tasks, failed = SrunLines(nodes), {}
    try:
        while (line := lines.get()) is not None:
            ended = tasks.add(line)
            if ended and ended[0] not in failed:
                failed[ended[0]] = ended[1]
        code = stop.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if code == 0 or stop.signum or not failed:
        return Outcome(code, stopped=bool(stop.signum))
    failure = nodes.blame(failed)
    print(f"dsf: error: {failure.line()}; srun stopped the job step on every node", file=sys.stderr, flush=True)
    return Outcome(code, failure)


def _pump(proc: subprocess.Popen, out: "queue.Queue[str | None]") -> None:
    """Pass every line on to our stdout as it comes, and to the watcher."""
    assert proc.stdout is not None  # both callers start it with stdout=PIPE
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        out.put(line.rstrip("\n"))
    out.put(None)


def _drain(lines: "queue.Queue[str | None]", nodes: NodeLines, failed: dict[str, int]) -> None:
    """Whatever is already read: more nodes' last words before choosing the cause."""
    while True:
        try:
            line = lines.get_nowait()
        except queue.Empty:
            return
        if line is None:
            return
        exited = nodes.add(line)
        if exited and exited[0] not in failed:
            failed[exited[0]] = exited[1]


def _stop(runner: subprocess.Popen, env: Mapping[str, str], hosts: list[str], world_info: str) -> None:
    """deepspeed's teardown (SIGTERM: pdsh interrupted, `pkill -f` of its launchers on every node),
    then a sweep that kills this job's launchers wherever they are still running."""
    runner.send_signal(signal.SIGTERM)
    try:
        runner.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        _kill_group(runner)
    _sweep(env, hosts, world_info, kill=True)


def _sweep(env: Mapping[str, str], hosts: list[str], world_info: str, *, kill: bool) -> None:
    """SIGTERM to this job's per-node launchers on every node (they pass it on to their ranks, which
    checkpoint); `kill`: 2 s later, SIGKILL to those still there (their ranks die with them)."""
    # The launcher's own command line only: anchored at its python (the ssh session's `bash -c "cd ...;
    # python -u -m deepspeed.launcher.launch ..."` that pdsh started, and this sweep's own shell, hold
    # the same words; a TERM to that shell would close the session and end the ranks before they save).
    # "[d]" keeps the pattern from matching itself; base64 holds no other regex character.
    pattern = shlex.quote(f"^[^ ]*python[^ ]* -u -m [d]eepspeed[.]launcher[.]launch --world_info={world_info}")
    command = f"pkill -TERM -f {pattern}; " + (f"sleep 2; pkill -KILL -f {pattern}; " if kill else "") + "true"
    sweep = ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), command]
    try:
        subprocess.run(sweep, env={**env, "PDSH_RCMD_TYPE": "ssh"}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        print("dsf: warning: could not sweep the nodes for left-over processes of the job", file=sys.stderr)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """`signum` to every process of `proc`'s group (started with start_new_session: it leads one), even
    after `proc` itself is gone."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and pdsh (same session)
    except ProcessLookupError:
        pass
    proc.wait()
