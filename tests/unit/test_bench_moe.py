"""bench/moe.py's pure parts (no launches; its table is the benchmark's to report): the model is the
few-hundred-M Qwen3-MoE shape issue 23 asks for, each ep's JSON is the one dsf builds (AutoEP's
section at ep > 1 only), the planned model states per rank fall with ep, and the table reads the
records it is given."""
from __future__ import annotations

import importlib.util

from dsframework.config import ModelSpec
from tests.distributed.launcher import REPO

spec = importlib.util.spec_from_file_location("bench_moe", REPO / "bench" / "moe.py")
moe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(moe)


def test_the_model_is_a_few_hundred_million_parameters_top_2_of_16(tmp_path):
    import json

    from dsframework.models.build import resolve_model
    from dsframework.planner.model import describe_model

    (tmp_path / "model.json").write_text(json.dumps(moe.MODEL))
    desc = describe_model(resolve_model(ModelSpec(name=str(tmp_path / "model.json"))).config, name="bench-moe")
    assert (desc.experts, desc.top_k, desc.autoep) == (16, 2, True)
    assert 150e6 < desc.total_params < 500e6 and desc.active_params < 0.3 * desc.total_params


def test_each_ep_gets_dsfs_json_and_fewer_planned_bytes(tmp_path):
    import json

    from dsframework.dsconfig import build_ds_config

    moe.save_tokenizer(tmp_path / "tok")
    (tmp_path / "model.json").write_text(json.dumps(moe.MODEL))
    args = moe.parse_args([])
    planned = {}
    for ep in args.ep:
        overrides = moe.run_overrides(args, ep=ep, model=tmp_path / "model.json", tokenizer=tmp_path / "tok",
                                      output_dir=tmp_path / f"ep{ep}")
        run = moe.run_config(overrides)
        ds = build_ds_config(run.train, run.parallel, dp_size=moe.WORLD)
        assert ds.get("expert_parallel") == ({"enabled": True, "autoep_size": ep} if ep > 1 else None)
        assert ds["zero_optimization"]["stage"] == 1
        planned[ep] = moe.planned_model_states(overrides)
    assert planned[1] > planned[2] > planned[4] > 0


def test_the_table_reads_its_records():
    runs = {"dsf": [{"tokens_per_s": 980.0, "final_loss": 2.5}, {"tokens_per_s": 1000.0, "final_loss": 2.5}],
            "raw": [{"tokens_per_s": 1000.0, "final_loss": 2.5, "model_states": [100, 120, 110, 100]},
                    {"tokens_per_s": 1010.0, "final_loss": 2.5, "model_states": [100, 100, 100, 100]}]}
    rows = [moe.row_of(1, runs, planned=120.0, experts=16), moe.row_of(4, {**runs, "raw": [
        {**r, "model_states": [60] * 4} for r in runs["raw"]]}, planned=60.0, experts=16)]
    assert rows[0]["measured_bytes"] == 120 and rows[1]["experts_per_rank"] == 4
    assert abs(rows[0]["dsf_over_raw"] - 990 / 1005) < 1e-12
    table = moe.markdown(rows, moe.parse_args([]))
    assert "| 4 | 4 |" in table and "ep 4 holds 0.50 of ep 1's" in table and "at most 1.5%" in table
