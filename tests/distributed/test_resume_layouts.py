"""Resume at any layout: a checkpoint saved at one tp x pp x dp resumes at another (ZeRO-1, global
batch 8, micro-batch 2) with its optimizer states, and the steps after the resume give the losses
of a run that trained at the new layout all along, within 1e-4.

Four runs of 6 steps on 4 ranks, one per layout, each saving global_step4, serve as both the
sources and the references: a transition copies the source run's output_dir, resumes it at the
target layout for steps 5-6 and compares them with the target run's. The layouts are equivalent,
so the four straight runs agree with each other too (within 1e-5: a check on the references).
The four straight runs share one launch with other modules' runs (conftest.shared_runs), and the
four transitions' resumes another.
One transition (tp 2 x pp 2 -> tp 1 x dp 4) saves again after the resume and is exported: run.yaml
still says tp 2, the manifest tp 1, and `dsf export` gives the resumed engine's logits (export reads
the layout the checkpoint has). A checkpoint lacking a file the conversion reads is named in one line,
nothing written. Without
processes: the dense <-> shard cuts agree with the shards the tensor-parallel plan makes, with
vocab padding (vocab 17), grouped kv heads, tied embeddings and GPT-2's fused, transposed Conv1D.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import TINY_YAML, assert_close, dsf, launch, losses, read_metrics, run_overrides
from tests.distributed.launcher import train_runs

COMMON = ["parallel.zero_stage=1", "train.steps=6", "train.micro_batch=2", "checkpoint.every=4"]
LAYOUTS = {  # name: parallel settings on 4 ranks
    "tp1pp1dp4": ["parallel.tp=1", "parallel.pp=1"],
    "tp2pp1dp2": ["parallel.tp=2", "parallel.pp=1"],
    "tp2pp2dp1": ["parallel.tp=2", "parallel.pp=2"],
    "tp1pp2dp2": ["parallel.tp=1", "parallel.pp=2"],
}
TRANSITIONS = [  # (saved at, resumed at)
    ("tp2pp2dp1", "tp1pp1dp4"),
    ("tp1pp1dp4", "tp2pp1dp2"),
    ("tp1pp2dp2", "tp1pp1dp4"),
    ("tp1pp1dp4", "tp2pp2dp1"),  # into a pipeline engine with tensor shards
]
EXPORTED = ("tp2pp2dp1", "tp1pp1dp4")  # saved again after the resume, then exported
ENGINE_LOGITS = Path(__file__).parent / "workers" / "engine_logits.py"


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs: each layout's uninterrupted run, at world 4."""
    layouts = LAYOUTS if ranks == 4 else {}
    return [f"{name}|eager|{';'.join([*COMMON, *parallel])}" for name, parallel in layouts.items()]


@pytest.fixture(scope="module")
def straight(shared_runs) -> dict[str, tuple[Path, dict[int, float]]]:
    """Each layout's uninterrupted run: output_dir (with global_step4) and step -> loss (one launch)."""
    root = shared_runs(4)[0]
    return {name: (root / name, losses(root / name)) for name in LAYOUTS}


def test_layouts_agree_before_any_resume(straight):
    reference = straight["tp1pp1dp4"][1]
    for name, (_, got) in straight.items():
        assert_close(got, reference, rtol=1e-5, what=f"{name} vs tp1pp1dp4, straight")


def transition_name(saved: str, target: str) -> str:
    return f"{saved}-to-{target}"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, straight) -> dict[str, tuple[Path, dict[int, float], list[Path], list[str]]]:
    """transition -> (its output_dir: the source run's, resumed at the target layout to step 6;
    step -> loss; the files of global_step4 before the resume; its overrides). All resumes in one launch."""
    root = tmp_path_factory.mktemp("resumed")
    runs, before = {}, {}
    for saved, target in TRANSITIONS:
        name = transition_name(saved, target)
        shutil.copytree(straight[saved][0], root / name)
        ckpts = root / name / "checkpoints"
        assert (ckpts / "latest").read_text().strip() == "global_step4"
        before[name] = sorted(p.relative_to(ckpts) for p in (ckpts / "global_step4").rglob("*"))
        final = ["checkpoint.save_final=true"] if (saved, target) == EXPORTED else []
        runs[name] = [*COMMON, *LAYOUTS[target], *final]
    got = train_runs(root, runs, num_ranks=4, resumed=tuple(runs))
    return {name: (root / name, got[name], before[name], runs[name]) for name in runs}


