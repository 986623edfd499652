"""Worker (run under the deepspeed launcher): the model states one rank holds under ZeRO-3 with hpZ
(ZeRO++ hierarchical partitioning), its secondary weight partition included.

    deepspeed --num_gpus 4 hpz_states.py OUT_DIR RUN.yaml case:NAME:k=v,k=v ... --set k=v ...
    # -> OUT_DIR/<case>-rank<r>.json: {"params": bytes, "secondary": bytes, "grads": ..., ...}

Counted as in workers/model_states.py (distinct storages), at the moment each is largest over two
optimizer steps (every rank runs the same sequences; with parallel.cp, its slice of them, through
`dsf train`'s own micro_batch_loss):
- params: just before each optimizer step (a secondary partition lives from a weight's first
  release after its forward until the step invalidates it): every parameter's partition
  (ds_tensor), its full data while gathered, and its secondary partition (ds_secondary_tensor);
- grads: after a micro-batch's backward inside the accumulation window and just before the step;
- optimizer: after the step.
Also reported: `secondary`, the secondary partitions alone; `hpz_group`, the size of the groups
they are split over (1 without any); `gathers`, how many weight all-gathers ran over groups of
each size (hpZ's gathers from the secondary partitions stay inside a group of zero_hpz ranks).
"""
import sys

import torch
import torch.distributed as dist
from deepspeed.runtime.zero import partition_parameters
from deepspeed.utils import groups

from dsframework.train.setup import prepare
from dsframework.train.step import micro_batch_loss
from dsframework.launching.supervise import exit_process
from model_states import _storages, grad_bytes, main, optimizer_bytes  # the sibling worker (this folder)

ALL_GATHER = partition_parameters._dist_allgather_fn  # every ZeRO-3 weight all-gather goes through it
GATHERS: dict[str, int] = {}  # group size (a JSON key) -> all-gathers over a group of that size


def counted_all_gather(input_tensor, output_tensor, group=None):
    size = str(dist.get_world_size(group))
    GATHERS[size] = GATHERS.get(size, 0) + 1
    return ALL_GATHER(input_tensor, output_tensor, group=group)


def secondaries(module) -> list:
    return [p for p in module.parameters() if getattr(p, "ds_secondary_tensor", None) is not None]


def param_bytes(module) -> int:
    params = list(module.parameters())
    return _storages([p.data for p in params] + [p.ds_tensor for p in params]
                     + [p.ds_secondary_tensor for p in secondaries(module)])


def measure(run, *, steps: int = 2) -> dict:
    GATHERS.clear()
    # One process builds an hpZ engine per case (`dsf train` builds one): DeepSpeed keeps the hpZ
    # group of the previous one in a global and refuses to make another while it is set.
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    session = prepare(run)
    engine = session.engine
    held = {"params": 0, "secondary": 0, "grads": 0, "hpz_group": 1}
    original_step = engine.optimizer.step

    def step_and_measure(*args, **kwargs):
        with_secondary = secondaries(engine.module)
        held["params"] = max(held["params"], param_bytes(engine.module))
        held["secondary"] = max(held["secondary"], _storages([p.ds_secondary_tensor for p in with_secondary]))
        held["hpz_group"] = max([held["hpz_group"], *(p.ds_secondary_tensor_group_size for p in with_secondary)])
        held["grads"] = max(held["grads"], grad_bytes(engine))
        return original_step(*args, **kwargs)

    engine.optimizer.step = step_and_measure
    per_step, micro = session.batch.micro_batch * session.batch.grad_accum, session.batch.micro_batch
    for step in range(steps):
        blocks = [session.train_blocks[step * per_step + i] for i in range(per_step)]
        for i in range(0, per_step, micro):
            engine.backward(micro_batch_loss(engine, torch.stack(blocks[i:i + micro]), session.loss_setup)[0])
            if not engine.is_gradient_accumulation_boundary():
                held["grads"] = max(held["grads"], grad_bytes(engine))
            engine.step()
    return {**held, "optimizer": optimizer_bytes(engine), "gathers": dict(GATHERS), "rank": session.rank,
            "dp": session.dims.dp, "cp": session.dims.cp}


if __name__ == "__main__":
    torch.set_num_threads(1)
    partition_parameters._dist_allgather_fn = counted_all_gather
    main(sys.argv[1:], measure=measure)
    exit_process(0)  # without the interpreter's teardown of gloo's threads (see supervise.exit_process)
