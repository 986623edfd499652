"""`dsf export`: a DeepSpeed checkpoint of any layout -> a `transformers` model directory, streamed.

    export_checkpoint("runs/tiny/checkpoints", "runs/tiny/hf")                       # latest tag
    export_checkpoint("runs/big/checkpoints", "runs/big/hf", max_shard_size="5GB")
    model = AutoModelForCausalLM.from_pretrained("runs/tiny/hf")

The weights are written the way `save_pretrained` writes them: fp32 safetensors, split at
`max_shard_size` (its meaning and its default) into model-00001-of-0000N.safetensors ... with
model.safetensors.index.json when there is more than one file, tied weights written once under the
name transformers keeps. No step holds the whole model: the names, shapes and shard plan come from a
weightless (meta) model, and each shard's tensors are read from the checkpoint as that shard is
written, so memory holds about one output shard plus the input of one tensor:

- ZeRO-3: deepspeed's `zero_to_fp32` in lazy mode (a parameter is gathered from the ranks'
  memory-mapped fp32 partitions when it is read);
- ZeRO-1/2: the same partitions, memory-mapped, each parameter sliced out of them when read
  (zero_to_fp32's lazy mode concatenates those whole);
- ZeRO-0: the module in mp_rank_XX_model_states.pt, memory-mapped;
- expert parallelism (DeepSpeed AutoEP, checkpoints/experts.py): at ZeRO 1-3 the fp32 partitions,
  memory-mapped, each weight joined from the pieces DeepSpeed records, an expert's from its ep ranks;
- pipeline: the per-layer files, one open at a time;
- tensor parallel: each tensor rank's part read as above (its mp_rank_YY files), and the ranks'
  parts of one parameter merged at a time (`merge_tensor_parallel_tensor`).

A LoRA run's checkpoint (model.lora in its run.yaml) holds only the adapters. Its export rebuilds the
frozen base as training did (`build_model` from model.name with train.seed: the pretrained directory's
weights or the seeded random init), applies the same adapters (models/lora.py), reads their trained
values from the checkpoint, and by default merges them into the base with peft's merge_and_unload and
writes it with save_pretrained (a plain transformers directory, sharded at `max_shard_size`); with
`adapter_only` it writes the adapter alone with PeftModel.save_pretrained (adapter_config.json,
adapter_model.safetensors), loadable with `PeftModel.from_pretrained(base, OUT_DIR)`. Either way the
tokenizer is written beside it. This path holds the whole base model in memory (peft merges in place).

    export_checkpoint("runs/lora/checkpoints", "runs/lora/hf")                          # merged
    export_checkpoint("runs/lora/checkpoints", "runs/lora/adapter", adapter_only=True)  # the adapter

A tensor read from a memory-mapped file is copied, and the file's pages are then handed back
(`_drop_mapped_pages`), so they do not pile up in the process's resident memory. The directory is
written under a temporary name and renamed into place, so a failed export never leaves a
half-written OUT_DIR, and an existing one is never replaced unless asked.
"""
from __future__ import annotations

import ctypes
import inspect
import json
import math
import mmap
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, cast

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.checkpoints.experts import autoep_layers, expert_checkpoint_entries
from dsframework.checkpoints.outputs import check_export_target
from dsframework.checkpoints.space import disk_full_error
from dsframework.config import load_run_config
from dsframework.data import load_tokenizer
from dsframework.errors import UserError
from dsframework.files import disk_full
from dsframework.models.build import build_model, resolve_model
from dsframework.models.hf import causal_lm_class
from dsframework.models.lora import apply_lora, merge_lora, trainable_names
from dsframework.models.tensor_parallel import merge_tensor_parallel_tensor, shard_layouts
from dsframework.models.pipeline import _LAYER_FILE, pipeline_layer_specs, pipeline_state_dict_to_hf
from dsframework.types import HFConfig

MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO 0-2; ZeRO-3 writes zero_pp_rank_*_<this> per rank


def _has_model_states(tag_dir: Path) -> bool:
    return any(tag_dir.glob(f"*{MODEL_STATES}"))