@pytest.mark.parametrize("saved,target", TRANSITIONS, ids=[transition_name(*t) for t in TRANSITIONS])
def test_resume_at_another_layout(tmp_path, straight, resumed, saved, target):
    out, losses, before, overrides = resumed[transition_name(saved, target)]
    ckpts = out / "checkpoints"
    assert sorted(losses) == list(range(1, 7)), "metrics.jsonl holds each step once"
    want = straight[target][1]
    assert_close({s: losses[s] for s in (5, 6)}, {s: want[s] for s in (5, 6)}, rtol=1e-4,
                 what=f"{saved} -> {target}: steps 5-6 vs the straight {target} run")
    lrs = {m["step"]: m["lr"] for m in read_metrics(out) if "lr" in m}
    want_lrs = {m["step"]: m["lr"] for m in read_metrics(straight[target][0]) if "lr" in m}
    assert lrs == pytest.approx(want_lrs, rel=1e-12), "the lr schedule continued"
    converted = ckpts / f"global_step4.universal-{target}"
    for param in (converted / "zero").iterdir():  # Adam's moments and step came along, not reset
        if param.is_dir():
            assert torch.load(param / "step.pt", weights_only=False) == 4, param.name
            assert torch.load(param / "exp_avg_sq.pt")["param"].abs().sum() > 0, param.name
    assert sorted(p.relative_to(ckpts) for p in (ckpts / "global_step4").rglob("*")) == before
    assert not list(ckpts.glob("*.partial"))
    if (saved, target) == EXPORTED:
        export_gives_the_engines_logits(tmp_path, out, overrides)


def export_gives_the_engines_logits(tmp_path, out, overrides):
    """The resumed run's last checkpoint (tp 1, in a run whose run.yaml says tp 2) exports, and
    `from_pretrained` on it gives the logits of the engine rebuilt from that checkpoint."""
    from transformers import AutoModelForCausalLM

    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step6"
    assert "tp: 2" in (ckpts / "run.yaml").read_text()  # a resume never rewrites it
    dsf("export", str(ckpts), str(tmp_path / "hf"))
    sets = [arg for o in run_overrides(out, overrides) for arg in ("--set", o)]
    launch([str(ENGINE_LOGITS), str(TINY_YAML), str(tmp_path / "engine.pt"), *sets], num_ranks=4)
    engine = torch.load(tmp_path / "engine.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        exported = model(input_ids=engine["input_ids"]).logits
    assert torch.allclose(exported, engine["logits"], atol=1e-5, rtol=0), (
        f"max |diff| {(exported - engine['logits']).abs().max().item():.3g}")


def test_a_missing_partition_is_named_and_nothing_is_written(tmp_path, straight):
    from transformers import AutoConfig

    from dsframework.errors import UserError
    from dsframework.layout import ParallelDims
    from dsframework.checkpoints.reshard import reshard

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(straight["tp2pp2dp1"][0] / "checkpoints", ckpts)
    missing = ckpts / "global_step4" / "zero_pp_rank_0_mp_rank_03_optim_states.pt"
    missing.unlink()
    before = sorted(p.relative_to(ckpts) for p in ckpts.rglob("*"))
    config = AutoConfig.from_pretrained(ckpts / "hf_config")
    with pytest.raises(UserError) as raised:
        reshard(ckpts, "global_step4", config, target=ParallelDims(world=4))  # saved: its manifest's
    message = str(raised.value)
    assert "\n" not in message and str(missing) in message and "parallel.tp=2" in message, message
    assert sorted(p.relative_to(ckpts) for p in ckpts.rglob("*")) == before


SHARD_CASES = {  # id: (preset, config overrides, tp)
    "llama-gqa-tp2": ("tiny-llama", {}, 2),
    "llama-tied-tp4": ("tiny-llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}, 4),
    "gpt2-tp2": ("tiny-gpt2", {}, 2),
    "gpt2-tp4": ("tiny-gpt2", {}, 4),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_dense_and_shards_round_trip_as_the_plan_cuts_them(case):
    """What reshard stores for a sharded parameter, chunked as DeepSpeed's loader chunks it, is
    each rank's shard as `shard_model` cuts it; merging those shards gives the dense tensor."""
    import copy

    from transformers import AutoConfig

    from dsframework.models.hf import causal_lm_class

    from dsframework.models.presets import PRESETS
    from dsframework.models.tensor_parallel import merge_tensor_parallel_tensor, shard_layouts, shard_model
    from dsframework.parallel.tensor import LayoutOnlyGroup
    from dsframework.checkpoints.reshard import concatenated_shards
    from dsframework.models.hf import hf_parameter_shapes

    preset, overrides, tp = SHARD_CASES[case]
    fields = {**PRESETS[preset], "vocab_size": 17, **overrides}  # 17: padded to a multiple of tp
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    dense = causal_lm_class(config)(config)
    weights = {name: p.detach() for name, p in dense.named_parameters()}
    ranks = [{name: p.detach() for name, p in shard_model(copy.deepcopy(dense), group=LayoutOnlyGroup(
        size=tp, rank=rank)).named_parameters(remove_duplicate=False)} for rank in range(tp)]
    layouts = shard_layouts(config, tp)
    sharded = [name for name in hf_parameter_shapes(config) if name in layouts[0]]
    assert any("embed" in name or "wte" in name for name in sharded)
    for name in sharded:
        per_rank = [layout[name] for layout in layouts]
        stored = concatenated_shards(weights[name], per_rank)
        for rank, chunk in enumerate(stored.chunk(tp, dim=per_rank[0][0])):
            assert torch.equal(chunk, ranks[rank][name]), f"{name}: rank {rank}'s chunk"
        assert torch.equal(merge_tensor_parallel_tensor(name, [shards[name] for shards in ranks], layouts),
                           weights[name]), name
