"""Worker (run under the deepspeed launcher): rebuild a run's engine from its latest checkpoint
and save the logits it gives on the first eval blocks, as rank 0 sees them.

    deepspeed --num_gpus 2 engine_logits.py RUN.yaml OUT.pt --set k=v ...
"""
import sys

import torch

from dsframework.config import load_run_config
from dsframework.engine import prepare


def main(argv):
    args = [a for a in argv if not a.startswith("--local_rank")]
    run_yaml, out, sets = args[0], args[1], [a for a in args[2:] if a != "--set"]
    session = prepare(load_run_config(run_yaml, sets), resume=True)
    input_ids = session.eval_blocks[:2]
    session.engine.eval()
    with torch.no_grad():
        logits = session.engine(input_ids=input_ids).logits
    if session.rank == 0:
        torch.save({"input_ids": input_ids, "logits": logits.float()}, out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
