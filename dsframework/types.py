"""Names for the objects from other libraries that cross dsframework's seams: the transformers
config, the DeepSpeed engine, the rank grid (the `mpu`), a transformers model; and DeepSpeed's
accelerator, typed (`accelerator()`).

    from dsframework.types import Engine, Grid, HFConfig

    def evaluate(engine: Engine, ...) -> float: ...
    def check_context_parallel(config: HFConfig, *, cp: int, ...) -> None: ...

Under the type checker (pyright, in the fast tier) each is the library's own class, so "go to
definition" lands on it and a wrong attribute is an error; at run time each is `typing.Any` and
importing this module imports nothing (`dsf plan`, `dsf --help` and the launcher's watcher start
without torch, deepspeed or transformers). Annotations only: never `isinstance` against them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine as Engine  # the pipeline engine is one too
    from deepspeed.runtime.pipe.engine import PipelineEngine  # pp > 1: train_batch / eval_batch
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid as Grid  # parallel/topology.build_grid
    from torch.nn import Module as HFModel  # a transformers model, or the Megatron-layer one built for tp
    from transformers import PreTrainedConfig as HFConfig
else:
    Engine = PipelineEngine = Grid = HFModel = HFConfig = Any

__all__ = ["Accelerator", "Engine", "Grid", "HFConfig", "HFModel", "PipelineEngine", "accelerator"]


class Accelerator(Protocol):
    """What dsframework calls on DeepSpeed's accelerator (deepspeed/accelerator/abstract_accelerator.py).
    Its abstract class names `device_index` without the default that CUDA's and the CPU's
    accelerators give it (None: the current device), which is how dsframework calls them."""

    def device_name(self, device_index: int | None = None) -> str: ...
    def current_device_name(self) -> str: ...
    def device_count(self) -> int: ...
    def set_device(self, device_index: int) -> None: ...
    def synchronize(self, device_index: int | None = None) -> None: ...
    def communication_backend_name(self) -> str: ...
    def get_rng_state(self, device_index: int | None = None) -> Any: ...
    def set_rng_state(self, new_state: Any, device_index: int | None = None) -> None: ...
    def is_fp16_supported(self) -> bool: ...
    def create_op_builder(self, class_name: str) -> Any: ...
    def export_envs(self) -> list[str]: ...


def accelerator() -> Accelerator:
    """DeepSpeed's accelerator of this process (`get_accelerator()`: CUDA on a GPU, the CPU
    accelerator here), typed: DeepSpeed's function leaves its return type to inference, which
    includes the None its cache starts as, so every call would read as possibly None."""
    from deepspeed.accelerator import get_accelerator

    return cast(Accelerator, get_accelerator())
