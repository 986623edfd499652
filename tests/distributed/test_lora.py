"""LoRA (model.lora, through peft) at world size 2, ZeRO 0-3: the adapters alone train, sit in optimizer
state and in checkpoints; a run equals a single-process peft reference, resumes exactly, and exports
(merged into the base, or the adapter alone) to the logits of the engine that trained it.

Every run is a real `dsf train` of 2 CPU ranks (gloo); the stages' runs share one launch with other
modules' runs (conftest.shared_runs). Each ZeRO stage trains 6 steps
once, saving at steps 3 and 6, on a preset's seeded random init (ZeRO 0 and 2) or a local pretrained
directory (ZeRO 1 and 3; under ZeRO-3 loaded partitioned); the reference is the plain PyTorch loop of
reference.py over the same blocks with peft's adapters on the same base (`lora_reference`). A resume is checked by pointing a copy of
a run's checkpoints at step 3 (step 6 removed: the state a run stopped after step 3 leaves) and running
`dsf train --resume` to step 6. `test_lora_is_small` prints the measured checkpoint and optimizer
sizes next to full fine-tuning of the same model (`pytest -s`).
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dsframework.config import ModelSpec, build_run_config
from dsframework.models.build import build_model, resolve_model
from dsframework.models.lora import apply_lora, trainable_names
from tests.distributed import reference
from tests.distributed.launcher import (BIN, TINY_YAML, Prefixed, assert_close, dsf, launch, losses, rank_env,
                                        run_overrides, train_run)

ENGINE_LOGITS = Path(__file__).parent / "workers" / "engine_logits.py"
COMMON = ["train.steps=6", "checkpoint.every=3", "model.lora.r=4", "model.lora.alpha=8"]
PRETRAINED = "model.name={pretrained}"  # a tiny Llama saved by save_pretrained (seed 7: not the preset's init)
STAGES = {  # name: overrides (a list of layers for two stages, peft's all-linear for the others)
    "zero0": ["parallel.zero_stage=0", "model.lora.target_modules=[q_proj, v_proj]"],
    "zero1": ["parallel.zero_stage=1", "model.lora.target_modules=[q_proj, v_proj]", PRETRAINED],
    "zero2": ["parallel.zero_stage=2", "model.lora.target_modules=all-linear"],
    "zero3": ["parallel.zero_stage=3", "model.lora.target_modules=all-linear", PRETRAINED],
}
FULL = ["parallel.zero_stage=3", "train.steps=2", "checkpoint.save_final=true", PRETRAINED]  # test_lora_is_small
RESUMED = ("zero3",)  # partitioned, the frozen base rebuilt (ZeRO-0, restored whole, was checked by hand: identical)


def lora_reference(run) -> tuple[dict[int, float], torch.nn.Module]:
    """reference.reference_train with peft's adapters on the base: (step -> loss, the trained peft model)."""
    from deepspeed.runtime import lr_schedules

    from dsframework.dsconfig import build_ds_config

    torch.manual_seed(0)
    tokenizer = reference.load_tokenizer(run.checkpoint_dir / "tokenizer")
    train_blocks, _ = reference.pack_splits(reference.load_texts(run.data), tokenizer, run.data)
    source = resolve_model(run.model)
    base = build_model(source, source.config_for(tokenizer), seed=run.train.seed)
    model = apply_lora(base, run.model.lora, seed=run.train.seed).train()
    params = [p for p in model.parameters() if p.requires_grad]
    t = run.train
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    one_process = t.model_copy(update={"micro_batch": None, "grad_accum": None})
    sched_cfg = build_ds_config(one_process, run.parallel, dp_size=1)["scheduler"]
    scheduler = getattr(lr_schedules, sched_cfg["type"])(optimizer, **sched_cfg["params"])
    sampler = reference.BlockSampler(len(train_blocks), micro_batch=t.global_batch, grad_accum=1, dp_size=1,
                                     dp_rank=0, seed=run.data.seed)
    out = {}
    for step in range(1, t.steps + 1):
        input_ids = train_blocks[sampler.global_indices((step - 1) * t.global_batch)]
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        out[step] = loss.item()
    return out, model.eval()


def worst(got: dict[int, float], want: dict[int, float], steps=None) -> float:
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in (steps or want))


def logits(model, vocab_size: int) -> torch.Tensor:
    input_ids = torch.arange(32).remainder(vocab_size).view(2, 16)
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def resume_from_step3(run_dir: Path, copy_dir: Path, overrides: list[str]) -> dict[int, float]:
    """A copy of the run as a stop after step 3 leaves it, resumed to step 6; returns its losses."""
    shutil.copytree(run_dir, copy_dir)
    shutil.rmtree(copy_dir / "checkpoints" / "global_step6")
    (copy_dir / "checkpoints" / "latest").write_text("global_step3")
    return train_run(copy_dir, overrides, flags=("--resume",))


