"""Context parallelism (DeepSpeed Ulysses, `parallel.cp`) trains exactly: each rank of a context
group holds seq_len / cp tokens of the same sequences, and the losses equal a single-process
reference that sees whole sequences, for ZeRO 0-3, the Llama family, GPT-2 and Granite (its
logits scaled after the head), at cp 2 (world 2),
cp 2 x dp 2 and tp 2 x cp 2 (world 4): each stage and each family at least once, not every
product (the suite's time); eval, resume and export work.

Every run is a real `dsf train` on N CPU ranks (gloo); the reference is the single-process plain
PyTorch loop of reference.py over the same weights and global batches. Launches are shared: one run
per layout, the runs of a world size in one launch with other modules' runs (conftest.shared_runs);
the resume and export checks reuse them.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dsframework.config import build_run_config
from tests.distributed.launcher import assert_close, losses, read_metrics, run_overrides, train_run
from tests.distributed.reference import assert_export_matches, reference_train

SAVE = ["checkpoint.every=4", "checkpoint.save_final=true"]
# name -> (ranks, settings): every stage, both families, each world; Llama at ZeRO-2 and GPT-2 at
# ZeRO-0 are not run (the stage paths are the same for both families).
RUNS = {
    "cp2-zero0-llama": (2, ["parallel.cp=2", "parallel.zero_stage=0", "logging.eval_every=4"]),
    "cp2-zero1-gpt2": (2, ["parallel.cp=2", "parallel.zero_stage=1", "model.name=tiny-gpt2"]),
    "cp2-zero3-gpt2": (2, ["parallel.cp=2", "parallel.zero_stage=3", "model.name=tiny-gpt2"]),
    "cp2xdp2-zero3-llama": (4, ["parallel.cp=2", "parallel.zero_stage=3", *SAVE]),
    "cp2xdp2-zero2-gpt2": (4, ["parallel.cp=2", "parallel.zero_stage=2", "model.name=tiny-gpt2"]),
    "tp2xcp2-zero3-llama": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.zero_stage=3", "checkpoint.save_final=true"]),
    # Granite divides its head's logits by logits_scaling before its loss: a shard's loss must too
    "cp2-zero1-granite": (2, ["parallel.cp=2", "parallel.zero_stage=1", "model.name={root}/granite.json"]),
}
GRANITE = {"logits_scaling": 0.25}  # logits x4: a loss that skipped the scaling would be far off


def settings(name: str, root: Path) -> list[str]:
    """RUNS[name]'s settings, with the shared launch's root where a model config was written."""
    return [setting.format(root=root) for setting in RUNS[name][1]]


def _family(name: str) -> str:
    return name.rsplit("-", 1)[1]


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs: the runs of this world size (Granite's config written under root)."""
    from dsframework.models.tiny import tiny_config

    if ranks == 2:
        tiny_config("granite", **GRANITE).to_json_file(root / "granite.json")
    return [f"{name}|eager|{';'.join(settings(name, root))}" for name, (world, _) in RUNS.items() if world == ranks]


@pytest.fixture(scope="module")
def cp_runs(shared_runs):
    """name -> (step -> loss) of every run in RUNS, "dir-<name>" -> its directory;
    "reference-<family>" -> (losses, model)."""
    runs, roots = {}, {}
    for name, (ranks, _) in RUNS.items():
        roots[name] = shared_runs(ranks)[0]
        runs[f"dir-{name}"] = roots[name] / name
        runs[name] = losses(runs[f"dir-{name}"])
    for family in ("llama", "gpt2", "granite"):
        name = next(n for n in RUNS if _family(n) == family)
        run = build_run_config({}, run_overrides(runs[f"dir-{name}"], settings(name, roots[name])))
        runs[f"reference-{family}"] = reference_train(run)
    return runs


@pytest.mark.parametrize("name", list(RUNS))
def test_context_parallel_matches_the_whole_sequence_reference(cp_runs, name):
    want, _ = cp_runs[f"reference-{_family(name)}"]
    assert want[8] < want[1], "the reference learns"
    assert_close(cp_runs[name], want, rtol=1e-4, what=f"{name} vs one process seeing whole sequences")
    # step 1: the untrained model's loss on the same batch, transformers' own (with Granite's scaling)
    assert abs(cp_runs[name][1] - want[1]) <= 1e-5 * want[1], (name, cp_runs[name][1], want[1])


def _mean_loss(model, blocks, micro_batch: int) -> float:
    from dsframework.data import eval_shard

    with torch.no_grad():
        batches = [blocks[i] for i in eval_shard(len(blocks), micro_batch=micro_batch, dp_size=1, dp_rank=0)]
        return sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)


def test_eval_loss_is_the_whole_sequence_loss(cp_runs):
    """cp 2 at dp 1: the eval loss after 8 steps is the reference model's on the same blocks."""
    from dsframework.data import load_texts, load_tokenizer
    from tests.packing_reference import pack_splits

    run_dir = cp_runs["dir-cp2-zero0-llama"]
    run = build_run_config({}, run_overrides(run_dir, RUNS["cp2-zero0-llama"][1]))
    _, held_out = pack_splits(load_texts(run.data), load_tokenizer(run.checkpoint_dir / "tokenizer"), run.data)
    evals = {m["step"]: m["eval_loss"] for m in read_metrics(run_dir) if "eval_loss" in m}
    assert sorted(evals) == [0, 4, 8]
    want = _mean_loss(cp_runs["reference-llama"][1].eval(), held_out, micro_batch=8)
    assert abs(evals[8] - want) <= 1e-4 * want, (evals, want)


