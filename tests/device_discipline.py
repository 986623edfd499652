"""A GPU rank simulated on this CPU-only torch build, for the defects CPU ranks cannot show: a host
tensor meeting a device tensor, a host tensor sent through a device-only (NCCL) collective, and a
host synchronisation inside a training step.

    with simulated_gpu_rank() as rank:             # a world of one: its default group stands for NCCL
        engine = rank.engine()                     # a stand-in engine whose weights are on cuda:0
        loss = train_step(engine, rank.host_batches(2), pipeline=False)
        assert loss.device.type == "cuda" and rank.syncs == []

How: PyTorch's FakeTensorMode makes tensors on `cuda:0` (no data, no kernels) and refuses an op
that writes a host tensor with a CUDA one (FakeTensorDeviceMismatchError), as CUDA does. Above it,
`DeviceRules` (a TorchDispatchMode) sees every collective (c10d ops go through the dispatcher) and
fails one that sends a CPU tensor on a group other than dsf's host group (parallel/host.host_group, a
gloo group beside NCCL on a GPU: made separate here), or a CUDA tensor on the host group; it
completes them at once (a world of one), and records each read back to the host (`.item()`, a copy
to the CPU) as a synchronisation. A real HF model cannot run there (some kernels need a CUDA build),
so `engine()` is a stand-in with DeepSpeed's engine interface over an embedding and a head: what is
checked is dsf's code around the model, not the model.
"""
from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)


class DeviceRuleBroken(AssertionError):
    """What a GPU would refuse, found on the CPU."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class DeviceRules(TorchDispatchMode):
    """Checks each collective's group against its tensors' device and counts host reads (module docstring)."""

    def __init__(self, host_group: Any) -> None:
        super().__init__()
        self.host_group, self.syncs, self.collectives = host_group, [], []
        self.events: list[str] = []  # copies to the device and the stand-in engine's forwards, in order

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            return self._collective(func, args)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.append("item")
            return 0 if not args[0].dtype.is_floating_point else 0.0
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if src.device.type == "cuda" and dst is not None and torch.device(dst).type == "cpu":
                self.syncs.append("copy to the host")
            if src.device.type == "cpu" and dst is not None and torch.device(dst).type == "cuda":
                self.events.append("copy to the device" if kwargs.get("non_blocking") else "blocking copy")
        return func(*args, **kwargs)

    def _collective(self, func: Any, args: Any) -> Any:
        name = func.__name__.split(".")[0]
        group = next(dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
                     and "ProcessGroup" in str(a._type()))
        on_host = group is self.host_group
        for tensor in _tensors([a for a in args if isinstance(a, (list, torch.Tensor))]):
            if tensor.device.type == "cpu" and not on_host:
                raise DeviceRuleBroken(f"{name}: a host tensor {tuple(tensor.shape)} on a device group "
                                       "(NCCL has no CPU backend: use parallel/host.host_group())")
            if tensor.device.type == "cuda" and on_host:
                raise DeviceRuleBroken(f"{name}: a cuda tensor {tuple(tensor.shape)} on the host (gloo) group")
        self.collectives.append((name, "host" if on_host else "device"))
        # The same collective on real host zeros (a world of one: it completes at once) for a real Work;
        # the fake tensors keep what they hold, which a world of one's reduction would not change.
        with unset_fake_temporarily():
            real = _real_like(list(args))
            out = func(*real)
        if name == "allgather_":  # each output list takes the input
            for outputs, tensor in zip(args[0], args[1]):
                outputs[0].copy_(tensor)
        if isinstance(out, tuple):
            return (args[0], *out[1:])
        return out


def _real_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)  # host: a stand-in for a world of one
    if isinstance(value, list):
        return [_real_like(item) for item in value]
    return value


class StandInEngine(torch.nn.Module):
    """DeepSpeed's engine interface (device, forward -> .loss, backward, step, train/eval) over an
    embedding and a head on cuda:0: the causal LM loss, or the summed masked loss over
    `num_items_in_batch` as transformers computes it for supervised rows."""

    def __init__(self, vocab: int, hidden: int, events: list[str] | None = None) -> None:
        super().__init__()
        # no autograd: recording a graph of fake cuda tensors needs a CUDA build (backward is a no-op)
        self.embed = torch.nn.Parameter(torch.empty(vocab, hidden, device=CUDA), requires_grad=False)
        self.head = torch.nn.Parameter(torch.empty(hidden, vocab, device=CUDA), requires_grad=False)
        self.device, self.steps, self.events = CUDA, 0, [] if events is None else events

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                **_: Any) -> Any:
        self.events.append("forward")
        hidden = self.embed.index_select(0, input_ids.flatten()).view(*input_ids.shape, -1)
        logits = hidden @ self.head
        loss = None
        if labels is not None:
            length = logits.shape[1] - 1  # (narrow, not slicing: FakeTensor's cuda slicing needs a CUDA build)
            flat = logits.narrow(1, 0, length).reshape(-1, logits.shape[-1])
            targets = labels.narrow(1, 1, length).reshape(-1)
            if num_items_in_batch is None:
                loss = F.cross_entropy(flat, targets)
            else:
                loss = F.cross_entropy(flat, targets, ignore_index=-100, reduction="sum") / num_items_in_batch
        return SimpleNamespace(loss=loss, logits=logits)

    def backward(self, loss: torch.Tensor) -> None:  # autograd does not run on fake tensors
        assert loss.device == self.device

    def step(self) -> None:
        self.steps += 1


class SimulatedRank:
    def __init__(self, fake: FakeTensorMode, rules: DeviceRules) -> None:
        self.fake, self.rules = fake, rules

    @property
    def syncs(self) -> list[str]:
        return self.rules.syncs

    @property
    def collectives(self) -> list[tuple[str, str]]:
        return self.rules.collectives

    @property
    def events(self) -> list[str]:
        """Copies to the device ("blocking copy" without non_blocking=True) and forwards, in order."""
        return self.rules.events

    def engine(self, vocab: int = 16, hidden: int = 8) -> StandInEngine:
        return StandInEngine(vocab, hidden, self.rules.events)

    def host_batches(self, count: int, *, rows: int = 2, seq_len: int = 8, vocab: int = 16) -> list[torch.Tensor]:
        """Micro-batches of token ids on the host, as the token store hands them out."""
        import numpy as np

        ids = np.arange(count * rows * seq_len, dtype=np.int64).reshape(count, rows, seq_len) % vocab
        return [torch.from_numpy(ids[i].copy()) for i in range(count)]


@contextlib.contextmanager
def simulated_gpu_rank() -> Iterator[SimulatedRank]:
    """A process group of one (gloo standing for NCCL), dsf's host group beside it, and the two
    modes above (see the module docstring)."""
    from dsframework.ports import free_port
    from dsframework.parallel import host

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    host.make_host_group(separate=True)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake, DeviceRules(host.host_group()) as rules:
            yield SimulatedRank(fake, rules)
    finally:
        host.make_host_group(separate=False)
        if started:
            dist.destroy_process_group()
