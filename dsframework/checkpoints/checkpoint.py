"""Checkpoints: DeepSpeed's own `save_checkpoint`/`load_checkpoint`, made crash-safe and checked.

    <output_dir>/checkpoints/
        latest                   tag of the newest complete checkpoint (switched atomically)
        global_step100/          DeepSpeed model/optimizer shards, rng_rank<R>.pt per rank and
                                 dsf_manifest.json (every file's size, the layout it was saved at:
                                 checkpoints/manifest.py's Manifest)
        global_step100.universal/  deepspeed's universal form, made when a run resumes at another dp
        global_step100.universal-tp1pp1dp4/  the same for another tp x pp (x dp): dsframework.checkpoints.reshard
        hf_config/config.json    the transformers config the model was built from
        tokenizer/               the run's tokenizer
        run.yaml                 the resolved run config

    save(engine, ckpt_dir, step=100, consumed_samples=3200, layout=dims)   # dims: the run's ParallelDims
    pending = start_save(engine, ckpt_dir, step=100, consumed_samples=3200, layout=dims)  # the same in parts:
    finish_writes(engine, pending)       # checkpoint.writer=decoupled: after the next step (files on disk,
    publish(engine, pending)             # summed in a thread during the step after it; then `latest`)
    manifest = verify(ckpt_dir, "global_step100")  # its Manifest; UserError naming a missing or truncated file
    saved_layout(manifest)               # the ParallelDims it was saved at (None: no manifest)
    state = load(engine, ckpt_dir)       # {"step": 100, "consumed_samples": 3200}

A run with frozen parameters (a LoRA run's base, models/lora.py) saves only the trainable ones
(`save_checkpoint(..., exclude_frozen_parameters=True)`), and its manifest lists their names; the frozen
base is rebuilt from model.name (the pretrained directory, or the seeded random init) and a resume loads
the module non-strictly, after checking the checkpoint holds exactly the parameters that train now.

A checkpoint is written under `global_stepN.partial`, its manifest written last, then renamed
to `global_stepN` and only then named in `latest` (write-to-temp + os.replace): a crash at any
point leaves `latest` on the previous complete checkpoint. With checkpoint.writer=decoupled,
DeepSpeed's background process per rank writes the shards (`DecoupledWriter`) while the next step
runs, and the commit waits until every rank's writer has finished. The client state holds the step and
the data position; each rank's RNG states sit beside the shards, so a resumed run draws the
same random numbers as one that never stopped. Checkpoints live on a filesystem every node sees
(as DeepSpeed's own loading and zero_to_fp32 assume).
"""
from __future__ import annotations

import os
import pickle
import random
import shutil
import signal
import time
from argparse import Namespace
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, cast

from dsframework.checkpoints.adam_products import restore_adam_products
from dsframework.checkpoints.integrity import (first_problem_of_ranks, gather_checksums, newest_intact, own_checksums,
                                               problem)
from dsframework.checkpoints.integrity import step_of as step_of  # tag_for's inverse (-1: not a step's tag)
from dsframework.checkpoints.manifest import MANIFEST, Manifest
from dsframework.checkpoints.space import disk_full_error, last_save_bytes, low_space_line
from dsframework.errors import UserError, raised_in
from dsframework.files import disk_full, written_then_renamed
from dsframework.layout import ParallelDims
from dsframework.models.lora import has_frozen_parameters
from dsframework.parallel.host import all_reduce_host, host_group
from dsframework.parallel.rng import set_tracked_rng_states, tracked_rng_states
from dsframework.types import Engine, HFConfig, HFModel, accelerator

TOKENIZER_DIR = "tokenizer"
HF_CONFIG_DIR = "hf_config"
RUN_YAML = "run.yaml"
PARTIAL = ".partial"
UNIVERSAL = ".universal"


def latest_tag(ckpt_dir: str | Path) -> str | None:
    """The tag in `<ckpt_dir>/latest`, or None when there is no checkpoint."""
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag or None


def tag_for(step: int) -> str:
    return f"global_step{step}"


def save_run_files(ckpt_dir: Path, *, config: HFConfig, run_yaml: str) -> None:
    """The transformers config and run config, saved once beside the checkpoints (rank 0)."""
    config.save_pretrained(str(ckpt_dir / HF_CONFIG_DIR))
    (ckpt_dir / RUN_YAML).write_text(run_yaml)


