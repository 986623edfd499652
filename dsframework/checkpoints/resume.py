"""Resuming a run: what it resumes from, decided once before the rendezvous, and the conversion of
a checkpoint saved at another layout, done by the ranks before the engine loads it.

    plan = ResumePlan.read(run)                      # pre-flight: the latest tag, its files' sizes checked
    plan = plan.checked(run)                         # every rank, after the rendezvous: their checksums
    print(plan.first_line(run))                      # rank 0: 'dsf: resuming from .../global_step6 (step 6)'
    run = plan.keep_expert_blocks(run)               # AutoEP's blocks kept at ep 1 when saved in them
    load_tag, universal = plan.load_tag(run, dims, config)   # every rank: converted first if need be

The rules of a resume (`resume_tag`): the ZeRO stage, the model and the context-parallel size stay
as saved; tp, pp and dp may change with the same global batch, and then the checkpoint is converted
once into DeepSpeed's universal format (`convert`): by rank 0 with DeepSpeed's ds_to_universal when
only dp changes, else by every rank, a share of the parameters each (`reshard_in_shares`: about
1/world of the elements each, one parameter's states at a time, through checkpoints/reshard.py's
dense layout). A rank that fails fails them all: bad input as its one line on every rank, anything
else as exit 1 beside that rank's traceback; the partial folder is removed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.checkpoints.integrity import newest_intact, step_tags, tags_before
from dsframework.checkpoints.manifest import Manifest
from dsframework.checkpoints.reshard import Resharding, universal_tag
from dsframework.config import RunConfig
from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.parallel.host import host_group, rank_zero_first
from dsframework.types import HFConfig


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a resume starts from: its tag (`latest`) and manifest (None: written before
    manifests), read and checked once, in pre-flight."""

    tag: str
    manifest: Manifest | None
    fell_back: str = ""  # checkpoint.fallback=previous: why the latest was not loaded (its one line)

    @classmethod
    def read(cls, run: RunConfig) -> ResumePlan:
        """The latest checkpoint of `run`, every file of it there at its saved size; UserError in one
        line when `latest` names nothing or there is no checkpoint."""
        tag = ckpt.latest_tag(run.checkpoint_dir)
        if tag is not None and not (run.checkpoint_dir / tag).is_dir():
            raise UserError("checkpoint", str(run.checkpoint_dir / "latest"), f"names {tag!r}, which is not there",
                            "restore that checkpoint folder or point `latest` at one that exists")
        if tag is None:
            raise no_latest(run.checkpoint_dir, run.output_dir)
        try:
            return cls(tag, ckpt.verify(run.checkpoint_dir, tag))
        except UserError as err:  # a file missing or of another size
            earlier = newest_intact(run.checkpoint_dir, before=tag, sums=False)
            if run.checkpoint.fallback != "previous" or err.field != "checkpoint file" or earlier is None:
                raise
            return cls(earlier, ckpt.read_manifest(run.checkpoint_dir, earlier), fell_back=f"{err.value} {err.rule}")

    def checked(self, run: RunConfig) -> ResumePlan:
        """Every rank, after the rendezvous: the files of the tag checked against their checksums, each
        rank reading a share. On a mismatch, with checkpoint.fallback=previous the newest earlier tag
        whose files check (said in `fell_back`), else a UserError naming the file and that tag."""
        if self.manifest is None:  # written before manifests: sizes and sums unknown
            return self
        ckpt_dir = run.checkpoint_dir
        bad = ckpt.verify_on_ranks(ckpt_dir, self.tag, self.manifest)
        if bad is None:
            return self
        good = next((t for t in tags_before(ckpt_dir, self.tag)
                     if ckpt.verify_on_ranks(ckpt_dir, t, ckpt.read_manifest(ckpt_dir, t) or self.manifest) is None),
                    None)
        error = ckpt.damaged(ckpt_dir, self.tag, bad, good=good)
        if run.checkpoint.fallback != "previous" or good is None:
            raise error
        return ResumePlan(good, ckpt.read_manifest(ckpt_dir, good), fell_back=f"{error.value} {error.rule}")

    def first_line(self, run: RunConfig) -> str:
        """What rank 0 prints first on resume: the tag it loads (and, after a fallback, why not the latest)."""
        where = f"dsf: resuming from {run.checkpoint_dir / self.tag}"
        step = f" (step {self.manifest.step})" if self.manifest is not None else ""
        if self.fell_back:
            return f"{where}{step}, the newest that checks (checkpoint.fallback=previous): {self.fell_back}"
        return where + step

    def keep_expert_blocks(self, run: RunConfig) -> RunConfig:
        return keep_expert_blocks(run, self.manifest)

    def load_tag(self, run: RunConfig, dims: ParallelDims, config: HFConfig) -> tuple[str, bool]:
        """(tag to load, whether it is universal) at `dims`, converted first if need be (every rank)."""
        return resume_tag(run, dims, self.manifest, config, tag=self.tag)


