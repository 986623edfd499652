"""Nothing on the training hot path that need not be there (dsf's own code; DeepSpeed's is its own):

- no host synchronisation per step beyond logging: with logging.every=4, every Tensor.item/
  tolist/float/int/bool/cpu, and every data-dependent op (equal, bincount, nonzero, unique,
  masked_select), made by a dsframework module in the loop falls on a logging step
  (the loss, the non-finite check) - none on the steps between, but for one host-side tensor
  that never waits for the device: the SIGTERM flag (guards.StopRequest, a CPU tensor reduced on
  a gloo group even beside NCCL); the epoch's sample order (data.sampling.BlockSampler) is drawn
  on the CPU once per epoch and kept as a numpy array;
- the data is prepared ahead: a step's batches are rows copied out of the token store (tokenized once,
  memory-mapped), taking well under 1% of the step's time;
- no Python-side per-parameter loop: the calls dsf's own code makes in a step (Python functions and
  C methods, counted with sys.setprofile) are the same in every step without logging and fewer than
  half the model's 147 parameter tensors (16 layers x 9 + embedding, final norm and head).
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.distributed.launcher import REPO, TINY_YAML, rank_env, run_overrides


def test_no_host_sync_between_logging_steps_and_data_ready(tmp_path):
    out = tmp_path / "hot_path.json"
    sets = [a for o in run_overrides(tmp_path / "run", ["train.steps=12", "logging.every=4", "parallel.zero_stage=1",
                                                          "model.overrides.num_hidden_layers=16"])
            for a in ("--set", o)]
    worker = REPO / "tests" / "distributed" / "workers" / "hot_path.py"
    proc = subprocess.run([sys.executable, str(worker), str(out), str(TINY_YAML), *sets], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=rank_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    host_side = ":guards.py:_collect:item"
    device_reads = {key for key in report["syncs"] if not key.endswith(host_side)}
    assert {int(key.split(":")[0]) for key in device_reads} == {4, 8, 12}, report["syncs"]
    flag_reads = {int(key.split(":")[0]) for key in report["syncs"] if key.endswith(host_side)}
    assert flag_reads == set(range(2, 13)), "one read of the SIGTERM flag a step (from the 2nd)"
    data = report["data_seconds"]
    assert len(data) == 12
    step_seconds = 8 * 32 / report["tokens_per_s"]  # global batch 8 x 32 tokens
    assert sum(data) / len(data) < 0.01 * step_seconds, (data, step_seconds)
    calls = {int(step): count for step, count in report["calls"].items()}
    quiet = [calls[step] for step in (2, 3, 5, 6, 7, 9, 10, 11)]
    assert len(set(quiet)) == 1 and quiet[0] < 147 // 2, calls
