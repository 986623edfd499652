"""`dsf export`: a DeepSpeed checkpoint of any ZeRO stage -> a `transformers` model directory.

    export_checkpoint("runs/tiny/checkpoints", "runs/tiny/hf")     # latest tag
    model = AutoModelForCausalLM.from_pretrained("runs/tiny/hf")

ZeRO 1-3 shards are merged to fp32 by deepspeed's own `zero_to_fp32`; a stage-0 checkpoint holds
the whole module already. The directory is written under a temporary name and renamed into place,
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


def _trained_with_tensor_parallelism(ckpt_dir: Path) -> bool:
    import yaml

    run_yaml = ckpt_dir / ckpt.RUN_YAML
    if not run_yaml.is_file():
        return False
    run = yaml.safe_load(run_yaml.read_text()) or {}
    return int((run.get("parallel") or {}).get("tp", 1)) > 1


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
    if _trained_with_tensor_parallelism(path):
        raise UserError("CKPT_DIR", str(path / tag), "holds tensor-parallel shards (mp_rank_01, ...)",
                        "merging tensor-parallel shards is not in dsf export yet; export a tp=1 run")
    if not (path / ckpt.HF_CONFIG_DIR / "config.json").is_file():
        raise UserError("CKPT_DIR", str(path), f"has no {ckpt.HF_CONFIG_DIR}/config.json",
                        "export checkpoints written by dsf train")
    return path, tag


def consolidated_state_dict(ckpt_dir: Path, tag: str, config: Any) -> dict[str, Any]:
    """The full state dict of a checkpoint under transformers names, whatever its ZeRO stage or
    pipeline split (fp32 runs: the pipeline's per-layer files hold the weights as trained)."""
    import torch

    if any((ckpt_dir / tag).glob("layer_*-model_states.pt")):  # DeepSpeed's pipeline engine
        from dsframework.parallel.pipeline import (pipeline_layer_specs, pipeline_state_dict_to_hf,
                                                   read_layer_states)

        state = pipeline_state_dict_to_hf(read_layer_states(ckpt_dir / tag), pipeline_layer_specs(config))
        return {name: tensor.float() for name, tensor in state.items()}
    if any((ckpt_dir / tag).glob("*zero_pp_rank_*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    states = torch.load(ckpt_dir / tag / MODEL_STATES, map_location="cpu", weights_only=False)
    return {name: tensor.float() for name, tensor in states["module"].items()}


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
    state = consolidated_state_dict(ckpt_dir, tag, config)
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
