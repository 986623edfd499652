"""Mixture-of-experts models at expert parallelism (DeepSpeed AutoEP through `parallel.ep`): tiny
random Mixtral and Qwen3-MoE, ep 2 x dp 2 at ZeRO 1, 2 and 3 (and Mixtral at ZeRO-0), in one
4-rank launch (workers/architectures.py, shared with test_architectures: conftest.engine_runs).
Each trains 5 steps to the single-process reference (transformers' own model and loss, the
router's load-balancing loss included as transformers computes it on each forward), each rank
holds only its half of the experts, and `dsf export` writes transformers' own expert layout,
which gives the trained engine's logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsframework.config import build_run_config
from tests.distributed.launcher import assert_close, losses, run_overrides
from tests.distributed.reference import reference_losses

# router_aux_loss_coef raised from 0.001 so that the load-balancing loss is well above the tolerance
MODELS = {"mixtral": {"router_aux_loss_coef": 0.05}, "qwen3_moe": {"router_aux_loss_coef": 0.05}}
RESUMED = ("mixtral", 3)  # stopped after step 3 and resumed (same layout, same process group, from disk)
CASES = [("mixtral", 0), *((model_type, stage) for model_type in MODELS for stage in (1, 2, 3))]
WORLD, EP = 4, 2


def case_name(model_type: str, stage: int) -> str:
    return f"{model_type}-ep{EP}-zero{stage}"


def overrides(root: Path, model_type: str, stage: int) -> list[str]:
    return [f"model.name={root / f'{model_type}.json'}", f"parallel.ep={EP}", f"parallel.zero_stage={stage}",
            "train.micro_batch=2", "train.steps=5", "checkpoint.save_final=true"]


def engine_specs(root: Path) -> list[str]:
    """conftest.engine_runs' specs (the 4-rank launch shared with test_architectures), after writing
    the models' configs under root."""
    from dsframework.models.tiny import tiny_config

    for model_type, fields in MODELS.items():
        tiny_config(model_type, **fields).to_json_file(root / f"{model_type}.json")
    specs = [f"{case_name(*case)}|{';'.join(overrides(root, *case))}" for case in CASES]
    stopped = ";".join([*overrides(root, *RESUMED), "train.stop_after=3", "checkpoint.save_final=false"])
    specs += [f"stopped|{stopped}", f"stopped|{';'.join(overrides(root, *RESUMED))}|resume"]
    # stopped at ep 2 and resumed at ep 4 (DeepSpeed's universal conversion of AutoEP's experts)
    at_ep2 = ";".join([*overrides(root, "mixtral", 1), "train.stop_after=3", "checkpoint.save_final=false"])
    at_ep4 = ";".join([*overrides(root, "mixtral", 1), "parallel.ep=4"])
    specs += [f"ep2-to-ep4|{at_ep2}", f"ep2-to-ep4|{at_ep4}|resume"]
    # ep 2 x dp 2 -> ep 1 x dp 4 (in AutoEP's blocks, kept by the resume) for step 4 -> ep 2 x dp 2
    at_ep1 = ";".join([*overrides(root, "mixtral", 1), "parallel.ep=1", "train.stop_after=4",
                       "checkpoint.save_final=false"])
    specs += [f"there-and-back|{at_ep2}", f"there-and-back|{at_ep1}|resume",
              f"there-and-back|{';'.join(overrides(root, 'mixtral', 1))}|resume"]
    return specs


@pytest.fixture(scope="module")
def trained(engine_runs) -> Path:
    return engine_runs


@pytest.mark.parametrize("model_type, stage", CASES, ids=[case_name(*case) for case in CASES])
def test_expert_parallel_trains_like_transformers(trained, model_type, stage):
    """5 steps within 1e-4 of the reference, whose loss adds the router's aux loss per forward; the
    same reference without it is further off than that (so the run did train with it)."""
    name = case_name(model_type, stage)
    run = build_run_config({}, run_overrides(trained / name, overrides(trained, model_type, stage)))
    got, want = losses(trained / name), reference_losses(run, dp=WORLD)
    assert_close(got, want, rtol=1e-4, what=name)
    without = build_run_config({}, run_overrides(trained / name, [*overrides(trained, model_type, stage),
                                                                  "model.overrides.output_router_logits=false"]))
    plain = reference_losses(without, steps=1, dp=WORLD)
    assert abs(plain[1] - got[1]) > 1e-3 * abs(got[1]), "the load-balancing loss is in the trained loss"


