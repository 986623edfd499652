"""bench/gpu.sh (the prepared single-GPU benchmark) works end to end before a GPU is at hand:
`--dry-run` plans tiny-llama for one device of the measured-peak profile, trains the plan 2 steps
with the chunked loss (eager: compiling is test_compile.py's, and would add 40-80 s here), then the
eager ZeRO-3 baseline, in bf16 on this machine's device, and prints compile seconds, tokens/s,
TFLOP/s and MFU against the bf16 matmul peak it measured."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from tests.distributed.launcher import REPO, rank_env

ROW = re.compile(r"^\| (planned|baseline) \| (\d) \| (\d+)x(\d+) \| ([\d.]+|-) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+)% "
                 r"\| \d+ \|$", re.M)


def test_gpu_bench_dry_run(tmp_path):
    env = {**rank_env(), "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "--dry-run"], capture_output=True, text=True,
                          timeout=400, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"measured bf16 matmul peak on \S+: [\d.]+ TFLOP/s", proc.stdout)
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(proc.stdout)}
    assert sorted(rows) == ["baseline", "planned"], proc.stdout
    # MFU is against the bf16 matmul peak the script measured (peak.json): each row's is its model
    # TFLOP/s over that peak. (Not bounded by 100% here: a CPU without bf16 units emulates a 1024^3
    # bf16 matmul slower than training's small ones, so on some machines the dry run shows >100%.)
    peak = json.loads((tmp_path / "peak.json").read_text())["peak_flops"]["bf16"]
    for name, (stage, micro, accum, compile_s, tokens, tflops, mfu) in rows.items():
        windows = [w for w in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                   if "tokens_per_s" in w]
        timed = windows[1:] or windows
        want = 100 * sum(w["tflops_per_rank"] for w in timed) / len(timed) * 1e12 / peak
        assert int(tokens.replace(",", "")) > 0 and float(mfu) > 0
        assert abs(float(mfu) - want) <= 0.05 + 1e-3 * want, (name, mfu, want)
    planned = yaml.safe_load((tmp_path / "plan" / "run.yaml").read_text())
    # The planned row trains what the plan wrote (with the chunked loss); the baseline is eager ZeRO-3, whole logits.
    assert rows["planned"][0] == str(planned["parallel"]["zero_stage"])
    assert rows["planned"][1] == str(planned["train"]["micro_batch"])
    assert rows["baseline"][3] == "-"
    planned_log = (tmp_path / "planned.log").read_text()
    assert "compile false | loss in chunks of" in planned_log
    assert "compile false | loss whole logits" in (tmp_path / "baseline.log").read_text()
    assert rows["baseline"][0] == "3"
    profile = json.loads((tmp_path / "peak.json").read_text())
    assert set(profile["peak_flops"]) == {"bf16"} and (tmp_path / "planned" / "metrics.jsonl").is_file()