def tensor_parallel_size(ckpt_dir: Path, tag: str) -> int:
    """The tensor-parallel size `tag` was saved at: its manifest's layout (a resume at another layout
    writes the new one there, and never rewrites run.yaml); for a checkpoint without a manifest, the
    run's parallel.tp from the run.yaml dsf train saved beside the checkpoints."""
    import yaml

    saved = ckpt.saved_layout(ckpt.read_manifest(ckpt_dir, tag))
    if saved is not None:
        return saved.tp
    run_yaml = ckpt_dir / ckpt.RUN_YAML
    if not run_yaml.is_file():
        return 1
    run = yaml.safe_load(run_yaml.read_text()) or {}
    return int((run.get("parallel") or {}).get("tp", 1))


def locate(path: str | Path, tag: str | None = None) -> tuple[Path, str]:
    """(checkpoints dir, tag) for a checkpoints dir (latest tag) or one tag's directory."""
    path = Path(path)
    if _has_model_states(path) and tag is None:
        path, tag = path.parent, path.name
    if not path.is_dir():
        raise UserError("CKPT_DIR", str(path), "is not a directory", "pass <output_dir>/checkpoints")
    tag = tag or ckpt.latest_tag(path)
    if tag is None:
        raise UserError("CKPT_DIR", str(path), "is not a checkpoint directory (no 'latest' file)",
                        "pass <output_dir>/checkpoints of a dsf run, or a global_step* folder in it")
    if not _has_model_states(path / tag):
        raise UserError("CKPT_DIR", str(path / tag), f"has no {MODEL_STATES}",
                        "the checkpoint is incomplete; export an earlier tag with --tag")
    tp = tensor_parallel_size(path, tag)
    missing = [r for r in range(tp) if not any((path / tag).glob(f"*mp_rank_{r:02d}_model_states.pt"))]
    if missing:
        raise UserError("CKPT_DIR", str(path / tag), f"lacks the files of tensor rank {missing[0]} "
                        f"(mp_rank_{missing[0]:02d}_*) of a tp={tp} run",
                        "the checkpoint is incomplete; export an earlier tag with --tag")
    if not (path / ckpt.HF_CONFIG_DIR / "config.json").is_file():
        raise UserError("CKPT_DIR", str(path), f"has no {ckpt.HF_CONFIG_DIR}/config.json",
                        "export checkpoints written by dsf train")
    return path, tag


def shard_size(max_shard_size: int | str | None) -> int:
    """`max_shard_size` in bytes, read as `save_pretrained` reads it ("5GB" = 5e9, "500MB", or an
    int); None is save_pretrained's own default (50GB in transformers 5)."""
    from huggingface_hub.serialization._base import parse_size_to_int  # what save_pretrained's split uses
    from transformers import PreTrainedModel

    value = max_shard_size
    if value is None:
        value = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    try:
        size = value if isinstance(value, int) else parse_size_to_int(str(value))
    except ValueError:
        size = 0
    if size <= 0:
        raise UserError("--max-shard-size", value, "is not a size",
                        "give a positive number and a unit, e.g. 5GB or 500MB (KB, MB, GB, TB; 1MB = 10^6 bytes)")
    return size


# --- reading a checkpoint one tensor at a time -----------------------------------------------------

def _drop_mapped_pages(files: frozenset[str]) -> None:
    """Hand back the pages this process has read of `files` (checkpoint files memory-mapped by
    torch.load(mmap=True)). Every tensor taken from them is copied first, and the mappings are
    private and never written, so a page read again is faulted in anew from the page cache; without
    this, every page read would stay resident until the file is unmapped. Linux only (a no-op
    elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in files:
            start, end = (int(address, 16) for address in fields[0].split("-"))
            madvise(start, end - start, mmap.MADV_DONTNEED)


class _FlatSlice:
    """One parameter of a ZeRO-1/2 checkpoint, unread: `shape.numel()` elements from `offset` of a
    parameter group's flat fp32 vector, which the data-parallel ranks' partitions hold in order."""

    def __init__(self, partitions: list, offset: int, shape: Any):
        self.partitions, self.offset, self.shape = partitions, offset, shape

    def contiguous(self) -> Any:
        import torch

        pieces, start, end = [], self.offset, self.offset + self.shape.numel()
        for partition in self.partitions:
            lo, hi = max(start, 0), min(end, partition.numel())
            if lo < hi:
                pieces.append(partition[lo:hi])
            start, end = start - partition.numel(), end - partition.numel()
        return torch.cat(pieces).view(self.shape)


class _OneFileOpen:
    """torch.load(mmap=True) of one file at a time: opening the next lets go of the last."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.state: dict = {}

    def get(self, path: Path) -> dict:
        import torch

        if path != self.path:
            self.state = {}  # unmapped once nothing holds its tensors
            self.state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self.path = path
        return self.state


