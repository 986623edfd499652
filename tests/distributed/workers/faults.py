"""Worker (run under the deepspeed launcher): `dsf train` with one fault injected on rank 0.

    deepspeed --num_gpus 2 faults.py --fault nan@4 train RUN.yaml --set ...
    deepspeed --num_gpus 2 faults.py --fault checkpoint@4 train RUN.yaml --set ...
    deepspeed --num_gpus 2 faults.py --fp16-on-cpu --fault nan@3 train RUN.yaml --set train.precision=fp16

`--fault POINT@STEP` (taken out of the arguments before `dsf` reads them) picks the fault:

- `nan@K`: rank 0's loss (the one backpropagated and the one logged) is multiplied by NaN in every
  micro-batch of optimizer step K, the divergence the NaN guard must catch (not with pp > 1, where
  DeepSpeed's pipeline engine computes the loss);
- `checkpoint@K`: rank 0 dies (exit 97) in the step-K save after every rank wrote its DeepSpeed
  shards and RNG state, before the checkpoint is committed (manifest, rename, `latest`);
- `latest@K`: rank 0 dies after the step-K checkpoint was renamed into place, before `latest`
  names it.

`--fp16-on-cpu` also lifts DeepSpeed's fp16 refusal on this CPU (fp16_on_cpu.py).

Production code knows nothing of faults: this worker wraps dsframework's own functions
(`one_step.train_step`, `one_step.micro_batch_loss`, `checkpoint.write_shards`,
`checkpoint.set_latest`), then runs the real `dsf train` in this process (the rank watcher is
bypassed, as in fp16_on_cpu.py, so the wrappers hold in the process that trains).
"""
import os
import re
import signal
import sys

from dsframework.checkpoints import checkpoint

from dsframework.train import step as one_step  # (`step` is the fault's step below)
from dsframework.launching.supervise import CHILD_MARK

EXIT_CODE = 97  # what a rank killed mid-save exits with (any non-zero would do; this one is recognisable)


def take_fault(argv: list[str]) -> tuple[str, int]:
    """Remove `--fault POINT@STEP` from argv (in place); (POINT, STEP)."""
    at = argv.index("--fault")
    spec = argv[at + 1]
    del argv[at:at + 2]
    match = re.fullmatch(r"(nan|checkpoint|latest)@(\d+)", spec)
    if not match:
        sys.exit(f"faults.py: --fault {spec!r}: expected nan@STEP, checkpoint@STEP or latest@STEP")
    return match.group(1), int(match.group(2))


def die(point: str, step: int, ds_engine=None) -> None:
    """Rank 0 exits now; with checkpoint.writer=decoupled its writer process dies with it (SIGKILL,
    mid-write or not: a node lost), which also leaves no orphan holding the test's output pipe."""
    print(f"dsf: fault {point}@{step} (tests/distributed/workers/faults.py): rank 0 dies here", flush=True)
    writer = getattr(getattr(ds_engine, "checkpoint_engine", None), "ckpt_process", None)
    if writer is not None and writer.pid is not None:
        os.kill(writer.pid, signal.SIGKILL)
    os._exit(EXIT_CODE)


def poison_loss_at(fault_step: int) -> None:
    """Rank 0's micro-batch losses become NaN during optimizer step `fault_step` (1-based, as logged)."""
    train_step, loss_of = one_step.train_step, one_step.micro_batch_loss
    poisoned = [False]

    def poisoning_train_step(ds_engine, *args, **kwargs):
        # DeepSpeed counts every optimizer step (skipped fp16 steps too) and restores the count on
        # resume, so global_steps + 1 is the step this call makes, whatever the accumulation.
        poisoned[0] = ds_engine.global_steps + 1 == fault_step
        try:
            return train_step(ds_engine, *args, **kwargs)
        finally:
            poisoned[0] = False

    def poisoned_loss(*args, **kwargs):
        loss, value = loss_of(*args, **kwargs)
        if poisoned[0]:
            return loss * float("nan"), value * float("nan")
        return loss, value

    one_step.train_step, one_step.micro_batch_loss = poisoning_train_step, poisoned_loss


def die_in_save_at(point: str, fault_step: int) -> None:
    """Rank 0 exits at `point` of the step-`fault_step` checkpoint save."""
    tag = checkpoint.tag_for(fault_step)
    if point == "checkpoint":
        write_shards = checkpoint.write_shards

        def write_shards_then_die(ds_engine, partial, **kwargs):
            write_shards(ds_engine, partial, **kwargs)
            if partial.name == tag + checkpoint.PARTIAL:  # (decoupled writer: while it writes in the background)
                die(point, fault_step, ds_engine)

        checkpoint.write_shards = write_shards_then_die
    else:
        set_latest = checkpoint.set_latest

        def die_before_set_latest(ckpt_dir, new_tag):
            if new_tag == tag:
                die(point, fault_step)
            set_latest(ckpt_dir, new_tag)

        checkpoint.set_latest = die_before_set_latest


# The guard: DeepSpeed's decoupled writer starts its process with multiprocessing's spawn, which
# imports this script again in it (as __mp_main__); it must not train there.
if __name__ == "__main__":
    point, step = take_fault(sys.argv)
    os.environ[CHILD_MARK] = "1"
    if "--fp16-on-cpu" in sys.argv:
        sys.argv.remove("--fp16-on-cpu")
        from fp16_on_cpu import lift_fp16_refusal  # the sibling worker (this script's folder is on sys.path)

        lift_fp16_refusal()
    if os.environ.get("RANK", "0") == "0":
        if point == "nan":
            poison_loss_at(step)
        else:
            die_in_save_at(point, step)

    from dsframework.commands.cli import main  # (after the patches, as dsf would import it)

    main()
