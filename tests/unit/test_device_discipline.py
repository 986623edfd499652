"""Host and device kept apart, checked on this CPU build (tests/device_discipline.py: fake cuda:0
tensors, the default group standing for NCCL, dsf's gloo host group beside it): a training step
keeps its loss on the device and never waits for it; evaluation reads back once; every host-side
figure (the mean of a number over ranks, the stop flag, the expert load) goes through the host group
and every device tensor through the default group; and every tensor factory in train/, models/,
parallel/ and checkpoints/ names its device or says why it is host-side (`# host: <why>`)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dsframework.data.store import STORE_VERSION, TokenStore
from dsframework.train import step
from dsframework.train.expert_load import ExpertLoad
from dsframework.train.guards import NonFiniteWatch, StopRequest
from dsframework.train.world import mean_over_ranks
from tests.device_discipline import CUDA, DeviceRuleBroken, simulated_gpu_rank

PACKAGE = Path(__file__).parents[2] / "dsframework"


def test_the_simulated_rank_refuses_what_a_gpu_refuses():
    """The harness itself: the three defects, each refused or counted (today's bugs of issue 31:
    a host loss total written with the CUDA loss, a host tensor on the NCCL group, a host read)."""
    with simulated_gpu_rank() as rank:
        loss = torch.ones((), device=CUDA)
        total = torch.zeros((), dtype=torch.float64)
        with pytest.raises(RuntimeError, match="wrong device|two devices"):  # what CUDA says, in FakeTensor's words
            total += loss.double()
        with pytest.raises(DeviceRuleBroken, match="a host tensor .* on a device group"):
            dist.all_reduce(torch.tensor([1.0]))
        with pytest.raises(DeviceRuleBroken, match="a cuda tensor .* on the host"):
            from dsframework.parallel.host import host_group
            dist.all_reduce(loss.reshape(1), group=host_group())
        loss.item()
        loss.cpu()
        assert rank.syncs == ["item", "copy to the host"]


@pytest.mark.parametrize("supervised", [False, True])
def test_a_step_keeps_its_loss_on_the_device_and_never_waits(supervised):
    with simulated_gpu_rank() as rank:
        engine = rank.engine()
        batches = rank.host_batches(3)
        if supervised:  # as data/store.py's micro_batch gives chat / prompt-completion rows
            batches = [{"input_ids": ids, "labels": ids.masked_fill(ids < 4, -100), "position_ids": ids,
                        "loss_weight": 0.5} for ids in batches]
        loss = step.train_step(engine, batches, pipeline=False)
        assert loss.device == CUDA and loss.dtype == torch.float64
        assert engine.steps == 3 and rank.syncs == [] and rank.collectives == []


@pytest.mark.parametrize("supervised", [False, True])
def test_a_step_copies_the_next_micro_batch_before_each_forward(supervised):
    """Without waiting (non_blocking=True: from pinned memory on a GPU, train/step.py to_device), and
    one ahead: the host queues micro-batch i+1's copy, then micro-batch i's forward."""
    with simulated_gpu_rank() as rank:
        batches = rank.host_batches(3)
        if supervised:  # ids, labels and positions: three copies a micro-batch
            batches = [{"input_ids": ids, "labels": ids, "position_ids": ids, "loss_weight": 0.5} for ids in batches]
        step.train_step(rank.engine(), batches, pipeline=False)
        copies = ["copy to the device"] * (3 if supervised else 1)
        assert rank.events == [*copies, *copies, "forward", *copies, "forward", "forward"]


def _store(directory: Path, *, supervised: bool, rows: int = 8, seq_len: int = 8) -> TokenStore:
    """An eval split written as data/store.py writes one."""
    directory.mkdir()
    meta = {"version": STORE_VERSION, "format": "chat" if supervised else "text", "seq_len": seq_len,
            "dtype": "uint16", "position_dtype": "uint16", "splits": {"eval": {"rows": rows, "tokens": rows * seq_len}}}
    (directory / "meta.json").write_text(json.dumps(meta))
    ids = np.arange(rows * seq_len) % 16
    ids.astype(np.uint16).tofile(directory / "eval.ids")
    if supervised:
        (ids % 2).astype(np.uint8).tofile(directory / "eval.trained")
        (np.arange(rows * seq_len) % seq_len).astype(np.uint16).tofile(directory / "eval.positions")
    return TokenStore(directory, "eval")


@pytest.mark.parametrize("supervised", [False, True])
def test_evaluation_sums_on_the_device_and_reads_back_once(tmp_path, supervised):
    blocks = _store(tmp_path / "store", supervised=supervised)
    with simulated_gpu_rank() as rank:
        step.evaluate(rank.engine(), blocks, micro_batch=2, dp_size=1, dp_rank=0, pipeline=False)
        assert rank.collectives == [("allreduce_", "device")]
        assert rank.syncs == ["item"]  # one read back for the whole evaluation, not one per micro-batch


def test_host_figures_go_through_the_host_group():
    with simulated_gpu_rank() as rank:
        mean_over_ranks(0.5)
        stop = StopRequest()
        stop.agreed()
        stop.agreed()
        stop.close()
        load = ExpertLoad(experts=4, top_k=2)
        load.aux_sum, load.forwards = torch.ones((), dtype=torch.float64, device=CUDA), 1
        load.counts = torch.zeros(2, 4, dtype=torch.long, device=CUDA)  # per layer, tokens per expert
        load.read()
        assert rank.collectives == [("allreduce_", "host")] * 4


def _router_output(layers: list[torch.Tensor]):
    from types import SimpleNamespace

    return SimpleNamespace(aux_loss=None, router_logits=tuple(layers))


def test_the_expert_load_counts_on_the_device_without_a_read_back():
    """A forward's tokens per expert, counted where the router logits are (bincount's data-dependent
    size would be read back first on a GPU: FakeTensorMode refuses it)."""
    with simulated_gpu_rank() as rank:
        load = ExpertLoad(experts=4, top_k=2)
        model = torch.nn.Module()  # (training: the hook counts training forwards only)
        for _ in range(2):
            load._after_forward(model, (), _router_output([torch.empty(6, 4, device=CUDA)] * 3))
        assert load.counts.device == CUDA and tuple(load.counts.shape) == (3, 4)
        assert rank.syncs == [] and rank.collectives == []


def test_the_expert_load_counts_what_bincount_counts():
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randn(50, 4, generator=generator), torch.randn(50, 6, generator=generator)]  # 6: 2 zero experts
    load = ExpertLoad(experts=4, top_k=2)
    load._after_forward(torch.nn.Module(), (), _router_output(layers))
    want = torch.stack([torch.bincount(layer.topk(2, dim=-1).indices.flatten(), minlength=4)[:4] for layer in layers])
    assert torch.equal(load.counts, want) and want.sum() > 0


def test_the_non_finite_watch_stays_on_the_device_until_read():
    with simulated_gpu_rank() as rank:
        watch = NonFiniteWatch(enabled=True, device=CUDA)
        for at in (1, 2):
            watch.update(at, torch.ones((), device=CUDA))
        assert rank.syncs == [] and rank.collectives == []
        watch.first_step()  # at logging: one all-reduce on the device, read back
        assert rank.collectives == [("allreduce_", "device")] and rank.syncs


# --- every tensor factory names its device, or says why it is host-side --------------------------

FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "randn", "rand", "randint",
             "linspace", "eye", "randperm"}
FOLDERS = ("train", "models", "parallel", "checkpoints")


def unplaced_factories(source: str) -> list[int]:
    """Lines of `torch.<factory>(...)` calls without `device=` and without a `# host:` comment on
    the call's lines or the line above it."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and "device" not in {k.arg for k in node.keywords}):
            around = lines[max(node.lineno - 2, 0):node.end_lineno]
            if not any("# host:" in line for line in around):
                out.append(node.lineno)
    return out


def test_every_tensor_factory_names_its_device_or_why_it_is_host_side():
    found = {f"{path.relative_to(PACKAGE)}:{line}": path.read_text().splitlines()[line - 1].strip()
             for folder in FOLDERS for path in sorted((PACKAGE / folder).rglob("*.py"))
             for line in unplaced_factories(path.read_text())}
    assert not found, "tensors made on the host without saying why (device=engine.device, or `# host: <why>`):\n" + \
        "\n".join(f"  {where}: {code}" for where, code in found.items())


def test_the_factory_rule_finds_the_host_total_of_issue_31():
    before = "import torch\ntotal = torch.zeros((), dtype=torch.float64)\n"
    after = "import torch\ntotal = torch.zeros((), dtype=torch.float64, device=engine.device)\n"
    said = "import torch\nflag = torch.tensor([1])  # host: a signal's flag, reduced on the host group\n"
    assert unplaced_factories(before) == [2] and unplaced_factories(after) == [] == unplaced_factories(said)
