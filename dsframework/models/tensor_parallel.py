"""Tensor parallelism for Hugging Face causal LMs: swap dense layers for their Megatron shards.

    model = build_model(source, config, seed=42)                 # the dense model, every rank
    tp_model = TensorParallelCausalLM(shard_model(model, group=tp_group), group=tp_group)  # 1/tp of the weights
    out = tp_model(input_ids=ids, labels=ids)                    # out.loss: models/loss.py's, vocab-parallel

The plan is data: models/plans.py reads the architecture's `base_model_tp_plan` (transformers'
own, for 116 causal-LM types; GPT-2's is written there) and each style becomes a Megatron layer:

| transformers style                 | dsframework layer                                          |
|------------------------------------|------------------------------------------------------------|
| colwise                            | ColumnParallelLinear (output features split)               |
| colwise_gather_output              | ColumnParallelLinear(gather_output=True)                   |
| packed_colwise                     | ColumnParallelLinear, each fused part split (`dense_index`)|
| rowwise / rowwise_split_input      | RowParallelLinear (input split here / already split)       |
| embedding_rowwise                  | VocabParallelEmbedding                                     |
| replicated_with_grad_allreduce     | replicated; gradients summed over the tensor group         |

Attention heads and key/value heads are split across ranks (transformers' attention reshapes by
-1 heads, so it runs on this rank's heads). The input embedding is always vocab-parallel and the
head emits this rank's vocab slice into models/loss.py's vocab-parallel loss: the full logits are
never gathered (the plan's own `lm_head: colwise_gather_output` would gather them).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, cast

import torch
from torch import nn

from dsframework.errors import UserError, divide
from dsframework.models.hf import causal_lm_class, is_tied, module_path
from dsframework.models.logits import processed_head
from dsframework.models.loss import causal_lm_loss, chunked_causal_lm_loss, vocab_parallel_token_loss
from dsframework.models.plans import STYLES, WORKING_LAYOUTS, architecture_plan, check_architecture, pattern_regex
from dsframework.parallel.rng import fork_around
from dsframework.parallel.tensor import (
    ColumnParallelLinear,
    LayoutOnlyGroup,
    RowParallelLinear,
    SequenceParallelBlock,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    shard_index,
    tensor_parallel_rank,
    tensor_parallel_size,
)
from dsframework.types import HFConfig


def _dense_weight(module: nn.Module, path: str, style: str) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight as [out, in], bias, transposed?) of a Linear, or of a transformers Conv1D ([in, out])."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return module.weight.t(), module.bias, True
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    raise UserError("parallel.tp", path, f"is a {type(module).__name__}, which the style {style!r} cannot split",
                    f"use {WORKING_LAYOUTS}")


def _split_linear(module: nn.Module, path: str, kind: str, style: str, *, group: Any, parts: int) -> nn.Module:
    """The Megatron layer for one plan entry: column (output rows split; packed: each fused part
    split; gathered: its output all-gathered back) or row (input columns split, output summed)."""
    weight, bias, transposed = _dense_weight(module, path, style)
    if kind.startswith(("column", "packed")):
        index = None
        if kind == "packed_column":
            tp, rank = tensor_parallel_size(group), tensor_parallel_rank(group)
            part = divide(weight.shape[0], parts, what=f"{path}'s fused output vs its {parts} parts")
            index = shard_index([part] * parts, rank=rank, tp=tp, what=f"{path}'s fused parts")
        layer = ColumnParallelLinear.from_dense_weight(weight, bias, group=group, out_index=index,
                                                       gather_output=kind == "column_gather")
    else:
        layer = RowParallelLinear.from_dense_weight(weight, bias, group=group, input_is_parallel=kind == "row")
    if transposed:
        # export writes the Conv1D's [in, out] back; metadata on the Parameter, as Megatron's: not in torch's stubs
        setattr(layer.weight, "dense_transposed", True)
    return layer


def _vocab_embedding(module: nn.Embedding, *, group: Any) -> VocabParallelEmbedding:
    """The embedding split by vocabulary; a scaled embedding (Gemma 3's `embed_scale`) keeps its scale."""
    sharded = VocabParallelEmbedding.from_dense(module, group=group)
    scale = getattr(module, "embed_scale", None)
    if scale is not None:
        # host: a float becomes a host buffer, which moves with the module; a tensor keeps its device
        sharded.register_buffer("embed_scale", torch.as_tensor(scale).detach().clone(), persistent=False)
    return sharded


def _replicated(param: nn.Parameter) -> bool:
    return not getattr(param, "tensor_model_parallel", False)


def _all_reduce_gradients(module: nn.Module, *, group: Any, only: Callable[[nn.Parameter], bool] = _replicated) -> None:
    """Sum the gradients of `module`'s own parameters that `only` selects (default: the replicated
    ones) over the tensor group: a norm that sees only this rank's heads, or with sequence
    parallelism only its slice of the tokens, has a partial gradient. A hook on the gradient
    before it accumulates, so gradient accumulation and DeepSpeed's own hooks see the summed
    gradient once; installed at the first forward, on whichever Parameter objects the module holds
    by then (construction replaces them)."""
    def sum_over_tensor_ranks(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    def install(mod: nn.Module, args: Any) -> None:
        for param in mod.parameters(recurse=False):
            if param.requires_grad and only(param) and not getattr(param, "grad_summed_over_tensor_ranks", False):
                param.register_hook(sum_over_tensor_ranks)
                setattr(param, "grad_summed_over_tensor_ranks", True)

    if tensor_parallel_size(group) > 1:
        module.register_forward_pre_hook(install)
    for param in module.parameters(recurse=False):
        if only(param):
            setattr(param, "replicated_grad_allreduce", True)


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _apply_plan(base: nn.Module, plan: Any, *, group: Any) -> None:
    """Every module a plan pattern matches becomes its style's layer (patterns that match nothing,
    e.g. an optional projection this config lacks, are skipped, as transformers does)."""
    paths = [path for path, _ in base.named_modules()]
    for pattern, style in plan.tp:
        kind, regex = STYLES[style], pattern_regex(pattern)
        for path in (p for p in paths if regex.match(p)):
            module = base.get_submodule(path)
            if kind == "grad_allreduce":
                _all_reduce_gradients(module, group=group)
            elif kind == "vocab_embedding":
                # the style transformers' plans give the token embedding: an nn.Embedding
                _set_submodule(base, path, _vocab_embedding(cast(nn.Embedding, module), group=group))
            elif kind != "replicated":
                _set_submodule(base, path, _split_linear(module, path, kind, style, group=group,
                                                         parts=plan.parts_of(pattern)))


def _shard_embeddings(model: Any, *, group: Any, tied: bool) -> None:
    """The input embedding split by vocabulary (whether or not the plan lists it: same function,
    1/tp of the memory), and the head vocab-parallel: tied to it, or split from its own weight."""
    base, embedding, head = model.base_model, model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, VocabParallelEmbedding):
        if not isinstance(embedding, nn.Embedding):
            raise UserError("parallel.tp", tensor_parallel_size(group), f"cannot split {model.config.model_type}'s "
                            f"input embedding ({type(embedding).__name__})", f"use {WORKING_LAYOUTS}")
        embedding = _vocab_embedding(embedding, group=group)
        _set_submodule(base, module_path(base, model.get_input_embeddings()), embedding)
    if head is None or not isinstance(head, nn.Linear):
        raise UserError("parallel.tp", tensor_parallel_size(group), f"cannot split {model.config.model_type}'s "
                        f"output head ({type(head).__name__})", f"use {WORKING_LAYOUTS}")
    head_name = next(name for name, child in model.named_children() if child is head)
    setattr(model, head_name, VocabParallelLMHead.tied_to(embedding) if tied
            else VocabParallelLMHead.from_dense(head, group=group))


def _gpt2_attention_sizes(model: Any, group: Any) -> None:
    """GPT2Attention splits c_attn's output by `split_size` and reshapes by `num_heads`: this rank's."""
    tp = tensor_parallel_size(group)
    for block in model.transformer.h:
        attn = block.attn
        attn.split_size, attn.embed_dim = attn.split_size // tp, attn.embed_dim // tp
        attn.num_heads //= tp


AFTER_SHARD = {"gpt2": _gpt2_attention_sizes}  # model type -> what its modules keep besides weights


class TensorParallelOutput(dict):
    """`.loss` and `.logits` (this rank's vocab slice), like a transformers model output."""

    __getattr__ = dict.__getitem__


class TensorParallelCausalLM(nn.Module):
    """A causal LM whose layers are tensor-parallel shards; forward(input_ids, labels) -> loss."""

    def __init__(self, model: Any, *, group: Any):
        super().__init__()
        self.model, self.group = model, group
        self.config = model.config
        self.loss_chunk_tokens: int | None = None  # models/loss.py use_chunked_loss: the loss in chunks

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None, **kwargs: Any):
        """`.loss` (models/loss.py's, with `shift_labels` the targets already shifted and
        `num_items_in_batch` the count it divides by) and `.logits` (None when chunked)."""
        # (with sequence parallelism the final norm gathered the whole sequence: use_sequence_parallel)
        hidden = self.model.base_model(input_ids=input_ids, **{"use_cache": False, **kwargs}).last_hidden_state
        token_loss = vocab_parallel_token_loss(group=self.group, vocab_size=self.config.vocab_size)
        head = processed_head(self.model)  # this rank's vocab slice, post-processed as the model's forward does
        if labels is None and shift_labels is None:
            return TensorParallelOutput(loss=None, logits=head(hidden))
        if self.loss_chunk_tokens:
            return TensorParallelOutput(loss=chunked_causal_lm_loss(
                head, hidden, labels, shifted=shift_labels, chunk_tokens=self.loss_chunk_tokens,
                token_loss=token_loss, over=num_items_in_batch), logits=None)
        logits = head(hidden)
        return TensorParallelOutput(loss=causal_lm_loss(logits, labels, shifted=shift_labels, token_loss=token_loss,
                                                        over=num_items_in_batch), logits=logits)


