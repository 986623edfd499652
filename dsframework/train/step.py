"""What one training step does on a rank: its micro-batches, their loss, the optimizer step, and
the held-out evaluation (the loop in train/loop.py calls these once per step or window).

    batches = step_batches(train_blocks, sampler, consumed)     # this rank's rows of the step
    loss = train_step(engine, batches, pipeline=False)          # forward, backward, optimizer step
    loss, value = micro_batch_loss(engine, batches[0])          # one micro-batch's (host ids, or to_device's)
    eval_loss = evaluate(engine, eval_blocks, micro_batch=2, dp_size=2, dp_rank=0, pipeline=False)
    # context parallel: the loss is set up once (train/setup.py) and handed to both
    loss_setup = LossSetup.context_parallel(grid, dims, vocab_size=32000, chunked=False)
    loss = train_step(engine, batches, pipeline=False, loss_setup=loss_setup)

The loop looks `train_step` and `step_batches` up in this module at each step, and `train_step`
and `evaluate` look up `micro_batch_loss` here at each call: the fault and hot-path tests' workers
replace them in this module (tests/distributed/workers/faults.py, hot_path.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from dsframework.data import BlockSampler, eval_shard
from dsframework.layout import ParallelDims
from dsframework.models.sequence_loss import SequenceShard, sequence_shard_loss
from dsframework.parallel.context import zero_gradient_scale
from dsframework.types import Engine, Grid, PipelineEngine


@dataclass(frozen=True)
class LossSetup:
    """How this run computes a micro-batch's loss, decided once at start-up (train/setup.py) and
    handed to every step and evaluation: the model's own causal LM loss (the default, `WHOLE`), or
    with context parallelism each rank's share of it over its slice of the sequences
    (models/sequence_loss.py)."""

    grid: Grid | None = None  # context parallel: the mpu whose sequence group splits each sequence
    tensor_group: Any = None  # tp x cp: the tensor group the vocab-parallel loss reduces over
    vocab_size: int = 0  # the model's vocabulary (the vocab-parallel loss's targets are checked against it)
    gradient_scale: float = 1.0  # what ZeRO's averaging over the sequence ranks must be undone by
    chunked: bool = False  # the loss in chunks of tokens (models/loss.py use_chunked_loss)

    @classmethod
    def context_parallel(cls, grid: Grid, dims: ParallelDims, *, vocab_size: int, chunked: bool) -> LossSetup:
        return cls(grid=grid, vocab_size=vocab_size, chunked=chunked,
                   tensor_group=grid.get_slice_parallel_group() if dims.tp_enabled else None,
                   gradient_scale=zero_gradient_scale(cp=dims.cp, zero_stage=dims.zero_stage))


WHOLE = LossSetup()


def step_batches(blocks: Any, sampler: BlockSampler, consumed: int) -> list:
    """This rank's micro-batches of one step: rows copied out of the token store (data/store.py).

    With chat / prompt-completion data each carries the weight that makes the sum of its trained
    tokens' losses a share of the mean over the trained tokens of the whole global batch (every rank
    counts them in the same rows: no communication)."""
    weight = None
    if blocks.supervised:
        ranks_times_accum = sampler.dp_size * sampler.grad_accum  # DeepSpeed averages over both
        weight = ranks_times_accum / max(blocks.trained_tokens(sampler.global_indices(consumed)), 1)
    return [blocks.micro_batch(indices, weight=weight) for indices in sampler.micro_batches(consumed)]


@dataclass(frozen=True)
class DeviceBatch:
    """A micro-batch copied to the engine's device by `to_device`, with what was counted on its host copy."""

    batch: Any  # the ids [rows, seq_len], or a supervised micro-batch's dict (its loss_weight left on the host)
    predicted: int | None = None  # context parallel: the tokens with a label (SequenceShard.count), else None


