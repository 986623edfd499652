"""The namespace nodes are what the other cluster tests take them for: separate hosts by name,
reachable from each other over ssh with the test's key only, on addresses that exist nowhere
outside the namespaces, started quickly."""
from __future__ import annotations

import subprocess

import pytest

from tests.cluster.nodes import SUBNET

pytestmark = pytest.mark.timeout(120)


def test_nodes_are_separate_hosts_joined_over_ssh(cluster):
    assert cluster.start_seconds < 20, f"the nodes took {cluster.start_seconds:.1f} s to start"
    root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    assert f"inet {SUBNET}." not in root, "the nodes' addresses exist only inside their namespaces"
    assert not any(cluster.namespaces[0] in line for line in root.splitlines())
    for k, name in enumerate(cluster.names):
        assert cluster.run(k, ["hostname"]).stdout.strip() == name
        addrs = cluster.run(k, ["ip", "-o", "-4", "addr", "show", "eth0"]).stdout
        assert f"inet {cluster.addrs[k]}/24" in addrs, addrs
        for other in cluster.names:  # by name, host key checked, the test's key: as pdsh and mpirun use it
            proc = cluster.run(k, ["ssh", "-o", "BatchMode=yes", other, "hostname"], timeout=30)
            assert (proc.returncode, proc.stdout.strip()) == (0, other), proc.stderr
