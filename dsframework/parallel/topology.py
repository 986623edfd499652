"""The rank grid: tensor (innermost) x data x pipe, on DeepSpeed's own topology classes.

    dims = ParallelDims(world=8, tp=2, pp=2)          # dp = 8 / (2 * 2) = 2
    check_layout(dims, num_heads=32, num_kv_heads=8, num_layers=32, ranks_per_node=8)
    topo = build_topology(dims)                        # PipeModelDataParallelTopology
    topo.get_coord(rank=3)                             # ProcessCoord(pipe=0, data=1, model=1)
    grid = build_grid(dims)                            # needs torch.distributed: the mpu for
                                                       # deepspeed.initialize(mpu=grid)

Tensor-parallel ranks are adjacent (the 'model' axis is innermost), so a tensor-parallel group
sits on one node, where its per-layer all-reduces use the fast link. ZeRO shards only across the
data-parallel group, which the grid hands to DeepSpeed.

Checks are pure (no torch.distributed, no disk): one rule set, `layout_problem`, which
`check_layout` raises for `dsf train` (before any process group exists) and `dsf launch`, and by
which the planner's search keeps only valid layouts (its property test uses it as the oracle).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsframework.errors import UserError


@dataclass(frozen=True)
class ParallelDims:
    """How `world` ranks split into tensor x pipeline x data parallel."""

    world: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel.{name}", getattr(self, name), "must be >= 1", "use a positive size")
        if self.world % (self.tp * self.pp):
            sizes = sorted({d for d in range(1, self.world + 1) if self.world % d == 0})
            raise UserError("world size", self.world, f"is not divisible by tp*pp = {self.tp}*{self.pp} = "
                            f"{self.tp * self.pp}", f"choose tp*pp in {{{', '.join(map(str, sizes))}}}")

    @property
    def dp(self) -> int:
        """Data-parallel size: the ranks left after tensor and pipeline parallelism."""
        return self.world // (self.tp * self.pp)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def layout_problem(dims: ParallelDims, *, num_heads: int, num_kv_heads: int, num_layers: int,
                   ranks_per_node: int | None = None, dp: int | None = None) -> UserError | None:
    """The first rule the layout breaks for this model and these nodes (None: it fits them).

    One rule set for `dsf train` and `dsf launch` (`check_layout`) and the planner's search, which
    enumerates only layouts for which this is None."""
    if dp is not None and dp != dims.dp:
        return UserError("parallel.dp", dp, f"but world {dims.world} / (tp*pp = {dims.tp * dims.pp}) = {dims.dp}",
                         f"set parallel.dp={dims.dp} or leave it out, or run on {dp * dims.tp * dims.pp} ranks")
    if num_heads % dims.tp:
        return UserError("parallel.tp", dims.tp, f"does not divide num_attention_heads={num_heads}",
                         f"choose tp in {_divisors(num_heads)}")
    if num_kv_heads % dims.tp:
        return UserError("parallel.tp", dims.tp, f"does not divide num_key_value_heads={num_kv_heads}",
                         f"choose tp in {_divisors(num_kv_heads)}")
    if dims.pp > num_layers:
        return UserError("parallel.pp", dims.pp, f"exceeds num_hidden_layers={num_layers}",
                         f"choose pp in 1..{num_layers}")
    if ranks_per_node is not None and dims.tp > ranks_per_node:
        return UserError("parallel.tp", dims.tp, f"exceeds the {ranks_per_node} ranks on one node",
                         f"tensor-parallel ranks must share a node: choose tp <= {ranks_per_node}")
    return None


def check_layout(dims: ParallelDims, *, num_heads: int, num_kv_heads: int, num_layers: int,
                 ranks_per_node: int | None = None, dp: int | None = None) -> None:
    """UserError unless the layout fits the model and the nodes (each rule names the fix)."""
    problem = layout_problem(dims, num_heads=num_heads, num_kv_heads=num_kv_heads, num_layers=num_layers,
                             ranks_per_node=ranks_per_node, dp=dp)
    if problem is not None:
        raise problem


def check_model_layout(dims: ParallelDims, config: Any, *, dp: int | None = None,
                       ranks_per_node: int | None = None) -> None:
    """check_layout with the heads, kv heads and layers of a transformers config.

        check_model_layout(dims, resolve_model(run.model).config, dp=run.parallel.dp, ranks_per_node=8)
    """
    heads = config.num_attention_heads
    check_layout(dims, num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                 num_layers=config.num_hidden_layers, dp=dp, ranks_per_node=ranks_per_node)


def build_topology(dims: ParallelDims):
    """DeepSpeed's PipeModelDataParallelTopology for `dims` (axes pipe, data, model)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)


def build_grid(dims: ParallelDims):
    """DeepSpeed's PipelineParallelGrid over the topology: the `mpu` for deepspeed.initialize,
    with the tensor-parallel group as its 'slice' group. Needs torch.distributed initialised."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    return PipelineParallelGrid(topology=build_topology(dims))
