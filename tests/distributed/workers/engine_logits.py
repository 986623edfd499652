"""Worker (run under the deepspeed launcher): build a run's engine - from its latest checkpoint,
or fresh with --fresh - and save the full logits it gives on the first two eval blocks.

    deepspeed --num_gpus 4 engine_logits.py RUN.yaml OUT.pt [--fresh] --set k=v ... [--next RUN.yaml OUT2.pt ...]

Several runs (`--next` between them) are built one after the other in this one process group.

Any layout: a pipeline engine's logits come from its last stage (eval_batch), tensor-parallel
vocab slices are gathered; one rank (last stage, tensor rank 0, data rank 0) writes OUT.pt.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.distributed.launcher

import torch
import torch.distributed as dist
from transformers import AutoConfig

from dsframework.config import load_run_config
from dsframework.train.setup import prepare
from dsframework.launching.supervise import exit_process
from dsframework.train.world import shutdown_distributed
from tests.distributed.launcher import forget_previous_run


def full_logits(session, input_ids, vocab_size):
    """(logits [batch, seq, vocab] or None on ranks that do not hold them, holds them)."""
    engine, dims = session.engine, session.dims
    if dims.pp_enabled:
        _, logits = engine.eval_batch(iter([(input_ids, input_ids)]), return_logits=True, num_micro_batches=1)
        holds = engine.is_last_stage()
    else:
        with torch.no_grad():
            logits = engine(input_ids=input_ids).logits
        holds = True
    if dims.tp_enabled and holds:  # this rank's padded vocab slice -> all of it
        group = engine.mpu.get_slice_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(dims.tp)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)[..., :vocab_size]  # drop the vocab padding
    return logits, holds


def save_logits(args: list[str]) -> None:
    """One run: RUN.yaml OUT.pt [--fresh] --set k=v ..."""
    fresh = "--fresh" in args
    args = [a for a in args if a != "--fresh"]
    run_yaml, out, sets = args[0], args[1], [a for a in args[2:] if a != "--set"]
    session = prepare(load_run_config(run_yaml, sets), resume=not fresh)
    vocab_size = AutoConfig.from_pretrained(str(session.run.checkpoint_dir / "hf_config")).vocab_size
    input_ids = session.eval_blocks[:2]
    session.engine.eval()
    logits, holds = full_logits(session, input_ids, vocab_size)
    tensor_rank = session.engine.mpu.get_slice_parallel_rank() if session.dims.tp_enabled else 0
    if holds and tensor_rank == 0 and session.dp_rank == 0:
        torch.save({"input_ids": input_ids, "logits": logits.float()}, out)
    if session.built is not None:  # what this rank materialised and read from a pretrained directory
        padding = sum(int((p.dense_index < 0).sum()) * p[0].numel() for p in session.engine.module.parameters()
                      if getattr(p, "dense_index", None) is not None)  # vocab padding rows: no file holds them
        stats = {"parameters": session.built.parameters, "bytes_read": session.built.bytes_read,
                 "padding": padding}
        Path(f"{out}.rank{dist.get_rank()}.json").write_text(json.dumps(stats))


def main(argv):
    args = [a for a in argv if not a.startswith("--local_rank")]
    runs = [[]]
    for arg in args:
        if arg == "--next":
            runs.append([])
        else:
            runs[-1].append(arg)
    for run_args in runs:
        forget_previous_run()
        save_logits(run_args)
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    exit_process(0)  # without the interpreter's teardown of gloo's threads (see supervise.exit_process)
