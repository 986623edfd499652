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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine as Engine  # the pipeline engine is one too
    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid as Grid  # parallel/topology.build_grid
    from torch.nn import Module as HFModel  # a transformers model, or the Megatron-layer one built for tp
    from transformers import PreTrainedConfig as HFConfig
else:
    Engine = Grid = HFModel = HFConfig = Any

__all__ = ["Engine", "Grid", "HFConfig", "HFModel", "accelerator"]


def accelerator() -> DeepSpeedAccelerator:
    """DeepSpeed's accelerator of this process (`get_accelerator()`: CUDA on a GPU, the CPU
    accelerator here), typed: DeepSpeed's function leaves its return type to inference, which
    includes the None its cache starts as, so every call would read as possibly None."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()  # type: ignore[return-value]  # never None once called