@dataclass
class Run:
    dir: Path
    overrides: list[str]
    losses: dict[int, float]
    resumed: dict[int, float] | None  # steps 1-3 from the copy's metrics, 4-6 resumed

    @property
    def config(self):
        return build_run_config({}, run_overrides(self.dir, self.overrides))


def run_settings(root: Path) -> dict[str, list[str]]:
    """name -> overrides of every stage in STAGES and "full", the pretrained base under `root`."""
    stages = {name: [*COMMON, *stage] for name, stage in STAGES.items()}
    return {name: [o.format(pretrained=root / "lora-pretrained") for o in settings]
            for name, settings in {**stages, "full": FULL}.items()}


def shared_specs(ranks: int, root: Path) -> list[str]:
    """conftest.shared_runs' specs at world 2 (named lora-<name>), after saving their pretrained base."""
    if ranks != 2:
        return []
    source = resolve_model(ModelSpec(name="tiny-llama"))
    build_model(source, source.config, seed=7).save_pretrained(root / "lora-pretrained")
    return [f"lora-{name}|eager|{';'.join(overrides)}" for name, overrides in run_settings(root).items()]


@pytest.fixture(scope="module")
def stage_runs(shared_runs, tmp_path_factory):
    """name -> Run, for every stage in STAGES (ZeRO-3 also resumed from step 3, in a launch of its own),
    and "full": full fine-tuning of ZeRO-3's base (no adapters), trained in the stages' launch."""
    shared = shared_runs(2)[0]
    root, copies, overrides = Prefixed(shared, "lora-"), tmp_path_factory.mktemp("lora"), run_settings(shared)
    runs = {}
    for name in overrides:
        resumed = resume_from_step3(root / name, copies / f"{name}_resumed", overrides[name]) if name in RESUMED else None
        runs[name] = Run(root / name, overrides[name], losses(root / name), resumed)
    return runs


@pytest.fixture(scope="module")
def references(stage_runs):
    """name -> (step -> loss, the trained peft model) of the single-process reference of that stage's run."""
    return {name: lora_reference(stage_runs[name].config) for name in STAGES}


@pytest.mark.parametrize("name", list(STAGES))
def test_lora_trains_like_the_single_process_reference(stage_runs, references, name):
    losses = stage_runs[name].losses
    want, _ = references[name]
    print(f"\nLoRA {name}: max relative loss difference to the reference {worst(losses, want):.2g}")
    assert_close(losses, want, rtol=1e-4, what=f"LoRA {name} vs the peft reference")


@pytest.mark.parametrize("name", list(STAGES))
def test_checkpoint_holds_the_adapters_alone_and_exports_the_reference(stage_runs, references, name, tmp_path):
    """The checkpoint's tensors are exactly the adapters (read back as dsf export reads any checkpoint);
    its merged export is the reference's adapted model, not the base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsframework.checkpoints.export import export_checkpoint, locate, open_checkpoint

    run = stage_runs[name].config
    ckpt_dir, tag = locate(run.checkpoint_dir)
    config = AutoConfig.from_pretrained(ckpt_dir / "hf_config")
    _, model = references[name]
    reader = open_checkpoint(ckpt_dir, tag, config, scratch=tmp_path)
    assert reader.names == set(trainable_names(model)), sorted(reader.names)[:4]
    assert all(torch.allclose(reader.read(n), p, atol=1e-5) for n, p in model.named_parameters() if p.requires_grad)

    hf_dir = export_checkpoint(ckpt_dir, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert not any("lora" in n for n in exported.state_dict())
    got, want = logits(exported, config.vocab_size), logits(model, config.vocab_size)
    base = build_model(resolve_model(run.model), config, seed=run.train.seed).eval()
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert (got - logits(base, config.vocab_size)).abs().max() > 100 * (got - want).abs().max()


@pytest.mark.parametrize("name", RESUMED)
def test_lora_resume_is_exact(stage_runs, name):
    straight, resumed = stage_runs[name].losses, stage_runs[name].resumed
    assert sorted(resumed) == list(range(1, 7)), "metrics.jsonl holds each step once"
    print(f"\nLoRA {name}: resumed steps 4-6, max relative difference {worst(resumed, straight, (4, 5, 6)):.2g}")
    assert_close({s: resumed[s] for s in (4, 5, 6)}, {s: straight[s] for s in (4, 5, 6)}, rtol=1e-6,
                 what=f"LoRA {name}: resumed steps 4-6 vs straight")


def test_exports_give_the_engines_logits(stage_runs, tmp_path):
    """ZeRO-3: the engine rebuilt from the checkpoint (the frozen base from model.name, the adapters
    loaded) gives the logits of the merged export (from_pretrained) within 1e-5, and of
    `dsf export --adapter-only` loaded with PeftModel.from_pretrained on the rebuilt base."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsframework.checkpoints.export import export_checkpoint

    run_dir, overrides = stage_runs["zero3"].dir, stage_runs["zero3"].overrides
    export_checkpoint(run_dir / "checkpoints", tmp_path / "hf")  # what `dsf export` runs (its CLI: test_export.py)
    dsf("export", str(run_dir / "checkpoints"), str(tmp_path / "adapter"), "--adapter-only")
    sets = [arg for o in run_overrides(run_dir, overrides) for arg in ("--set", o)]
    launch([str(ENGINE_LOGITS), str(TINY_YAML), str(tmp_path / "engine.pt"), *sets], num_ranks=2)
    engine = torch.load(tmp_path / "engine.pt")

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(run_dir / "checkpoints" / "hf_config")
    run = stage_runs["zero3"].config
    base = build_model(resolve_model(run.model), config, seed=run.train.seed)
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if "adapter" in p.name) == [
        "adapter_config.json", "adapter_model.safetensors"]
    with torch.no_grad():
        for what, model in (("merged export", merged), ("adapter export", adapter)):
            got = model(input_ids=engine["input_ids"]).logits
            assert torch.allclose(got, engine["logits"], atol=1e-5, rtol=0), (
                f"{what}: max |diff| {(got - engine['logits']).abs().max().item():.3g}")


