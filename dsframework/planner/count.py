"""Parameters per tensor rank and per pipeline layer, counted on the model itself: built on the
meta device (no memory, no weights), sharded for one tensor rank by the plan dsf train applies
(`models.tensor_parallel.shard_model` with a `LayoutOnlyGroup`: no process group), and cut where
the pipeline's layers cut it (`models.pipeline.pipeline_layer_descriptions`, their `hf_names`).

    counts = model_counts(config)          # cached per config: the planner asks thousands of times
    shares = counts.shares(2)              # TensorShares of one rank at tp=2
    shares.items                           # per pipeline layer: (elements of each tensor, kind)
    counts.tp_problem(8)                   # None, or why tp=8 cannot run this model
    counts.pipeline_problem                # None, or why it cannot be cut into stages

Exact for every architecture shard_model and the pipeline take: a count is what a rank holds.
Layers of the same structure are counted once: the model is sharded at depth k, k the layers up to
the last new structure (1 for a uniform stack), and each layer takes its representative's count.
"""
from __future__ import annotations

import copy
import re
from typing import Any

import torch

from dsframework.models.hf import causal_lm_class, skip_transformers_init
from dsframework.models.tensor_parallel import shard_model
from dsframework.models.pipeline import hf_names, pipeline_layer_descriptions
from dsframework.parallel.tensor import LayoutOnlyGroup
from dsframework.planner.desc import SharesByTp, TensorShares, problem_text
from dsframework.types import HFConfig


def _meta_model(config: HFConfig) -> Any:
    with torch.device("meta"), skip_transformers_init():
        return causal_lm_class(config)(config)


def _decoder_layers(model: Any) -> tuple[str, Any]:
    """(path, ModuleList) of the decoder layers: the longest ModuleList of the model."""
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)]
    return max(lists, key=lambda item: len(item[1]))


def _signature(layer: Any) -> tuple:
    return tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())


def _shallow_config(config: HFConfig, depth: int) -> Any:
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = depth
    if getattr(shallow, "layer_types", None):
        shallow.layer_types = list(shallow.layer_types[:depth])
    return shallow


class ModelCounts(SharesByTp):
    """A config's parameters, counted (see the module docstring); `model_counts` caches one per config."""

    def __init__(self, config: HFConfig):
        self.config = config
        self.model = _meta_model(config)  # whole depth, unsharded: tp = 1
        self.layers_path, layers = _decoder_layers(self.model)
        signatures = [_signature(layer) for layer in layers]
        first = {sig: i for i, sig in reversed(list(enumerate(signatures)))}
        self.representative = [first[sig] for sig in signatures]
        self.signatures = signatures
        self.depth = max(first.values()) + 1
        self.specs_paths, self.pipeline_problem = self._spec_paths()
        self._shares: dict[int, TensorShares | str] = {}

    def _spec_paths(self) -> tuple[list[tuple[tuple[str, ...], str]], str | None]:
        """Per pipeline layer: (HF module paths, kind); without a pipeline adapter, the same parts
        from the module tree, and why pp > 1 is not available."""
        layer = re.compile(rf"^{re.escape(self.layers_path)}\.\d+$")
        try:
            specs = pipeline_layer_descriptions(self.config)
        except Exception as error:  # noqa: BLE001 - any refusal means: no pipeline for this model
            return self._module_tree_paths(), problem_text(error)
        out = []
        for index, spec in enumerate(specs):
            paths = tuple(dict.fromkeys(p for group in hf_names(spec).values() for p in group))
            kind = ("embed" if index == 0 else "head" if index == len(specs) - 1
                    else "layer" if any(layer.match(p) for p in paths) else "norm")
            out.append((paths, kind))
        return out, None

    def _module_tree_paths(self) -> list[tuple[tuple[str, ...], str]]:
        """The pipeline's parts without its adapter: the input embedding, each decoder layer, every
        other parameter (final norm, learned positions, ...), the output head (the embedding if tied)."""
        model = self.model
        names = {id(module): name for name, module in model.named_modules()}
        embed = names[id(model.get_input_embeddings())]
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is model.get_input_embeddings().weight
        head_paths = (embed,) if tied else (names[id(head)],) if head is not None else ()
        known = (embed, self.layers_path, *head_paths)
        rest = tuple(name for name, _ in model.named_parameters()
                     if not any(name == k or name.startswith(k + ".") for k in known))
        layers = [((f"{self.layers_path}.{i}",), "layer") for i in range(len(self.representative))]
        return [((embed,), "embed"), *layers, (rest, "norm"), (head_paths, "head")]

    def _count_or_why(self, tp: int) -> TensorShares | str:
        try:
            return self._count(tp)
        except Exception as error:  # noqa: BLE001 - shard_model's refusal, whatever its type
            return problem_text(error)

    def _count(self, tp: int) -> TensorShares:
        if tp == 1:
            model, depth = self.model, len(self.representative)
        else:
            model, depth = _meta_model(_shallow_config(self.config, self.depth)), self.depth
            if [_signature(layer) for layer in _decoder_layers(model)[1]] != self.signatures[:depth]:
                model, depth = _meta_model(self.config), len(self.representative)  # not a prefix: whole
            shard_model(model, group=LayoutOnlyGroup(size=tp, rank=0))
        by_path = _params_by_path(model)
        return TensorShares(tp=tp, items=tuple((self._sizes(by_path, paths, depth), kind)
                                               for paths, kind in self.specs_paths))

    def _sizes(self, by_path: dict[str, list[int]], paths: tuple[str, ...], depth: int) -> tuple[int, ...]:
        """Elements of each parameter under `paths`, a layer beyond `depth` counted as its
        representative."""
        prefix = self.layers_path + "."
        sizes: list[int] = []
        for path in paths:
            if path.startswith(prefix) and depth < len(self.representative):
                index, _, rest = path[len(prefix):].partition(".")
                path = prefix + str(self.representative[int(index)]) + ("." + rest if rest else "")
            sizes += by_path.get(path, [])
        return tuple(sizes)


def _params_by_path(model: Any) -> dict[str, list[int]]:
    """{module or parameter path: elements of every parameter at or under it} (tied parameters
    once, at their first name)."""
    out: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:end]), []).append(param.numel())
    return out


_CACHE: dict[str, ModelCounts] = {}


def model_counts(config: HFConfig) -> ModelCounts:
    """The ModelCounts of `config` (a copy of it), one per distinct config."""
    key = config.to_json_string(use_diff=False)
    if key not in _CACHE:
        _CACHE[key] = ModelCounts(copy.deepcopy(config))
    return _CACHE[key]


def clear_cache() -> None:
    """Forget every count (bench/plan_speed.py times each plan from scratch)."""
    _CACHE.clear()
