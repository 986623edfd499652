"""The state of DeepSpeed's host Adam that no checkpoint holds, put back after a resume.

    load_checkpoint(...)                 # weights, Adam's moments and step, the lr schedule
    restore_adam_products(engine)        # then: beta1^t and beta2^t as an uninterrupted run has them

DeepSpeed's C++ Adam for the host (`cpu_adam.h`: the CPU accelerator's FusedAdam and ZeRO-Offload's
DeepSpeedCPUAdam) keeps beta1^t and beta2^t for the bias correction as running products in float,
multiplied by beta at every step, and computes them as `std::pow(beta, t)` only when a step does not
follow the one before: the first step of a resumed process. The two differ in the last bit, so the
first update after a resume differs from an uninterrupted run's by an ulp, and training amplifies it
(3.4e-5 relative after 100 steps and four resumes, seen here). Replaying the products, one step on a
one-element tensor per step already taken, gives the op what an uninterrupted run has: a resume is then
bit for bit the straight run (tests/distributed/test_faults.py). About 2 µs per step taken, once.
CUDA's FusedAdam and torch's AdamW compute beta^t from the step every time and need nothing.
"""
from __future__ import annotations

from typing import Any

from dsframework.types import Engine


def restore_adam_products(engine: Engine) -> int:
    """Replay the steps the loaded optimizer has taken through its host Adam op (see the module
    docstring); returns how many (0: not a host Adam, or no step taken yet)."""
    wrapper = getattr(engine, "optimizer", None)  # (None: an engine built without one)
    return 0 if wrapper is None else replay_adam_products(getattr(wrapper, "optimizer", wrapper), engine.device)


def replay_adam_products(optimizer: Any, device: Any) -> int:
    """`restore_adam_products` for the optimizer itself (DeepSpeed's base optimizer, under ZeRO's)."""
    import torch

    replay = _host_adam_step(optimizer, device)
    steps = _steps_taken(optimizer)
    if replay is None or steps == 0:
        return 0
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    # grad, param, exp_avg, exp_avg_sq: lr 0 and a zero grad leave them as they are (nothing reads them)
    tensors = [torch.zeros(1, dtype=torch.float32) for _ in range(4)]  # host: the host Adam ops' own memory
    for step in range(1, steps + 1):
        replay(step, beta1, beta2, group, tensors)
    return steps


def _steps_taken(optimizer: Any) -> int:
    """The optimizer's step count, as its state holds it (per parameter, all equal)."""
    steps = [state["step"] for state in optimizer.state.values() if "step" in state]
    return int(max(steps)) if steps else 0


def _host_adam_step(optimizer: Any, device: Any) -> Any:
    """A function that runs one step of `optimizer`'s host C++ Adam on four given tensors, or None
    where the optimizer keeps no running products (CUDA's FusedAdam, torch's Adam)."""
    kind = type(optimizer).__name__
    if kind == "DeepSpeedCPUAdam":  # ZeRO-Offload's, one C++ object per optimizer
        def cpu_adam(step: int, beta1: float, beta2: float, group: dict, tensors: list) -> None:
            grad, param, exp_avg, exp_avg_sq = tensors
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, 0.0, beta1, beta2, group["eps"], 0.0,
                                              group["bias_correction"], param, grad, exp_avg, exp_avg_sq)
        return cpu_adam
    if kind == "FusedAdam" and getattr(device, "type", str(device)) == "cpu":  # one C++ object per mode
        def fused_adam(step: int, beta1: float, beta2: float, group: dict, tensors: list) -> None:
            optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, [[t] for t in tensors], 0.0,
                                        beta1, beta2, group["eps"], step, optimizer.adam_w_mode,
                                        1 if group["bias_correction"] else 0, 0.0)
        return fused_adam
    return None
