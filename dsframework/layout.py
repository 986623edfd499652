"""The layout: how a run's ranks split into tensor x context x pipeline x data parallel, and its rules.

    dims = ParallelDims(world=8, tp=2, pp=2)          # dp = 8 / (2 * 2) = 2
    dims = ParallelDims(world=8, cp=2, zero_stage=3, zero_hpz=2)   # dp 4; ZeRO over cp x dp = 8
    dims = ParallelDims.of(run.parallel, world=8)      # a run config's
    str(dims)                                          # 'tp 1 x pp 1 x cp 2 x dp 4, hpZ 2': the one rendering
    ParallelDims.from_dict(manifest.layout)            # what a checkpoint was saved at (dims.as_dict())
    check_layout(dims, num_heads=32, num_kv_heads=8, num_layers=32, seq_len=4096, ranks_per_node=8)

(parallel/topology.py builds the process groups of a layout: build_topology, build_grid.)

`ParallelDims` is the one description of a layout: the four axes Accelerate's ParallelismConfig
names (dp_replicate x dp_shard x cp x tp) map onto it as dp x cp x tp plus ZeRO's stage and
hpZ group (see docs/parallel-layouts.md), and pp beside them. A future axis is a field here,
a rule in `composition_problem` / `layout_problem`, and an axis of `build_topology`.

Tensor-parallel ranks are adjacent (the 'model' axis is innermost), so a tensor-parallel group
sits on one node, where its per-layer all-reduces use the fast link; context-parallel ranks come
next (Ulysses' all-to-alls, four a layer, stay near too). ZeRO shards across the data-parallel
ranks, and with context parallelism across data x context (DeepSpeed's "sequence data parallel"
group): the context ranks of one replica hold the same weights.

Checks are pure (no torch.distributed, no disk): one rule set. `composition_problem` (which axes
compose, which ZeRO stage each allows) runs when the run config is built; `layout_problem` adds
the world and the model, and is what `check_layout` raises for `dsf train` (before any process
group exists) and `dsf launch`, and what the planner's search keeps only valid layouts by (its
property test uses it as the oracle).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsframework.errors import UserError
from dsframework.types import HFConfig

# What DeepSpeed 0.19 composes, for the one-line refusals (docs/parallel-layouts.md).
SUPPORTED_COMPOSITIONS = ("tp x pp x dp with ZeRO 0-1; tp x cp x dp with ZeRO 0-3; "
                          "zero_hpz with ZeRO-3 over cp x dp (tp = pp = 1); "
                          "ep within dp with ZeRO 0-3 (tp = pp = cp = 1)")


@dataclass(frozen=True)
class ParallelDims:
    """How `world` ranks split into tensor x context x pipeline x data parallel, and how ZeRO
    shards across the data (x context) ranks."""

    world: int
    tp: int = 1        # tensor-parallel size (Megatron-style layers)
    pp: int = 1        # pipeline stages
    cp: int = 1        # context-parallel size (DeepSpeed Ulysses: each rank holds seq_len / cp)
    zero_stage: int = 0
    zero_hpz: int = 1  # ZeRO-3 hpZ: a secondary copy of the weights shared within groups of this size
    ep: int = 1        # expert-parallel size (DeepSpeed AutoEP): each of ep data ranks holds 1/ep of the experts
    autoep: bool = False  # AutoEP's expert blocks at ep 1 too (all experts on each rank, no all-to-all)

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp", "cp", "zero_hpz", "ep"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel.{name}", getattr(self, name), "must be >= 1", "use a positive size")
        if self.world % self.model_parallel:
            sizes = sorted({d for d in range(1, self.world + 1) if self.world % d == 0})
            raise UserError("world size", self.world, f"is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}"
                            f" = {self.model_parallel}", f"choose tp*pp*cp in {{{', '.join(map(str, sizes))}}}")

    @classmethod
    def of(cls, parallel: Any, *, world: int) -> "ParallelDims":
        """The layout of a run config's `parallel` section on `world` ranks."""
        return cls(world=world, tp=parallel.tp, pp=parallel.pp, cp=parallel.cp,
                   zero_stage=parallel.zero_stage, zero_hpz=parallel.zero_hpz, ep=parallel.ep,
                   autoep=parallel.autoep)

    def as_dict(self) -> dict[str, int | bool]:
        """The layout as a checkpoint manifest stores it (dp too, for a reader's eye; `from_dict` derives it)."""
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp,
                "zero_stage": self.zero_stage, "zero_hpz": self.zero_hpz, "ep": self.ep,
                "autoep": self.autoep_blocks}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, zero_stage: int = 0) -> "ParallelDims":
        """A manifest's layout (`as_dict`), also in its older forms: {world, tp, pp, dp} only, later
        with cp, zero_stage and zero_hpz; an axis a manifest lacks is 1, and a stage it lacks is
        `zero_stage` (the caller's: the resuming run's).

            ParallelDims.from_dict({"world": 4, "tp": 2, "pp": 1, "dp": 2}, zero_stage=1)
        """
        return cls(world=data["world"], tp=data["tp"], pp=data["pp"], cp=data.get("cp", 1),
                   zero_stage=data.get("zero_stage", zero_stage), zero_hpz=data.get("zero_hpz", 1),
                   ep=data.get("ep", 1), autoep=data.get("autoep", False))

    def __str__(self) -> str:
        """The layout as every message shows it: 'tp 2 x pp 1 x cp 1 x dp 4' (', hpZ 2' with hpZ,
        ', ep 2' with experts split, 'dp 4 (AutoEP)' with AutoEP's blocks at ep 1); the ZeRO stage is
        shown by each message where it matters."""
        return (f"tp {self.tp} x pp {self.pp} x cp {self.cp} x dp {self.dp}"
                + (f", hpZ {self.zero_hpz}" if self.hpz_enabled else "")
                + (f", ep {self.ep}" if self.ep_enabled else "")
                + (" (AutoEP)" if self.autoep_blocks and not self.ep_enabled else ""))

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica spans: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size: the replicas, each seeing its own samples."""
        return self.world // self.model_parallel

    @property
    def zero_ranks(self) -> int:
        """Ranks ZeRO shards states and reduces gradients across: data x context (DeepSpeed's
        sequence-data-parallel group; the context ranks of a replica hold the same weights)."""
        return self.dp * self.cp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hpz_enabled(self) -> bool:
        return self.zero_hpz > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def autoep_blocks(self) -> bool:
        """DeepSpeed AutoEP swaps the MoE blocks in: at ep > 1, or at ep 1 with `autoep` (a checkpoint
        of its blocks moves between ep sizes by DeepSpeed's universal conversion, not to transformers' own)."""
        return self.ep > 1 or self.autoep


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def composition_problem(*, tp: int, pp: int, cp: int, zero_stage: int, zero_hpz: int,
                        ep: int = 1, autoep: bool = False) -> UserError | None:
    """Which axes compose and which ZeRO stage each allows (no world, no model): None if these do.

    Checked when the run config is built (`config.ParallelSpec`) and again by `layout_problem`."""
    if pp > 1 and zero_stage > 1:
        return UserError("parallel.pp", pp, f"needs zero_stage 0 or 1 (DeepSpeed's pipeline engine), got "
                         f"zero_stage={zero_stage}", "set parallel.zero_stage=1 or parallel.pp=1")
    if cp > 1 and pp > 1:
        return UserError("parallel.cp", cp, f"does not compose with parallel.pp={pp}: DeepSpeed's Ulysses runs in "
                         "its plain engine, not the pipeline engine", f"supported: {SUPPORTED_COMPOSITIONS}")
    if zero_hpz > 1 and zero_stage != 3:
        return UserError("parallel.zero_hpz", zero_hpz, f"needs zero_stage=3 (hpZ partitions ZeRO-3's weights), "
                         f"got zero_stage={zero_stage}", "set parallel.zero_stage=3 or parallel.zero_hpz=1")
    if zero_hpz > 1 and tp > 1:
        return UserError("parallel.zero_hpz", zero_hpz, f"does not compose with parallel.tp={tp}: DeepSpeed builds "
                         "hpZ groups from consecutive world ranks, which would mix tensor-parallel ranks",
                         f"supported: {SUPPORTED_COMPOSITIONS}")
    return _expert_composition_problem(ep=ep, tp=tp, pp=pp, cp=cp, zero_hpz=zero_hpz, autoep=autoep)


def _expert_composition_problem(*, ep: int, tp: int, pp: int, cp: int, zero_hpz: int,
                                autoep: bool) -> UserError | None:
    # DeepSpeed's AutoEP refuses tensor parallelism from an mpu (dsf's Megatron layers); the
    # pipeline engine, Ulysses and hpZ beside it are not probed here, so refused rather than guessed.
    others = {"tp": tp, "pp": pp, "cp": cp, "zero_hpz": zero_hpz}
    clash = next((name for name, size in others.items() if size > 1), None)
    if (ep > 1 or autoep) and clash:
        field, value = ("parallel.ep", ep) if ep > 1 else ("parallel.autoep", True)
        return UserError(field, value, f"does not compose with parallel.{clash}={others[clash]}: DeepSpeed's "
                         "AutoEP splits the experts over data-parallel ranks only",
                         f"set parallel.{clash}=1 (ep composes with dp and ZeRO 0-3) or "
                         + ("parallel.ep=1" if ep > 1 else "parallel.autoep=false"))
    return None


def grid_problem(dims: ParallelDims, *, dp: int | None = None) -> UserError | None:
    """The rules that need the world but not the model (`dsf config --world-size` checks these)."""
    problem = composition_problem(tp=dims.tp, pp=dims.pp, cp=dims.cp, zero_stage=dims.zero_stage,
                                  zero_hpz=dims.zero_hpz, ep=dims.ep, autoep=dims.autoep)
    if problem is not None:
        return problem
    if dims.dp % dims.ep:
        return UserError("parallel.ep", dims.ep, f"does not divide the {dims.dp} data-parallel ranks (world "
                         f"{dims.world} / tp*pp*cp = {dims.model_parallel})", f"choose ep in {_divisors(dims.dp)}")
    if dp is not None and dp != dims.dp:
        return UserError("parallel.dp", dp, f"but world {dims.world} / (tp*pp*cp = {dims.model_parallel}) = {dims.dp}",
                         f"set parallel.dp={dims.dp} or leave it out, or run on {dp * dims.model_parallel} ranks")
    if dims.zero_ranks % dims.zero_hpz:
        return UserError("parallel.zero_hpz", dims.zero_hpz, f"does not divide the {dims.zero_ranks} ranks ZeRO "
                         f"shards across (dp={dims.dp} x cp={dims.cp})", f"choose zero_hpz in {_divisors(dims.zero_ranks)}")
    return None


def layout_problem(dims: ParallelDims, *, num_heads: int, num_kv_heads: int, num_layers: int,
                   seq_len: int | None = None, ranks_per_node: int | None = None,
                   dp: int | None = None) -> UserError | None:
    """The first rule the layout breaks for this model and these nodes (None: it fits them).

    One rule set for `dsf train` and `dsf launch` (`check_layout`) and the planner's search, which
    enumerates only layouts for which this is None."""
    problem = grid_problem(dims, dp=dp)
    if problem is not None:
        return problem
    if num_heads % dims.tp:
        return UserError("parallel.tp", dims.tp, f"does not divide num_attention_heads={num_heads}",
                         f"choose tp in {_divisors(num_heads)}")
    if num_kv_heads % dims.tp:
        return UserError("parallel.tp", dims.tp, f"does not divide num_key_value_heads={num_kv_heads}",
                         f"choose tp in {_divisors(num_kv_heads)}")
    heads, kv_heads = num_heads // dims.tp, num_kv_heads // dims.tp  # each tensor rank's, which cp splits
    per = f" per tensor rank (tp={dims.tp})" if dims.tp_enabled else ""
    if heads % dims.cp:
        return UserError("parallel.cp", dims.cp, f"does not divide the {heads} attention heads{per}",
                         f"choose cp in {_divisors(heads)}")
    if kv_heads % dims.cp and dims.cp % kv_heads:  # Ulysses copies kv heads when cp is a multiple
        return UserError("parallel.cp", dims.cp, f"neither divides nor is a multiple of the {kv_heads} key/value "
                         f"heads{per}", f"choose cp in {_divisors(kv_heads)} or a multiple of {kv_heads}")
    if seq_len is not None and seq_len % dims.cp:
        return UserError("parallel.cp", dims.cp, f"does not divide data.seq_len={seq_len}",
                         f"choose data.seq_len a multiple of {dims.cp}")
    if dims.pp > num_layers:
        return UserError("parallel.pp", dims.pp, f"exceeds num_hidden_layers={num_layers}",
                         f"choose pp in 1..{num_layers}")
    if ranks_per_node is not None and dims.tp > ranks_per_node:
        return UserError("parallel.tp", dims.tp, f"exceeds the {ranks_per_node} ranks on one node",
                         f"tensor-parallel ranks must share a node: choose tp <= {ranks_per_node}")
    return None


def check_layout(dims: ParallelDims, *, num_heads: int, num_kv_heads: int, num_layers: int,
                 seq_len: int | None = None, ranks_per_node: int | None = None, dp: int | None = None) -> None:
    """UserError unless the layout fits the model and the nodes (each rule names the fix)."""
    problem = layout_problem(dims, num_heads=num_heads, num_kv_heads=num_kv_heads, num_layers=num_layers,
                             seq_len=seq_len, ranks_per_node=ranks_per_node, dp=dp)
    if problem is not None:
        raise problem


def check_model_layout(dims: ParallelDims, config: HFConfig, *, dp: int | None = None, seq_len: int | None = None,
                       ranks_per_node: int | None = None) -> None:
    """check_layout with the heads, kv heads and layers of a transformers config.

        check_model_layout(dims, resolve_model(run.model).config, dp=run.parallel.dp, seq_len=run.data.seq_len)
    """
    heads = config.num_attention_heads
    check_layout(dims, num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                 num_layers=config.num_hidden_layers, seq_len=seq_len, dp=dp, ranks_per_node=ranks_per_node)


def chunked_loss_problem(setting: bool | str, *, pp: int) -> UserError | None:
    """train.chunked_loss=true with a pipeline, refused (auto stays plain there): the rule dsf
    train's pre-flight applies (`check_chunked_loss_layout`) and the planner's search too."""
    if setting is True and pp > 1:
        return UserError("train.chunked_loss", True, f"is not offered with parallel.pp={pp}: the pipeline's last "
                         "stage gets its logits from its head layer (a LayerSpec), not from a loss that calls the "
                         "head", "set train.chunked_loss=auto (whole logits with pp) or false, or use parallel.tp")
    return None
