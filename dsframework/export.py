"""`dsf export`: a DeepSpeed checkpoint of any ZeRO stage -> a `transformers` model directory.

    export_checkpoint("runs/tiny/checkpoints", "runs/tiny/hf")     # latest tag
    model = AutoModelForCausalLM.from_pretrained("runs/tiny/hf")

ZeRO 1-3 shards are merged to fp32 by deepspeed's own `zero_to_fp32`; a stage-0 checkpoint holds
the whole module already; a pipeline checkpoint holds one file per layer. With tensor
parallelism, each tensor rank's part is read that way on its own (mp_rank_YY files), and the
ranks' shards are merged into dense tensors (`merge_tensor_parallel_shards`). The directory is written under a temporary name and renamed into place,
so a failed export never leaves a half-written OUT_DIR, and an existing one is never replaced
unless asked.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from dsframework import checkpoint as ckpt
from dsframework.errors import UserError

MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO 0-2; ZeRO-3 writes zero_pp_rank_*_<this> per rank


def _has_model_states(tag_dir: Path) -> bool:
    return any(tag_dir.glob(f"*{MODEL_STATES}"))


def tensor_parallel_size(ckpt_dir: Path) -> int:
    """The run's parallel.tp, from the run.yaml dsf train saved beside the checkpoints."""
    import yaml

    run_yaml = ckpt_dir / ckpt.RUN_YAML
    if not run_yaml.is_file():
        return 1
    run = yaml.safe_load(run_yaml.read_text()) or {}
    return int((run.get("parallel") or {}).get("tp", 1))


def locate(path: str | Path, tag: str | None = None) -> tuple[Path, str]:
    """(checkpoints dir, tag) for a checkpoints dir (latest tag) or one tag's directory."""
    path = Path(path)
    if _has_model_states(path) and tag is None:
        path, tag = path.parent, path.name
    if not path.is_dir():
        raise UserError("CKPT_DIR", str(path), "is not a directory", "pass <output_dir>/checkpoints")
    tag = tag or ckpt.latest_tag(path)
    if tag is None:
        raise UserError("CKPT_DIR", str(path), "is not a checkpoint directory (no 'latest' file)",
                        "pass <output_dir>/checkpoints of a dsf run, or a global_step* folder in it")
    if not _has_model_states(path / tag):
        raise UserError("CKPT_DIR", str(path / tag), f"has no {MODEL_STATES}",
                        "the checkpoint is incomplete; export an earlier tag with --tag")
    tp = tensor_parallel_size(path)
    missing = [r for r in range(tp) if not any((path / tag).glob(f"*mp_rank_{r:02d}_model_states.pt"))]
    if missing:
        raise UserError("CKPT_DIR", str(path / tag), f"lacks the files of tensor rank {missing[0]} "
                        f"(mp_rank_{missing[0]:02d}_*) of a tp={tp} run",
                        "the checkpoint is incomplete; export an earlier tag with --tag")
    if not (path / ckpt.HF_CONFIG_DIR / "config.json").is_file():
        raise UserError("CKPT_DIR", str(path), f"has no {ckpt.HF_CONFIG_DIR}/config.json",
                        "export checkpoints written by dsf train")
    return path, tag


def _one_tensor_rank(tag_dir: Path, rank: int, scratch: Path) -> Path:
    """A tag directory holding only tensor rank `rank`'s files (symlinks), which is what
    zero_to_fp32 expects: one model-parallel rank, its data-parallel partitions."""
    view = scratch / f"mp{rank}" / tag_dir.name
    view.mkdir(parents=True)
    for path in tag_dir.glob(f"*mp_rank_{rank:02d}_*"):
        (view / path.name).symlink_to(path.resolve())
    return view


def _rank_state_dict(ckpt_dir: Path, tag: str, config: Any, *, tensor_rank: int | None,
                     scratch: Path) -> dict[str, Any]:
    """One tensor rank's weights (or the whole model's at tp=1) under transformers names."""
    import torch

    tag_dir = ckpt_dir / tag
    is_pipeline = any(tag_dir.glob("layer_*-model_states.pt"))
    if is_pipeline:  # DeepSpeed's pipeline engine
        from dsframework.parallel.pipeline import (pipeline_layer_specs, pipeline_state_dict_to_hf,
                                                   read_layer_states)

        state = pipeline_state_dict_to_hf(read_layer_states(tag_dir, tensor_rank=tensor_rank),
                                          pipeline_layer_specs(config))
    elif any(tag_dir.glob("*zero_pp_rank_*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        if tensor_rank is not None:
            tag_dir = _one_tensor_rank(tag_dir, tensor_rank, scratch)
        state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag)
    else:
        rank = 0 if tensor_rank is None else tensor_rank
        state = torch.load(tag_dir / f"mp_rank_{rank:02d}_model_states.pt", map_location="cpu",
                           weights_only=False)["module"]
    if tensor_rank is not None and not is_pipeline:  # TensorParallelCausalLM holds it as .model
        state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    return {name: tensor.float() for name, tensor in state.items()}


def consolidated_state_dict(ckpt_dir: Path, tag: str, config: Any, *, tp: int = 1) -> dict[str, Any]:
    """The full state dict of a checkpoint under transformers names, whatever its ZeRO stage,
    pipeline split or tensor-parallel size (fp32 runs: the pipeline's per-layer files and the
    stage-0 module hold the weights as trained)."""
    if tp == 1:
        return _rank_state_dict(ckpt_dir, tag, config, tensor_rank=None, scratch=ckpt_dir)
    from dsframework.models.tensor_parallel import merge_tensor_parallel_shards

    with tempfile.TemporaryDirectory(prefix="dsf-export-") as scratch:
        shards = [_rank_state_dict(ckpt_dir, tag, config, tensor_rank=r, scratch=Path(scratch)) for r in range(tp)]
    return merge_tensor_parallel_shards(shards, config)


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, *, tag: str | None = None,
                      overwrite: bool = False) -> Path:
    """Write config, safetensors weights and tokenizer for `from_pretrained`; returns out_dir."""
    ckpt_dir, tag = locate(ckpt_path, tag)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError("OUT_DIR", str(out_dir), "is a file", "choose a directory path")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError("OUT_DIR", str(out_dir), "exists and is not empty",
                        "choose a new directory or pass --overwrite")

    import torch
    from transformers import AutoConfig

    from dsframework.data import load_tokenizer
    from dsframework.models import causal_lm_class

    config = AutoConfig.from_pretrained(str(ckpt_dir / ckpt.HF_CONFIG_DIR), local_files_only=True)
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    state = consolidated_state_dict(ckpt_dir, tag, config, tp=tensor_parallel_size(ckpt_dir))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # tied heads share the embedding, which the checkpoint holds once
    still_meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta or unexpected:
        raise UserError("CKPT_DIR", str(ckpt_dir / tag),
                        f"does not match its config (missing {still_meta[:3]}, unexpected {unexpected[:3]})",
                        "export with the hf_config saved by the same run")
    model.float()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer_dir = ckpt_dir / ckpt.TOKENIZER_DIR
        if tokenizer_dir.is_dir():
            load_tokenizer(tokenizer_dir, field="checkpoint tokenizer").save_pretrained(str(staging))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
