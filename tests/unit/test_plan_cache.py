"""planner/desc_cache.py: a model `dsf plan` described once is read back whole (its fields and every
tp counted), a tp never counted is counted on the model and kept, a changed config.json or a file
that cannot be read is a miss; and a second `dsf plan` process imports neither torch nor transformers
and prints the same plan."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from dsframework.planner.cluster import cluster_preset
from dsframework.planner.count import model_counts
from dsframework.planner.desc_cache import CachedCounts, DescCache
from dsframework.planner.memory import Workload
from dsframework.planner.model import describe_model
from dsframework.planner.search import search

CONFIG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=512, max_position_embeddings=256)


def test_a_described_model_comes_back_whole_and_grows_by_the_tp_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("DSF_PLAN_CACHE", str(tmp_path))
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    config = transformers.LlamaConfig(**CONFIG)
    path.write_text(config.to_json_string())
    spec = {"name": str(path), "overrides": {}}
    desc = describe_model(config, name=str(path))
    for tp in (1, 2, 3):  # 3 does not divide the heads: the reason is kept too
        desc.tp_problem(tp)
    cache = DescCache.for_spec(spec)
    assert cache is not None and cache.load(load_counts=lambda: model_counts(config)) is None  # nothing saved yet
    cache.save(desc)

    loaded = DescCache.for_spec(spec).load(load_counts=lambda: model_counts(config))
    assert loaded == desc and isinstance(loaded.counts, CachedCounts)
    assert loaded.shares(2) == desc.shares(2) and loaded.tp_problem(3) == desc.tp_problem(3) is not None
    assert loaded.pp_problem == desc.pp_problem
    job, cluster = Workload(seq_len=128, global_batch=16, precision="bf16"), cluster_preset("h100-80gb")
    assert [c.as_dict() for c in search(loaded, cluster, job).candidates[:5]] == \
        [c.as_dict() for c in search(desc, cluster, job).candidates[:5]]
    assert loaded.counts.added  # the search asked for tp = 4 and 8, which were counted on the model
    assert loaded.shares(4) == desc.shares(4)
    DescCache.for_spec(spec).save(loaded)
    kept = json.loads(next(tmp_path.glob("*.json")).read_text())["shares"]
    assert {"1", "2", "3", "4", "8"} <= set(kept)

    path.write_text(transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 6}).to_json_string())
    assert DescCache.for_spec(spec).load(load_counts=lambda: model_counts(config)) is None  # another config.json: a miss
    path.write_text(config.to_json_string())
    for broken in ("{not json", '{"desc": [], "shares": {}, "pipeline_problem": null}'):
        next(tmp_path.glob("*.json")).write_text(broken)
        assert DescCache.for_spec(spec).load(load_counts=lambda: model_counts(config)) is None  # counted again
    blocked = tmp_path / "a-file"  # a cache directory that cannot be made: the plan goes on, nothing written
    blocked.write_text("")
    monkeypatch.setenv("DSF_PLAN_CACHE", str(blocked))
    DescCache.for_spec(spec).save(desc)
    assert blocked.read_text() == "" and not list(tmp_path.glob("*.partial"))
    monkeypatch.setenv("DSF_PLAN_CACHE", "off")
    assert DescCache.for_spec(spec) is None


@pytest.mark.distributed
def test_a_second_dsf_plan_imports_neither_torch_nor_transformers(tmp_path):
    """`dsf plan` run twice as a process: the second reads the model from the cache, imports neither
    torch nor transformers (most of a plan's seconds), and prints the same plan. (GPT-2: a model the
    first counts on the model; a Llama is counted from its config by both, planner/analytic.py.)"""
    code = ("import sys; from dsframework.commands.cli import cli\n"
            "try:\n    cli.main(sys.argv[1:], standalone_mode=False)\n"
            "finally:\n    print('imported:', [m for m in ('torch', 'transformers') if m in sys.modules])")
    argv = ["plan", "--model", "gpt2-124m", "--cluster", "h100-80gb", "--nodes", "2", "--seq-len", "4096",
            "--global-batch", "256", "--explain", "tp=2 zero=3"]
    env = {**os.environ, "DSF_PLAN_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout.rsplit("imported:", 1) for run in runs)
    assert "torch" in first[1] and second[1].strip() == "[]", (first[1], second[1])
    assert first[0] == second[0] and "explain tp=2" in second[0]