def _rng_states() -> dict[str, Any]:
    import numpy as np
    import torch

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
              "tensor_parallel": tracked_rng_states()}  # tp > 1: the attention core's own stream
    device = accelerator()
    if device.device_name() != "cpu":
        states["accelerator"] = device.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "accelerator" in states:
        accelerator().set_rng_state(states["accelerator"])
    set_tracked_rng_states(states.get("tensor_parallel", {}))


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old content or the new, never a torn file; on disk before it is renamed."""
    with written_then_renamed(path, durable=True) as tmp:
        tmp.write_text(text)


def set_latest(ckpt_dir: Path, tag: str) -> None:
    """Name `tag` in `<ckpt_dir>/latest`: the commit of a checkpoint (rank 0, once `tag` is complete)."""
    _write_atomically(Path(ckpt_dir) / "latest", tag)


def _frozen_and_trainable(engine: Engine) -> tuple[bool, dict[str, list[int]]]:
    """(whether some of the model's parameters are frozen, {name: shape} of those that train; a ZeRO-3
    partitioned parameter's whole shape), over every rank: a pipeline stage holds its own layers, and
    a stage without a frozen parameter still saves and loads as the others do (a collective). The
    names are gathered only in a run with frozen parameters (a LoRA run: its adapters' names), never
    every parameter name of every rank of a full run at each save."""
    import torch
    import torch.distributed as dist

    module = cast(HFModel, engine.module)  # (DeepSpeed's engine types it through nn.Module's __getattr__)
    trainable = {name: list(getattr(param, "ds_shape", param.shape))
                 for name, param in module.named_parameters() if param.requires_grad}
    frozen = has_frozen_parameters(module)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return frozen, trainable
    anywhere = torch.tensor([int(frozen)])  # host: a flag for the host group
    all_reduce_host(anywhere, op=dist.ReduceOp.MAX)
    if not anywhere.item():
        return False, trainable
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, trainable, group=host_group())  # pickled: host-side
    return True, {name: shape for names in everyone for name, shape in names.items()}


def write_shards(engine: Engine, partial: Path, *, client_state: dict[str, Any], exclude_frozen: bool) -> None:
    """This rank's part of a checkpoint into the folder `partial`: DeepSpeed's model/optimizer shards
    (with `client_state`; frozen parameters left out when `exclude_frozen`) and its RNG states. A disk
    that fills on any rank removes `partial` and ends every rank in one line (`agree_written`)."""
    import torch
    import torch.distributed as dist

    failed = None
    try:
        engine.save_checkpoint(str(partial.parent), tag=partial.name, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=exclude_frozen)
    except Exception as err:  # noqa: BLE001 - a full disk is told to every rank; anything else re-raised
        if not disk_full(err):
            raise
        dist.barrier()  # the save's own closing barrier, where the ranks whose writes succeeded wait
        failed = err
    if failed is None:
        try:
            torch.save(_rng_states(), partial / f"rng_rank{engine.global_rank}.pt")
        except Exception as err:  # noqa: BLE001 - as above
            if not disk_full(err):
                raise
            failed = err
    agree_written(partial, failed)


def agree_written(partial: Path, failed: BaseException | None) -> None:
    """Every rank, after writing its part of `partial`: when any rank's disk filled, rank 0 removes
    `partial` (nothing half-written stays) and every rank raises the same one line."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(failed is not None)])  # host: a flag for the host group
    all_reduce_host(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    ckpt_dir = partial.parent
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier(group=host_group())  # removed before any rank exits (a launcher then ends the others)
    good = latest_tag(ckpt_dir)
    raise disk_full_error("checkpoint", partial, needed=last_save_bytes(ckpt_dir), last_good=good,
                          fix="free space there or set checkpoint.keep=N, then " +
                          ("continue with --resume" if good else "start the run again (--overwrite)"))


class SavedFiles:
    """DeepSpeed's checkpoint engine, recording the files it saves on this rank: what this rank sums
    for the manifest (checkpoints/integrity.py), right after they are on disk.

        engine.checkpoint_engine = SavedFiles(engine.checkpoint_engine)   # record_saved_files(engine)
        engine.checkpoint_engine.take_saved()   # [paths saved since last asked]
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.saved: list[Path] = []

    def save(self, state_dict: Any, path: str) -> None:
        self.inner.save(state_dict, path)
        self.saved.append(Path(path))

    def take_saved(self) -> list[Path]:
        saved, self.saved = self.saved, []
        return saved

    def __getattr__(self, name: str) -> Any:  # the rest is DeepSpeed's engine unchanged
        return getattr(self.inner, name)


class DecoupledWriter(SavedFiles):
    """DeepSpeed's decoupled checkpoint engine (`checkpoint.writer.decoupled`: a background process
    per rank writes the shards; DeepSpeed commits them at the next optimizer step), as dsf uses it.

        engine.checkpoint_engine = DecoupledWriter(engine.checkpoint_engine)  # after deepspeed.initialize
        engine.checkpoint_engine.waited_s   # seconds the trainer waited for the writer since last asked

    Everything is DeepSpeed's but three things. `save` hands the process host tensors cut off the
    autograd graph: ZeRO-1/2's state_dict slices the fp32 partitions without `detach()`, and torch
    refuses to send a non-leaf tensor that requires grad to another process ("Cowardly refusing to
    serialize non-leaf tensor which requires_grad"; DeepSpeed 0.19.8, CPU and CUDA alike). A CUDA
    tensor is copied to the host first (the snapshot): sent as it is, torch would share it through
    CUDA IPC, the writer would open a CUDA context of its own on the trainer's GPU, and the trainer
    would have to keep every shared block alive. A host tensor is not copied (`detach()` copies
    nothing): the writer reads it through shared memory (/dev/shm, `check_shm_for_snapshot`), and
    DeepSpeed keeps it unchanged until the commit at the next optimizer step. `load` reads as
    DeepSpeed's sync engine does (`weights_only=False`):
    the decoupled engine's plain `torch.load` refuses DeepSpeed's own files under torch >= 2.6
    ("UnpicklingError: Weights only load failed"). And `commit` counts the seconds the trainer waits
    in it: the part of a checkpoint's stall that happens inside `engine.step()`.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.waited_s = 0.0

    def save(self, state_dict: Any, path: str) -> None:
        import torch
        from torch.utils._pytree import tree_map

        super().save(tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, state_dict), path)

    def load(self, path: str, map_location: Any = None) -> Any:
        import torch

        return torch.load(path, map_location=map_location, weights_only=False)  # the run's own files

    def commit(self, info: Any) -> bool:
        started = time.perf_counter()
        try:
            return self.inner.commit(info)
        finally:
            self.waited_s += time.perf_counter() - started

    def take_waited(self) -> float:
        """The seconds waited in `commit` since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited


SHM = Path("/dev/shm")


def snapshot_bytes(module: Any, *, zero_ranks: int) -> int:
    """About what one rank hands its decoupled writer per save: the module's parameters (every rank
    saves its model states) and its share of Adam's fp32 master weights and two moments."""
    params = [p for p in module.parameters()]
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return weights + 12 * trainable // max(zero_ranks, 1)


def check_shm_for_snapshot(snapshot: int, *, ranks_per_node: int, shm: Path = SHM) -> None:
    """UserError before the first save when /dev/shm cannot hold a decoupled save's snapshots of
    every rank on this node (the writer receives host tensors through shared memory; a container's
    default /dev/shm is 64 MB, and a full one kills the writer with a bus error mid-save)."""
    stat = os.statvfs(shm)
    free, needed = stat.f_bavail * stat.f_frsize, snapshot * ranks_per_node
    if needed > free:
        raise UserError("checkpoint.writer", "decoupled", f"needs about {needed / 2**30:.2f} GiB of {shm} per save "
                        f"({ranks_per_node} ranks x {snapshot / 2**30:.2f} GiB), and it has "
                        f"{free / 2**30:.2f} GiB free",
                        f"use checkpoint.writer=sync, or give {shm} more room (docker run --shm-size="
                        f"{max(1, -(-needed * 5 // 4 // 2**30))}g, or mount -o remount,size=... {shm})")


SPARED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the stop signals (protocol/exits.py)


@contextmanager
def writer_spared_by_sigterm(decoupled: bool) -> Iterator[None]:
    """Start DeepSpeed's decoupled writer (`deepspeed.initialize` spawns it) inside this block: it
    inherits SIGTERM, SIGINT and SIGHUP ignored, as an ignored signal stays across exec. SLURM before
    a preemption, DeepSpeed's launcher and `dsf launch` signal every process of a rank's tree (or of
    its process group), the writer too, and the checkpoint the trainer then saves needs it alive. It
    ends when the trainer closes it (`close_writer`) or, if the trainer dies first, by the rank's
    watcher (launching/supervise.py). Nothing changes for the sync writer.

        with writer_spared_by_sigterm(run.checkpoint.writer == "decoupled"):
            engine, *_ = deepspeed.initialize(...)
    """
    if not decoupled:
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SPARED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# (engine: Any in the four below: they put or read dsf's DecoupledWriter in engine.checkpoint_engine,
# which DeepSpeed's annotation types as one of its own checkpoint engines)
def use_decoupled_writer(engine: Any) -> bool:
    """Wrap DeepSpeed's checkpoint engine (once, after deepspeed.initialize): with checkpoint.writer=
    decoupled in `DecoupledWriter`, else in `SavedFiles`; whether it is the decoupled one."""
    decoupled = engine.checkpoint_engine.is_decoupled()
    engine.checkpoint_engine = (DecoupledWriter if decoupled else SavedFiles)(engine.checkpoint_engine)
    return decoupled


def is_decoupled(engine: Any) -> bool:
    """Whether `engine` writes checkpoints in the background (checkpoint.writer=decoupled)."""
    return bool(engine.checkpoint_engine.is_decoupled())


def close_writer(engine: Any) -> None:
    """End the decoupled writer's process (after finishing what it was given); nothing for the sync
    writer. Each rank, when its run ends however it ends: else the writer outlives it, waiting for work."""
    if engine is not None and is_decoupled(engine):
        engine.checkpoint_engine.cleanup()


@dataclass
class Pending:
    """A checkpoint whose shards are in `<tag>.partial` (or on their way there, from DeepSpeed's
    decoupled writer), not yet committed: `commit` makes it the `latest`."""

    ckpt_dir: Path
    tag: str
    step: int
    layout: ParallelDims
    trainable: dict[str, list[int]] | None  # the names that train, with frozen parameters left out
    seconds: float  # the trainer's seconds spent on it so far
    sums: Future | None = None  # this rank's checksums, being summed (finish_writes; publish reads them)


def save(engine: Engine, ckpt_dir: Path, *, step: int, consumed_samples: int, layout: ParallelDims) -> str:
    """Save a checkpoint of every rank at `step` (all ranks call it) and commit it; returns its tag.
    Frozen parameters are left out (the manifest's `trainable` names what is in)."""
    return commit(engine, start_save(engine, ckpt_dir, step=step, consumed_samples=consumed_samples, layout=layout))


def start_save(engine: Engine, ckpt_dir: Path, *, step: int, consumed_samples: int, layout: ParallelDims) -> Pending:
    """Write (sync writer) or queue (decoupled writer) every rank's shards of `step` into `<tag>.partial`;
    `commit` finishes it. Between the two the model and optimizer must not step unless DeepSpeed commits
    its writer first (its engine.step() does; the pipeline engine's train_batch does not)."""
    import torch.distributed as dist

    started = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    partial = ckpt_dir / (tag + PARTIAL)
    if dist.get_rank() == 0 and partial.exists():  # left by a crash during an earlier save
        shutil.rmtree(partial)
    dist.barrier()
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    # The universal-checkpoint marker is the client's to write (Megatron-DeepSpeed does the same):
    # ds_to_universal refuses a checkpoint without it. On the module, where DeepSpeed's save reads it
    # and adds its own (AutoEP's expert patterns; AutoEP refuses the key in client_state).
    if getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None:
        setattr(engine.module, UNIVERSAL_CHECKPOINT_INFO,
                {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})
    client_state = {"dsf": {"step": step, "consumed_samples": consumed_samples}}
    frozen, trainable = _frozen_and_trainable(engine)
    write_shards(engine, partial, client_state=client_state, exclude_frozen=frozen)
    return Pending(ckpt_dir, tag, step, layout, trainable if frozen else None, time.perf_counter() - started)


def room_for_save(ckpt_dir: Path) -> str | None:
    """Every rank, before a save: rank 0's reason the disk cannot hold another checkpoint as large as
    the last (checkpoints/space.py), the same on every rank; None when it can (or none was saved yet)."""
    import torch.distributed as dist

    line = [low_space_line(Path(ckpt_dir)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(line, src=0, group=host_group())  # pickled: host-side
    return line[0]


def commit(engine: Engine, pending: Pending) -> str:
    """Make `pending` the latest checkpoint (all ranks call it); returns its tag: `finish_writes`,
    then `publish`."""
    finish_writes(engine, pending)
    return publish(engine, pending)


def finish_writes(engine: Engine, pending: Pending) -> None:
    """Every rank: wait until this rank's files of `pending` are on disk (the decoupled writer: at once
    if DeepSpeed committed them at an optimizer step since), then sum them in a background thread
    (`pending.sums`): with the decoupled writer, during the next step (published after it)."""
    import torch.distributed as dist

    started = time.perf_counter()
    writer = engine.checkpoint_engine
    if writer is not None and writer.is_decoupled():  # checkpoint.writer=decoupled (`DecoupledWriter`)
        info = writer.get_commit_info()
        if info is not None:  # not yet committed by an optimizer step
            writer.commit(info)
    if isinstance(writer, DecoupledWriter):
        pending.seconds += writer.take_waited()  # (inside the step that waited, or just now)
    partial = pending.ckpt_dir / (pending.tag + PARTIAL)
    own = [*(writer.take_saved() if isinstance(writer, SavedFiles) else []), partial / f"rng_rank{dist.get_rank()}.pt"]
    pending.sums = _summing().submit(own_checksums, partial, own)
    pending.seconds += time.perf_counter() - started


def publish(engine: Engine, pending: Pending) -> str:
    """Every rank, after `finish_writes`: once every rank's files are on disk and summed, rank 0 writes
    the manifest (sizes and checksums), renames `<tag>.partial` to `<tag>` and names it in `latest`."""
    import torch.distributed as dist

    started = time.perf_counter()
    assert pending.sums is not None, "publish follows finish_writes"
    mine = pending.sums.result()
    dist.barrier()  # every rank's files are on disk
    partial = pending.ckpt_dir / (pending.tag + PARTIAL)
    sums = gather_checksums(partial, mine)  # each rank its own files; rank 0 gets them all
    failed = None
    if dist.get_rank() == 0:
        try:
            _publish(pending, sums)
        except OSError as err:  # the manifest or `latest` on a full disk: `latest` still names the last good one
            if not disk_full(err):
                raise
            failed = err
    agree_written(partial, failed)  # (and the barrier after the commit)
    pending.seconds += time.perf_counter() - started
    return pending.tag


_pool: list[ThreadPoolExecutor] = []


def _summing() -> ThreadPoolExecutor:
    """The thread that sums a checkpoint's files beside the training loop (one, made on first use)."""
    if not _pool:
        _pool.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsf-checksums"))
    return _pool[0]


def _publish(pending: Pending, sums: dict[str, str] | None) -> None:
    """Rank 0's part of a commit: the manifest (sizes and `sums`) last into `<tag>.partial`, the
    rename, then `latest`."""
    ckpt_dir, tag = pending.ckpt_dir, pending.tag
    partial, final = ckpt_dir / (tag + PARTIAL), ckpt_dir / tag
    files = {str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()}
    Manifest(pending.step, pending.layout.as_dict(), files, pending.trainable, sums).write(partial / MANIFEST)
    if final.exists():  # a later checkpoint of an abandoned branch of this run (latest is older)
        shutil.rmtree(final)
    for stale in ckpt_dir.glob(tag + UNIVERSAL + "*"):  # conversions of what it replaces
        shutil.rmtree(stale)
    os.replace(partial, final)
    set_latest(ckpt_dir, tag)


def read_manifest(ckpt_dir: Path, tag: str) -> Manifest | None:
    """The manifest of `tag`, or None for a checkpoint written before manifests existed."""
    path = Path(ckpt_dir) / tag / MANIFEST
    return Manifest.read(path) if path.is_file() else None


def saved_layout(manifest: Manifest | None, *, zero_stage: int = 0) -> ParallelDims | None:
    """The layout a checkpoint was saved at, from its manifest (any of its forms, ParallelDims.from_dict:
    a manifest from before the ZeRO stage was recorded has `zero_stage`); None without a manifest.

        saved_layout(read_manifest(ckpt_dir, tag))   # ParallelDims(world=4, tp=1, ..., zero_stage=1)
    """
    return None if manifest is None else manifest.saved_layout(zero_stage=zero_stage)


def verify(ckpt_dir: Path, tag: str, *, sums: bool = False) -> Manifest | None:
    """Check every file the manifest lists is there at its full size (and, with `sums`, of its saved
    checksum: one process reads them all, as `dsf export` does); returns the manifest (None: none).
    UserError naming the first bad file and the newest earlier checkpoint that checks."""
    manifest = read_manifest(ckpt_dir, tag)
    if manifest is None:
        return None
    bad = problem(Path(ckpt_dir) / tag, manifest, sorted(manifest.files), sums=sums)
    if bad is not None:
        raise damaged(ckpt_dir, tag, bad, sums=sums)
    return manifest


def verify_on_ranks(ckpt_dir: Path, tag: str, manifest: Manifest) -> tuple[str, str] | None:
    """Every rank: (file, what is wrong) for the first file of `tag` that is not as saved (size and
    checksum), each rank reading a share of the files; None when all check."""
    return first_problem_of_ranks(Path(ckpt_dir) / tag, manifest)


def damaged(ckpt_dir: Path, tag: str, bad: tuple[str, str], *, sums: bool = True, good: str | None = "") -> UserError:
    """The one line for a checkpoint file that is not as saved: the file, what is wrong, and the
    newest earlier checkpoint whose files check (`good`; "": found here, by size and with `sums` by checksum)."""
    good = newest_intact(ckpt_dir, before=tag, sums=sums) if good == "" else good
    fix = (f"restore it, or resume from {good}, the newest checkpoint that checks: --set checkpoint.fallback=previous, "
           f"or echo {good} > {Path(ckpt_dir) / 'latest'}" if good else
           "restore it from a backup; no earlier checkpoint checks")
    return UserError("checkpoint file", str(Path(ckpt_dir) / tag / bad[0]), bad[1], fix)


def to_universal(ckpt_dir: Path, tag: str, *, into: Path | None = None) -> str:
    """Convert `tag` with deepspeed's ds_to_universal (once; rank 0); returns the universal tag,
    written beside the checkpoint or in the directory `into` (a scratch directory).

    A universal checkpoint holds each parameter's fp32 weights and optimizer states whole, so a
    run saved at one data-parallel size loads at another.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    root = Path(into or ckpt_dir)
    out = root / (tag + UNIVERSAL)
    if out.is_dir():  # renamed into place only when complete
        return out.name
    tmp = root / (tag + UNIVERSAL + PARTIAL)
    shutil.rmtree(tmp, ignore_errors=True)
    ds_to_universal(Namespace(input_folder=str(Path(ckpt_dir) / tag), output_folder=str(tmp), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    for extra in [*(Path(ckpt_dir) / tag).glob("rng_rank*.pt"), Path(ckpt_dir) / tag / MANIFEST]:
        if extra.is_file():
            shutil.copy2(extra, tmp / extra.name)
    os.replace(tmp, out)
    return out.name


LORA_FIXED = ("r", "alpha", "target_modules")  # what a resume keeps of model.lora (dropout may change)


def check_same_adapters(ckpt_dir: Path, lora: Any) -> None:
    """On resume, before anything is converted or built: model.lora (a LoraSpec or None) must be the
    one the run started with (its run.yaml beside the checkpoints), else a one-line UserError."""
    import yaml

    run_yaml = Path(ckpt_dir) / RUN_YAML
    if not run_yaml.is_file():
        return
    saved = ((yaml.safe_load(run_yaml.read_text()) or {}).get("model") or {}).get("lora")
    if saved is None and lora is not None:
        raise UserError("model.lora", None, f"is set, but {ckpt_dir} holds a run without adapters (every weight "
                        "trained)", "resume without model.lora, or start a LoRA run from its export (model.name=HF_DIR)")
    if saved is not None and lora is None:
        raise UserError("model.lora", None, f"is not set, but {ckpt_dir} holds a LoRA run's adapters "
                        f"(r={saved.get('r')}, target_modules={saved.get('target_modules')})",
                        "resume with the model.lora the run started with")
    if saved is None or lora is None:  # (both None: a run without adapters, saved and resumed)
        return

    def as_set(value: Any) -> Any:  # a list of names in any order; a YAML list when printed
        return f"[{', '.join(sorted(value))}]" if isinstance(value, list) else value

    now = lora.model_dump(mode="json")
    for key in LORA_FIXED:
        if key in saved and as_set(saved[key]) != as_set(now[key]):
            raise UserError(f"model.lora.{key}", as_set(now[key]), f"differs from the checkpoint's {as_set(saved[key])} "
                            "(a resume keeps the adapters)", f"resume with model.lora.{key}={as_set(saved[key])}")


def _check_trainable(engine: Engine, ckpt_dir: Path, tag: str) -> bool:
    """Whether the engine has frozen parameters; UserError unless the checkpoint holds exactly the
    parameters that train now (the same adapters, or every weight of a run without them)."""
    frozen, trainable = _frozen_and_trainable(engine)
    manifest = read_manifest(ckpt_dir, tag)
    saved = manifest.trainable if manifest is not None else None
    where = str(Path(ckpt_dir) / tag)
    if frozen and saved is None:
        raise UserError("model.lora", None, f"is set, but {where} holds every weight of a run without adapters",
                        "resume without model.lora (or start a LoRA run from an exported model: model.name=HF_DIR)")
    if saved is not None and not frozen:
        raise UserError("model.lora", None, f"is not set, but {where} holds only LoRA adapters "
                        f"({len(saved)} tensors)", "resume with the model.lora the run started with")
    if saved is not None and saved != trainable:
        differ = sorted(set(saved) ^ set(trainable))
        example = (f"e.g. {differ[0]}" if differ else
                   "; ".join(f"{n} {trainable[n]} now, {saved[n]} saved" for n in trainable if saved[n] != trainable[n])[:200])
        raise UserError("model.lora", None, f"gives other adapters than {where} holds ({len(trainable)} tensors now, "
                        f"{len(saved)} saved; {example})",
                        "resume with the model.lora (r, target_modules) the run started with")
    return frozen


# What loading a damaged or foreign checkpoint raises: torch.load's errors for a file that is truncated
# (RuntimeError from the zip reader), empty (EOFError), garbage (UnpicklingError; KeyError from the
# weights-only unpickler), missing or unreadable (OSError); DeepSpeed's KeyError/AssertionError/ValueError
# where it indexes or checks a state dict that lacks what it expects; RuntimeError where torch's
# load_state_dict finds other shapes. Each is also what a bug raises, so it is the checkpoint's fault
# only when raised in the code of LOADERS.
DAMAGED_CHECKPOINT = (RuntimeError, EOFError, OSError, pickle.UnpicklingError, KeyError, AssertionError, ValueError)
LOADERS = ("torch", "deepspeed")


def load(engine: Engine, ckpt_dir: Path, *, tag: str | None = None) -> dict[str, int]:
    """Load the latest checkpoint (or `tag`) into `engine`; returns the dsf client state."""
    import torch

    tag = tag or latest_tag(ckpt_dir)
    if tag is None or not (Path(ckpt_dir) / tag).is_dir():
        raise UserError("checkpoint", str(ckpt_dir), f"latest names {tag!r}, which is not there",
                        "point output_dir at a run with a complete checkpoint")
    frozen = _check_trainable(engine, ckpt_dir, tag)
    try:  # a module without its frozen parameters (they were rebuilt from model.name) loads non-strictly
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=not frozen)
    except DAMAGED_CHECKPOINT as err:
        if not raised_in(err, *LOADERS):  # the same exception from code of ours is a bug: its traceback
            raise
        raise UserError("checkpoint", str(Path(ckpt_dir) / tag),
                        f"could not be loaded ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})",
                        "it is incomplete or corrupt; resume from an earlier tag") from None
    if path is None or not client_state or "dsf" not in client_state:
        raise UserError("checkpoint", str(Path(ckpt_dir) / tag), "is not a dsf checkpoint",
                        "resume only runs written by dsf train")
    rng_file = Path(ckpt_dir) / tag / f"rng_rank{engine.global_rank}.pt"
    if rng_file.is_file():  # a rank beyond the saved world (resumed at a larger dp) has none
        _set_rng_states(torch.load(rng_file, weights_only=False))
    restore_adam_products(engine)  # (DeepSpeed's host Adam: what makes the next step the straight run's)
    return client_state["dsf"]
