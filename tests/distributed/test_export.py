"""Export round trip: ZeRO-3 training at world 2, and tp2 x pp2 at world 4 -> `dsf export` ->
`from_pretrained` gives the engine's logits; tensor-parallel and pipeline checkpoints export the
reference-trained weights; the exported directory trains again as a local pretrained model.
The trainings of this module share a launch per world size with other modules (conftest.shared_runs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsframework.config import build_run_config
from tests.distributed.launcher import TINY_YAML, Prefixed, dsf, launch, run_overrides, train_run
from tests.distributed.reference import reference_train

WORKER = Path(__file__).parent / "workers" / "engine_logits.py"
ZERO3 = ["parallel.zero_stage=3", "train.steps=4", "checkpoint.save_final=true"]
TRAINED_WEIGHTS = {  # test_export_holds_the_trained_weights
    "pp2_zero1": ["parallel.zero_stage=1", "parallel.pp=2", "train.micro_batch=2"],
    "tp2_zero1": ["parallel.zero_stage=1", "parallel.tp=2"],
    "tp2_zero3_gpt2": ["parallel.zero_stage=3", "parallel.tp=2", "model.name=tiny-gpt2"],
}
GPT2_FIRST = ["model.name=tiny-gpt2", "parallel.zero_stage=2", "train.steps=3", "checkpoint.save_final=true"]


def trained_weights_overrides(layout: str) -> list[str]:
    return [*TRAINED_WEIGHTS[layout], "train.steps=3", "checkpoint.save_final=true"]


TP2_PP2 = ["model.name=tiny-llama", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1",
           "train.micro_batch=2", "train.steps=3", "checkpoint.save_final=true"]


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs: zero3, the TRAINED_WEIGHTS layouts and gpt2_first at world 2,
    tp2_pp2 at world 4 (named export-<name>)."""
    runs = {2: {"zero3": ZERO3, **{name: trained_weights_overrides(name) for name in TRAINED_WEIGHTS},
                "gpt2_first": GPT2_FIRST},
            4: {"tp2_pp2": TP2_PP2}}.get(ranks, {})
    return [f"export-{name}|eager|{';'.join(overrides)}" for name, overrides in runs.items()]


@pytest.fixture(scope="module")
def trained(shared_runs) -> Prefixed:
    """This module's world-2 runs: `trained / "zero3"` is the zero3 run's directory."""
    return Prefixed(shared_runs(2)[0], "export-")


def export_and_compare_with_engine(tmp_path, run_dir: Path, overrides: list[str], *, num_ranks: int):
    """`dsf export` the trained run in run_dir, rebuild the engine from the checkpoint (a worker under
    the launcher): `from_pretrained` on the export gives the engine's logits within 1e-5. Returns the export."""
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "hf"
    dsf("export", str(run_dir / "checkpoints"), str(hf_dir))
    sets = [arg for o in run_overrides(run_dir, overrides) for arg in ("--set", o)]
    launch([str(WORKER), str(TINY_YAML), str(tmp_path / "engine.pt"), *sets], num_ranks=num_ranks)
    engine = torch.load(tmp_path / "engine.pt")

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        exported = model(input_ids=engine["input_ids"]).logits
    assert exported.shape == engine["logits"].shape
    assert torch.allclose(exported, engine["logits"], atol=1e-5, rtol=0), (
        f"max |diff| {(exported - engine['logits']).abs().max().item():.3g}")
    return hf_dir


def test_zero3_export_round_trip(tmp_path, trained):
    from transformers import AutoTokenizer

    hf_dir = export_and_compare_with_engine(tmp_path, trained / "zero3", ZERO3, num_ranks=2)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    assert tokenizer.decode(tokenizer("17,18,19", add_special_tokens=False)["input_ids"]) == "17,18,19"
    assert json.loads((hf_dir / "config.json").read_text())["vocab_size"] == len(tokenizer)


def test_tp2_pp2_export_round_trip(tmp_path, shared_runs):
    """Four ranks, two tensor ranks per stage: the exported directory gives the logits of the
    engine rebuilt from the same checkpoint (its last stage, vocab slices gathered). (GPT-2's
    fused q|k|v merge through a real checkpoint is in the tp2_zero3_gpt2 case below.)"""
    export_and_compare_with_engine(tmp_path, shared_runs(4)[0] / "export-tp2_pp2", TP2_PP2, num_ranks=4)


@pytest.mark.parametrize("layout", list(TRAINED_WEIGHTS))
def test_export_holds_the_trained_weights(tmp_path, trained, layout):
    """Two pipeline stages (per-layer files) and tensor-parallel shards (ZeRO-1 partitions of a
    Llama, ZeRO-3 partitions of a GPT-2 with its fused q|k|v, per tensor rank): the exported model
    equals the single-process reference after the same 3 steps. (Stages 0 and 1 without TP or PP:
    test_zero.py, on its own runs.)"""
    from transformers import AutoModelForCausalLM

    overrides, run_dir = trained_weights_overrides(layout), trained / layout
    dsf("export", str(run_dir / "checkpoints"), str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    _, reference = reference_train(build_run_config({}, run_overrides(run_dir, overrides)))
    input_ids = torch.arange(32).remainder(exported.config.vocab_size).view(2, 16)
    with torch.no_grad():
        got, want = exported(input_ids=input_ids).logits, reference.eval()(input_ids=input_ids).logits
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_gpt2_trains_from_a_local_pretrained_directory(tmp_path, trained):
    """A different architecture (GPT-2, tied embeddings) on ZeRO-2, exported, then loaded back
    with from_pretrained under ZeRO-3: its first loss equals the exported model's loss."""
    from transformers import AutoModelForCausalLM

    first_dir, hf_dir = trained / "gpt2_first", tmp_path / "hf"
    dsf("export", str(first_dir / "checkpoints"), str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "ties survive export"

    again = train_run(tmp_path / "again", [f"model.name={hf_dir}", "parallel.zero_stage=3", "train.steps=2",
                                           "train.lr=1e-9", "train.warmup_steps=0"])
    # Same data and order as the first run's step 1 batch: recompute that loss on the export.
    from dsframework.data import BlockSampler, load_texts, load_tokenizer
    from tests.packing_reference import pack_splits

    run = build_run_config({}, run_overrides(tmp_path / "again", [f"model.name={hf_dir}"]))
    tokenizer = load_tokenizer(hf_dir)
    blocks, _ = pack_splits(load_texts(run.data), tokenizer, run.data)
    indices = BlockSampler(len(blocks), micro_batch=8, grad_accum=1, dp_size=1, dp_rank=0,
                           seed=run.data.seed).global_indices(0)
    with torch.no_grad():
        want = model(input_ids=blocks[indices], labels=blocks[indices]).loss.item()
    assert abs(again[1] - want) / want < 1e-5, (again[1], want)
