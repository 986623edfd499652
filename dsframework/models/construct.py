"""Build a model for a tensor/pipeline layout without ever holding it whole: meta first, then each
rank materialises only the parameters it owns.

    model = empty_model(config)                          # parameters on the meta device, buffers real
    templates = dense_templates(model)                   # each module before tensor-parallel swaps
    shard_model(model, group=tp_group)                   # meta shards with their dense_index
    owned = stage_module_paths(model, num_stages=2, stage=1)   # pipeline: this stage's modules
    report = materialize(model, templates, SeededInit(model, seed=42), owned=owned)
    report.bytes_read                                    # pretrained: what this rank read from disk

`build_for_layout` does those steps for `dsf train` (and ZeRO-3 partitioning at construction);
with `device` and `dtype` each module's parameters are made on the rank's device in its training
dtype as they get their values (at tp = pp = 1 that is `build_model`'s path: models/build.py).

Where the values come from:
- `SeededInit`: the same numbers as the dense build (`build_model`): every module is initialised
  by transformers' `_init_weights` under a seed derived from its name, so a rank re-creates one
  dense module at a time (a dense twin of the module, on the CPU), initialises it exactly as the
  dense build would, and keeps only its rows or columns (`dense_index`). The largest dense tensor
  it ever holds is one weight (the embedding, typically).
- `PretrainedSlices`: a local `model.safetensors` or sharded `model.safetensors.index.json` read
  slice by slice (`safe_open(...).get_slice`): a rank reads only the rows/columns of the tensors it
  owns (replicated tensors whole), and counts the bytes it read.

Tied weights (an lm_head that is the embedding) are one parameter: it gets the value of its last
owner in module order, as in the dense build (transformers' init of lm_head runs last there).
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import gc
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

import torch
from torch import nn

from dsframework.errors import UserError
from dsframework.models.hf import causal_lm_class, count_parameters, skip_transformers_init
from dsframework.models.tensor_parallel import shard_model
from dsframework.models.pipeline import stage_module_paths
from dsframework.types import HFConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"


# --- meta construction --------------------------------------------------------------------------

CONSTRUCTOR_VALUES_UP_TO = 64  # elements: a parameter this small keeps the value its constructor gave it


@contextlib.contextmanager
def parameters_on_meta():
    """Inside, every nn.Parameter a module registers lands on the meta device (no memory); buffers
    (rotary frequencies, masks) are computed as usual. (accelerate's init_empty_weights does the
    same; dsframework does not depend on accelerate.)"""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = param.__dict__
            meta = self._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            vars(meta).update(kwargs)  # vars: torch's stubs type a tensor's __dict__ as read-only
            if param.numel() <= CONSTRUCTOR_VALUES_UP_TO:  # e.g. xIELU's alphas (Apertus): set here, not by
                # transformers' init; metadata on the Parameter, as Megatron sets it: not in torch's stubs
                setattr(meta, "constructor_value", param.detach().clone())

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def empty_model(config: HFConfig) -> nn.Module:
    """The causal LM of `config` with its parameters on the meta device, buffers real, fp32."""
    from transformers.initialization import no_init_weights

    # no_init_weights: torch's own init never touches the pages of a parameter about to go to meta.
    with parameters_on_meta(), no_init_weights(), skip_transformers_init():
        model = causal_lm_class(config)._from_config(config, dtype=torch.float32)
    model.tie_weights()  # no_init_weights skips init_weights, where transformers ties
    return model


def dense_templates(model: nn.Module) -> dict[str, nn.Module]:
    """{module path: module} taken before tensor-parallel swaps: the dense twin each shard was cut
    from (shapes, class for `_init_weights`). The sharding plans keep module paths."""
    return {path: module for path, module in model.named_modules() if module._parameters}


# --- where values come from ---------------------------------------------------------------------

def _runs(index: torch.Tensor) -> list[tuple[int, int, bool]]:
    """(start, stop, is_padding) runs of consecutive dense indices; -1 entries are padding runs."""
    runs: list[tuple[int, int, bool]] = []
    for value in index.tolist():
        if runs:
            start, stop, pad = runs[-1]
            if pad and value < 0:
                runs[-1] = (start, stop + 1, True)
                continue
            if not pad and value == stop:
                runs[-1] = (start, stop + 1, False)
                continue
        runs.append((0, 1, True) if value < 0 else (value, value + 1, False))
    return runs


def _cut(read: Callable[[int, int, int], torch.Tensor], param: nn.Parameter, dense_shape: torch.Size) -> torch.Tensor:
    """This rank's part of a dense tensor, from `read(dim, start, stop)` (a slice of the stored
    tensor along `dim`, in the stored layout): along `partition_dim` at `dense_index` (padding rows
    zero), transposed back when the dense tensor is stored [in, out] (GPT-2's Conv1D)."""
    if not getattr(param, "tensor_model_parallel", False):  # replicated: all of it
        return read(0, 0, dense_shape[0])
    dim = getattr(param, "partition_dim")  # metadata on the Parameter (shard_model): not in torch's stubs
    transposed = getattr(param, "dense_transposed", False)
    stored_dim = (1 - dim) if transposed else dim
    parts = []
    for start, stop, pad in _runs(getattr(param, "dense_index")):
        if pad:
            shape = list(param.shape)
            shape[dim] = stop - start
            parts.append(torch.zeros(shape, dtype=param.dtype))  # host: padding beside the slices read from disk
        else:
            piece = read(stored_dim, start, stop)
            parts.append(piece.t() if transposed else piece)
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


class ConstructorValueUnknown(UserError):
    """A large parameter that only its module's constructor sets (transformers' init leaves it alone:
    Qwen3-Next's router weight), whose value a weightless build does not keep."""


def _constructor_value(template: nn.Module, path: str, name: str) -> torch.Tensor:
    """The value a parameter transformers' `_init_weights` does not set got from its module's
    constructor (kept for small ones by `parameters_on_meta`); ConstructorValueUnknown for a large one
    (`build_model` then builds on the host; tp/pp name it in one line)."""
    value = getattr(template._parameters[name], "constructor_value", None)
    if value is None:
        raise ConstructorValueUnknown("model.name", f"{path}.{name}", "is set by its module's constructor, not by "
                                      "transformers' init, and is too large to keep while the model is built weightless",
                                      "use parallel.tp=1 and parallel.pp=1 (the dense build), or a pretrained directory")
    return value


class SeededInit:
    """Random initialisation equal to `build_model`'s: a dense twin of each module (CPU, one at a
    time), seeded by the module's name, initialised by transformers' `_init_weights`."""

    def __init__(self, model: nn.Module, *, seed: int):
        self.init_weights = cast(Callable[[nn.Module], None], model._init_weights)  # a PreTrainedModel's
        self.seed = seed
        self.bytes_read = 0

    def values(self, path: str, template: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
        twin = copy.copy(template)  # shallow: only this module's own parameters get storage
        twin._parameters = dict(template._parameters)
        # its own dict: to_empty swaps the buffers too, and a shallow copy shares the template's, which
        # is the model's own module where no tensor-parallel layer replaced it (xIELU's beta and eps)
        twin._buffers = dict(template._buffers)
        twin._modules = {}
        twin.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for param in twin._parameters.values():
                if param is not None:
                    setattr(param, "_is_hf_initialized", False)  # transformers skips tensors flagged as done
                    param.fill_(float("nan"))  # what transformers' init leaves alone stays NaN
            torch.manual_seed((self.seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63))
            self.init_weights(twin)
            for name, param in twin._parameters.items():
                if param is not None and bool(param.isnan().all()):
                    param.copy_(_constructor_value(template, path, name))
        out = {}
        for name, param in module._parameters.items():
            if param is None:
                continue
            dense_param = twin._parameters[name]
            assert dense_param is not None  # the dense twin of `module`: the same parameters
            dense = dense_param.detach()
            out[name] = _cut(lambda dim, a, b, dense=dense: _part(dense, dim, a, b), param, dense.shape)
        return out


def _part(dense: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows/columns [start, stop) of a dense twin's tensor: the tensor itself when that is all of it
    (a replicated or unsharded parameter: no second copy), else a clone (a shard must not be a view
    that keeps the whole dense tensor alive)."""
    if (start, stop) == (0, dense.shape[dim]):
        return dense
    return dense.narrow(dim, start, stop - start).clone()


class PretrainedSlices:
    """Reads a local pretrained directory's safetensors (one file or an index of shards) slice by
    slice; `bytes_read` counts what this process read. `aliases`: the other names of a tied
    parameter (lm_head.weight <-> the embedding), any of which the files may hold."""

    def __init__(self, directory: Path, *, aliases: dict[str, list[str]], prefix: str):
        self.directory, self.aliases, self.prefix = Path(directory), aliases, prefix
        self.bytes_read = 0
        self.where = self._index()
        self._open: dict[Path, Any] = {}
        self.renamed: dict[str, str] = {}  # model name -> the stored key transformers renames to it

    @classmethod
    def for_model(cls, directory: Path, model: nn.Module) -> "PretrainedSlices":
        """The reader of `directory` for `model` (a meta or sharded skeleton of the config's model):
        its tied aliases, base-model prefix and the stored names transformers renames at load.

            reader = PretrainedSlices.for_model(pretrained_dir, empty_model(config))
        """
        reader = cls(directory, aliases=tied_aliases(model), prefix=cast(str, model.base_model_prefix))
        reader.renamed = renamed_at_load(model, reader.where)
        return reader

    def _index(self) -> dict[str, Path]:
        index = self.directory / SAFETENSORS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise UserError("model.name", str(index), "is not a safetensors index (no weight_map)",
                                "re-save the model with save_pretrained") from None
            where = {name: self.directory / file for name, file in weight_map.items()}
            missing = sorted({str(p) for p in where.values() if not p.is_file()})
            if missing:
                raise UserError("model.name", missing[0], f"is named by {index.name} but is not there",
                                "copy the missing shard into the directory or re-save the model")
            return where
        single = self.directory / SAFETENSORS_FILE
        if not single.is_file():
            raise UserError("model.name", str(self.directory), "has no model.safetensors or "
                            f"{SAFETENSORS_INDEX} (tensor/pipeline layouts read safetensors slice by slice)",
                            "convert the weights with save_pretrained(..., safe_serialization=True)")
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = safe_open(str(path), framework="pt").__enter__()
        return self._open[path]

    def _stored_name(self, name: str) -> str | None:
        for candidate in (name, *self.aliases.get(name, ())):
            for key in (candidate, candidate.removeprefix(self.prefix + "."), self.renamed.get(candidate)):
                if key in self.where:
                    return key
        return None

    def stored(self, name: str, dense_shape: Any) -> Any:
        """The safetensors slice of parameter `name`, checked against its dense shape (the dense
        module's own layout: a Conv1D weight is [in, out]); a UserError names what is wrong."""
        key = self._stored_name(name)
        if key is None:
            raise UserError("model.name", str(self.directory), f"holds no tensor {name!r}",
                            "point model.name at the complete pretrained directory")
        tensor_slice = self._handle(self.where[key]).get_slice(key)
        stored, expected = list(tensor_slice.get_shape()), list(dense_shape)
        if stored != expected:
            raise UserError("model.name", str(self.where[key]), f"tensor {key!r} has shape {stored}, the config "
                            f"gives {expected}", "use the config.json saved with these weights")
        return tensor_slice

    def values(self, path: str, template: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, param in module._parameters.items():
            if param is None:
                continue
            dense_param = template._parameters[name]
            assert dense_param is not None  # the dense twin of `module`: the same parameters
            dense_shape = dense_param.shape
            tensor_slice = self.stored(f"{path}.{name}", dense_shape)
            dtype = param.dtype

            def read(dim: int, start: int, stop: int, tensor_slice=tensor_slice) -> torch.Tensor:
                piece = tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]
                self.bytes_read += piece.numel() * piece.element_size()
                return piece.to(dtype)

            out[name] = _cut(read, param, dense_shape)
        return out

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()


def renamed_at_load(model: nn.Module, stored_keys: Iterable[str]) -> dict[str, str]:
    """{model name: stored key} for the stored keys that transformers only renames as it loads them:
    its own WeightRenamings, as from_pretrained applies them (GPT-NeoX's `embed_out` -> `lm_head`,
    EXAONE's `transformer.h.N.attn.attention` -> `model.layers.N.self_attn`, LFM3's `gate_proj` ->
    `g_proj`). A key that a WeightConverter merges or splits (Qwen3-MoE's per-expert weights) is left
    out: no one stored tensor holds its slice. A model with other kinds of transforms (Dory's layer
    pairs) gets no renaming at all rather than a guess."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    hf_model = cast("PreTrainedModel", model)  # a transformers model (its skeleton)
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if type(t) is WeightRenaming]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings or len(renamings) + len(converters) < len(transforms):
        return {}
    names = {name: True for name, _ in model.named_parameters(remove_duplicate=False)}
    renamed = {}
    for key in stored_keys:
        name, converted_by = rename_source_key(key, renamings, converters, base_model_prefix=hf_model.base_model_prefix,
                                               meta_state_dict=names)
        if converted_by is None and name != key and name in names:
            renamed[name] = key
    return renamed


def converted_at_load(model_type: str) -> bool:
    """True when transformers renames or merges this type's stored tensors as it loads them (its
    conversion mapping: Qwen3-MoE's per-expert gate/up/down into fused experts, GPT-NeoX, ...):
    its own save_pretrained writes the stored names, which are not the model's."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return bool(get_checkpoint_conversion_mapping(model_type))


def check_pretrained_files(directory: Path, config: HFConfig, *, sliced: bool = False) -> None:
    """UserError unless the directory's safetensors (one file or an index of shards) hold every
    tensor of `config`'s model at its shape. Reads the files' headers only; run before any rank
    starts, so a broken download is named at once, whatever the layout. (pytorch_model.bin
    directories are left to transformers.) A type transformers converts at load may store other
    names: accepted for from_pretrained (which converts and checks them itself), refused for
    `sliced` loading (tp or pp), which reads the model's own names slice by slice."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX)):
        return
    model = empty_model(config)
    reader = PretrainedSlices.for_model(directory, model)
    try:
        for name, param in model.named_parameters():
            if reader._stored_name(name) is None and converted_at_load(config.model_type):
                if not sliced:
                    return
                raise UserError("model.name", str(directory), f"stores {config.model_type}'s weights under the names "
                                f"transformers converts at load (no {name!r}), which tp/pp's sliced loading does not "
                                "read", "use parallel.tp=1 and parallel.pp=1 (from_pretrained converts them)")
            reader.stored(name, param.shape)
    finally:
        reader.close()


def reads_every_tensor(directory: Path, config: HFConfig) -> bool:
    """Whether `PretrainedSlices` reads `config`'s whole model from `directory`: safetensors holding
    every parameter under the model's own names (or names transformers only renames). False for a
    pytorch_model.bin directory and for a type whose stored tensors transformers merges at load
    (Qwen3-MoE's per-expert weights): those load with from_pretrained. Reads the headers only."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX)):
        return False
    model = empty_model(config)
    reader = PretrainedSlices.for_model(directory, model)
    try:
        return all(reader._stored_name(name) is not None for name, _ in model.named_parameters())
    finally:
        reader.close()


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """{parameter name: its other names} for parameters reachable under several names."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: [other for other in group if other != name]
            for group in names.values() if len(group) > 1 for name in group}


# --- materialisation ----------------------------------------------------------------------------

def _malloc_trim() -> Callable[[], Any]:
    """glibc's malloc_trim(0), or a no-op where there is none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


release_freed_memory = _malloc_trim()
release_freed_memory.__doc__ = """Give the pages of freed blocks back to the OS (glibc malloc_trim).

Building a rank's share frees a dense twin or a full tensor shard after every module; glibc serves
later blocks from the heap's free space and keeps what lies between live blocks resident, so
without a trim a rank's resident memory grows by more than it keeps (measured: ZeRO-3 x tp2 kept
333 MB and its peak grew by 820 MB)."""


def host_memory() -> dict[str, int]:
    """{"VmRSS": bytes, "VmHWM": bytes}: this process's resident memory now and at its peak
    (/proc/self/status; {} where there is none)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    return {key: int(rest.split()[0]) * 1024 for key, _, rest in (line.partition(":") for line in lines)
            if key in ("VmRSS", "VmHWM")}


@dataclass
class HostPeak:
    """The host memory of a block (`host_peak`), in bytes."""

    before: int = 0      # resident when the block began
    peak: int = 0        # the highest resident during the block (VmHWM)
    reset: bool = False  # False: the peak could not be reset, so it is the process's own so far


@contextlib.contextmanager
def host_peak() -> Any:
    """Measure the host's peak resident memory over the block: VmHWM, reset as the block begins
    (writing 5 to /proc/self/clear_refs, Linux 4.0+) so that it is the block's own peak.

        with host_peak() as peak:
            model = build_model(...)
        peak.peak - peak.before          # what building added at its highest
    """
    out = HostPeak()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        out.reset = True
    except OSError:
        pass
    out.before = host_memory().get("VmRSS", 0)
    yield out
    out.peak = host_memory().get("VmHWM", 0)


def placed(value: torch.Tensor, device: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`value` on `device` in `dtype`, the way DeepSpeed's engine casts a module's parameters for
    bf16/fp16 (a floating tensor only) and moves it (`module.to(device)`); `value` itself when it is
    there already. The cast is a plain rounding of the fp32 value, so a parameter made in bf16 here
    equals one DeepSpeed casts from fp32 at initialize (its optimizers keep fp32 master copies made
    from the bf16 parameters either way). Not blocking: from pageable host memory the copy has taken
    the values by the time it returns (CUDA stages them), so `value` may go at once, and a build
    under DSF_CUDA_SYNC_DEBUG does not report one synchronisation per parameter."""
    if dtype is not None and not value.is_floating_point():
        dtype = None
    return value.to(device=device if device is not None else value.device, dtype=dtype or value.dtype,
                    non_blocking=True)


def move_buffers(model: nn.Module, device: Any) -> None:
    """Every buffer of `model` (rotary frequencies, masks: computed on the CPU as the meta model was
    built) moved to `device`, as DeepSpeed's `module.to(device)` would; their dtypes are kept."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device, non_blocking=True)  # as `placed`


@dataclass
class Materialized:
    """What `materialize` did on this rank."""

    parameters: int = 0           # elements materialised (this rank's share)
    bytes_read: int = 0           # from a pretrained directory
    modules: list[str] = field(default_factory=list)


def _owned(path: str, owned: Iterable[str] | None) -> bool:
    if owned is None:
        return True
    return any(path == p or path.startswith(p + ".") for p in owned)


def materialize(model: nn.Module, templates: dict[str, nn.Module], source: Any, *,
                owned: Iterable[str] | None = None, zero3: Any = None, device: Any = None,
                dtype: torch.dtype | None = None) -> Materialized:
    """Give the meta parameters of the modules under `owned` (all when None) their values from
    `source` (SeededInit or PretrainedSlices), one module at a time, in place: every module that
    holds a parameter (tied ones included) gets the same new tensor, which keeps the shard's
    attributes (tensor_model_parallel, partition_dim, dense_index). `zero3`: a deepspeed.zero.Init
    whose partitioning each module's new parameters go through at once (ZeRO-3 with tp). `device`,
    `dtype`: where each value goes as it is made (`placed`; None: where the source made it, fp32)."""
    owned = None if owned is None else list(owned)
    modules = [(path, module) for path, module in model.named_modules()
               if module._parameters and _owned(path, owned)]
    last_owner: dict[int, str] = {}
    for path, module in modules:
        for param in module._parameters.values():
            if param is not None and param.device.type == "meta":
                last_owner[id(param)] = path
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    report = Materialized()
    for path, module in modules:
        todo = {name for name, p in module._parameters.items()
                if p is not None and p.device.type == "meta" and last_owner.get(id(p)) == path}
        if not todo:
            continue
        values = source.values(path, templates.get(path, module), module)
        new_params = []
        for name in todo:
            old = module._parameters[name]
            assert old is not None  # in `todo`: a meta parameter
            new = nn.Parameter(placed(values[name], device, dtype).contiguous(), requires_grad=old.requires_grad)
            vars(new).update({k: v for k, v in old.__dict__.items() if k != "_is_hf_initialized"})
            module._parameters[name] = new
            replaced[id(old)] = (old, new)
            new_params.append(new)
            report.parameters += new.numel()
        del values
        if zero3 is not None:
            zero3._convert_to_zero_parameters(new_params)  # partition over data-parallel ranks now
            # The full tensors outlive the partitioning in reference cycles (through the broadcast
            # DeepSpeed runs on them): collect now, or a rank keeps its whole tensor shard anyway.
            gc.collect(0)  # the cycles are young: generation 0 is enough, and cheap
        release_freed_memory()
        report.modules.append(path)
    for module in model.modules():  # other holders of a tied parameter
        for name, param in module._parameters.items():
            if param is not None and id(param) in replaced and replaced[id(param)][0] is param:
                module._parameters[name] = replaced[id(param)][1]
    report.bytes_read = source.bytes_read
    return report


# --- for dsf train ------------------------------------------------------------------------------

@dataclass
class Built:
    """A model for a tensor/pipeline layout, this rank's share materialised."""

    model: nn.Module        # transformers' module tree; other stages' modules stay on meta
    num_parameters: int     # the whole model's, counted on meta before sharding
    report: Materialized


def zero_group(mpu: Any) -> Any:
    """The group ZeRO partitions over: data x context ranks with context parallelism (DeepSpeed's
    sequence-data group), else the data-parallel group; None (the world) without an mpu."""
    if mpu is None:
        return None
    if hasattr(mpu, "get_sequence_data_parallel_group"):
        return mpu.get_sequence_data_parallel_group()
    return mpu.get_data_parallel_group()


def build_for_layout(source: Any, config: HFConfig, *, seed: int, tp_group: Any = None,
                     pipeline: tuple[int, int] | None = None, partition_method: str = "parameters",
                     zero3_ds_config: dict[str, Any] | None = None, mpu: Any = None, device: Any = None,
                     dtype: torch.dtype | None = None) -> Built:
    """Meta model -> tensor-parallel shards (tp_group) -> this pipeline stage's modules
    (pipeline=(num_stages, stage)) materialised from `source`'s pretrained directory or the seeded
    init; with `zero3_ds_config`, each module's shards are partitioned over the data-parallel group of
    `mpu` (the grid deepspeed.initialize gets; None: the world) as they are
    made (zero.Init), so a rank never holds more than one module's tensor shard in full. With
    `device`, each module's parameters go there in `dtype` as they are made, and the buffers after
    (`build_model`'s path at tp = pp = 1: the host holds one module's dense twin at a time)."""
    model = empty_model(config)
    num_parameters = count_parameters(model)
    templates = dense_templates(model)
    if tp_group is not None:
        shard_model(model, group=tp_group)
    owned = None
    if pipeline is not None:
        num_stages, stage = pipeline
        owned = stage_module_paths(model, num_stages=num_stages, stage=stage, partition_method=partition_method)
    if source.pretrained_dir is not None:
        values: Any = PretrainedSlices.for_model(source.pretrained_dir, model)
    else:
        values = SeededInit(model, seed=seed)
    zero3 = None
    if zero3_ds_config is not None:
        import deepspeed

        zero3 = deepspeed.zero.Init(config_dict_or_path=zero3_ds_config, mpu=mpu,
                                    data_parallel_group=zero_group(mpu))
    try:
        report = materialize(model, templates, values, owned=owned, zero3=zero3, device=device, dtype=dtype)
    finally:
        if isinstance(values, PretrainedSlices):
            values.close()
    if device is not None:
        move_buffers(model, device)
    return Built(model, num_parameters, report)
