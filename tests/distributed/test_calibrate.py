"""`dsf calibrate` measures this machine with real ranks and writes a profile `dsf plan` takes."""
from __future__ import annotations

import json

from tests.distributed.launcher import dsf


def test_calibrated_profile_drives_dsf_plan(tmp_path):
    profile_path = tmp_path / "cpu.json"
    dsf("calibrate", "--ranks", "2", "-o", str(profile_path))
    profile = json.loads(profile_path.read_text())
    assert profile["gpus_per_node"] == 2
    assert 1e8 < profile["peak_flops"]["fp32"] < 1e14, "a CPU core does between 0.1 and 100 TFLOP/s"
    assert 1e6 < profile["intra_node_bandwidth"] < 1e12
    assert 0 < profile["collective_latency_s"] < 1 and 0 < profile["op_overhead_s"] < 1e-2
    assert profile["memory_per_gpu"] * 2 <= profile["cpu_memory_per_node"] * 1.001

    plan = json.loads(dsf("plan", "--model", "tiny-llama", "--cluster", str(profile_path), "--gpus-per-node", "2",
                          "--seq-len", "64", "--global-batch", "8", "--precision", "fp32", "--json").stdout)
    assert plan["cluster"]["peak_flops"]["fp32"] == profile["peak_flops"]["fp32"]
    best = plan["candidates"][0]
    assert best["fits"] and best["dp"] * best["tp"] * best["pp"] == 2
