"""Checkpoints: DeepSpeed's own `save_checkpoint`/`load_checkpoint`, plus what resuming needs.

    <output_dir>/checkpoints/
        latest                 tag of the newest checkpoint (written by DeepSpeed)
        global_step100/        DeepSpeed model/optimizer shards, and rng_rank<R>.pt per rank
        hf_config/config.json  the transformers config the model was built from
        tokenizer/             the run's tokenizer
        run.yaml               the resolved run config

    save(engine, ckpt_dir, step=100, consumed_samples=3200)
    state = load(engine, ckpt_dir)     # {"step": 100, "consumed_samples": 3200}

The client state holds the step and the data position; each rank's RNG states sit beside the
shards, so a resumed run draws the same random numbers as one that never stopped.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from dsframework.errors import UserError

TOKENIZER_DIR = "tokenizer"
HF_CONFIG_DIR = "hf_config"
RUN_YAML = "run.yaml"


def latest_tag(ckpt_dir: str | Path) -> str | None:
    """The tag in `<ckpt_dir>/latest`, or None when there is no checkpoint."""
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag or None


def tag_for(step: int) -> str:
    return f"global_step{step}"


def save_run_files(ckpt_dir: Path, *, config: Any, run_yaml: str) -> None:
    """The transformers config and run config, saved once beside the checkpoints (rank 0)."""
    config.save_pretrained(str(ckpt_dir / HF_CONFIG_DIR))
    (ckpt_dir / RUN_YAML).write_text(run_yaml)


def _rng_states() -> dict[str, Any]:
    import numpy as np
    import torch
    from deepspeed.accelerator import get_accelerator

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        states["accelerator"] = accelerator.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np
    import torch
    from deepspeed.accelerator import get_accelerator

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "accelerator" in states:
        get_accelerator().set_rng_state(states["accelerator"])


def save(engine: Any, ckpt_dir: Path, *, step: int, consumed_samples: int) -> str:
    """Save a checkpoint of every rank at `step`; returns its tag."""
    import torch

    tag = tag_for(step)
    client_state = {"dsf": {"step": step, "consumed_samples": consumed_samples}}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state)
    torch.save(_rng_states(), Path(ckpt_dir) / tag / f"rng_rank{engine.global_rank}.pt")
    return tag


def load(engine: Any, ckpt_dir: Path) -> dict[str, int]:
    """Load the latest checkpoint into `engine`; returns the dsf client state (step, data position)."""
    import torch

    tag = latest_tag(ckpt_dir)
    if tag is None or not (Path(ckpt_dir) / tag).is_dir():
        raise UserError("checkpoint", str(ckpt_dir), f"latest names {tag!r}, which is not there",
                        "point output_dir at a run with a complete checkpoint")
    try:
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    except (RuntimeError, EOFError, OSError, KeyError, ValueError) as err:
        raise UserError("checkpoint", str(Path(ckpt_dir) / tag),
                        f"could not be loaded ({type(err).__name__})",
                        "it is incomplete or corrupt; resume from an earlier tag") from None
    if path is None or not client_state or "dsf" not in client_state:
        raise UserError("checkpoint", str(Path(ckpt_dir) / tag), "is not a dsf checkpoint",
                        "resume only runs written by dsf train")
    rng_file = Path(ckpt_dir) / tag / f"rng_rank{engine.global_rank}.pt"
    if rng_file.is_file():
        _set_rng_states(torch.load(rng_file, weights_only=False))
    return client_state["dsf"]