def shard_model(model: Any, *, group: Any) -> Any:
    """Swap `model`'s dense layers for this rank's shards, in place, as its architecture's plan says
    (models/plans.py); returns it. UserError (one line) for an architecture or style that cannot.

    The result keeps transformers' module tree and names, so the pipeline can cut it into
    stages (tp x pp); `TensorParallelCausalLM` wraps it for the loss instead (tp x dp).
    """
    tp = tensor_parallel_size(group)
    plan = check_architecture(model.config, tp=tp) if tp > 1 else architecture_plan(model.config)
    if plan.tp_problem:
        check_architecture(model.config, tp=2)  # raises, naming the problem
    tied = is_tied(model)  # (before the plan splits the embedding away from the head)
    _apply_plan(model.base_model, plan, group=group)
    _shard_embeddings(model, group=group, tied=tied)
    if model.config.model_type in AFTER_SHARD:
        AFTER_SHARD[model.config.model_type](model, group)
    return model


# --- sequence parallelism -------------------------------------------------------------------------

def _decoder_layers(model: Any) -> tuple[Any, nn.ModuleList | None]:
    """(the architecture's plan, its decoder layers' ModuleList, or None without a pipeline plan)."""
    plan = architecture_plan(model.config)
    return plan, (getattr(model.base_model, plan.pp.layers, None) if plan.pp is not None else None)