def newest_complete_tag(ckpt_dir: Path) -> str | None:
    """The newest `global_stepN` in `ckpt_dir` whose manifest verifies (every file there, as saved),
    or None. What a resume could start from when `latest` names nothing."""
    for tag in reversed(step_tags(ckpt_dir)):
        try:
            if ckpt.verify(ckpt_dir, tag) is not None:  # (None: no manifest, nothing to verify it by)
                return tag
        except UserError:  # a file missing or altered: an older one may verify
            continue
    return None


def no_latest(ckpt_dir: Path, output_dir: str) -> UserError:
    """The one line for a resume where `latest` is empty or missing: the newest complete checkpoint
    and the command that names it, when there is one (a crash between a save and its `latest`, a
    `latest` emptied by a full disk), else that there is nothing to resume."""
    latest = Path(ckpt_dir) / "latest"
    tag = newest_complete_tag(ckpt_dir)
    if tag is None:
        return UserError("output_dir", output_dir, "holds no checkpoint to resume from",
                         "run without --resume to start training")
    state = "is empty" if latest.is_file() else "is missing"
    return UserError("checkpoint", str(latest), f"{state}, but {tag} in {ckpt_dir} is complete (its manifest "
                     "verifies)", f"resume from it: echo {tag} > {latest}; then run with --resume again")


def keep_expert_blocks(run: RunConfig, manifest: Manifest | None) -> RunConfig:
    """`run`, with `parallel.autoep` on when it resumes at ep 1 from a checkpoint saved in DeepSpeed
    AutoEP's expert blocks (at ep > 1): the universal conversion then gathers every expert onto each
    rank in those blocks, whose names (experts.w1, ...) transformers' own expert modules do not have."""
    was = ckpt.saved_layout(manifest)
    if was is None or not was.autoep_blocks or run.parallel.ep > 1 or run.parallel.autoep:
        return run
    return run.model_copy(update={"parallel": run.parallel.model_copy(update={"autoep": True})})


def resume_tag(run: RunConfig, dims: ParallelDims, manifest: Manifest | None, config: HFConfig, *,
               tag: str | None = None) -> tuple[str, bool]:
    """(tag to load, whether it is a universal checkpoint) for resuming at `dims`.

    The ZeRO stage and the model stay as saved (the model is checked before this is called);
    tp, pp and dp may change, with the same global batch. The checkpoint is converted once and
    every rank then loads its new shard of it (`checkpoint.load_universal`):
    - dp alone, at tp = pp = 1, ZeRO-1/2/3: deepspeed's ds_to_universal on rank 0 (`checkpoint.to_universal`);
      with split experts, ep and dp (AutoEP's blocks before and after, at ep 1 too: its own names), the same;
    - tp or pp (and dp beside them), ZeRO-1/2: every rank a share, through the dense layout
      (`reshard_in_shares` below).
    ZeRO-0 states are whole on every rank of a layout: dp may change, tp and pp may not. ZeRO-3 with
    tensor parallelism, and context parallelism, resume at their saved layout only (cp itself may not
    change; zero_hpz may).
    """
    tag = tag or ckpt.latest_tag(run.checkpoint_dir)
    assert tag is not None, f"{run.checkpoint_dir} holds no checkpoint (ResumePlan.read refuses that first)"
    # (a manifest from before the ZeRO stage was recorded: taken to be this run's)
    was = ckpt.saved_layout(manifest, zero_stage=dims.zero_stage)
    if was is None:  # written before manifests: its layout is unknown, taken to be this one
        return tag, False
    stage = dims.zero_stage
    check_same_stage_and_cp(was, dims)
    axes = ("tp", "pp", "dp", "ep", "autoep_blocks")
    if all(getattr(was, axis) == getattr(dims, axis) for axis in axes):
        return tag, False
    if was.autoep_blocks != dims.autoep_blocks or (dims.autoep_blocks and stage == 0):
        # AutoEP's checkpoints name its grouped experts (experts.w1, ...), not transformers' fused ones;
        # DeepSpeed's universal conversion moves them to another ep or dp, between AutoEP runs, at ZeRO 1-3
        # (keep_expert_blocks keeps AutoEP's blocks for a resume at ep 1).
        raise UserError("parallel.ep", dims.ep, f"cannot resume at {dims} from a checkpoint saved at {was}: experts "
                        "move to another ep or dp only between runs in DeepSpeed AutoEP's blocks (ep > 1, or "
                        "parallel.autoep=true at ep 1), at ZeRO 1-3",
                        f"resume with parallel.ep={was.ep}" + (" on the saved layout" if stage == 0 else
                                                               " (start at ep 1 with parallel.autoep=true to "
                                                               "move to ep > 1 later)"))
    if dims.cp_enabled:  # (the universal-checkpoint conversions below are not tested with cp's ZeRO groups)
        raise UserError("parallel.cp", dims.cp, f"runs resume at their saved layout only (saved {was}, now {dims})",
                        f"resume on {was.world} ranks with parallel.tp={was.tp}")
    change, keep = f"{was} -> {dims}", f"resume with parallel.tp={was.tp} parallel.pp={was.pp}"
    layers_move = (was.tp, was.pp) != (dims.tp, dims.pp)
    if stage == 0:
        if not layers_move:
            return tag, False
        raise UserError("parallel.zero_stage", 0, f"cannot resume at another tp or pp ({change}): ZeRO-0 "
                        "keeps its optimizer states in each layout's own files", keep)
    if stage == 3 and (was.tp_enabled or dims.tp_enabled):
        raise UserError("parallel.zero_stage", 3, f"with tensor parallelism resumes only at its saved layout "
                        f"({change}): DeepSpeed's universal loader does not cut a ZeRO-3 parameter into tensor "
                        "shards", f"{keep} on {was.world} ranks")
    dp_only = not layers_move and not dims.tp_enabled and not dims.pp_enabled
    target = tag + ckpt.UNIVERSAL if dp_only else universal_tag(tag, dims)
    convert(run.checkpoint_dir, tag, config, was=was, dims=dims, into=target)
    return target, True


