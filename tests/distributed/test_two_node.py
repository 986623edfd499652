"""A real two-node run on one machine gives the same losses as one node with the same world size.

Two Linux network namespaces stand in for two hosts: each holds one end of a veth pair with its
own address (10.213.77.1/30 and .2, which exist only inside the namespaces) and its own `lo`, so
the ranks can reach each other only over the veth. In each namespace a `deepspeed` launcher is
started the way one starts it on a cluster without ssh:

    ip netns exec NS_k deepspeed --hostfile H --no_ssh --node_rank k \\
        --master_addr 10.213.77.1 --master_port P dsf train tiny.yaml --set ...

with H naming both addresses with `slots=1`. That is world size 2 across two "nodes", one rank
each (LOCAL_SIZE=1, so DeepSpeed's per-node shm all-reduce stays off and every collective goes
through gloo over the veth). Gloo picks its interface from the hostname, which resolves to
nothing inside a namespace, so GLOO_SOCKET_IFNAME names the namespace's veth. Both nodes share
one output_dir (same filesystem): rank 0 writes the tokenizer and metrics.jsonl, rank 1 reads the
tokenizer from it. The per-step losses must match a single-node `deepspeed --num_gpus 2` run of
the same config to 1e-5 relative.

Where namespaces cannot be made (not root, no `ip`, `ip netns add` refused) -- or when
DSF_TEST_TWO_NODE_LOOPBACK=1 forces it -- the two launchers run on loopback instead (hostfile
`127.0.0.1 slots=1` / `localhost slots=1`, master 127.0.0.1), which still exercises the
--no_ssh/--node_rank multi-node path; a warning says so. The namespaces, the veth and any process
left in them are removed at teardown, also on failure; a hung launcher fails the test on a
timeout.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest

from tests.distributed.launcher import (BIN, REPO, TINY_YAML, assert_close, free_port, launch, losses,
                                        rank_env, run_overrides)

OVERRIDES = ["train.steps=6"]
ADDRS = ("10.213.77.1", "10.213.77.2")  # a private /30; it lives only inside the namespaces
TIMEOUT = 180  # seconds for the two-node run; a rendezvous or collective hang fails, not blocks
FORCE_LOOPBACK = "DSF_TEST_TWO_NODE_LOOPBACK"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Nodes:
    """Two namespaces joined by a veth pair, or, where they cannot be made, loopback."""

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.namespaces = (f"dsf2n-{tag}-0", f"dsf2n-{tag}-1")
        self.ifnames = (f"dsf{tag}a", f"dsf{tag}b")  # <= 15 characters
        self.made: list[str] = []
        self.fallback_reason = ""

    @property
    def loopback(self) -> bool:
        return bool(self.fallback_reason)

    def up(self) -> None:
        if os.environ.get(FORCE_LOOPBACK) == "1":
            self.fallback_reason = f"{FORCE_LOOPBACK}=1"
        elif os.geteuid() != 0:
            self.fallback_reason = "not root"
        elif shutil.which("ip") is None:
            self.fallback_reason = "no `ip` command"
        else:
            try:
                self._make()
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
                detail = getattr(err, "stderr", "") or err
                self.fallback_reason = f"cannot create network namespaces: {str(detail).strip()}"
                self.down()

    def _make(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self.made.append(ns)
        _ip("link", "add", self.ifnames[0], "type", "veth", "peer", "name", self.ifnames[1])
        for ns, ifname, addr in zip(self.namespaces, self.ifnames, ADDRS):
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", ifname)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", ifname, "up")

    def down(self) -> None:
        """Kill what still runs inside the namespaces, then delete them (which deletes the veth)."""
        for ns in self.made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if self.made:  # in case it never left the root namespace
            subprocess.run(["ip", "link", "del", self.ifnames[0]], capture_output=True, timeout=30)
        self.made.clear()

    def hosts(self) -> tuple[str, str]:
        return ("127.0.0.1", "localhost") if self.loopback else ADDRS

    def command(self, node: int, cmd: list[str]) -> list[str]:
        return cmd if self.loopback else ["ip", "netns", "exec", self.namespaces[node], *cmd]

    def env(self, node: int) -> dict[str, str]:
        return dict(rank_env(), GLOO_SOCKET_IFNAME="lo" if self.loopback else self.ifnames[node])


@pytest.fixture
def nodes():
    two = Nodes()
    try:
        two.up()
        yield two
    finally:
        two.down()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its launch.py and the rank
        except ProcessLookupError:
            pass
    proc.wait()


def run_two_nodes(nodes: Nodes, output_dir: Path, logs: Path) -> dict[int, float]:
    """One `deepspeed --no_ssh --node_rank k` per node, both at once; returns step -> loss."""
    hostfile = logs / "hostfile"
    hostfile.write_text("".join(f"{host} slots=1\n" for host in nodes.hosts()))
    master, port = nodes.hosts()[0], free_port()
    sets = [arg for o in run_overrides(output_dir, OVERRIDES) for arg in ("--set", o)]
    procs, outs = [], []
    try:
        for node in range(2):
            cmd = [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                   "--master_addr", master, "--master_port", str(port),
                   str(BIN / "dsf"), "train", str(TINY_YAML), *sets]
            outs.append(open(logs / f"node{node}.log", "w"))
            procs.append(subprocess.Popen(nodes.command(node, cmd), stdout=outs[-1], stderr=subprocess.STDOUT,
                                          env=nodes.env(node), cwd=REPO, start_new_session=True))
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break  # a hang, or one node failed and the other would wait for it forever
            time.sleep(0.2)
    finally:
        for proc in procs:
            _kill(proc)
        for out in outs:
            out.close()
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        tails = "\n".join(f"--- node {k} (exit {codes[k]}) ---\n{(logs / f'node{k}.log').read_text()[-4000:]}"
                          for k in range(2))
        pytest.fail(f"two-node run failed or hung (>{TIMEOUT}s):\n{tails}")
    return losses(output_dir)


def test_two_nodes_match_one_node(tmp_path, nodes, record_property):
    mode = f"loopback ({nodes.fallback_reason})" if nodes.loopback else "network namespaces + veth"
    record_property("two_node_mode", mode)
    print(f"two-node run over {mode}")
    if nodes.loopback:
        warnings.warn(f"two-node test ran both launchers on loopback, not in network namespaces: "
                      f"{nodes.fallback_reason}")
    else:  # the node addresses exist only inside the namespaces
        host_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
        assert not any(f"inet {addr}/" in host_addrs for addr in ADDRS)

    logs = tmp_path / "logs"
    logs.mkdir()
    started = time.monotonic()
    two_node = run_two_nodes(nodes, tmp_path / "two_node", logs)
    print(f"two-node run: {time.monotonic() - started:.1f}s")

    single_dir = tmp_path / "one_node"
    sets = [arg for o in run_overrides(single_dir, OVERRIDES) for arg in ("--set", o)]
    launch([str(BIN / "dsf"), "train", str(TINY_YAML), *sets], num_ranks=2, timeout=TIMEOUT)
    one_node = losses(single_dir)

    assert sorted(two_node) == list(range(1, 7)), "metrics.jsonl holds each step once"
    assert_close(two_node, one_node, rtol=1e-5, what=f"two nodes ({mode}) vs one node")
