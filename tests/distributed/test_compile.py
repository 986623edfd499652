"""train.compile and train.chunked_loss train what eager training with the whole logits trains.

One launch of 2 CPU ranks (tests/distributed/workers/train_matrix.py, shared with other modules:
conftest.shared_runs) trains tiny-llama 8 steps in every layout, eager with the plain loss
(at ZeRO 0, 2 and 3 test_zero's runs, the same run config) and compiled (with the chunked loss where
it applies), and the losses agree within 1e-4 at every step:

| layout         | compiled with | loss        |
|----------------|---------------|-------------|
| ZeRO-0, -1, -2 | aot_eager     | plain       |
| ZeRO-1 + eval  | aot_eager     | plain; eval losses agree too (the no-grad graph) |
| ZeRO-3         | inductor      | chunked     |
| tp 2           | aot_eager     | chunked (vocab-parallel) |
| pp 2           | aot_eager     | plain (a pipeline keeps the whole logits) |
| cp 2           | aot_eager     | chunked (each shard's labels) |
| ZeRO-2, auto   | aot_eager     | plain; train.compile=auto compiling after its 4 timed eager steps |

aot_eager runs the graphs dynamo and AOT autograd trace through DeepSpeed's hooks (where the
layouts differ) without generating kernels; the ZeRO-3 run uses inductor itself, as production
does, and reports its compile time out of tokens/s. The chunked loss's own equality of loss and
gradients (1e-5) is tests/unit/test_chunked_loss.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed.launcher import assert_close, losses, read_metrics

LAYOUTS = {
    "z0": ["parallel.zero_stage=0"],
    "z1": ["parallel.zero_stage=1", "logging.eval_every=4"],
    "z2": ["parallel.zero_stage=2"],
    "z3": ["parallel.zero_stage=3"],
    "tp2": ["parallel.zero_stage=1", "parallel.tp=2"],
    "pp2": ["parallel.zero_stage=1", "parallel.pp=2"],
    "cp2": ["parallel.zero_stage=1", "parallel.cp=2"],
}
CHUNKED = ["train.chunked_loss=true", "train.loss_chunk_tokens=50"]  # 128 tokens per micro-batch: 3 chunks
COMPILED = {  # layout -> (backend, extra overrides)
    "z0": ("aot_eager", []), "z1": ("aot_eager", []), "z2": ("aot_eager", []),
    "z3": ("inductor", CHUNKED), "tp2": ("aot_eager", CHUNKED), "pp2": ("aot_eager", []),
    "cp2": ("aot_eager", CHUNKED),
}


# test_zero.py's eager runs of these layouts (BASE_OVERRIDES train eager with the whole logits)
EAGER_FROM_TEST_ZERO = {"z0": "zero0", "z2": "zero2", "z3": "zero3"}


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs, at world 2: each layout compiled, and eager where test_zero has no run of it."""
    if ranks != 2:
        return []
    specs = []
    for name, overrides in LAYOUTS.items():
        if name not in EAGER_FROM_TEST_ZERO:
            specs.append(f"{name}|eager|{';'.join(overrides + ['train.compile=false', 'train.chunked_loss=false'])}")
        backend, extra = COMPILED[name]
        specs.append(f"{name}_compiled|{backend}|{';'.join(overrides + ['train.compile=true'] + extra)}")
        if name == "z2":  # (before cp, whose Ulysses attention stays registered in this process)
            specs.append("z2_auto|aot_eager|" + ";".join(overrides + ["train.compile=auto"]))
    return specs


def eager(root, layout: str) -> dict[int, float]:
    return losses(root / EAGER_FROM_TEST_ZERO.get(layout, layout))


@pytest.fixture(scope="module")
def matrix(shared_runs):
    root, stdout, _ = shared_runs(2)
    return root, stdout


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_training_matches_eager(matrix, layout):
    root, _ = matrix
    eager_losses, compiled = eager(root, layout), losses(root / f"{layout}_compiled")
    assert len(eager_losses) == 8 and eager_losses[8] < eager_losses[1], f"{layout}: the eager run does not learn"
    assert_close(compiled, eager_losses, rtol=1e-4, what=f"{layout}: compiled vs eager")


def test_compiled_evaluation_matches_eager(matrix):
    root, _ = matrix
    evals = [{m["step"]: m["eval_loss"] for m in read_metrics(root / name) if "eval_loss" in m}
             for name in ("z1", "z1_compiled")]
    assert sorted(evals[0]) == [0, 4, 8]
    assert_close(evals[1], evals[0], rtol=1e-4, what="eval loss, compiled vs eager")


def test_compile_time_is_reported_and_kept_out_of_tokens_per_s(matrix):
    root, stdout = matrix
    records = [m for m in read_metrics(root / "z3_compiled") if "loss" in m]
    assert records[0]["compile_s"] > 0, records[0]  # inductor compiles in the first step's window
    assert all("compile_s" not in m for m in records[1:]), records
    assert records[0]["tokens_per_s"] > 0
    assert "compile true | loss in chunks of 50 tokens" in stdout
    assert "dsf: compiled the model in" in stdout


def test_auto_compiles_mid_run_when_it_pays(matrix):
    """train.compile=auto times steps 2-4 eager, then (the worker expecting no compile time)
    compiles: the losses stay the eager run's and the compile seconds land in a later window."""
    root, stdout = matrix
    assert_close(losses(root / "z2_auto"), eager(root, "z2"), rtol=1e-4, what="z2: auto-compiled vs eager")
    assert re.search(r"dsf: train.compile=auto: 4 steps left x [\d.e-]+ s x 14% saved = [\d.e-]+ s > 0 s to "
                     r"compile: compiling", stdout), stdout[-3000:]
    # Compile seconds, if any, come after the decision (z2_compiled's graphs, already traced in this
    # process, may serve this model: dynamo takes parameters as inputs).
    records = [m for m in read_metrics(root / "z2_auto") if "loss" in m]
    assert all(m["step"] >= 5 for m in records if "compile_s" in m), records
    assert stdout.count("dsf: compiled the model in") == len(COMPILED) + 1, stdout[-3000:]  # every true run, and auto
