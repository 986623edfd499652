"""The README's main job: the built-in default trains on 2 ranks, its eval loss falls by at least
half, and the exported directory loads with transformers and counts."""
from __future__ import annotations

import json
import subprocess
import time

import torch

from tests.distributed.launcher import REPO, free_port, rank_env


def test_quickstart_learns_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "quickstart"
    env = dict(rank_env(), OUTPUT_DIR=str(out), MASTER_PORT=str(free_port()))
    start = time.perf_counter()
    proc = subprocess.run(["bash", "launch/quickstart.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"quickstart took {elapsed:.0f} s")  # the 3-minute target is measured, not asserted

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert rows[0]["step"] == 0 and len(evals) >= 2
    assert evals[-1] <= 0.5 * evals[0], f"eval loss {evals[0]:.3f} -> {evals[-1]:.3f}"
    assert "quickstart: eval loss" in proc.stdout

    model = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "hf", local_files_only=True)
    prompt = tokenizer("40,41,42,", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(generated[0, prompt.shape[1]:]).startswith("43,"), tokenizer.decode(generated[0])
