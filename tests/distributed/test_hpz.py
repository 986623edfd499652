"""ZeRO++ hierarchical partitioning (`parallel.zero_hpz`) at world 4, ZeRO-3: hpZ 2 at dp 4 and at
cp 2 x dp 2 trains to plain ZeRO-3's losses and the single-process reference's, a stopped hpZ run
resumes exactly and its checkpoint exports the reference's weights, weight all-gathers run inside
groups of 2 ranks, and each rank holds the model states the planner predicts (the secondary
partition included). Plain ZeRO-3, hpZ stopped at step 4, and cp 2 x dp 2 with hpZ train in the
world-4 launch other modules share (conftest.shared_runs); hpZ resumes in a new process group, and one
measuring launch serves both hpZ layouts.

The model is tiny-llama widened so its weights lie above ZeRO-3's persistence threshold (100k
elements; below it DeepSpeed keeps a weight whole on every rank after the first step and hpZ has
nothing to gather), with micro-batches of one sequence (gradient accumulation under hpZ too).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsframework.config import build_run_config, load_run_config
from dsframework.dsconfig import resolve_batch
from dsframework.layout import ParallelDims
from dsframework.planner.memory import Workload, Layout, memory_per_rank
from dsframework.planner.model import describe_model
from tests.distributed.launcher import TINY_YAML, Prefixed, assert_close, launch, losses, read_metrics, run_overrides
from tests.distributed.launcher import train_run
from tests.distributed.reference import assert_export_matches, reference_train

WORKER = Path(__file__).parent / "workers" / "hpz_states.py"
WORLD = 4
MODEL = ["model.overrides.hidden_size=384", "model.overrides.intermediate_size=1024",
         "model.overrides.num_key_value_heads=4"]  # every matrix >= 147k elements: partitioned
COMMON = [*MODEL, "parallel.zero_stage=3", "train.micro_batch=1", "train.lr=1e-3"]  # 1 x accum 2 x dp 4 = 8
HPZ = [*COMMON, "parallel.zero_hpz=2", "checkpoint.save_final=true"]
CP_HPZ = [*COMMON, "parallel.cp=2", "parallel.zero_hpz=2"]  # cp 2 x dp 2: ZeRO and hpZ over cp x dp
STATES_BASE = ["model.name=tiny-llama", "data.dataset=counting", "data.num_examples=400", "data.seq_len=32",
               "train.global_batch=8", "train.precision=fp32", "logging.progress=false", "logging.eval_every=0",
               "checkpoint.every=0", "checkpoint.save_final=false"]


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs at world 4 (named hpz-<name>): plain ZeRO-3, hpZ 2 stopped after
    step 4, cp 2 x dp 2 with hpZ 2."""
    runs = {"zero3": COMMON, "hpz2": [*HPZ, "train.stop_after=4"], "cp2_hpz2": CP_HPZ} if ranks == WORLD else {}
    return [f"hpz-{name}|eager|{';'.join(overrides)}" for name, overrides in runs.items()]


@pytest.fixture(scope="module")
def runs(shared_runs):
    """Step -> loss of plain ZeRO-3 (8 steps straight), of hpZ 2 (4 steps, a stop with a
    checkpoint, `--resume` for 4 more and a final checkpoint) and of cp 2 x dp 2 with hpZ 2, the
    single-process reference's losses and model, and the run directories (the first three in
    conftest.shared_runs' launch of world 4)."""
    root = Prefixed(shared_runs(WORLD)[0], "hpz-")
    out = {"root": root, "zero3": losses(root / "zero3"), "hpz2_first": losses(root / "hpz2"),
           "cp2_hpz2": losses(root / "cp2_hpz2")}
    out["hpz2_latest_at_stop"] = (root / "hpz2" / "checkpoints" / "latest").read_text().strip()
    out["hpz2"] = train_run(root / "hpz2", HPZ, num_ranks=WORLD, flags=("--resume",))
    out["reference"], out["reference_model"] = reference_train(build_run_config({}, run_overrides(root / "hpz2", HPZ)))
    return out


@pytest.mark.parametrize("name", ["hpz2", "cp2_hpz2"])
def test_hpz_trains_to_plain_zero3_and_the_reference(runs, name):
    """Steps 1-8 of hpZ 2 at dp 4 (5-8 after the resume) and at cp 2 x dp 2, against plain ZeRO-3
    at dp 4 and one process seeing whole sequences."""
    assert len(runs["reference"]) == 8 and runs["reference"][8] < runs["reference"][1]
    assert_close(runs[name], runs["zero3"], rtol=1e-4, what=f"{name} vs plain ZeRO-3 at dp 4")
    assert_close(runs[name], runs["reference"], rtol=1e-4, what=f"{name} vs single process")