def to_device(engine: Engine, host_batch: Any, loss_setup: LossSetup = WHOLE) -> DeviceBatch:
    """`host_batch` (data/store.py's ids or dict) on the engine's device. On a GPU the copy is made
    from pinned memory with non_blocking=True: the host queues it and goes on (the forward that reads
    it runs after it on the same stream), so train_step issues the next micro-batch's copy before the
    current forward. Pageable memory would make the host wait for each copy; on the CPU nothing is
    pinned (pinning needs CUDA) and the tensors are the host's own."""
    import torch

    device = engine.device
    pin = str(device).startswith("cuda") and torch.cuda.is_available()

    def move(tensor: Any) -> Any:
        return (tensor.pin_memory() if pin else tensor).to(device, non_blocking=True)

    if isinstance(host_batch, dict):
        return DeviceBatch({key: value if key == "loss_weight" else move(value) for key, value in host_batch.items()})
    predicted = SequenceShard.count(host_batch) if loss_setup.grid is not None else None  # on the host: no wait
    return DeviceBatch(move(host_batch), predicted)


def micro_batch_loss(engine: Engine, input_ids: Any, loss_setup: LossSetup = WHOLE) -> tuple[Any, Any]:
    """(the loss to backpropagate, the micro-batch's mean loss detached) for whole sequences:
    `input_ids` a micro-batch on the host (copied here) or already a `to_device` DeviceBatch.

    With context parallelism each rank runs its slice of the sequences and backpropagates its
    share of the mean (models/sequence_loss.py); otherwise the model's own causal LM loss. A
    supervised micro-batch (a dict, data/store.py) gives the sum of its trained tokens' losses
    times its loss_weight (the model divides it by num_items_in_batch = 1 / loss_weight): examples
    packed in a row see only themselves (position ids restart at each example; transformers then
    masks attention block-diagonally)."""
    moved = input_ids if isinstance(input_ids, DeviceBatch) else to_device(engine, input_ids, loss_setup)
    if isinstance(moved.batch, dict):
        # The summed loss of the trained tokens over the global batch's count (loss_weight is
        # data ranks x accumulation / that count): transformers' num_items_in_batch, which its loss
        # and dsf's heads (models/loss.reduce_loss) divide the sum by instead of this micro-batch's count.
        batch = {key: value for key, value in moved.batch.items() if key != "loss_weight"}
        loss = engine(**batch, use_cache=False, num_items_in_batch=1.0 / moved.batch["loss_weight"]).loss
        return loss, loss.detach()
    input_ids = moved.batch
    if loss_setup.grid is not None:
        shard = SequenceShard.of(input_ids, loss_setup.grid, predicted=moved.predicted)
        return sequence_shard_loss(engine, shard, grid=loss_setup.grid,
                                   tensor_group=loss_setup.tensor_group, vocab_size=loss_setup.vocab_size,
                                   gradient_scale=loss_setup.gradient_scale, chunked=loss_setup.chunked)
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    return loss, loss.detach()


def train_step(engine: Engine, micro_batches: list, *, pipeline: bool, loss_setup: LossSetup = WHOLE,
               enter: Any = None) -> Any:
    """One optimizer step over this rank's micro-batches; their mean loss (a float64 tensor on the
    engine's device: nothing here waits for the device). Each micro-batch is copied to the device one
    ahead (`to_device`), and its loss is `micro_batch_loss(engine, batch, loss_setup)` (looked up in
    this module at each call: the fault tests' worker wraps it). `enter(phase)` is told each phase as
    it starts (train/hang.py's heartbeat)."""
    import torch

    enter = enter or _no_phase
    if pipeline:  # DeepSpeed's pipeline engine runs the 1F1B schedule over all micro-batches
        enter("pipeline schedule")
        data = iter([(ids, ids) for ids in micro_batches])
        return cast(PipelineEngine, engine).train_batch(data_iter=data).detach().double()
    total = torch.zeros((), dtype=torch.float64, device=engine.device)  # the losses add up where they are
    ahead = to_device(engine, micro_batches[0], loss_setup)
    for index in range(len(micro_batches)):
        current = ahead
        if index + 1 < len(micro_batches):  # the next copy queued before this forward (to_device)
            ahead = to_device(engine, micro_batches[index + 1], loss_setup)
        enter("forward")
        loss, value = micro_batch_loss(engine, current, loss_setup)
        enter("backward")
        engine.backward(loss)
        enter("optimizer step")
        engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
        total += value.double()
    return total / len(micro_batches)


