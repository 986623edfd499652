"""DeepSpeed's host Adam ops keep beta^t as running products no checkpoint holds
(checkpoints/adam_products.py): an optimizer loaded from a state dict, as a resumed process loads it,
takes its next step bit for bit as the uninterrupted one only once the products are replayed.

Step 10 is one where the running product of 0.95 and pow(0.95, 10) differ in float (the first
resumed step of the chain in tests/distributed/test_faults.py that drifted by 3.4e-5 over 100 steps).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from dsframework.checkpoints.adam_products import replay_adam_products
from dsframework.jit import pin_build_tools

SIZE, BETAS = 65536, (0.9, 0.95)


@pytest.fixture
def built_ops(monkeypatch):
    """The ops the setup built in this environment (as `dsf train` finds them: jit.pin_build_tools),
    not a build of their own in ~/.cache (a minute each on a fresh machine); the environment restored after."""
    for name in ("TORCH_EXTENSIONS_DIR", "PATH"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    pin_build_tools()


def as_a_fresh_process_finds_it(optimizer) -> None:
    """FusedAdam's C++ object is one per process and mode: a step at other betas makes its next real
    step start from pow(beta, t), as the first step of a new process does."""
    if type(optimizer).__name__ == "FusedAdam":
        optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, [[torch.zeros(1)] for _ in range(4)],
                                    0.0, 0.5, 0.5, 1e-8, 1, 1, 1, 0.0)


def tenth_step(kind: str, *, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the parameter after 10 uninterrupted steps, after 9 + a reload + the 10th)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    make = {"DeepSpeedCPUAdam": DeepSpeedCPUAdam, "FusedAdam": FusedAdam}[kind]
    generator = torch.Generator().manual_seed(0)
    straight = torch.nn.Parameter(torch.randn(SIZE, generator=generator))
    grads = [torch.randn(SIZE, generator=generator) for _ in range(10)]
    optimizer = make([straight], lr=3e-3, betas=BETAS, weight_decay=0.1)
    for grad in grads[:9]:
        straight.grad = grad.clone()
        optimizer.step()
    resumed = torch.nn.Parameter(straight.detach().clone())
    saved = copy.deepcopy(optimizer.state_dict())  # (a state dict shares the live moments)
    straight.grad = grads[9].clone()
    optimizer.step()

    reloaded = make([resumed], lr=3e-3, betas=BETAS, weight_decay=0.1)
    reloaded.load_state_dict(saved)
    as_a_fresh_process_finds_it(reloaded)
    if replay:
        assert replay_adam_products(reloaded, torch.device("cpu")) == 9
    resumed.grad = grads[9].clone()
    reloaded.step()
    return straight.detach(), resumed.detach()


@pytest.mark.parametrize("kind", ["DeepSpeedCPUAdam", "FusedAdam"])  # ZeRO-Offload's; the CPU accelerator's
def test_a_reloaded_host_adam_steps_as_the_straight_one_once_its_products_are_replayed(kind, built_ops):
    straight, resumed = tenth_step(kind, replay=False)
    assert not torch.equal(straight, resumed), "DeepSpeed's op no longer keeps running products: drop the replay"
    assert (straight - resumed).abs().max() < 1e-6  # (an ulp here and there)
    straight, resumed = tenth_step(kind, replay=True)
    assert torch.equal(straight, resumed)


def test_an_optimizer_without_running_products_is_left_alone():
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(4)
    optimizer.step()
    assert replay_adam_products(optimizer, torch.device("cpu")) == 0
