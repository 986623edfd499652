"""The pdsh watcher names the node that failed and why, from the lines pdsh passes on.

The lines below are the shapes pdsh and dsf print (`pdsh@HERE: HOST: ssh exited with exit code N`,
`HOST: <a line the node printed>`); the cluster tests (tests/cluster) run the real thing.
"""
from dsframework.launching.watch import NodeLines

HOSTS = ["node0", "node1"]


def feed(lines: list[str]) -> tuple[NodeLines, dict[str, int]]:
    nodes, failed = NodeLines(HOSTS), {}
    for line in lines:
        exited = nodes.add(line)
        if exited:
            failed.setdefault(*exited)
    return nodes, failed


def test_the_killed_rank_is_blamed_even_when_another_node_failed_first():
    nodes, failed = feed([
        "node0: train: 10%|#  | 1/10",
        "node1: dsf: rank 3 (local rank 1 on node1, pid 4242) was killed by SIGKILL (out of memory? see `dmesg`; "
        "or killed by hand); the launcher stops the other ranks",
        "node0: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "pdsh@node0: node0: ssh exited with exit code 1",
        "pdsh@node0: node1: ssh exited with exit code 137",
    ])
    assert failed == {"node0": 1, "node1": 137}
    failure = nodes.blame(failed)
    assert (failure.host, failure.code) == ("node1", 137) and "rank 3" in failure.cause and "SIGKILL" in failure.cause
    assert "\n" not in failure.line()


def test_ssh_refusal_and_a_missing_venv_are_named():
    nodes, failed = feed(["pdsh@node0: node1: ssh: connect to host node1 port 22: Connection refused",
                          "pdsh@node0: node1: ssh exited with exit code 255"])
    assert nodes.blame(failed).line() == "node1 failed (exit 255): ssh: connect to host node1 port 22: Connection refused"
    nodes, failed = feed(["node1: bash: line 1: /work/main/.venv/bin/python: No such file or directory",
                          "pdsh@node0: node1: ssh exited with exit code 127"])
    assert "No such file or directory" in nodes.blame(failed).cause


def test_dsf_errors_lose_their_prefix_and_a_clean_exit_is_no_failure():
    nodes, failed = feed(["node0: dsf: error: data.dataset='x': does not exist; fix it",
                          "pdsh@node0: node0: ssh exited with exit code 2",
                          "pdsh@node0: node1: ssh exited with exit code 0"])
    assert failed == {"node0": 2} and nodes.blame(failed).cause == "data.dataset='x': does not exist; fix it"


def test_a_silent_node_is_still_named():
    nodes, failed = feed(["pdsh@node0: node1: ssh exited with exit code 9"])
    assert nodes.blame(failed).line() == "node1 failed (exit 9): it printed nothing"