def heads_are_split(model: Any) -> bool:
    """Whether each tensor rank's attention runs on its own heads: not where the plan gathers a
    column-parallel output back (Phi-3's and OLMo 2's plans: every rank runs all heads, replicated,
    and their dropout must draw the same mask on every rank)."""
    return not any(isinstance(m, ColumnParallelLinear) and m.gather_output for m in model.modules())


def _gathered_blocks(layer: nn.Module) -> list[nn.Module]:
    """The children of a decoder layer that hold column-parallel layers (its attention, its MLP):
    under sequence parallelism each takes the whole sequence at its input."""
    return [block for block in layer.children() if any(isinstance(m, ColumnParallelLinear) for m in block.modules())]


def sequence_parallel_problem(model: Any) -> str | None:
    """Why the sharded `model` cannot split its sequence over the tensor ranks between its
    attention and MLP blocks (None: it can). Outside them a layer may hold only norms: a module
    that mixes tokens (a state-space mixer) or routes them (experts that the plan leaves whole)
    would see a slice of the sequence."""
    plan, layers = _decoder_layers(model)
    if layers is None:
        return f"dsf finds {model.config.model_type}'s decoder layers through its pipeline plan, which it lacks"
    if plan.pp is not None and not plan.pp.last:  # (the sequence is gathered back there)
        return f"{model.config.model_type}'s pipeline plan names no final norm after its decoder layers"
    for index, layer in enumerate(layers):
        inside = {id(m) for block in _gathered_blocks(layer) for m in block.modules()}
        for path, module in layer.named_modules():
            if id(module) in inside or not list(module.parameters(recurse=False)):
                continue
            if isinstance(module, RowParallelLinear) or "norm" not in type(module).__name__.lower():
                return (f"layers.{index}.{path} ({type(module).__name__}) is outside the blocks the tp plan splits "
                        "and not a norm")
    return None


