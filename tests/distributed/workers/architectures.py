"""Worker (run under the deepspeed launcher): `dsf train` runs of several architectures one after
the other in one process group (tests/distributed/test_architectures.py). Per run, each rank writes
what its engine holds, and the rank holding the trained engine's logits saves them.

    deepspeed --num_gpus 4 architectures.py OUT_ROOT 'qwen3|model.name=/x/qwen3.json;parallel.tp=2' ...

Each spec is NAME|OVERRIDES (`;`-separated, on top of the tests' BASE_OVERRIDES), trained into
OUT_ROOT/NAME as `dsf train` does (prepare, then the loop); NAME|OVERRIDES|resume continues the run
already in OUT_ROOT/NAME (`dsf train --resume`); NAME|OVERRIDES|masks also records the dropout
masks of one more training forward and the bytes one saves for backward (OUT_ROOT/NAME/masks-rank{R}.pt).
Then:
- OUT_ROOT/NAME/held-rank{R}.json: {"parameters": elements of the engine's parameters on this rank
  (a tied weight once per stage that holds a copy), "stage", "tensor_rank", "sequence_parallel"};
- OUT_ROOT/NAME/engine.pt: {"input_ids", "logits"} of the trained engine on two evaluation blocks
  (workers/engine_logits.py's full_logits: the last stage's, vocab slices gathered).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.distributed.launcher

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

from dsframework.config import load_run_config
from dsframework.launching.supervise import exit_process
from dsframework.train.loop import run_steps
from dsframework.train.metrics import open_sinks
from dsframework.train.setup import prepare
from dsframework.train.world import shutdown_distributed
from tests.distributed.launcher import TINY_YAML, forget_previous_run, run_overrides
from tests.distributed.workers.engine_logits import full_logits
from tests.saved_tensors import saved_bytes


def held(session) -> dict:
    engine, dims = session.engine, session.dims
    params = {id(p): p.numel() for p in engine.module.parameters()}
    return {"parameters": sum(params.values()),
            "stage": engine.stage_id if dims.pp_enabled else 0,
            "tensor_rank": engine.mpu.get_slice_parallel_rank() if dims.tp_enabled else 0,
            "sequence_parallel": session.sequence_parallel}


def one_run(out: Path, overrides: list[str], *, resume: bool = False):
    run = load_run_config(TINY_YAML, run_overrides(out, overrides))
    session = prepare(run, resume=resume)
    (out / f"held-rank{session.rank}.json").write_text(json.dumps(held(session)))
    sinks = open_sinks(run, resume_step=None, enabled=session.rank == 0)
    try:
        run_steps(run, session, sinks, resume=resume)
    finally:
        sinks.close()
    vocab_size = AutoConfig.from_pretrained(str(run.checkpoint_dir / "hf_config")).vocab_size
    input_ids = session.eval_blocks[:2]
    session.engine.eval()
    logits, holds = full_logits(session, input_ids, vocab_size)
    tensor_rank = session.engine.mpu.get_slice_parallel_rank() if session.dims.tp_enabled else 0
    if holds and tensor_rank == 0 and session.dp_rank == 0:
        torch.save({"input_ids": input_ids, "logits": logits.float()}, out / "engine.pt")
    return session


class _Draws(TorchDispatchMode):
    """Every Bernoulli draw (a dropout's mask) made inside the block, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli, torch.ops.aten.native_dropout):
            self.masks.append((out[1] if isinstance(out, tuple) else out).detach().bool().clone())
        return out


def dropout_masks(session, out: Path) -> None:
    """The masks of one more training forward (after the run: its losses are untouched), and the bytes
    a training forward saves for backward (tests/saved_tensors.py), per rank."""
    engine = session.engine
    engine.train()
    ids = session.eval_blocks[:2].to(engine.device)
    saved, loss = saved_bytes(engine.module, lambda: engine(input_ids=ids, labels=ids).loss)
    del loss  # (and what the forward kept: no backward)
    with torch.no_grad(), _Draws() as draws:
        engine(input_ids=ids, labels=ids)
    tensor_rank = engine.mpu.get_slice_parallel_rank() if session.dims.tp_enabled else 0
    torch.save({"masks": draws.masks, "tensor_rank": tensor_rank, "dp_rank": session.dp_rank, "saved_bytes": saved,
                "micro_batch": len(ids)}, out / f"masks-rank{session.rank}.pt")


def main(root: str, specs: list[str]) -> None:
    for spec in specs:
        forget_previous_run()
        name, overrides, *flags = spec.split("|")
        session = one_run(Path(root) / name, [o for o in overrides.split(";") if o], resume="resume" in flags)
        if "masks" in flags:
            dropout_masks(session, Path(root) / name)


if __name__ == "__main__":
    torch.set_num_threads(1)
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1:])
    shutdown_distributed()
    exit_process(0)  # without the interpreter's teardown of gloo's threads (see supervise.exit_process)
