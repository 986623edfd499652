"""The planner: exact parameter counts, activation bytes against what autograd really saves,
the search rules, and `dsf plan` (table, JSON schema, files for dsf train, errors)."""
from __future__ import annotations

import copy
import json
import shlex
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from dsframework.commands.cli import cli
from dsframework.errors import UserError
from dsframework.config import ModelSpec, load_run_config
from dsframework.layout import ParallelDims
from dsframework.models.build import build_model, resolve_model
from dsframework.models.hf import causal_lm_class
from dsframework.models.recompute import use_selective_recompute
from dsframework.planner.cluster import GiB, cluster_preset, load_cluster
from dsframework.planner.memory import Workload, Layout, attention_core_bytes, memory_per_rank, stage_shapes
from dsframework.planner.model import describe_model
from dsframework.planner.search import enumerate_layouts, search
from dsframework.planner.speed import step_time
from tests.saved_tensors import saved_bytes


def _configs():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    presets = {name: resolve_model(ModelSpec(name=name)).config
               for name in ("tiny-llama", "tiny-gpt2", "small-llama", "gpt2-124m", "llama-1b", "llama-7b")}
    small = dict(vocab_size=1000, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    return {**presets, "qwen2": Qwen2Config(**small), "mistral": MistralConfig(**small),
            "llama-biases-tied": LlamaConfig(**small, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
            "gpt2-n_inner": GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_inner=100)}


CONFIGS = _configs()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_are_exact(name):
    config = CONFIGS[name]
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    layer = model.base_model.layers[0] if hasattr(model.base_model, "layers") else model.base_model.h[0]
    desc = describe_model(config, name=name)
    assert desc.total_params == sum(p.numel() for p in model.parameters())
    assert desc.layer_params == sum(p.numel() for p in layer.parameters())


def test_flops_per_token_is_six_n_plus_attention():
    desc = describe_model(CONFIGS["llama-7b"], name="llama-7b")
    dense = desc.layers * desc.layer_sharded + desc.vocab * desc.hidden
    assert desc.flops_per_token(2048) == pytest.approx(6 * dense + 12 * desc.layers * 2048 * desc.hidden)
    assert 6 * 6.5e9 < desc.flops_per_token(2048) < 6 * 8e9


def test_experts_a_plan_leaves_whole_count_once_and_run_on_every_tensor_rank():
    """transformers 5.25's MoE plans shard attention only (Mixtral's experts and router stay whole on
    each tensor rank). The model's FLOPs count each matrix once, whatever the plan splits, and leave
    the idle experts out; at tp 2 each rank runs the whole experts and half of the rest."""
    from dsframework.models.tiny import tiny_config
    from dsframework.planner.speed import step_time
    from tests.unit.test_experts import attention_only

    config = tiny_config("mixtral", num_local_experts=8, vocab_size=1000)
    config.base_model_tp_plan = attention_only(config.base_model_tp_plan)  # 5.25's plan on any release
    desc = describe_model(config, name="mixtral")
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    layers = [p for p in model.model.layers.parameters() if p.dim() > 1]
    experts = [p for name, p in model.model.layers.named_parameters() if ".experts." in name]
    idle = sum(p.numel() for p in experts) * (8 - config.num_experts_per_tok) // 8
    assert desc.flops_per_token(64) == 6 * (sum(p.numel() for p in layers) + desc.vocab * desc.hidden - idle) + (
        12 * desc.layers * 64 * desc.hidden)
    assert desc.tp_problem(2) is None and desc.experts_unsplit
    routers = sum(p.numel() for name, p in model.model.layers.named_parameters() if name.endswith("gate.weight"))
    assert desc.matrices_unsplit == sum(p.numel() for p in experts) + routers
    assert desc.unsplit_flops_per_token() == 6 * (desc.matrices_unsplit - idle)
    cluster, job = cluster_preset("h100-80gb", nodes=1, gpus_per_node=2), Workload(seq_len=64, global_batch=8)
    one, two = (step_time(desc, Layout(ParallelDims(world=2, tp=tp, zero_stage=1)), job, cluster).compute
                for tp in (1, 2))
    assert two > 2 * one * desc.unsplit_flops_per_token() / desc.flops_per_token(64)  # tp 2 runs twice the tokens


def _saved_bytes(model, input_ids) -> int:
    """Bytes autograd keeps for backward: every distinct storage packed, parameters excluded."""
    return saved_bytes(model, lambda: model(input_ids=input_ids, labels=input_ids))[0]


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_activation_bytes_match_what_autograd_saves(one_thread, name, checkpointing):
    source = resolve_model(ModelSpec(name=name))
    source.config.vocab_size = 97
    model = build_model(source, source.config, seed=1).train()
    if checkpointing == "full":  # what dsf train does with activation_checkpointing=full
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if checkpointing == "selective":  # ... and with selective
        use_selective_recompute(model)
    desc = describe_model(model.config, name=name)
    for micro_batch, seq_len in [(1, 32), (2, 64), (4, 128), (1, 256)]:
        measured = _saved_bytes(model, torch.randint(0, 97, (micro_batch, seq_len)))
        predicted = memory_per_rank(desc, Layout(ParallelDims(world=1), micro_batch=micro_batch, activation_checkpointing=checkpointing),
                                    Workload(seq_len=seq_len, global_batch=micro_batch, precision="fp32")).activations
        assert abs(predicted - measured) <= 0.15 * measured, (micro_batch, seq_len, predicted, measured)


def test_selective_recompute_keeps_less_than_none_the_same_loss_and_the_planner_counts_the_difference(one_thread):
    """The saved-tensor counter: with selective recompute a layer no longer keeps its attention
    core's saved tensors (sdpa's log-sum-exp), exactly what the planner's attention_core_bytes counts;
    the loss and the gradients are the same."""
    source = resolve_model(ModelSpec(name="tiny-llama"))
    source.config.vocab_size = 97
    plain = build_model(source, source.config, seed=1).train()
    selective = build_model(source, copy.deepcopy(source.config), seed=1).train()
    assert use_selective_recompute(selective) == "dsf_selective_sdpa" and plain.config._attn_implementation == "sdpa"
    desc = describe_model(plain.config, name="tiny-llama")
    ids = torch.randint(0, 97, (2, 64))
    kept_none, loss_none = saved_bytes(plain, lambda: plain(input_ids=ids, labels=ids).loss)
    kept_selective, loss_selective = saved_bytes(selective, lambda: selective(input_ids=ids, labels=ids).loss)
    core = attention_core_bytes(desc, micro_batch=2, seq_len=64, tp=1, precision="fp32")
    assert kept_selective < kept_none and kept_none - kept_selective == desc.layers * core
    loss_none.backward()
    loss_selective.backward()
    assert loss_selective.item() == loss_none.item()
    for a, b in zip(plain.parameters(), selective.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_orders_memory_none_selective_full_and_time_the_other_way(dropout):
    desc = replace(describe_model(CONFIGS["llama-7b"], name="llama-7b"), dropout=dropout)
    cluster, job = cluster_preset("h100-80gb", nodes=1, gpus_per_node=8), Workload(seq_len=4096, global_batch=64)
    layouts = [Layout(ParallelDims(world=8, tp=2, zero_stage=1), micro_batch=2, grad_accum=8,
                      activation_checkpointing=c) for c in ("none", "selective", "full")]
    none, selective, full = (memory_per_rank(desc, lay, job).activations for lay in layouts)
    assert none > selective > full
    # Korthikanti: selective frees the attention core's saved tensors, the s x s term with dropout
    core = attention_core_bytes(desc, micro_batch=2, seq_len=4096, tp=2, precision="bf16")
    assert none - selective == pytest.approx(desc.layers * core) and (core > 4096 * 2 * 4096 or not dropout)
    t_none, t_selective, t_full = (step_time(desc, lay, job, cluster).total for lay in layouts)
    assert t_full > t_selective > t_none


def test_pipeline_stages_cover_the_model_once_and_tp_splits_it():
    desc = describe_model(CONFIGS["llama-7b"], name="llama-7b")
    assert sum(s.params for s in stage_shapes(desc, 1, 1)) == desc.total_params
    assert sum(s.layers for s in stage_shapes(desc, 1, 4)) == desc.layers
    split = sum(s.params for s in stage_shapes(desc, 2, 1))
    assert split == pytest.approx(desc.total_params / 2, rel=0.01)  # only norms stay whole


def test_zero_stages_shrink_model_states_as_deepspeed_does():
    desc = describe_model(CONFIGS["llama-7b"], name="llama-7b")
    job = Workload(seq_len=2048, global_batch=64, precision="bf16")
    states = [memory_per_rank(desc, Layout(ParallelDims(world=8, zero_stage=z), micro_batch=1, grad_accum=8), job) for z in range(4)]
    P = desc.total_params
    # bf16 accumulates in fp32 at ZeRO 1-3 (data_types.grad_accum_dtype): stage 1's BF16_Optimizer keeps
    # an fp32 gradient buffer of the whole model beside the bf16 grads; stage 2 an fp32 copy of its
    # partition; stage 3 its partition in fp32
    assert states[1].optimizer == pytest.approx(12 * P / 8) and states[1].grads == pytest.approx((2 + 4) * P)
    assert states[2].grads == pytest.approx((2 + 4) * P / 8) and states[2].params == pytest.approx(2 * P)
    assert states[3].params < 2 * P / 8 * 1.01 and states[3].grads == pytest.approx(4 * P / 8)
    fp32 = [memory_per_rank(desc, Layout(ParallelDims(world=8, zero_stage=z), micro_batch=1, grad_accum=8),
                            replace(job, precision="fp32")) for z in (1, 2, 3)]
    assert [s.grads for s in fp32] == pytest.approx([4 * P, 4 * P / 8, 4 * P / 8])  # fp32: one fp32 copy
    offloaded = memory_per_rank(desc, Layout(ParallelDims(world=8, zero_stage=3), offload_optimizer=True, offload_param=True), job)
    assert offloaded.optimizer == 0 and offloaded.cpu_per_rank >= (12 + 2 + 4) * P / 8 * 0.99


def test_search_obeys_the_rules():
    desc = describe_model(CONFIGS["llama-7b"], name="llama-7b")
    cluster = cluster_preset("a100-80gb", nodes=2, gpus_per_node=8)
    job = Workload(seq_len=2048, global_batch=128)
    layouts = list(enumerate_layouts(desc, cluster, job))
    assert layouts and all(lay.dims.world == 16 for lay in layouts)
    assert all(lay.micro_batch * lay.grad_accum * lay.dims.dp == 128 for lay in layouts)
    assert all(lay.dims.zero_stage <= 1 for lay in layouts if lay.dims.pp > 1)
    assert all(desc.heads % lay.dims.tp == 0 and lay.dims.tp <= 8 for lay in layouts)
    assert all(lay.dims.zero_stage == 3 for lay in layouts if lay.offload_param)
    assert {lay.dims.tp for lay in layouts} == {1, 2, 4, 8} and max(lay.dims.pp for lay in layouts) == 16


def test_a_70b_model_needs_more_than_one_node_and_says_why():
    desc = describe_model(resolve_model(ModelSpec(name="llama-70b")).config, name="llama-70b")
    plan = search(desc, cluster_preset("a100-40gb", nodes=1, gpus_per_node=8), Workload(seq_len=4096, global_batch=64))
    assert plan.best is None
    assert "ZeRO-2" in plan.dropped_families and "GiB >" in plan.dropped_families["ZeRO-2"]
    assert any("nodes" in line and "would fit" in line for line in plan.suggestions)


def _plan(*args):
    return CliRunner().invoke(cli, ["plan", *args], catch_exceptions=False)


def test_dsf_plan_table_and_json_schema():
    args = ["--model", "llama-7b", "--cluster", "h100-80gb", "--nodes", "2", "--seq-len", "4096",
            "--global-batch", "256"]
    table = _plan(*args, "--top", "3")
    assert table.exit_code == 0 and "tokens/s" in table.output and "| 3 |" in table.output
    data = json.loads(_plan(*args, "--json").stdout)
    record = data["candidates"][0]
    assert set(record) >= {"dp", "tp", "pp", "cp", "zero_stage", "zero_hpz", "offload_optimizer", "offload_param",
                           "micro_batch",
                           "grad_accum", "activation_checkpointing", "sequence_parallel", "fits", "memory", "cpu_memory",
                           "step_time_s", "tokens_per_s"}
    assert set(record["memory"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert record["fits"] and record["memory"]["total"] < 80 * GiB
    assert record["dp"] * record["tp"] * record["pp"] * record["cp"] == 16


def test_the_plan_splits_the_step_of_its_first_two_and_of_a_named_layout():
    """`dsf plan` shows the step of the first choice and the runner-up split into parts that add up to
    it (the JSON's step_parts_s too), with MFU; --explain does the same for the layout named (the
    fastest with those values), fitting or not."""
    args = ["--model", "llama-70b", "--cluster", "h100-80gb", "--nodes", "16", "--seq-len", "4096",
            "--global-batch", "1024"]
    data = json.loads(_plan(*args, "--json").stdout)
    for record in data["candidates"][:50]:
        assert sum(record["step_parts_s"].values()) == pytest.approx(record["step_time_s"], rel=1e-9)
    first, second = data["candidates"][:2]
    out = _plan(*args, "--top", "2", "--explain", "tp=8, pp=4 zero=1 ckpt=full").output
    lines = out.splitlines()
    at = lines.index("why, in numbers (one optimizer step of the busiest rank):")
    for line, record in zip(lines[at + 1:at + 3], (first, second)):
        assert f"tp {record['tp']} x pp {record['pp']} x cp {record['cp']} x dp {record['dp']}" in line, line
        assert f"step {record['step_time_s']:.3g} s = matmul and attention" in line and f"MFU {record['mfu']:.1%}" in line
    explained = lines[-1]
    assert explained.startswith("explain tp=8, pp=4 zero=1 ckpt=full, tp 8 x pp 4 x cp 1 x dp 4, ZeRO-1")
    assert "checkpointing full" in explained and "pipeline bubble" in explained and "tensor all-reduces" in explained
    named = [c for c in data["candidates"] if (c["tp"], c["pp"], c["zero_stage"], c["activation_checkpointing"],
                                               c["offload_optimizer"]) == (8, 4, 1, "full", "none") and c["fits"]]
    fastest = max(named, key=lambda c: c["tokens_per_s"])
    assert f"step {fastest['step_time_s']:.3g} s" in explained and "does not fit" not in explained
    pinned_apart = _plan(*args, "--tp", "4", "--zero-stage", "3", "--explain", "tp=8, pp=4 zero=1 ckpt=full").output
    assert pinned_apart.splitlines()[-1] == explained  # a name against the pins: searched with its own sizes
    too_big = _plan(*args, "--explain", "tp=1 pp=1 cp=1 zero=0").output.splitlines()[-1]
    assert "[does not fit: needs" in too_big and "dp 128" in too_big
    with_json = json.loads(_plan(*args, "--json", "--explain", "tp=8 pp=4 zero=1 ckpt=full").stdout)  # still JSON
    assert with_json["explain"]["layout"] == "tp=8 pp=4 zero=1 ckpt=full"
    assert with_json["explain"]["step_time_s"] == fastest["step_time_s"]


def test_dsf_plan_writes_a_run_config_dsf_train_reads(tmp_path):
    out = tmp_path / "plan"
    result = _plan("--model", "tiny-llama", "--cluster", "cpu-local", "--nodes", "1", "--gpus-per-node", "4",
                   "--seq-len", "64", "--global-batch", "16", "--precision", "fp32", "-o", str(out))
    assert result.exit_code == 0, result.output
    run = load_run_config(out / "run.yaml")
    ds = json.loads((out / "ds_config.json").read_text())
    dp = 4 // (run.parallel.tp * run.parallel.pp)
    assert ds["train_batch_size"] == 16 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * dp
    assert ds["zero_optimization"]["stage"] == run.parallel.zero_stage


def test_dsf_plan_pins_a_dimension():
    data = json.loads(_plan("--model", "llama-7b", "--cluster", "h100-80gb", "--seq-len", "2048",
                            "--global-batch", "64", "--tp", "2", "--zero-stage", "1", "--json").stdout)
    assert {(c["tp"], c["zero_stage"]) for c in data["candidates"]} == {(2, 1)}


@pytest.mark.parametrize("content, said", [(b'{"name": "cpu", ', "is not valid JSON"),
                                           (b"\xff\xfe\x00\x01", "is not a text file (not UTF-8)")])
def test_a_cluster_profile_that_is_not_json_is_one_line(tmp_path, content, said):
    (tmp_path / "cpu.json").write_bytes(content)
    with pytest.raises(UserError, match=r"--cluster=.*cpu\.json.*" + said.replace("(", r"\(").replace(")", r"\)")):
        load_cluster(str(tmp_path / "cpu.json"))


# --- the files `dsf plan -o` writes, and what it prints (issue 33, item 6) -----------------------

TINY_PLAN = ("--model", "tiny-llama", "--cluster", "cpu-local", "--gpus-per-node", "4", "--seq-len", "64",
             "--global-batch", "16", "--precision", "fp32")
MY_YAML = """\
# my run: the team's settings
model:
  name: tiny-llama   # the base
data:
  dataset: counting
  seq_len: 64
  tokenizer_vocab_size: 300

train:
  steps: 7
  lr: 3.0e-4        # tuned
  global_batch: 16
  micro_batch: 8
  grad_accum: 2
  precision: fp32

parallel:
  zero_stage: 3
  zero_knobs:
    prefetch_bucket: 1000
  # keep hpZ off for now
  tp: 2

output_dir: runs/mine
"""
PLAN_OWNED = ("micro_batch", "grad_accum", "chunked_loss", "tp", "pp", "cp", "ep", "zero_stage", "zero_hpz",
              "offload_optimizer", "offload_param", "activation_checkpointing", "zero_knobs")


def _planned(tmp_path, *args):
    out = tmp_path / "plan"
    result = _plan(*args, "-o", str(out))
    assert result.exit_code == 0, result.output
    return out, result


def test_dsf_plan_run_writes_the_users_file_with_only_the_plans_fields_changed(tmp_path):
    (tmp_path / "my.yaml").write_text(MY_YAML)
    out, result = _planned(tmp_path, "--run", str(tmp_path / "my.yaml"), "--cluster", "cpu-local",
                           "--gpus-per-node", "4")
    reference, _ = _planned(tmp_path / "ref", *TINY_PLAN)  # the same plan without --run
    mine, planned, plain = (load_run_config(p) for p in (tmp_path / "my.yaml", out / "run.yaml",
                                                          reference / "run.yaml"))
    for section in ("parallel", "train"):
        for key in PLAN_OWNED:
            if hasattr(getattr(planned, section), key) and key != "grad_accum":
                assert getattr(getattr(planned, section), key) == getattr(getattr(plain, section), key), key
    dp = 4 // (planned.parallel.tp * planned.parallel.pp * planned.parallel.cp)
    assert planned.train.global_batch == 16 == planned.train.micro_batch * planned.train.grad_accum * dp
    assert planned.data == mine.data and planned.model == mine.model and planned.output_dir == "runs/mine"
    assert (planned.train.steps, planned.train.lr) == (7, 3e-4) and planned.logging.cluster == "cpu-local"
    text = (out / "run.yaml").read_text()
    assert text.startswith("# ") and "every other line as" in text.split("\n\n")[0]
    kept = [line for line in MY_YAML.splitlines()
            if not any(line.strip().startswith(f"{key}:") for key in PLAN_OWNED) and "prefetch_bucket" not in line]
    assert all(line in text.splitlines() for line in kept)  # comments, order, the user's values: as written
    changed = [line for line in text.splitlines() if line not in MY_YAML.splitlines() and not line.startswith("#")]
    assert changed and all(line.endswith("# dsf plan") or line.endswith(":") for line in changed), changed
    assert "my.yaml with the plan's fields set" in result.stderr


@pytest.mark.parametrize("text, changes, kept", [
    ("train:\n  lr: 0.1  # mine\n  micro_batch: 4\n", {"train.micro_batch": 2}, "  lr: 0.1  # mine"),
    ("# top\nparallel:\n  zero_knobs:\n    reduce_bucket: 5\n\n  tp: 2\n", {"parallel.zero_knobs": {}}, "  tp: 2"),
    ("train:\n  lr: 0.1\n", {"parallel.tp": 2, "train.micro_batch": 2}, "  lr: 0.1"),
    ("parallel: {tp: 2}\ntrain: {lr: 0.1}\n", {"parallel.tp": 1}, None),  # flow style: written out again
])
def test_merged_run_yaml_edits_lines_or_writes_the_values_out(text, changes, kept):
    from dsframework.config import parse_yaml
    from dsframework.planner.files import merged_data, merged_run_yaml

    written = parse_yaml(text)
    merged = merged_run_yaml(text, written, changes, header=["the header"])
    assert parse_yaml(merged) == merged_data(written, changes)
    assert merged.startswith("# the header\n")
    if kept is None:
        assert "could not be edited line by line" in merged
    else:
        assert kept in merged.splitlines() and "could not be edited" not in merged
        assert sum(line.endswith("# dsf plan") for line in merged.splitlines()) == len(changes)


def test_dsf_plan_marks_the_fields_it_did_not_choose_as_placeholders(tmp_path):
    out, result = _planned(tmp_path, *TINY_PLAN)
    lines = (out / "run.yaml").read_text().splitlines()
    header = [line for line in lines[:8] if line.startswith("#")]
    assert "dsf plan" in header[0] and "placeholder" in " ".join(header) and "--run" in " ".join(header)

    def line(key: str) -> str:
        return next(x for x in lines if x.strip().startswith(f"{key}:"))

    for key in ("dataset", "tokenizer_vocab_size", "lr", "steps", "seed", "output_dir"):
        assert "# placeholder:" in line(key), line(key)
    assert "set your data" in line("dataset")
    for key in ("name", "seq_len", "micro_batch", "global_batch", "tp", "pp", "zero_stage", "activation_checkpointing",
                "chunked_loss", "cluster"):
        assert "#" not in line(key), line(key)
    assert load_run_config(out / "run.yaml").data.dataset == "addition"
    assert "placeholder" in result.stderr


def test_dsf_plan_prints_dsf_launch_and_sbatch_for_more_than_one_node(tmp_path):
    from tests.unit.test_docs import dsf_args, parse_problem

    one, single = _planned(tmp_path / "one", *TINY_PLAN)
    assert f"deepspeed --num_gpus 4 $(which dsf) train {one / 'run.yaml'}" in single.stderr
    two_nodes = [*TINY_PLAN[:4], "--gpus-per-node", "2", "--nodes", "2", *TINY_PLAN[6:]]
    out, result = _planned(tmp_path / "two", *two_nodes)
    assert "deepspeed --num_gpus" not in result.stderr
    launch = next(x.strip() for x in result.stderr.splitlines() if x.strip().startswith("dsf launch"))
    assert launch.startswith(f"dsf launch {out / 'run.yaml'} --hostfile HOSTFILE --cluster cpu-local")
    assert parse_problem(dsf_args(launch) or []) is None
    sbatch = next(x.strip() for x in result.stderr.splitlines() if "sbatch" in x)
    assert sbatch.startswith("GPUS_PER_NODE=2 sbatch --nodes=2 --gpus-per-node=0 launch/slurm.sbatch "
                             f"{out / 'run.yaml'}")
    # launch/slurm.sbatch passes what follows the run config to dsf launch, beside its own flags
    tail = shlex.split(sbatch.split("launch/slurm.sbatch", 1)[1], comments=True)
    assert parse_problem(["launch", *tail, "--hostfile", "h", "--launcher", "slurm", "--master-addr", "a"]) is None
    assert "dsf launch" in (out / "README.txt").read_text() and "sbatch" in (out / "README.txt").read_text()


def test_start_lines_of_gpu_nodes():
    from dsframework.planner.files import start_lines

    lines = start_lines(cluster_preset("h100-80gb", nodes=16, gpus_per_node=8), world=128, run_yaml="p/run.yaml",
                        cluster_field="h100-80gb")
    assert lines[0].startswith("dsf launch p/run.yaml --hostfile HOSTFILE --cluster h100-80gb   # ")
    assert "`<host> slots=8`" in lines[0]
    assert lines[1].startswith("sbatch --nodes=16 --gpus-per-node=8 launch/slurm.sbatch p/run.yaml --cluster h100-80gb")
    assert start_lines(cluster_preset("h100-80gb", nodes=1), world=8, run_yaml="p/run.yaml", cluster_field=None) == [
        "deepspeed --num_gpus 8 $(which dsf) train p/run.yaml"]


def test_ds_config_stays_plain_deepspeed_json_and_readme_says_what_it_is(tmp_path):
    from dsframework.dsconfig import validate_ds_config

    out, result = _planned(tmp_path, *TINY_PLAN)
    ds = json.loads((out / "ds_config.json").read_text())
    assert not [key for key in ds if key.startswith("_")]
    dp = ds["train_batch_size"] // (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"])
    validate_ds_config(ds, dp_size=dp)  # DeepSpeedConfig accepts the file as written
    # why README.txt and not a comment key: DeepSpeedConfig refuses unknown keys inside its sections
    commented = {**ds, "zero_optimization": {**ds.get("zero_optimization", {}), "_comment": "what this is"}}
    with pytest.raises(UserError, match="_comment"):
        validate_ds_config(commented, dp_size=dp)
    readme = (out / "README.txt").read_text()
    assert "ds_config.json" in readme and "DeepSpeed" in readme and "dsf train does not read it" in readme
    assert "ds_config.json (DeepSpeed's JSON" in result.stderr and "plain JSON, no comments" in result.stderr


def test_a_first_choice_under_10_percent_headroom_says_so():
    from dataclasses import replace

    from dsframework.planner.report import headroom_line, plan_table

    desc = describe_model(resolve_model(ModelSpec(name="llama-7b")).config, name="llama-7b")
    plan = search(desc, cluster_preset("h100-80gb"), Workload(seq_len=2048, global_batch=64), knobs=False)
    best = plan.best
    assert best is not None

    def with_headroom(share: float):  # the same plan on a GPU whose usable memory leaves `share` free
        usable = best.memory.total / (1 - share)
        return replace(plan, cluster=replace(plan.cluster, memory_per_gpu=usable + GiB))

    tight = headroom_line(with_headroom(0.095), best)
    assert tight is not None and "under 10% memory headroom" in tight and "9.5% free" in tight
    assert f"predicted peak {best.memory.total / GiB:.1f} GiB of" in tight and "the next layout" in tight
    if best.layout.micro_batch > 1:
        assert "smaller micro-batch" in tight
    assert headroom_line(with_headroom(0.2), best) is None
    assert tight.strip() in plan_table(with_headroom(0.095), top=1)
    assert "memory headroom" not in plan_table(with_headroom(0.2), top=1)


@pytest.mark.parametrize("section, pinned", [("model:\n  name: tiny-llama\n  lora: {r: 4}\n", ("tp", "pp", "cp", "ep")),
                                             ("model: {name: tiny-llama}\ndata: {format: chat}\n", ("pp", "cp"))])
def test_dsf_plan_run_plans_what_the_run_config_allows(tmp_path, section, pinned):
    """A LoRA run trains at tp = pp = cp = 1 (its adapters alone have gradients); chat data at pp = cp = 1:
    --run plans only those layouts, so the run.yaml it writes is one dsf train accepts."""
    (tmp_path / "my.yaml").write_text(section + "train: {global_batch: 16}\n")
    result = _plan("--run", str(tmp_path / "my.yaml"), "--cluster", "cpu-local", "--gpus-per-node", "4", "--json")
    data = json.loads(result.stdout)
    assert (data["model"], data["seq_len"], data["precision"]) == ("tiny-llama", 64, "fp32")  # the run's own
    assert data["candidates"] and all(c.get(axis, 1) == 1 for c in data["candidates"] for axis in pinned)
    if "lora" in section:
        full = json.loads(_plan(*TINY_PLAN, "--tp", "1", "--pp", "1", "--cp", "1", "--json").stdout)["candidates"]
        assert max(c["memory"]["grads"] for c in data["candidates"]) < min(c["memory"]["grads"] for c in full
                                                                            if c["zero_stage"] == 0)
