"""bench/compare.py's pure parts (no launches; the tables themselves are the benchmark's to report):
the Trainer's JSONs of the "recommended" table train the job's optimizer and lr schedule once the
Trainer has filled their "auto" values, with the tool's ZeRO block otherwise as published; the
plan's run.yaml keeps its layout and takes the job's fields; the loss check flags a gap; the
defaults measure small-llama."""
from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import yaml

from dsframework.config import dump_run_config, load_run_config
from tests.distributed.launcher import REPO

spec = importlib.util.spec_from_file_location("bench_compare", REPO / "bench" / "compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def job(tmp_path) -> list[str]:
    args = compare.parse_args(["--steps", "20", "--model", "tiny-llama", "--seq-len", "64"])
    return compare.run_overrides(args, stage=3, tokenizer_dir=tmp_path / "tok", output_dir=tmp_path)


def test_defaults_measure_small_llama_and_smoke_stays_tiny():
    args = compare.parse_args([])
    assert (args.model, args.seq_len, args.cluster, args.table) == ("small-llama", 128, "calibrate", "both")
    smoke = compare.parse_args(["--smoke"])
    assert (smoke.model, smoke.seq_len, smoke.cluster) == ("tiny-llama", 64, "cpu-local")
    assert (smoke.steps, smoke.repeats) == (6, 1)
    assert compare.parse_args(["--smoke", "--model", "small-llama"]).model == "small-llama"


def test_trainer_jsons_train_the_job_once_the_trainer_fills_auto(tmp_path):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    overrides = job(tmp_path)
    run = load_run_config(compare.TINY_YAML, overrides)
    t = run.train
    dsf_json = compare.dsf_ds_config(overrides)
    args = SimpleNamespace(world_size=2, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                           max_grad_norm=t.grad_clip, learning_rate=t.lr, adam_beta1=t.betas[0], adam_beta2=t.betas[1],
                           adam_epsilon=t.eps, weight_decay=t.weight_decay, save_on_each_node=False, fp16=False,
                           fp16_full_eval=False, bf16=False, bf16_full_eval=False,
                           get_warmup_steps=lambda steps: t.warmup_steps)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    for preset in (compare.HF_DOCS_ZERO3, compare.AXOLOTL_ZERO3):
        given = compare.trainer_ds_config(preset, dsf_json)
        assert "offload_param" not in given["zero_optimization"]
        hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(given)))
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model, t.steps)
        filled = hf.config
        assert "\"auto\"" not in json.dumps(filled)
        assert filled["optimizer"] == dsf_json["optimizer"] and filled["scheduler"] == dsf_json["scheduler"]
        assert (filled["train_batch_size"], filled["gradient_clipping"]) == (16, t.grad_clip)
        assert not filled["fp16"]["enabled"]
        published = {k: v for k, v in preset["zero_optimization"].items() if not k.startswith("offload")}
        assert {k: v for k, v in filled["zero_optimization"].items() if given["zero_optimization"][k] != "auto"} \
            == {k: v for k, v in published.items() if v != "auto"}
    kept = compare.trainer_ds_config(compare.HF_DOCS_ZERO3, dsf_json, keep_offload=True)
    assert kept["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_planned_run_yaml_keeps_the_layout_and_takes_the_job(tmp_path):
    plan = load_run_config(compare.TINY_YAML, ["parallel.zero_stage=1", "train.micro_batch=4", "train.lr=0.5",
                                               "data.dataset=addition", "train.steps=999"])
    (tmp_path / "plan.yaml").write_text(dump_run_config(plan))
    overrides = job(tmp_path)
    compare.planned_run_yaml(tmp_path / "plan.yaml", overrides, tmp_path / "run.yaml")
    merged = load_run_config(tmp_path / "run.yaml")
    want = load_run_config(compare.TINY_YAML, overrides)
    assert (merged.parallel.zero_stage, merged.train.micro_batch) == (1, 4)
    assert (merged.train.lr, merged.train.steps, merged.data, merged.model) == \
        (want.train.lr, want.train.steps, want.data, want.model)
    assert yaml.safe_load((tmp_path / "run.yaml").read_text())["parallel"] == plan.model_dump(mode="json")["parallel"]


def test_loss_check_and_ratio():
    def launch(rate, loss):
        return {"tokens_per_s": rate, "final_loss": loss, "final_lr": 1e-3, "launch_s": 1.0, "train_s": 1.0,
                "engine": {}}

    runs = {"dsf": [launch(120, 2.0), launch(130, 2.0)], "docs": [launch(100, 2.001), launch(90, 2.001)],
            "axolotl": [launch(50, 2.5), launch(60, 2.5)]}
    f = compare.summarize_recommended(runs, tolerance=0.01)
    assert f["best_trainer"] == "docs" and abs(f["dsf_over_best"] - 125 / 95) < 1e-9
    assert f["dsf_over_best_range"] == [120 / 100, 130 / 90]
    assert f["docs"]["loss_agrees"] and not f["axolotl"]["loss_agrees"]