@pytest.mark.parametrize("model_type", list(MODELS))
def test_each_rank_holds_half_the_experts(trained, model_type):
    """At ZeRO-1 (weights whole on every rank): a rank holds the dense part and 1/ep of the experts."""
    from transformers import AutoConfig

    from dsframework.models.experts import expert_layout
    from dsframework.models.hf import causal_lm_class

    name = case_name(model_type, 1)
    config = AutoConfig.from_pretrained(trained / name / "checkpoints" / "hf_config")
    assert config.output_router_logits, "dsf trains a mixture of experts with its load-balancing loss"
    model = causal_lm_class(config)(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    assert expert_layout(config).experts % EP == 0 and experts > 0
    for rank in range(WORLD):
        held = json.loads((trained / name / f"held-rank{rank}.json").read_text())["parameters"]
        assert held == total - experts + experts // EP, (rank, held, total, experts)


@pytest.mark.parametrize("model_type, stage", CASES, ids=[case_name(*case) for case in CASES])
def test_export_writes_transformers_experts_with_the_engines_logits(trained, tmp_path, model_type, stage):
    """ZeRO 1-3 streamed from the memory-mapped fp32 partitions (experts split over the ep 2 x dp 2
    ranks' expert-data groups), ZeRO-0 from the per-expert files; AutoEP's w1 | w3 and w2 back to
    transformers' gate_up_proj and down_proj."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.distributed.launcher import dsf

    name = case_name(model_type, stage)
    before = sorted(p.name for p in (trained / name / "checkpoints").iterdir())
    dsf("export", str(trained / name / "checkpoints"), str(tmp_path / "hf"))
    assert sorted(p.name for p in (trained / name / "checkpoints").iterdir()) == before
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32).eval()
    assert model.config.model_type == model_type
    engine = torch.load(trained / name / "engine.pt")
    with torch.no_grad():
        exported = model(input_ids=engine["input_ids"]).logits
    assert torch.allclose(exported, engine["logits"], atol=1e-5, rtol=0), (
        f"max |diff| {(exported - engine['logits']).abs().max().item():.3g}")


def test_resume_at_the_same_layout_is_exact(trained):
    """Steps 4 and 5 after a stop at step 3 and a resume from its checkpoint (AutoEP's ZeRO-3
    partitions of the experts) equal the straight run's."""
    straight, resumed = losses(trained / case_name(*RESUMED)), losses(trained / "stopped")
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert_close({s: resumed[s] for s in (4, 5)}, {s: straight[s] for s in (4, 5)}, rtol=1e-6, what="resumed")


def test_resume_at_another_ep_continues_the_run(trained):
    """Stopped at ep 2 after step 3, resumed at ep 4 through DeepSpeed's universal conversion:
    steps 4 and 5 equal the straight ep 2 run's (the experts' fp32 weights and Adam moments moved)."""
    straight, resumed = losses(trained / case_name("mixtral", 1)), losses(trained / "ep2-to-ep4")
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert_close({s: resumed[s] for s in (4, 5)}, {s: straight[s] for s in (4, 5)}, rtol=1e-5, what="ep2 -> ep4")
    assert (trained / "ep2-to-ep4" / "checkpoints" / "global_step3.universal").is_dir()


def test_resume_at_ep1_and_back_continues_the_run(trained):
    """ep 2 x dp 2 stopped after step 3, step 4 at ep 1 x dp 4 (every rank holds all the experts,
    in AutoEP's blocks: the resume keeps them), step 5 at ep 2 x dp 2 again: each through
    DeepSpeed's universal conversion, equal to the straight ep 2 run's steps."""
    straight, resumed = losses(trained / case_name("mixtral", 1)), losses(trained / "there-and-back")
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert_close({s: resumed[s] for s in (4, 5)}, {s: straight[s] for s in (4, 5)}, rtol=1e-5, what="ep2 -> 1 -> 2")
    checkpoints = trained / "there-and-back" / "checkpoints"
    assert (checkpoints / "global_step3.universal").is_dir() and (checkpoints / "global_step4.universal").is_dir()
    saved = json.loads((checkpoints / "global_step4" / "dsf_manifest.json").read_text())["layout"]
    assert (saved["ep"], saved["autoep"], saved["dp"]) == (1, True, 4)


def test_resume_from_transformers_experts_into_autoep_is_refused_in_one_line(trained):
    """A checkpoint of transformers' own expert modules (ep 1 without parallel.autoep) resumed at ep 2
    is refused before any conversion, naming the way that works."""
    from dsframework.errors import UserError
    from dsframework.layout import ParallelDims
    from dsframework.checkpoints.manifest import MANIFEST, Manifest
    from dsframework.checkpoints.resume import keep_expert_blocks, resume_tag

    run = build_run_config({}, run_overrides(trained / "stopped", overrides(trained, *RESUMED)))
    dense = Manifest(step=5, layout=ParallelDims(world=WORLD, zero_stage=3).as_dict(), files={})
    assert keep_expert_blocks(run, dense) is run
    with pytest.raises(UserError, match=r"parallel.ep=2: cannot resume at tp 1 x pp 1 x cp 1 x dp 4, ep 2 from a "
                                        r"checkpoint saved at tp 1 x pp 1 x cp 1 x dp 4: experts move to another ep "
                                        r"or dp only between runs in DeepSpeed AutoEP's blocks .*; resume with "
                                        r"parallel.ep=1 \(start at ep 1 with parallel.autoep=true"):
        resume_tag(run, ParallelDims(world=WORLD, zero_stage=3, ep=2), dense, None)
    at_ep1 = run.model_copy(update={"parallel": run.parallel.model_copy(update={"ep": 1})})
    saved = Manifest.read(trained / "stopped" / "checkpoints" / "global_step5" / MANIFEST)
    assert keep_expert_blocks(at_ep1, saved).parallel.autoep


def test_the_first_line_names_the_experts(trained):
    import re

    # the launch's output holds every world-4 run of the session (test_architectures' Mixtral at
    # tp 2 x pp 2 among them): this module's runs are the dp 4 ones
    lines = [line for line in (trained / "stdout.txt").read_text().splitlines()
             if " parameters (" in line and "x dp 4" in line]
    first = re.compile(r"active per token: 4 experts, top 2, (\d) per rank\) \| world 4 = tp 1 x pp 1 x cp 1 x dp 4"
                       r"(?:, ep (\d)| \(AutoEP\)) \| ZeRO-")
    found = [first.search(line) for line in lines]
    assert lines and all(found), lines[:2]
    # the ep 4 resume, and the ep 1 one in AutoEP's blocks
    assert {(int(m.group(1)), int(m.group(2) or 1)) for m in found} == {(2, 2), (1, 4), (4, 1)}


@pytest.mark.parametrize("model_type", list(MODELS))
def test_the_routers_figures_are_logged(trained, model_type):
    """Step 1's logged aux loss and expert load (train/expert_load.py, read from AutoEP's blocks on
    4 ranks) equal those of transformers' own forwards on the same micro-batches in one process."""
    from tests.distributed.launcher import read_metrics
    from tests.distributed.reference import reference_router_figures

    name = case_name(model_type, 1)
    run = build_run_config({}, run_overrides(trained / name, overrides(trained, model_type, 1)))
    logged = next(r for r in read_metrics(trained / name) if r.get("step") == 1)
    want = reference_router_figures(run, dp=WORLD, top_k=2, experts=4)
    for key, value in want.items():
        assert abs(logged[key] - value) <= 1e-5 * abs(value), (key, logged[key], value)
    assert 0.25 <= logged["expert_load_max_share"] <= 1


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' spec at world 2: a local pretrained Qwen3-MoE with a chat template (saved
    under `root` first) fine-tuned on chats at ep 2 under ZeRO-3."""
    from tests.distributed.test_sft import addition_chats, pretrained_chat_model

    if ranks != 2:
        return []
    inputs = root / "experts-chat-inputs"
    inputs.mkdir()
    pretrained_chat_model(inputs / "pretrained", addition_chats(inputs / "chats.jsonl"), model_type="qwen3_moe")
    overrides = [f"model.name={inputs / 'pretrained'}", f"data.dataset={inputs / 'chats.jsonl'}", "data.format=chat",
                 "data.seq_len=128", "data.eval_fraction=0.1", "parallel.zero_stage=3", "parallel.ep=2",
                 "train.steps=30", "train.global_batch=8", "logging.eval_every=15"]
    return [f"experts-chat|eager|{';'.join(overrides)}"]


def test_a_pretrained_moe_chat_model_fine_tunes_at_ep2_under_zero3(shared_runs):
    """A local pretrained Qwen3-MoE directory (saved by shared_specs, with a chat template) fine-tunes
    on chats at ep 2 under ZeRO-3 (loaded partitioned, its experts split by AutoEP): the held-out loss
    on the assistant's tokens falls."""
    from tests.distributed.launcher import read_metrics

    evals = [row["eval_loss"] for row in read_metrics(shared_runs(2)[0] / "experts-chat") if "eval_loss" in row]
    assert len(evals) == 3 and evals[-1] < 0.7 * evals[0], evals
