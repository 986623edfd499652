"""Session fixtures of the cluster tests: the namespace nodes (tests/cluster/nodes.py), SLURM on
them, and the single-node reference losses every multi-node training is compared with.

    def test_x(clean, reference, tmp_path):      # clean: the cluster, with no job left on it before or after
        code, output, _ = run_on(clean, 0, dsf_launch_cmd(tmp_path, "pdsh"), cwd=tmp_path, timeout=240,
                                 log=tmp_path / "job.log")
        assert_matches(losses(tmp_path / "out"), reference, rtol=1e-5, what="pdsh")  # its first steps
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.cluster.jobs import RANKS_PER_NODE, REFERENCE_STEPS, launch_args, sweep
from tests.cluster.nodes import Cluster, NamespacesUnavailable, missing
from tests.distributed.launcher import BIN, launch, losses


@pytest.fixture(scope="session")
def cluster():
    why = missing()
    if why:
        pytest.skip(f"cluster tests: {why}")
    root = Path(tempfile.mkdtemp(prefix="dsf-cluster-"))
    nodes = Cluster(root, nodes=2)
    try:
        try:
            nodes.start()
        except NamespacesUnavailable as err:
            pytest.skip(f"cluster tests: {err}")
        print(f"\ncluster: {nodes.count} nodes up in {nodes.start_seconds:.1f} s ({root})")
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm(cluster):
    why = missing("slurm")
    if why:
        pytest.skip(f"SLURM tests: {why}")
    started = time.monotonic()
    try:
        cluster.start_slurm()
    except (RuntimeError, TimeoutError) as err:
        pytest.fail(f"SLURM did not come up: {err}\n{cluster.slurm_logs()}")
    print(f"\nslurm: munged, slurmctld, {cluster.count} slurmd up in {time.monotonic() - started:.1f} s")
    return cluster


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """step -> loss of the same run on one node: `deepspeed --num_gpus 4` (4 CPU ranks), once a session,
    REFERENCE_STEPS steps of the schedule every run here follows."""
    out = tmp_path_factory.mktemp("reference") / "out"
    launch([str(BIN / "dsf"), "train", *launch_args(out, [f"train.stop_after={REFERENCE_STEPS}"])],
           num_ranks=2 * RANKS_PER_NODE, timeout=300)
    got = losses(out)
    assert sorted(got) == list(range(1, REFERENCE_STEPS + 1))
    return got


@pytest.fixture
def clean(cluster):
    """Nothing of an earlier job on the nodes before the test, and nothing left after it."""
    sweep(cluster)
    yield cluster
    sweep(cluster)