def _optimizer_state_bytes(tag_dir: Path) -> list[int]:
    """Per rank, the bytes of the optimizer state tensors DeepSpeed holds and saves (Adam's moments and
    the fp32 master partitions) in a ZeRO-3 checkpoint's *_optim_states.pt files."""
    def tensor_bytes(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(tensor_bytes(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(tensor_bytes(v) for v in value)
        return 0

    return [tensor_bytes(torch.load(path, weights_only=False)["optimizer_state_dict"])
            for path in sorted(tag_dir.glob("*optim_states.pt"))]


def test_lora_is_small(stage_runs, tmp_path):
    """LoRA vs full fine-tuning of the same tiny Llama at ZeRO-3 (2 ranks): checkpoint bytes on disk and
    optimizer state bytes, printed; the adapters' optimizer state is their share of the parameters.
    `--adapter-only` of the full run's checkpoint is one line, exit 2, nothing written."""
    from transformers import AutoConfig

    lora_run = stage_runs["zero3"]
    lora_dir, full_dir = lora_run.dir, stage_runs["full"].dir
    assert stage_runs["full"].overrides[-1] in lora_run.overrides  # model.name: the same base
    sizes, optimizer, trainable = {}, {}, {}
    for what, run_dir in (("lora", lora_dir), ("full", full_dir)):
        tag_dir = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
        sizes[what] = sum(p.stat().st_size for p in tag_dir.iterdir())
        optimizer[what] = _optimizer_state_bytes(tag_dir)
    run = lora_run.config
    config = AutoConfig.from_pretrained(run.checkpoint_dir / "hf_config")
    base = build_model(resolve_model(run.model), config, seed=run.train.seed)
    everything = sum(p.numel() for p in base.parameters())
    adapted = apply_lora(base, run.model.lora, seed=run.train.seed)
    trainable = {"lora": sum(p.numel() for p in adapted.parameters() if p.requires_grad), "full": everything}
    print(f"\nLoRA r=4 all-linear vs full fine-tuning, tiny-llama, ZeRO-3 on 2 ranks:\n"
          f"  trainable parameters   {trainable['lora']:>10,} vs {trainable['full']:>10,}\n"
          f"  checkpoint on disk     {sizes['lora'] / 1e6:>10.3f} MB vs {sizes['full'] / 1e6:>7.3f} MB "
          f"({sizes['full'] / sizes['lora']:.1f}x)\n"
          f"  optimizer state bytes  {sum(optimizer['lora']):>10,} vs {sum(optimizer['full']):>10,} "
          f"({sum(optimizer['full']) / sum(optimizer['lora']):.1f}x; per rank {optimizer['lora']} vs {optimizer['full']})")
    for what in ("lora", "full"):  # Adam's two moments and the fp32 master copy, 4 bytes each, split over 2 ranks
        assert sum(optimizer[what]) == pytest.approx(12 * trainable[what], rel=0.01), (what, optimizer[what])
    assert sum(optimizer["lora"]) * 10 < sum(optimizer["full"])
    assert sizes["lora"] * 4 < sizes["full"]

    out = tmp_path / "adapter"
    proc = subprocess.run([str(BIN / "dsf"), "export", str(full_dir / "checkpoints"), str(out), "--adapter-only"],
                          capture_output=True, text=True, env=rank_env(), timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stdout + proc.stderr
    assert "--adapter-only" in proc.stderr and "drop --adapter-only" in proc.stderr and not out.exists()