def _no_phase(phase: str) -> None:
    pass


def evaluate(engine: Engine, eval_blocks: Any, *, micro_batch: int, dp_size: int, dp_rank: int,
             pipeline: bool, loss_setup: LossSetup = WHOLE) -> float:
    """Mean loss over the held-out blocks, every rank running the same number of forwards
    (all micro-batches hold the same number of blocks); with chat / prompt-completion data, the
    mean over every trained token of the held-out rows."""
    import torch
    import torch.distributed as dist

    shard = eval_shard(len(eval_blocks), micro_batch=micro_batch, dp_size=dp_size, dp_rank=dp_rank)
    # (summed loss, trained tokens) or (summed mean loss, micro-batches) of this rank's rows, kept on
    # the device (one read back at the end, not one per micro-batch) and summed over every rank there
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    count = torch.zeros((), dtype=torch.float64, device=engine.device)
    engine.eval()
    with torch.no_grad():
        if eval_blocks.supervised:
            for indices in shard:
                total += micro_batch_loss(engine, eval_blocks.micro_batch(indices, weight=1.0), loss_setup)[1].double()
                count += eval_blocks.trained_tokens(indices)
        elif pipeline:
            batches = [eval_blocks[indices] for indices in shard]
            pipe = cast(PipelineEngine, engine)  # (eval_batch returns the loss without return_logits)
            total += cast(torch.Tensor, pipe.eval_batch(iter([(ids, ids) for ids in batches]),
                                                        num_micro_batches=len(batches))).double()
            count += 1.0
        else:
            for indices in shard:
                total += micro_batch_loss(engine, eval_blocks[indices], loss_setup)[1].double()
                count += 1.0
    engine.train()
    if not eval_blocks.supervised:  # the mean over ranks of each rank's mean (every rank runs as many)
        total, count = total / count.clamp(min=1), torch.ones_like(count)
    sums = torch.stack([total, count])
    dist.all_reduce(sums)  # a device tensor on the default group (tensor ranks hold the same rows: alike)
    total, count = sums.unbind()
    return (total / count.clamp(min=1)).item()


class StepBreakdown:
    """Milliseconds per optimizer step in forward, backward, the gradient reduction DeepSpeed waits
    for at the end of backward (exposed communication) and the optimizer step, averaged over a
    logging window, from DeepSpeed's wall-clock timers (`wall_clock_breakdown`, on with
    logging.breakdown; rank 0 reports its own).

    DeepSpeed resets its timers after every step (printing them), keeping a copy for clients:
    `get_wall_clock_timers()`, read here once per step - a dict, no device synchronisation.
    """

    TIMERS = {"forward_ms": "fwd", "backward_ms": "bwd", "allreduce_ms": "bwd_allreduce", "optimizer_ms": "step"}

    def __init__(self, engine: Engine, *, enabled: bool) -> None:
        self.engine, self.enabled = engine, enabled
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add_step(self) -> None:
        if not self.enabled:
            return
        timers = self.engine.get_wall_clock_timers() or {}
        for key, name in self.TIMERS.items():
            if name in timers:
                self.sums[key] = self.sums.get(key, 0.0) + timers[name]
        self.steps += 1

    def read(self) -> dict[str, float]:
        out = {key: total / self.steps for key, total in self.sums.items()} if self.steps else {}
        self.sums, self.steps = {}, 0
        return out
