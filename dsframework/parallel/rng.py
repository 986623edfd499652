"""Random streams under tensor parallelism (Megatron's model-parallel RNG, DeepSpeed's tracker).

Dropout inside a split region (the attention core: each tensor rank holds its own heads) must
draw a mask of its own on every tensor rank, or the ranks drop the same positions of different
heads; dropout in a replicated region (after a row-parallel layer's all-reduce) must draw the
same mask on every tensor rank, or their replicated activations part. So two streams, as
Megatron-LM keeps them: the default generator (the same on every tensor rank) and a tracked one
seeded `seed + 2718 + tensor rank`, entered around the split region:

    seed_tensor_parallel_rng(seed=42, tensor_rank=grid.get_slice_parallel_rank())   # once, after the build
    with tensor_parallel_rng():          # the attention core (models/attention.py forks it there)
        probs = F.dropout(probs, p=0.1)  # this rank's own mask
    states = tracked_rng_states()        # saved beside the default generator's in a checkpoint
    set_tracked_rng_states(states)       # ... and put back on resume

The tracker is DeepSpeed's (`deepspeed.checkpointing.get_cuda_rng_tracker`, on the accelerator's
default generator: CUDA's on a GPU, the CPU's here), so DeepSpeed's own activation checkpointing
(the pipeline's) restores it at a recompute; torch's non-reentrant checkpoint does not, and takes
`checkpoint_contexts` as its `context_fn` for that (HF's gradient checkpointing, the selective one).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

STREAM = "model-parallel-rng"  # DeepSpeed's and Megatron's name for the tensor-parallel stream
SEED_OFFSET = 2718  # Megatron's offset between the default seed and the tensor-parallel ones


def _tracker() -> Any:
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def seed_tensor_parallel_rng(*, seed: int, tensor_rank: int) -> None:
    """Seed this rank's tensor-parallel stream (again, if it was: a second run in one process)."""
    tracker = _tracker()
    tracker.reset()
    tracker.add(STREAM, seed + SEED_OFFSET + tensor_rank)


_inside = [0]  # forks entered and not left: a fork inside a fork draws on (DeepSpeed's would restart the stream)


@contextlib.contextmanager
def tensor_parallel_rng() -> Iterator[None]:
    """Draw from this tensor rank's own stream inside the block (the default generator is left as
    it was); the default generator when no stream was seeded (tp = 1)."""
    tracker = _tracker()
    if _inside[0] or STREAM not in tracker.states_:
        yield
        return
    _inside[0] += 1
    try:
        with tracker.fork(STREAM):
            yield
    finally:
        _inside[0] -= 1


def fork_around(module: Any, *, when: Any = None) -> None:
    """`module`'s forward draws from the tensor-parallel stream (a dropout in the sequence-parallel
    region: each tensor rank holds its own tokens), or, with `when`, at the calls where `when()` is
    true (the default stream otherwise)."""
    def enter(mod: Any, args: Any) -> None:
        mod._dsf_fork = tensor_parallel_rng() if when is None or when() else contextlib.nullcontext()
        mod._dsf_fork.__enter__()

    def leave(mod: Any, args: Any, output: Any) -> None:
        mod.__dict__.pop("_dsf_fork").__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def tracked_rng_states() -> dict[str, Any]:
    """The tracked streams' states (host byte tensors), for a checkpoint; {} when none is seeded."""
    return {name: state.clone() for name, state in _tracker().get_states().items()}


def set_tracked_rng_states(states: dict[str, Any]) -> None:
    """Put back what `tracked_rng_states` returned (a checkpoint's); {} leaves the tracker as it is."""
    if states:
        _tracker().set_states({name: state.clone() for name, state in states.items()})


class _Snapshot:
    """The tracked states at a checkpointed segment's forward, put back around its recompute."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.states = _tracker().get_states()  # (a fork replaces the state tensors: no copy needed)
        yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        tracker = _tracker()
        now = tracker.get_states()
        tracker.set_states(dict(self.states))
        try:
            yield
        finally:
            tracker.set_states(now)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` (non-reentrant): the recompute draws the tracked
    streams from where the forward did, as torch's own `preserve_rng_state` does for the default
    generator, so a recomputed dropout mask is the forward's."""
    snapshot = _Snapshot()
    return snapshot.forward(), snapshot.recompute()