def convert(ckpt_dir: Path, tag: str, config: HFConfig, *, was: ParallelDims, dims: ParallelDims, into: str) -> None:
    """`tag` (saved at `was`) converted into the universal tag `into` for `dims`: by rank 0 with
    DeepSpeed's ds_to_universal for a dp-only change, else by every rank, a share each."""
    import torch

    dp_only = into == tag + ckpt.UNIVERSAL
    if torch.distributed.get_rank() == 0:
        print(f"dsf: resuming at {dims} from a checkpoint saved at {was}: converting {tag} into {into}"
              + ("" if dp_only else f" (each of the {dims.world} ranks a share of the parameters)"), flush=True)
    if dp_only:
        with rank_zero_first():
            if torch.distributed.get_rank() == 0:
                ckpt.to_universal(ckpt_dir, tag)
    else:
        reshard_in_shares(ckpt_dir, tag, config, saved=was, target=dims)


def check_same_stage_and_cp(was: ParallelDims, dims: ParallelDims) -> None:
    """A resume keeps the ZeRO stage and the context-parallel size (zero_hpz may change: DeepSpeed
    never saves hpZ's secondary copy, the files and tensors are the same)."""
    if was.zero_stage != dims.zero_stage:
        raise UserError("parallel.zero_stage", dims.zero_stage, f"differs from the checkpoint's {was.zero_stage} "
                        "(a resume keeps the ZeRO stage; tp, pp and dp may change)",
                        f"resume with parallel.zero_stage={was.zero_stage}")
    if was.cp != dims.cp:
        raise UserError("parallel.cp", dims.cp, f"differs from the checkpoint's {was.cp} (a resume "
                        "keeps the context-parallel size; tp, pp and dp may change)",
                        f"resume with parallel.cp={was.cp}")


def reshard_in_shares(ckpt_dir: Path, tag: str, config: HFConfig, *, saved: ParallelDims, target: ParallelDims) -> str:
    """Convert `tag` for `target` with every rank (each calls this); returns the universal tag."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    with rank_zero_first():  # rank 0's bad-input line (no manifest, missing files) reaches every rank
        job = Resharding.plan(ckpt_dir, tag, config, target=target, saved=saved)
        if job is not None and rank == 0:
            job.clear()
    if job is None:
        return universal_tag(tag, target)
    failure, error = _try_share(job, rank=rank, world=world)
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, failure, group=host_group())  # pickled: host-side
    if any(outcomes):
        if rank == 0:
            job.clear()  # nothing half-written is left
        if error is not None:
            raise error
        first = next(o for o in outcomes if o)
        if first == "failed":
            raise SystemExit(1)  # that rank's traceback is the report
        raise UserError(*first)
    if rank == 0:  # (the all-gather above returned on every rank once every share was on disk)
        job.commit()
    dist.barrier()  # whole and renamed before any rank loads it
    return job.name


def _try_share(job: Resharding, *, rank: int, world: int) -> tuple[Any, BaseException | None]:
    """(None, None) when this rank's share is written; else what the other ranks are told (a
    UserError's fields, or "failed") and the exception this rank raises."""
    try:
        job.write_share(rank=rank, world=world)
    except UserError as err:
        return (err.field, err.value, err.rule, err.fix), err
    except Exception as err:  # noqa: BLE001 - re-raised on this rank after the others are told
        return "failed", err
    return None, None