def test_hpz_resume_is_exact(runs):
    """The stopped hpZ run goes on where it stopped: steps 1-4 before the stop and 5-8 after it
    equal the straight run's within 1e-6, learning rates included. The straight run is plain
    ZeRO-3's: hpZ changes where a weight is gathered from, never its value, so an uninterrupted
    hpZ run is plain ZeRO-3 step for step (bit for bit on these CPU ranks), as steps 1-4 show."""
    assert sorted(runs["hpz2_first"]) == [1, 2, 3, 4] and runs["hpz2_latest_at_stop"] == "global_step4"
    resumed, straight = runs["hpz2"], runs["zero3"]
    assert sorted(resumed) == list(range(1, 9)), "metrics.jsonl holds each step once"
    assert_close({s: resumed[s] for s in range(1, 5)}, {s: straight[s] for s in range(1, 5)},
                 rtol=1e-6, what="hpZ 2 steps 1-4 vs plain ZeRO-3")
    assert_close({s: resumed[s] for s in range(5, 9)}, {s: straight[s] for s in range(5, 9)},
                 rtol=1e-6, what="hpZ 2: resumed steps 5-8 vs straight")
    lrs = {m["step"]: m["lr"] for m in read_metrics(runs["root"] / "hpz2") if "lr" in m}
    assert lrs == pytest.approx({m["step"]: m["lr"] for m in read_metrics(runs["root"] / "zero3") if "lr" in m},
                                rel=1e-12)


def test_hpz_export_holds_the_reference_weights(runs):
    """`dsf export` of the resumed hpZ run's step-8 checkpoint gives the reference's logits."""
    assert_export_matches(runs["root"] / "hpz2", runs["reference_model"])


STATE_CASES = {"hpz2": "parallel.zero_stage=3,parallel.zero_hpz=2",
               "cp2_hpz2": "parallel.zero_stage=3,parallel.zero_hpz=2,parallel.cp=2"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """case -> (output dir, [per-rank measurement]) of STATE_CASES (workers/hpz_states.py), one launch."""
    out = tmp_path_factory.mktemp("hpz_states")
    sets = [arg for o in [*STATES_BASE, *MODEL, "train.micro_batch=1"] for arg in ("--set", o)]
    launch([str(WORKER), str(out), str(TINY_YAML), *[f"case:{n}:{o}" for n, o in STATE_CASES.items()], *sets],
           num_ranks=WORLD)
    results = {}
    for name in STATE_CASES:
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-rank*.json"))]
        assert len(ranks) == WORLD, f"{name}: {len(ranks)} of {WORLD} ranks reported"
        results[name] = (out / name, ranks)
    return results


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_hpz_gathers_weights_within_groups_of_two(measured, case):
    """Every rank holds a secondary partition split over 2 ranks, and weight all-gathers ran over
    groups of 2 (from the secondary copy) besides all 4 ranks ZeRO shards over (dp, or cp x dp)."""
    _, ranks = measured[case]
    for got in ranks:
        assert got["hpz_group"] == 2 and got["secondary"] > 0, got
        assert got["gathers"].get("2", 0) > 0, f"rank {got['rank']}: no all-gather within a group of 2: {got}"
        assert set(got["gathers"]) <= {"2", str(WORLD)}, got


def planned(output_dir: Path, *, zero_hpz: int):
    """The planner's memory for the run that wrote `output_dir`, at `zero_hpz`."""
    from transformers import AutoConfig

    run = load_run_config(output_dir / "checkpoints" / "run.yaml")
    desc = describe_model(AutoConfig.from_pretrained(output_dir / "checkpoints" / "hf_config"), name="tiny-llama")
    cp = run.parallel.cp
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=WORLD // cp)
    layout = Layout(ParallelDims(world=WORLD, cp=cp, zero_stage=3, zero_hpz=zero_hpz), micro_batch=batch.micro_batch,
                    grad_accum=batch.grad_accum)
    return memory_per_rank(desc, layout, Workload(seq_len=run.data.seq_len, global_batch=batch.global_batch,
                                             precision=run.train.precision))


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_hpz_model_states_match_the_planner(measured, case):
    """Per rank, params (partition + persistent weights + the secondary partition), gradients and
    optimizer states are within 5% of the planner's prediction, and so is the secondary partition
    alone (the planner's params at hpZ 2 less its params at hpZ 1)."""
    output_dir, ranks = measured[case]
    want, without = planned(output_dir, zero_hpz=2), planned(output_dir, zero_hpz=1)
    expected = {"params": want.params + want.cpu_params, "grads": want.grads + want.cpu_grads,
                "optimizer": want.optimizer + want.cpu_optimizer, "secondary": want.params - without.params}
    for got in ranks:
        for key, value in expected.items():
            assert got[key] > 0, f"rank {got['rank']}: measured no {key}"
            assert abs(value - got[key]) <= 0.05 * got[key], (
                f"{case} rank {got['rank']} {key}: predicted {value:,.0f} B, engine holds {got[key]:,} B")