def use_sequence_parallel(model: Any, *, group: Any, regather: bool = True) -> None:
    """Megatron's sequence parallelism on a model `shard_model` split (Korthikanti et al. 2022):
    between the attention and MLP blocks each tensor rank holds seq_len / tp of the tokens (its
    norms, residuals and dropout run on those alone, and store a tp-th of the activations). The
    first decoder layer takes this rank's slice; each block holding column-parallel layers (the
    attention, the MLP) all-gathers the sequence at its input (its own code reads the sequence
    length there; with `regather`, its backward gathers it again rather than keep it: off under
    full activation checkpointing), row-parallel layers reduce-scatter it instead of all-reducing.
    Outside the blocks, and after a row-parallel layer inside one, each rank holds its own tokens:
    the replicated parameters there (norms, row-parallel biases) sum their gradients over the
    tensor group, and dropout draws each rank's own stream (parallel/rng.py). The head gets the
    whole sequence back at the final norm's output. Call
    `sequence_parallel_problem` first."""
    plan, layers = _decoder_layers(model)
    assert layers is not None and plan.pp is not None
    norm = [model.base_model.get_submodule(name) for name in plan.pp.last]
    for layer in layers:  # (sequence_ranks: read by the pipeline's stages, models/pipeline.py _whole_length)
        setattr(layer, "sequence_ranks", tensor_parallel_size(group))
        blocks = _gathered_blocks(layer)
        inside = {id(m) for block in blocks for m in block.modules()}
        _split_tokens_region([m for m in layer.modules() if id(m) not in inside], group=group)
        for block in blocks:
            _gathered_block(block, group, regather=regather)
    for module in norm:
        _split_tokens_region(list(module.modules()), group=group)
    # The whole sequence again at the final norm's output, inside the base model's forward: some
    # reshape it there by the input's length (GPT-2's view(-1, seq_len, hidden)), which a slice
    # would silently reinterpret as other tokens.
    norm[-1].register_forward_hook(_gather_output(group))
    setattr(layers[0], "takes_whole_sequence", True)
    layers[0].register_forward_pre_hook(_first_layer_takes_its_slice(group), with_kwargs=True)


def _split_tokens_region(modules: list[nn.Module], *, group: Any) -> None:
    """Modules that see this rank's slice of the sequence: their replicated parameters' gradients
    are partial (summed over the tensor group), their dropout draws this rank's stream."""
    for module in modules:
        if list(module.parameters(recurse=False)):
            _all_reduce_gradients(module, group=group)
        if isinstance(module, nn.Dropout):
            fork_around(module)