@pytest.mark.parametrize("name", ["cp2xdp2-zero3-llama"])
def test_resume_from_a_context_parallel_checkpoint_is_exact(cp_runs, tmp_path, name):
    """The step-4 checkpoint of the run, resumed, gives the run's own steps 5-8 (1e-6)."""
    ranks, run_settings = RUNS[name]
    resumed_dir = tmp_path / name
    shutil.copytree(cp_runs[f"dir-{name}"], resumed_dir)
    ckpts = resumed_dir / "checkpoints"
    shutil.rmtree(ckpts / "global_step8")
    (ckpts / "latest").write_text("global_step4")
    resumed = train_run(resumed_dir, run_settings, num_ranks=ranks, flags=("--resume",))
    assert_close({s: resumed[s] for s in range(5, 9)}, {s: cp_runs[name][s] for s in range(5, 9)},
                 rtol=1e-6, what=f"{name} resumed at step 4")


@pytest.mark.parametrize("name", ["cp2xdp2-zero3-llama", "tp2xcp2-zero3-llama"])
def test_export_holds_the_reference_weights(cp_runs, name):
    """`dsf export` of the step-8 checkpoint gives the reference's logits (1e-4)."""
    assert_export_matches(cp_runs[f"dir-{name}"], cp_runs["reference-llama"][1])


def test_resume_refuses_another_context_parallel_size(cp_runs, tmp_path):
    """A checkpoint saved at cp 2 resumed at cp 1: one line naming the field, exit 2, nothing touched."""
    import subprocess

    from dsframework.checkpoints.outputs import LOCK
    from tests.distributed.launcher import BIN, TINY_YAML, rank_env

    run_dir = tmp_path / "moved"
    shutil.copytree(cp_runs["dir-cp2xdp2-zero3-llama"], run_dir)

    def files() -> dict:  # every file's mtime (but the lock a resume past pre-flight takes: checkpoints/outputs.py;
        # a directory's own mtime moves with pre-flight's write probe, made and removed in it)
        return {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != LOCK}

    before = files()
    settings = [s for s in RUNS["cp2xdp2-zero3-llama"][1] if s != "parallel.cp=2"]
    sets = [a for o in run_overrides(run_dir, settings) for a in ("--set", o)]
    proc = subprocess.run([str(BIN / "dsf"), "train", str(TINY_YAML), *sets, "--resume"], capture_output=True,
                          text=True, timeout=300, env=rank_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "dsf: error: parallel.cp=1: differs from the checkpoint's 2"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert files() == before


def _whole_sequence_saved_bytes(name: str, micro_batch: int, seq_len: int) -> tuple[int, float]:
    from dsframework.config import ModelSpec
    from dsframework.models.build import build_model, resolve_model
    from tests.distributed.workers.cp_activations import VOCAB
    from tests.saved_tensors import saved_bytes

    torch.manual_seed(0)
    source = resolve_model(ModelSpec(name=name))
    source.config.vocab_size = VOCAB
    model = build_model(source, source.config, seed=1).train()
    input_ids = torch.randint(0, VOCAB, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    return saved_bytes(model, lambda: model(input_ids=input_ids, labels=input_ids).loss.item())


def test_context_parallel_halves_the_activations_the_planner_predicts(tmp_path):
    """The same micro-batch (2 x 512 tokens) at cp 1 (one process) and cp 2 (two ranks): each cp-2
    rank saves about half the bytes for backward (plus what Ulysses adds), and both are within 15%
    of the planner's activation memory; the loss is the same."""
    from dsframework.config import ModelSpec
    from dsframework.models.build import resolve_model
    from dsframework.layout import ParallelDims
    from dsframework.planner.memory import Workload, Layout, memory_per_rank
    from dsframework.planner.model import describe_model
    from tests.distributed.launcher import launch
    from tests.distributed.workers.cp_activations import VOCAB

    micro_batch, seq_len, names = 2, 512, ["tiny-llama", "tiny-gpt2"]
    launch([str(Path(__file__).parent / "workers" / "cp_activations.py"), str(tmp_path), str(micro_batch),
            str(seq_len), *names], num_ranks=2)
    import json

    for name in names:
        whole, whole_loss = _whole_sequence_saved_bytes(name, micro_batch, seq_len)
        ranks = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in range(2)]
        config = resolve_model(ModelSpec(name=name)).config
        config.vocab_size = VOCAB
        desc = describe_model(config, name=name)
        job = Workload(seq_len=seq_len, global_batch=micro_batch, precision="fp32")
        predicted = {cp: memory_per_rank(desc, Layout(ParallelDims(world=cp, cp=cp), micro_batch=micro_batch), job).activations
                     for cp in (1, 2)}
        assert all(abs(r["loss"] - whole_loss) <= 1e-5 * whole_loss for r in ranks), (ranks, whole_loss)
        for r in ranks:
            assert 0.45 * whole <= r["saved_bytes"] <= 0.6 * whole, (name, r["saved_bytes"], whole)
            assert abs(predicted[2] - r["saved_bytes"]) <= 0.15 * r["saved_bytes"], (name, predicted, r, whole)
        assert abs(predicted[1] - whole) <= 0.15 * whole, (name, predicted, whole)
        print(f"{name}: cp1 {whole} B (predicted {predicted[1]:.0f}), cp2 per rank "
              f"{[r['saved_bytes'] for r in ranks]} B (predicted {predicted[2]:.0f})")