class _LayerTensor:
    """One tensor of a pipeline layer file, unread."""

    def __init__(self, files: _OneFileOpen, path: Path, key: str):
        self.files, self.path, self.key = files, path, key

    def contiguous(self) -> Any:
        return self.files.get(self.path)[self.key].clone()


class TensorReader:
    """One tensor rank's part of a checkpoint (all of it at tp=1): `names`, and `read(name)`, that
    tensor in memory of its own, fp32 if floating point. An entry is a tensor (perhaps a view of a
    memory-mapped file: copied when read) or an unread one, whose .contiguous() gathers or copies it
    into new memory (deepspeed's GatheredTensor, _FlatSlice, _LayerTensor). Pages of the files the
    reader maps are handed back after each read."""

    def __init__(self, entries: Mapping[str, Any], *, mapped: frozenset[str]):
        self.entries, self.mapped = dict(entries), mapped
        self.names = set(self.entries)

    def read(self, name: str) -> Any:
        import torch

        entry = self.entries[name]
        value = entry.clone() if isinstance(entry, torch.Tensor) else entry.contiguous()
        if value.is_floating_point():
            value = value.float()
        _drop_mapped_pages(self.mapped)
        return value


class TensorParallelReader:
    """The tp ranks' readers as one: `read(name)` merges that parameter's parts (only they are held)."""

    def __init__(self, ranks: list[TensorReader], config: HFConfig):
        self.ranks, self.layouts = ranks, shard_layouts(config, len(ranks))
        self.names = set.intersection(*(rank.names for rank in ranks))

    def read(self, name: str) -> Any:
        return merge_tensor_parallel_tensor(name, [rank.read(name) for rank in self.ranks], self.layouts)


def _one_tensor_rank(tag_dir: Path, rank: int, scratch: Path) -> Path:
    """A tag directory holding only tensor rank `rank`'s files (symlinks), which is what
    zero_to_fp32 expects: one model-parallel rank, its data-parallel partitions."""
    view = scratch / f"mp{rank}" / tag_dir.name
    view.mkdir(parents=True)
    for path in tag_dir.glob(f"*mp_rank_{rank:02d}_*"):
        (view / path.name).symlink_to(path.resolve())
    return view


