"""Worker (run under the deepspeed launcher): for each case, build dsf's engine and measure the
bytes of parameters, gradients and optimizer states this rank really holds during one step.

    deepspeed --num_gpus 2 model_states.py OUT_DIR RUN.yaml case:NAME:k=v,k=v ... --set k=v ...
    # -> OUT_DIR/<case>-rank<r>.json: {"params": bytes, "grads": bytes, "optimizer": bytes, ...}

What is counted, as distinct tensor storages (a tensor reached twice counts once):
- params: the module's parameters; under ZeRO-3 each one's partition (ds_tensor) plus its full
  data while gathered (the persistent small ones stay gathered); offloaded ones count too (the
  planner's device and host bytes are compared together: on CPU ranks both are host memory);
- grads: the most held at any of: after a micro-batch's backward inside the accumulation window,
  and just before the optimizer step (p.grad, and ZeRO's gradient partitions and buffers);
- optimizer: after the step, the Adam states and ZeRO's fp32 master partitions;
- persistent: elements of the parameters ZeRO-3 keeps whole (ds_persist), and reduce_bucket: the
  bytes of ZeRO-3's reduce bucket (its ipg buffers), what parallel.zero_knobs sizes.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.distributed.launcher

from dsframework.config import load_run_config
from dsframework.launching.supervise import exit_process
from dsframework.train.setup import prepare
from dsframework.train.world import shutdown_distributed
from tests.distributed.launcher import forget_previous_run


def _storages(tensors) -> int:
    """Bytes covered by the tensors: the union of their memory ranges, so a view and the flat
    buffer it lies in count once (alignment padding, which DeepSpeed marks `_zero_padding`, is
    not a tensor the rank owns)."""
    spans = sorted({(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors
                    if torch.is_tensor(t) and t.numel() > 0 and not getattr(t, "_zero_padding", False)})
    total, end = 0, -1
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _flat(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)


def param_bytes(module) -> int:
    tensors = []
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            tensors.append(p.ds_tensor)
        tensors.append(p.data)
    return _storages(tensors)


MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
GRAD_ATTRS = ("averaged_gradients", "grads_in_partition", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
              "grad_partitions_flat_buffer")


def grad_bytes(engine) -> int:
    tensors = [p.grad for p in engine.module.parameters()]
    for attr in GRAD_ATTRS:
        tensors += list(_flat(getattr(engine.optimizer, attr, None)))
    for attr in MASTER_ATTRS:  # with offload, the fp32 gradient partition hangs off the master copy
        tensors += [t.grad for t in _flat(getattr(engine.optimizer, attr, None))]
    return _storages(tensors)


def optimizer_bytes(engine) -> int:
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    tensors = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    for attr in MASTER_ATTRS:
        tensors += list(_flat(getattr(engine.optimizer, attr, None)))
    return _storages(tensors)


def persistent_elements(module) -> int:
    return sum(p.ds_numel for p in module.parameters() if getattr(p, "ds_persist", False))


def reduce_bucket_bytes(engine) -> int:
    """ZeRO-3's contiguous reduce buckets (one per dtype, allocated at start); 0 at other stages."""
    buckets = getattr(engine.optimizer, "ipg_buckets", None) or {}
    return sum(b.buffer.numel() * b.buffer.element_size() for b in buckets.values()
               if torch.is_tensor(getattr(b, "buffer", None)))


def measure(run) -> dict:
    session = prepare(run)
    engine = session.engine
    held = {"grads": 0}
    original_step = engine.optimizer.step

    def step_and_measure(*args, **kwargs):  # just before the update: the gradients as reduced
        held["grads"] = max(held["grads"], grad_bytes(engine))
        return original_step(*args, **kwargs)

    engine.optimizer.step = step_and_measure
    blocks = [session.train_blocks[i] for i in range(session.batch.micro_batch * session.batch.grad_accum)]
    micro = [torch.stack(blocks[i:i + session.batch.micro_batch])
             for i in range(0, len(blocks), session.batch.micro_batch)]
    if session.dims.pp_enabled:  # measure after each backward instruction of the 1F1B schedule
        from deepspeed.runtime.pipe.schedule import BackwardPass

        backward = engine._INSTRUCTION_MAP[BackwardPass]

        def backward_and_measure(self, *args, **kwargs):
            result = backward(self, *args, **kwargs)
            held["grads"] = max(held["grads"], grad_bytes(self))
            return result

        engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, BackwardPass: backward_and_measure}
        engine.train_batch(data_iter=iter([(ids, ids) for ids in micro]))
    else:
        for ids in micro:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if not engine.is_gradient_accumulation_boundary():
                held["grads"] = max(held["grads"], grad_bytes(engine))
            engine.step()
    return {"params": param_bytes(engine.module), "grads": held["grads"], "optimizer": optimizer_bytes(engine),
            "persistent": persistent_elements(engine.module), "reduce_bucket": reduce_bucket_bytes(engine),
            "rank": session.rank, "stage": getattr(engine, "stage_id", 0), "dp": session.dims.dp}


def main(argv, measure=measure):
    """OUT_DIR RUN.yaml case:NAME:k=v,... --set k=v ...: `measure` each case's run config, one JSON
    a rank (hpz_states.py passes its own `measure`)."""
    args = [a for a in argv if not a.startswith("--local_rank")]
    out_dir, run_yaml = Path(args[0]), args[1]
    cases = [a for a in args[2:] if a.startswith("case:")]
    sets = [a for a in args[2:] if a not in cases and a != "--set"]
    for case in cases:
        _, name, spec = case.split(":", 2)
        overrides = [*sets, *spec.split(","), f"output_dir={out_dir / name}"]
        forget_previous_run()  # each case as in a fresh process (an ep run read a tp run's stale mpu)
        result = measure(load_run_config(run_yaml, overrides))
        (out_dir / f"{name}-rank{result['rank']}.json").write_text(json.dumps(result))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    exit_process(0)  # without the interpreter's teardown of gloo's threads (see supervise.exit_process)
