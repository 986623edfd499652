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
from typing import Mapping

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
    told: list[int] = []

    def forward(signum: int, frame: object) -> None:  # deepspeed's runner stops pdsh jobs on these
        told.append(signum)
        runner.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
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
            if line:
                exited = nodes.add(line)
                if exited and exited[0] not in failed:
                    failed[exited[0]] = exited[1]
                    deadline = deadline or time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                break
        if failed:
            _drain(lines, nodes, failed)
            failure = nodes.blame(failed)
            print(f"dsf: error: {failure.line()}; stopping the job on every node", file=sys.stderr, flush=True)
            _stop(runner, env, hosts, world_info)
            return Outcome(failure.code if 0 < failure.code < 256 else 1, failure)
        code = runner.wait()
        code = code if code >= 0 else 128 - code
        if code and local and not told:
            return Outcome(code, nodes.blame({hosts[0]: code}))
        return Outcome(code, stopped=bool(told))
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if runner.poll() is None:
            _kill_group(runner)


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
    told: list[int] = []

    def forward(signum: int, frame: object) -> None:  # srun passes them on to every task
        told.append(signum)
        srun.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    lines: "queue.Queue[str | None]" = queue.Queue()
    threading.Thread(target=_pump, args=(srun, lines), daemon=True).start()
    nodes = NodeLines(hosts)
    tasks, failed = SrunLines(nodes), {}
    try:
        while (line := lines.get()) is not None:
            ended = tasks.add(line)
            if ended and ended[0] not in failed:
                failed[ended[0]] = ended[1]
        code = srun.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    code = code if code >= 0 else 128 - code
    if code == 0 or told or not failed:
        return Outcome(code, stopped=bool(told))
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
    # "[d]" so the pattern does not match the remote shell running it; base64 holds no other regex character
    pattern = shlex.quote(f"[d]eepspeed.launcher.launch --world_info={world_info}")
    sweep = ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts),
             f"pkill -TERM -f {pattern}; sleep 2; pkill -KILL -f {pattern}; true"]
    try:
        subprocess.run(sweep, env={**env, "PDSH_RCMD_TYPE": "ssh"}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        print("dsf: warning: could not sweep the nodes for left-over processes of the job", file=sys.stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and pdsh (same session)
    except ProcessLookupError:
        pass
    proc.wait()