def _pipeline_entries(tag_dir: Path, config: HFConfig, *, tensor_rank: int | None) -> dict[str, _LayerTensor]:
    """{HF name: that tensor of a layer file} from the pipeline's layer_XX-model_YY files: each file's
    keys are read (its pickle, no data), and its tensors one file at a time when written."""
    import torch

    specs, files, entries = pipeline_layer_specs(config), _OneFileOpen(), {}
    for path in sorted(tag_dir.iterdir()):
        match = _LAYER_FILE.match(path.name)
        if not match:
            continue
        file_rank = int(match.group(2) or 0)
        if file_rank > 0 and tensor_rank is None:
            raise UserError("checkpoint", str(tag_dir), "holds tensor-parallel layer files (layer_XX-model_YY)",
                            "read them one tensor rank at a time (tensor_rank=)")
        if file_rank != (tensor_rank or 0):
            continue
        keys = list(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
        names = pipeline_state_dict_to_hf({int(match.group(1)): {key: key for key in keys}}, specs)
        entries.update({name: _LayerTensor(files, path, key) for name, key in names.items()})
    if not entries:
        which = "" if tensor_rank is None else f" of tensor rank {tensor_rank}"
        raise UserError("checkpoint", str(tag_dir), f"holds no layer_XX-model_states.pt files{which}",
                        "point to a tag directory of a pipeline-parallel checkpoint")
    return entries


def _zero12_entries(tag_dir: Path) -> dict[str, Any]:
    """{name: unread tensor} of a ZeRO-1/2 checkpoint directory (one model-parallel rank): buffers and
    frozen weights from the model states, trainable weights as slices of the fp32 partitions. The
    offsets are zero_to_fp32's (`_zero2_merge_trainable_params`), without its concatenation."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_model_state_files, get_optim_files, parse_optim_states

    (model_file,) = get_model_state_files(str(tag_dir))
    states = torch.load(model_file, map_location="cpu", mmap=True, weights_only=False)
    _, world_size, flat_groups, paddings = parse_optim_states(get_optim_files(str(tag_dir)), str(tag_dir))
    entries: dict[str, Any] = {name: states["module"][name] for name in states["buffer_names"]}
    entries.update(states.get("frozen_param_fragments") or {})
    align = 2 * world_size  # ZeRO-2 pads each group to a multiple of this
    for group, shapes in enumerate(states["param_shapes"]):
        partitions = [groups[group] for groups in flat_groups]
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            entries[name] = _FlatSlice(partitions, offset, torch.Size(shape))
            offset += math.prod(shape) + (paddings[group][index] if paddings is not None else 0)
        available = sum(partition.numel() for partition in partitions)
        if math.ceil(offset / align) != math.ceil(available / align):
            raise ValueError(f"{tag_dir}: parameter group {group} holds {available} numels, its shapes {offset}")
    for alias, name in states["shared_params"].items():
        if name in entries:
            entries[alias] = entries[name]
    return entries


def _rank_reader(ckpt_dir: Path, tag: str, config: HFConfig, *, tensor_rank: int | None, scratch: Path) -> TensorReader:
    """One tensor rank's weights (or the whole model's at tp=1) under transformers names, unread."""
    import torch

    tag_dir = ckpt_dir / tag
    mapped = frozenset(str(path.resolve()) for path in tag_dir.iterdir())
    if tensor_rank is None and autoep_layers(tag_dir):  # expert parallelism (tp = pp = 1)
        return TensorReader(expert_checkpoint_entries(ckpt_dir, tag, config), mapped=mapped)
    is_pipeline = any(tag_dir.glob("layer_*-model_states.pt"))
    if is_pipeline:  # DeepSpeed's pipeline engine
        entries = _pipeline_entries(tag_dir, config, tensor_rank=tensor_rank)
    elif any(tag_dir.glob("*zero_pp_rank_*optim_states.pt")):
        view = tag_dir if tensor_rank is None else _one_tensor_rank(tag_dir, tensor_rank, scratch)
        if any(view.glob("zero_pp_rank_*_model_states.pt")):  # ZeRO-3: one model states file per rank
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            # (lazy_mode returns its dict of unread tensors; DeepSpeed's function is unannotated)
            entries = cast(dict, get_fp32_state_dict_from_zero_checkpoint(str(view.parent), tag=tag, lazy_mode=True))
        else:
            entries = _zero12_entries(view)
    else:
        rank = 0 if tensor_rank is None else tensor_rank
        entries = torch.load(tag_dir / f"mp_rank_{rank:02d}_model_states.pt", map_location="cpu", mmap=True,
                             weights_only=False)["module"]
    if tensor_rank is not None and not is_pipeline:  # TensorParallelCausalLM holds it as .model
        entries = {name.removeprefix("model."): tensor for name, tensor in entries.items()}
    return TensorReader(entries, mapped=mapped)


def open_checkpoint(ckpt_dir: Path, tag: str, config: HFConfig, *, tp: int = 1,
                    scratch: Path) -> TensorReader | TensorParallelReader:
    """A reader of the checkpoint's tensors under transformers names, whatever its ZeRO stage,
    pipeline split or tensor-parallel size (`scratch`: a directory for per-tensor-rank views, kept
    while the reader is used)."""
    if tp == 1:
        return _rank_reader(ckpt_dir, tag, config, tensor_rank=None, scratch=scratch)
    return TensorParallelReader([_rank_reader(ckpt_dir, tag, config, tensor_rank=rank, scratch=scratch)
                                 for rank in range(tp)], config)


# --- writing the transformers directory ----------------------------------------------------------

def weights_to_write(model: Any, reader: Any, *, where: str) -> dict[str, tuple[str, Any]]:
    """{name save_pretrained writes: (the checkpoint's name for it, the fp32 meta tensor)}, in the
    model's state_dict order; a tied weight is written once, under the name transformers keeps (its
    other name in the checkpoint serves too). UserError if checkpoint and config disagree."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    aliases = {name: names for names in tied.values() for name in names}
    plan, missing = {}, []
    for name, meta in kept.items():
        found = [n for n in (name, *aliases.get(name, ())) if n in reader.names]
        if not found:
            missing.append(name)
            continue
        plan[name] = (found[0], meta.float() if meta.is_floating_point() else meta)
    unexpected = sorted(reader.names - set(state))
    if missing or unexpected:
        raise UserError("CKPT_DIR", where, f"does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})",
                        "export with the hf_config saved by the same run")
    return plan


def write_weights(reader: Any, plan: Mapping[str, tuple[str, Any]], directory: Path, *, max_shard_size: int,
                  total_parameters: int, where: str) -> list[str]:
    """The safetensors files save_pretrained would write for `plan` (same split, names and index),
    one shard at a time, each tensor read when its shard is written; returns the file names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    split = split_torch_state_dict_into_shards(
        {name: meta for name, (_, meta) in plan.items()},
        filename_pattern=SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {}
        for name in names:
            source, meta = plan[name]
            tensor = reader.read(source)
            if tensor.shape != meta.shape:
                raise UserError("CKPT_DIR", where, f"does not match its config ({source} is {list(tensor.shape)}, "
                                f"the config makes it {list(meta.shape)})", "export with the hf_config saved by the same run")
            shard[name] = tensor
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        del shard, tensor  # before the next shard is read
    if split.is_sharded:
        index = {"metadata": {"total_parameters": total_parameters, **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(split.filename_to_tensors)


def write_config(model: Any, directory: Path) -> None:
    """config.json, and generation_config.json for a model that generates, as save_pretrained writes
    them for the fp32 model."""
    model.config.dtype = "float32"
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(directory))
    if model.can_generate():
        model.generation_config.save_pretrained(str(directory))


def lora_run(ckpt_dir: Path) -> Any:
    """The run config dsf train saved beside the checkpoints when that run trained LoRA adapters
    (model.lora), else None."""
    run_yaml = ckpt_dir / ckpt.RUN_YAML
    if not run_yaml.is_file():
        return None
    run = load_run_config(run_yaml)
    return run if run.model.lora is not None else None


def lora_model(ckpt_dir: Path, tag: str, run: Any, config: HFConfig, *, scratch: Path) -> Any:
    """The peft model of a LoRA checkpoint: the base rebuilt from model.name and train.seed as training
    built it, with the adapters' trained values read from the checkpoint (which holds nothing else)."""
    import torch

    where = str(ckpt_dir / tag)
    try:
        source = resolve_model(run.model)
    except UserError as err:
        raise UserError("CKPT_DIR", where, f"holds LoRA adapters, and their base model cannot be rebuilt ({err})",
                        "restore the model.name the run trained on, or edit it in "
                        f"{ckpt_dir / ckpt.RUN_YAML}") from None
    model = apply_lora(build_model(source, config, seed=run.train.seed), run.model.lora, seed=run.train.seed)
    reader = open_checkpoint(ckpt_dir, tag, config, scratch=scratch)
    params = dict(model.named_parameters())
    wanted, buffers = set(trainable_names(model)), {name for name, _ in model.named_buffers()}
    missing, unexpected = sorted(wanted - reader.names), sorted(reader.names - wanted - buffers)
    if missing or unexpected:
        raise UserError("CKPT_DIR", where, f"does not hold the adapters of its run.yaml's model.lora (missing "
                        f"{missing[:2]}, unexpected {unexpected[:2]})", "export with the run.yaml saved by the same run")
    with torch.no_grad():
        for name in sorted(wanted):
            tensor = reader.read(name)
            if tensor.shape != params[name].shape:
                raise UserError("CKPT_DIR", where, f"does not match its run.yaml's model.lora ({name} is "
                                f"{list(tensor.shape)}, the config makes it {list(params[name].shape)})",
                                "export with the run.yaml saved by the same run")
            params[name].copy_(tensor)
    return model


def _write_lora(ckpt_dir: Path, tag: str, run: Any, config: HFConfig, staging: Path, *, scratch: Path,
                adapter_only: bool, max_shard_size: int) -> None:
    """The merged model (or the adapter alone) of a LoRA checkpoint, written into `staging`."""
    model = lora_model(ckpt_dir, tag, run, config, scratch=scratch)
    if adapter_only:
        model.peft_config["default"].base_model_name_or_path = run.model.name
        model.save_pretrained(str(staging))
        return
    merged = merge_lora(model)
    merged.config.dtype = "float32"
    merged.save_pretrained(str(staging), max_shard_size=max_shard_size)


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, *, tag: str | None = None,
                      overwrite: bool = False, max_shard_size: int | str | None = None,
                      adapter_only: bool = False) -> Path:
    """Write config, safetensors weights (sharded at `max_shard_size`, save_pretrained's default when
    None) and tokenizer for `from_pretrained`; returns out_dir. A LoRA run's adapters are merged into
    the base weights, or with `adapter_only` written alone (PeftModel.save_pretrained)."""
    ckpt_dir, tag = locate(ckpt_path, tag)
    lora = lora_run(ckpt_dir)
    if adapter_only and lora is None:
        raise UserError("--adapter-only", None, f"needs a LoRA run's checkpoint, and {ckpt_dir} trained every "
                        "weight (its run.yaml has no model.lora)", "drop --adapter-only")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError("OUT_DIR", str(out_dir), "is a file", "choose a directory path")
    check_export_target(out_dir, ckpt_dir, overwrite=overwrite)  # never into, over or around a run's files
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError("OUT_DIR", str(out_dir), "exists and is not empty",
                        "choose a new directory or pass --overwrite")
    ckpt.verify(ckpt_dir, tag, sums=True)  # every file as saved (size and checksum), or one line naming it
    max_bytes = shard_size(max_shard_size)

    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(ckpt_dir / ckpt.HF_CONFIG_DIR), local_files_only=True)
    with torch.device("meta"):  # names, shapes and ties; no weights
        model = causal_lm_class(config)(config)
    where = str(ckpt_dir / tag)
    with tempfile.TemporaryDirectory(prefix="dsf-export-") as scratch:
        if lora is None:
            reader = open_checkpoint(ckpt_dir, tag, config, tp=tensor_parallel_size(ckpt_dir, tag), scratch=Path(scratch))
            plan = weights_to_write(model, reader, where=where)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        try:
            if lora is not None:
                _write_lora(ckpt_dir, tag, lora, config, staging, scratch=Path(scratch),
                            adapter_only=adapter_only, max_shard_size=max_bytes)
            else:
                write_weights(reader, plan, staging, max_shard_size=max_bytes,
                              total_parameters=model.num_parameters(), where=where)
                write_config(model, staging)
            tokenizer_dir = ckpt_dir / ckpt.TOKENIZER_DIR
            if tokenizer_dir.is_dir():
                load_tokenizer(tokenizer_dir, field="checkpoint tokenizer").save_pretrained(str(staging))
            if out_dir.exists():
                shutil.rmtree(out_dir)
            staging.rename(out_dir)
        except Exception as err:  # noqa: BLE001 - a full disk is one line; anything else re-raised
            if not disk_full(err):
                raise
            shutil.rmtree(staging, ignore_errors=True)  # (before the free space is measured)
            raise disk_full_error("OUT_DIR", out_dir, needed=export_bytes(model), last_good=None,
                                  fix="free space there or export to another disk") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def export_bytes(model: Any) -> int:
    """About what an export writes: the model's parameters in float32 (the tokenizer and config are small)."""
    return 4 * sum(p.numel() for p in model.parameters())
