"""Worker (run under the deepspeed launcher): build a run's engine fresh, save the full logits it
gives on the first two eval blocks, then save it as a checkpoint (step 0) - no training step, so a
large model's checkpoint costs one build and one save.

    deepspeed --num_gpus 2 save_fresh_checkpoint.py RUN.yaml OUT.pt --set k=v ...

ZeRO 0-3 without tensor or pipeline parallelism (every rank holds the full logits; data rank 0
writes OUT.pt). The checkpoint is dsf train's: <output_dir>/checkpoints/global_step0, with the
hf_config, tokenizer and run.yaml that prepare() writes beside it.
"""
import sys

import torch

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.config import load_run_config
from dsframework.train.setup import prepare
from dsframework.launching.supervise import exit_process
from dsframework.train.world import shutdown_distributed


def main(argv):
    args = [a for a in argv if not a.startswith("--local_rank")]
    run_yaml, out, sets = args[0], args[1], [a for a in args[2:] if a != "--set"]
    session = prepare(load_run_config(run_yaml, sets))
    assert not (session.dims.tp_enabled or session.dims.pp_enabled), "ZeRO layouts only"
    input_ids = session.eval_blocks[:2]
    session.engine.eval()
    with torch.no_grad():
        logits = session.engine(input_ids=input_ids).logits
    if session.dp_rank == 0:
        torch.save({"input_ids": input_ids, "logits": logits.float()}, out)
    ckpt.save(session.engine, session.run.checkpoint_dir, step=0, consumed_samples=0,
              layout=session.dims)
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    exit_process(0)  # without the interpreter's teardown of gloo's threads (see supervise.exit_process)