def _gathered_block(block: nn.Module, group: Any, *, regather: bool) -> None:
    """`block`'s input gathered (SequenceParallelBlock) for its forward alone; its row-parallel
    layers reduce-scatter, and what follows them in the block (a residual dropout, a row bias) is
    on this rank's tokens; the rest of the block runs as without sequence parallelism."""
    scope = SequenceParallelBlock(group, regather=regather)
    past_row = [False]

    def enter(hidden: torch.Tensor) -> torch.Tensor:
        past_row[0] = False
        return scope.enter(hidden)

    def row_done(module: nn.Module, args: Any, output: Any) -> None:
        past_row[0] = True

    block.register_forward_pre_hook(_on_hidden_states(enter), with_kwargs=True)
    block.register_forward_hook(lambda module, args, output: scope.leave())
    for module in block.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.sequence_parallel = True
        if isinstance(module, RowParallelLinear):
            module.register_forward_hook(row_done)
            if module.bias is not None:
                _all_reduce_gradients(module, group=group)  # (its weight is split: only the bias)
        if isinstance(module, nn.Dropout):  # (before the row layer: the default stream, or the core's fork)
            fork_around(module, when=lambda: past_row[0])


def _on_hidden_states(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward pre-hook (with kwargs) that applies `change` to the module's hidden states: its
    first positional argument, or `hidden_states=`."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (change(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    return hook


def _gather_output(group: Any) -> Callable:
    """A forward hook: the module's output (this rank's tokens) all-gathered to the whole sequence,
    for the head; its backward keeps this rank's slice of the gradient (the vocab-parallel head's
    input gradient is already whole on every rank after its own all-reduce)."""
    return lambda module, args, output: gather_from_sequence_parallel_region(output, group=group, partial_grads=False)


def _first_layer_takes_its_slice(group: Any) -> Callable:
    return _on_hidden_states(lambda hidden: scatter_to_sequence_parallel_region(hidden, group=group))


# --- merging shards back (dsf export) ------------------------------------------------------------

def shard_layouts(config: HFConfig, tp: int) -> list[dict[str, tuple[int, torch.Tensor, bool]]]:
    """Per tensor rank, {transformers parameter name: (partition dim, dense index, transposed)}
    of every sharded parameter, found by running the plan on a weightless (meta) model; names
    missing from a rank's dict are replicated. transposed: the dense tensor is stored [in, out]."""
    layouts = []
    for rank in range(tp):
        with torch.device("meta"):
            model = causal_lm_class(config)(config)
        shard_model(model, group=LayoutOnlyGroup(size=tp, rank=rank))
        layouts.append({name: (param.partition_dim, param.dense_index,
                               getattr(param, "dense_transposed", False))
                        for name, param in model.named_parameters(remove_duplicate=False)
                        if getattr(param, "tensor_model_parallel", False)})
    return layouts


def merge_tensor_parallel_tensor(name: str, parts: Sequence[torch.Tensor],
                                 layouts: Sequence[Mapping[str, tuple[int, torch.Tensor, bool]]]) -> torch.Tensor:
    """One dense tensor (transformers name and shape) from the tp ranks' parts of it, in rank order.

        layouts = shard_layouts(config, tp)                          # once per export
        dense = merge_tensor_parallel_tensor(name, [part_of_rank0, part_of_rank1], layouts)

    A sharded parameter's slices go back where `dense_index` says (vocab padding dropped, GPT-2's
    fused q|k|v rows re-interleaved; Conv1D weights transposed back to [in, out]); a replicated
    tensor is rank 0's and must be equal on every rank. Only these parts are held, so an export
    merges one parameter at a time.
    """
    first = parts[0]
    if name not in layouts[0]:
        for rank, part in enumerate(parts[1:], start=1):
            if not torch.equal(part, first):
                raise ValueError(f"{name}: the replicated tensor differs between tensor ranks 0 and {rank}")
        return first
    dim, _, transposed = layouts[0][name]
    size = 1 + max(int(layout[name][1].max()) for layout in layouts)
    shape = list(first.shape)
    shape[dim] = size
    dense = first.new_empty(shape)
    filled = torch.zeros(size, dtype=torch.bool)  # host: export merges host tensors
    for layout, part in zip(layouts, parts):
        index = layout[name][1]
        kept = (index >= 0).nonzero().flatten()
        dense.index_copy_(dim, index[kept], part.index_select(dim, kept))
        filled[index[kept]] = True
    if not filled.all():
        raise ValueError(f"{name}: the shards cover {int(filled.sum())} of {size} slices")
    return dense.t().contiguous() if transposed else dense
