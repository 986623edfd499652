"""Sequence parallelism and tensor parallelism's random streams, in the 4-rank launch shared with
test_architectures (conftest.engine_runs: no launch of its own).

- Sequence parallelism (parallel.sequence_parallel, auto = on at tp > 1): test_architectures'
  tp2 x pp2 runs of the suite's architectures (Mixtral aside: its experts stay whole, so auto
  leaves it off) train with it on; here the same runs with it off give the same losses within
  1e-6, every step.
- GPT-2 with dropout 0.1 everywhere (embeddings, attention probabilities, residuals) at tp2 x dp2,
  the dropout masks of one training forward recorded (workers/architectures.py `masks`): the
  attention core's dropout (each tensor rank holds its own heads) draws a mask of its own on each
  tensor rank; without sequence parallelism the residual dropout (after the row-parallel
  all-reduce) the same mask on both; with it, each rank its own mask over its own tokens; the
  embedding's dropout, before the sequence is split, the same on both (parallel/rng.py's streams).
- What a rank saves for backward (tests/saved_tensors.py, one training forward of the same GPT-2)
  falls with sequence parallelism by what the planner counts (planner/memory.py: Korthikanti et
  al.'s norms and dropout masks split tp ways, the blocks' gathered inputs kept as a slice), within 10%.
- A run stopped at step 2 and resumed is the straight run, every step (GPT-2 with dropout,
  sequence parallel): the checkpoint saved and restored the tensor-parallel stream.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsframework.layout import ParallelDims
from dsframework.planner.memory import Layout, Workload, stage_memories
from dsframework.planner.model import describe_model
from tests.distributed.launcher import losses
from tests.distributed.test_architectures import ARCHITECTURES, overrides

SEQUENCE_PARALLEL = [t for t in ARCHITECTURES if t != "mixtral"]
DROPOUT = {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
RNG_LAYOUT = ["parallel.tp=2", "parallel.zero_stage=1", "train.micro_batch=2", "train.steps=4"]


def engine_specs(root: Path) -> list[str]:
    """conftest.engine_runs' specs (test_architectures writes those models' configs under root)."""
    from dsframework.models.tiny import tiny_config

    tiny_config("gpt2", **DROPOUT).to_json_file(root / "gpt2-dropout.json")
    run = ";".join([f"model.name={root / 'gpt2-dropout.json'}", *RNG_LAYOUT])
    off = [f"sp-off-{t}|{';'.join([*overrides(root, t), 'parallel.sequence_parallel=false'])}"
           for t in SEQUENCE_PARALLEL]
    return [*off, f"gpt2-dropout|{run};parallel.sequence_parallel=false|masks",
            f"gpt2-dropout-sp|{run};parallel.sequence_parallel=true|masks",
            f"gpt2-dropout-sp-resumed|{run};parallel.sequence_parallel=true;train.stop_after=2",
            f"gpt2-dropout-sp-resumed|{run};parallel.sequence_parallel=true|resume"]


@pytest.fixture(scope="module")
def trained(engine_runs) -> Path:
    return engine_runs


@pytest.mark.parametrize("model_type", SEQUENCE_PARALLEL)
def test_sequence_parallel_trains_as_without_it(trained, model_type):
    held = json.loads((trained / model_type / "held-rank0.json").read_text())
    assert held["sequence_parallel"] is True  # (auto)
    assert json.loads((trained / f"sp-off-{model_type}" / "held-rank0.json").read_text())["sequence_parallel"] is False
    on, off = losses(trained / model_type), losses(trained / f"sp-off-{model_type}")
    assert sorted(on) == sorted(off) == [1, 2, 3, 4]
    for step in on:
        assert on[step] == pytest.approx(off[step], rel=1e-6, abs=0), (step, on, off)


def _pairs(trained: Path, name: str) -> list[tuple[list, list]]:
    """Per data-parallel rank, (tensor rank 0's masks, tensor rank 1's)."""
    saved = [torch.load(path) for path in sorted((trained / name).glob("masks-rank*.pt"))]
    assert len(saved) == 4
    pairs = []
    for dp_rank in (0, 1):
        pair = sorted((s for s in saved if s["dp_rank"] == dp_rank), key=lambda s: s["tensor_rank"])
        assert [s["tensor_rank"] for s in pair] == [0, 1]
        assert len(pair[0]["masks"]) == len(pair[1]["masks"])
        pairs.append((pair[0]["masks"], pair[1]["masks"]))
    return pairs


LAYERS = 2  # models/tiny.py's depth: one attention dropout and two residual ones a layer, one embedding one


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_masks_differ_where_ranks_hold_their_own_and_agree_elsewhere(trained, sequence_parallel):
    for first, second in _pairs(trained, "gpt2-dropout-sp" if sequence_parallel else "gpt2-dropout"):
        shapes = [tuple(m.shape) for m in first]
        heads = [(a, b) for a, b in zip(first, second) if a.dim() == 4]  # [batch, heads / tp, seq, seq]
        residual = [(a, b) for a, b in zip(first, second) if a.dim() == 3]  # [batch, seq (/ tp with SP), hidden]
        assert len(heads) == LAYERS and len(residual) == 2 * LAYERS + 1, shapes
        embedding, residual = residual[0], residual[1:]
        for a, b in heads:
            assert not torch.equal(a, b), "the tensor ranks' heads drew the same mask"
            assert 0.8 < a.float().mean().item() < 0.97  # (kept share: 1 - dropout)
        assert torch.equal(*embedding), "the embedding's dropout (whole sequence, every rank) differs"
        seq = embedding[0].shape[1]
        for a, b in residual:
            assert a.shape[1] == (seq // 2 if sequence_parallel else seq), shapes
            assert torch.equal(a, b) is not sequence_parallel, "the residual dropout's masks, tensor rank 0 vs 1"


def test_a_resume_continues_the_straight_run_exactly(trained):
    straight, resumed = losses(trained / "gpt2-dropout-sp"), losses(trained / "gpt2-dropout-sp-resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=0), (step, straight, resumed)


def test_saved_activations_fall_by_what_the_planner_counts(trained):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(trained / "gpt2-dropout" / "checkpoints" / "hf_config")
    desc = describe_model(config, name="gpt2-dropout")

    def measured(name: str) -> float:
        saved = [torch.load(path)["saved_bytes"] for path in sorted((trained / name).glob("masks-rank*.pt"))]
        assert len(saved) == 4
        return sum(saved) / len(saved)

    def predicted(sequence_parallel: bool) -> float:
        layout = Layout(ParallelDims(world=4, tp=2, zero_stage=1), micro_batch=2, grad_accum=2,
                        sequence_parallel=sequence_parallel)
        return stage_memories(desc, layout, Workload(seq_len=32, global_batch=8, precision="fp32",
                                                     chunked_loss=False))[0].activations

    without, with_ = measured("gpt2-dropout"), measured("gpt2-dropout-sp")
    fall, counted = without - with_, predicted(False) - predicted(True)
    # The planner counts CUDA's dropout, which keeps a 1-byte mask; on the CPU (these ranks), dropout keeps its fp32
    # scaled noise (4 bytes): the two residual dropouts of each layer, on half the tokens, 3 bytes more
    tokens, tp = 2 * 32, 2
    counted += desc.layers * 2 * desc.hidden * 3 * tokens * (1 - 1 / tp)
    assert fall > 0 and abs(fall / counted - 1) < 0.10, (without, with_, predicted(False), predicted(True))
