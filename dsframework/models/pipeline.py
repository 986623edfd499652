"""HF causal LM -> `deepspeed.pipe.LayerSpec` list -> `deepspeed.pipe.PipelineModule`.

    model = build_model(source, config, seed=run.train.seed)       # the dense model: its weights
    pipe = build_pipeline_module(model, num_stages=2, partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(),
                                           config=ds_config)        # ZeRO stage 0 or 1
    if engine.global_rank == 0:
        print(stage_table(pipe))
    batches = iter([(input_ids, input_ids)] * grad_accum)             # (inputs, labels) per micro-batch
    loss = engine.train_batch(batches)    # mean loss of the step, on every rank of the pipeline

The model becomes a flat list of layers, cut where the architecture's pipeline plan
(`base_model_pp_plan`, models/plans.py) says; DeepSpeed cuts the list into stages:

    index    Llama (and 90 other plans)           GPT-2 (dsf's plan)        GPT-NeoX
    0        model.embed_tokens                   transformer.wte+wpe+drop  gpt_neox.embed_in+emb_dropout
    1..N     model.layers.{i-1}                   transformer.h.{i-1}       gpt_neox.layers.{i-1}
    N+1      model.norm                           transformer.ln_f          gpt_neox.final_layer_norm
    N+2      lm_head (or the tied embedding)      lm_head = wte (tied)      embed_out

What travels between stages is one tensor, the hidden states [batch, seq, hidden]; the first stage
takes the token ids, the last gives the logits (post-processed as the model's own forward does:
Gemma's softcapping, Granite's scaling; models/logits.py), and models/loss.py's
`causal_lm_loss(logits, labels)` runs on the last stage with labels = the token ids.

What an architecture's forward does between those modules (embedding scale, learned positions,
rotary variants such as Gemma 3's local and global ones, per-layer attention types, sliding
windows, masks) is not re-implemented per architecture: each stage runs the model's own forward
on a *skeleton* of the base model whose decoder layers are stubs (`_LayerStub`). The stub of the
stage's layer stops that forward and hands back the arguments it was about to pass (mask,
position ids, cos/sin), and the stage calls its real layer with them; the final-norm stage feeds
its input in after the last stub and lets the forward finish. The skeleton's weights that other
stages hold are stubs too, so a stage holds only its own layers; an architecture whose forward
uses a weight outside its pipeline plan is refused in one line. Tied input/output embeddings
(GPT-2; Llama with tie_word_embeddings) are two `TiedLayerSpec`s under the key "embed": DeepSpeed
keeps one copy on the first and one on the last stage and all-reduces their gradients.

Weights: built from a model, every LayerSpec holds *references* to the dense model's submodules,
so each stage starts from exactly the dense model's weights (and trains them in place); the dense
model keeps the other stages' layers alive, which is fine for models that fit one host's memory.
Built from a config alone, the layers are those of a weightless (meta-device) model of the same
structure: enough for partitioning, stage tables and mapping checkpoints back to HF names.

Checkpoints: PipelineModule saves layer i as `layer_{i:02d}-model_states.pt` (its wrapper's
state_dict); `hf_names(spec)` gives, per child of the wrapper, the HF module paths it maps to:

    hf = pipeline_state_dict_to_hf(read_layer_states(ckpt_dir / tag), pipeline_layer_specs(config))
    model.load_state_dict(hf)                                       # transformers' own names

(The tied head's layer is never written by DeepSpeed; the embedding's file maps to both
`transformer.wte.weight` and `lm_head.weight`.)
"""
from __future__ import annotations

import copy
import functools
import inspect
import re
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar, cast

import torch
from torch import nn
from torch.nn import functional as F

from dsframework.errors import UserError
from dsframework.layout import ParallelDims
from dsframework.models.experts import check_expert_parallel
from dsframework.models.hf import causal_lm_class, is_tied, module_path
from dsframework.models.logits import logit_postprocess
from dsframework.models.loss import causal_lm_loss, vocab_parallel_token_loss
from dsframework.models.plans import (
    PipelinePlan,
    architecture_plan,
    check_architecture,
    check_context_parallel,
    infer_pipeline_plan,
    pipeline_refusal,
)
from dsframework.models.tensor_parallel import shard_model
from dsframework.models.tiny import tiny_twin
from dsframework.parallel.tensor import (
    LayoutOnlyGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from dsframework.runtime_facts import partition_balanced, partition_uniform
from dsframework.types import HFConfig

TIED_KEY = "embed"


# --- stage modules ------------------------------------------------------------------------------

class _Ref:
    """An argument handed to a LayerSpec by reference, with a short name for logs and tables."""

    __slots__ = ("obj", "label")

    def __init__(self, obj: Any, label: str):
        self.obj, self.label = obj, label

    def __repr__(self) -> str:
        return self.label


def _unref(ref: _Ref | None) -> Any:
    return None if ref is None else ref.obj


class _Stop(Exception):
    """Raised by a layer stub to leave the base model's forward at the layer a stage runs, with
    the arguments the model's forward passes that layer."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args, self.kwargs = args, kwargs


class _LayerStub(nn.Module):
    """Decoder layer `index` in a stage's skeleton of the base model: passes the hidden states on,
    stops the forward at the stage's layer (`plan["stop"]`), or hands the stage's input to the
    rest of the forward after the last layer (`plan["inject"]`)."""

    def __init__(self, index: int, plan: dict, layer: nn.Module, returns_tuple: bool):
        super().__init__()
        self.index, self.plan, self.returns_tuple = index, plan, returns_tuple
        for name, value in vars(layer).items():  # what the forward may read off a layer (Dory: attention_type)
            if not name.startswith("_") and isinstance(value, (str, int, float, bool, type(None))):
                setattr(self, name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.index == self.plan.get("stop"):
            raise _Stop(args, kwargs)
        hidden = self.plan["hidden"] if self.index == self.plan.get("inject") else (
            args[0] if args else kwargs["hidden_states"])
        return (hidden, None) if self.returns_tuple else hidden


class _ShapeStub(nn.Module):
    """A module this stage does not hold, in its skeleton: an embedding gives zeros of its output
    shape (GPT-2's learned positions, added to hidden states the stage replaces anyway), anything
    else passes its input on."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.dim = getattr(module, "embedding_dim", None)
        self.dtype = next(module.parameters()).dtype

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.dim is None:
            return x
        return torch.zeros(*x.shape, self.dim, dtype=self.dtype, device=x.device)


@functools.cache
def _layers_return_tuples(base_class: type, layers: str) -> bool:
    """Whether the base model's forward unpacks what its layers return (`hidden_states, weights =
    layer(...)`, `outputs[0]`: Bamba) rather than taking a tensor: read from the loop in its source,
    since return annotations are stale (Gemma 3's says tuple and returns a tensor)."""
    try:
        source = inspect.getsource(base_class.forward)
    except (OSError, TypeError):
        return False
    loop = re.search(rf"for\s+(?:\w+\s*,\s*)?(\w+)\s+in\s+[^\n]*self\.{layers}\b", source)
    if loop is None:
        return False
    call = re.search(rf"^\s*([\w, ]+?)\s*=\s*{loop.group(1)}\(", source[loop.end():], re.M)
    if call is None:
        return False
    target = call.group(1)
    return "," in target or re.search(rf"\b{target}\[0\]", source) is not None


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _skeleton(base: nn.Module, plan: PipelinePlan, *, keep: tuple[str, ...]) -> tuple[nn.Module, dict]:
    """(a copy of the base model whose decoder layers are stubs and whose parameter-holding
    children other than `keep` are `_ShapeStub`s, its stubs' shared plan). Running the model's own
    forward on it computes what the architecture passes each layer (positions, rotary variants,
    per-layer masks and sliding windows, embedding scale) from its own code; not registered as a
    child of a stage, so it adds no parameters."""
    stub_plan: dict = {}
    skeleton = copy.copy(base)
    skeleton.__dict__.update(_parameters={}, _modules=dict(base._modules), _forward_hooks={},
                             _forward_pre_hooks={}, _backward_hooks={})
    for name, child in base.named_children():
        if name == plan.layers:
            tuples = _layers_return_tuples(type(base), name)
            skeleton._modules[name] = nn.ModuleList(_LayerStub(i, stub_plan, layer, tuples)
                                                    for i, layer in enumerate(cast(nn.ModuleList, child)))
        elif name not in keep and _has_parameters(child):
            skeleton._modules[name] = _ShapeStub(child)
    return skeleton, stub_plan


def _run_base(skeleton: nn.Module, stub_plan: dict, **inputs: Any) -> Any:
    """The base model's own forward on the skeleton: a `_Stop` (the stop layer's arguments), or
    its output."""
    try:
        return type(skeleton).forward(skeleton, use_cache=False, **inputs)
    except _Stop as stop:
        return stop
    finally:
        stub_plan.pop("hidden", None)


def _parameterless_children(base: nn.Module) -> dict[str, nn.Module]:
    """The base model's children without parameters (rotary embeddings: buffers only), which
    every stage's skeleton uses; registered on each stage so they move with it to its device."""
    return {name: child for name, child in base.named_children() if not _has_parameters(child)}


class _StagePart(nn.Module):
    """What the stage modules share: the base model's children they hold, its skeleton."""

    skeleton: nn.Module  # set by _hold, outside nn.Module's bookkeeping
    stub_plan: dict

    def _hold(self, base: nn.Module, plan: PipelinePlan, names: tuple[str, ...]) -> None:
        for name, child in _parameterless_children(base).items():
            self.add_module(name, child)
        for name in names:
            self.add_module(name, base.get_submodule(name))
        skeleton, stub_plan = _skeleton(base, plan, keep=names)
        object.__setattr__(self, "skeleton", skeleton)  # not a child: its modules are held above or elsewhere
        object.__setattr__(self, "stub_plan", stub_plan)


class EmbeddingPipe(_StagePart):
    """First stage: token ids [b, s] -> the hidden states the model's forward hands its first
    decoder layer (embedding, and whatever the architecture does next: scaling, positions, dropout).
    With `head_copy`, only the token embedding (the tied head's copy on the last stage)."""

    def __init__(self, config: _Ref, base: _Ref, plan: _Ref, token: str, head_copy: bool = False):
        super().__init__()
        self.token = token
        if head_copy:
            self.add_module(token, base.obj.get_submodule(token))
        else:
            self._hold(base.obj, plan.obj, plan.obj.first)

    @property
    def token_embedding(self) -> nn.Module:
        return getattr(self, self.token)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.stub_plan["stop"] = 0
        return _run_base(self.skeleton, self.stub_plan, input_ids=input_ids).args[0]


def _whole_length(hidden_states: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """What the skeleton's forward takes for the hidden states (it reads their shape for the mask
    and the positions): with sequence parallelism, between layers each tensor rank holds a slice of
    the sequence, so a stand-in of the whole length (a broadcast view: nothing is copied)."""
    ranks = getattr(layer, "sequence_ranks", 1)
    if ranks == 1 or getattr(layer, "takes_whole_sequence", False):
        return hidden_states
    b, s, h = hidden_states.shape
    return hidden_states[:, :1].expand(b, s * ranks, h)


class DecoderLayerPipe(_StagePart):
    """Decoder layer `index`, called with the arguments the model's own forward would give it
    (found by running that forward on the stage's skeleton up to this layer)."""

    def __init__(self, config: _Ref, base: _Ref, plan: _Ref, index: int):
        super().__init__()
        self.index = index
        self._hold(base.obj, plan.obj, ())
        self.layer = getattr(base.obj, plan.obj.layers)[index]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.stub_plan["stop"] = self.index
        stop = _run_base(self.skeleton, self.stub_plan, inputs_embeds=_whole_length(hidden_states, self.layer))
        args, kwargs = stop.args, dict(stop.kwargs)
        if args:
            args = (hidden_states, *args[1:])
        else:
            kwargs["hidden_states"] = hidden_states
        out = self.layer(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # (hidden states, attention weights): Bamba


class FinalNormPipe(_StagePart):
    """The base model's forward after its last decoder layer (the final norm), on the stage's input."""

    def __init__(self, config: _Ref, base: _Ref, plan: _Ref):
        super().__init__()
        self._hold(base.obj, plan.obj, plan.obj.last)
        self.last_layer = len(getattr(base.obj, plan.obj.layers)) - 1
        # (not a child: another stage's layer; object.__setattr__ keeps it out of nn.Module's bookkeeping)
        object.__setattr__(self, "layer_before", getattr(base.obj, plan.obj.layers)[-1])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.stub_plan.update(inject=self.last_layer, hidden=hidden_states)
        shape_of = _whole_length(hidden_states, cast(nn.Module, self.layer_before))
        return _run_base(self.skeleton, self.stub_plan, inputs_embeds=shape_of).last_hidden_state


class LMHeadPipe(nn.Module):
    """The untied output projection: hidden states -> logits, post-processed as the model's own
    forward does (models/logits.py)."""

    post: Callable[[torch.Tensor], torch.Tensor] | None  # set outside nn.Module's bookkeeping

    def __init__(self, config: _Ref, lm_head: _Ref, post: _Ref):
        super().__init__()
        self.lm_head = lm_head.obj
        object.__setattr__(self, "post", post.obj)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        return logits if self.post is None else self.post(logits)


def tied_lm_head(embedding: EmbeddingPipe, hidden_states: torch.Tensor, post: Any = None) -> torch.Tensor:
    """The tied head's forward_fn: logits = hidden @ token_embedding.weight^T (as nn.Linear);
    with a vocab-parallel embedding, this rank's vocab slice of them (VocabParallelLMHead); then
    the model's own post-processing `post` (models/logits.py), if any."""
    if isinstance(embedding.token_embedding, VocabParallelEmbedding):
        logits = VocabParallelLMHead.tied_to(embedding.token_embedding)(hidden_states)
    else:
        logits = F.linear(hidden_states, cast(torch.Tensor, embedding.token_embedding.weight))
    return logits if post is None else post(logits)


def pipeline_loss_fn(model: Any) -> Any:
    """The last stage's loss(logits, labels): models/loss.py's `causal_lm_loss`, with the
    vocab-parallel per-token loss for a model whose layers were sharded by
    `models.tensor_parallel.shard_model` (tp x pp)."""
    embedding = model.get_input_embeddings() if model is not None else None
    if isinstance(embedding, VocabParallelEmbedding):
        token_loss = vocab_parallel_token_loss(group=embedding.group, vocab_size=embedding.num_embeddings)
        return functools.partial(causal_lm_loss, token_loss=token_loss)
    return causal_lm_loss


# --- the layer specs ----------------------------------------------------------------------------

def _spec(spec: Any, *, label: str, hf: dict[str, tuple[str, ...]]) -> Any:
    """Annotate a LayerSpec with its HF name (for tables) and its children's HF module paths."""
    spec.hf_label, spec.hf_names = label, hf
    return spec


def _child_name(parent: nn.Module, module: nn.Module) -> str:
    return next(name for name, child in parent.named_children() if child is module)


def _checked_plan(model: Any) -> PipelinePlan:
    """The architecture's pipeline plan, or UserError: no plan, or a child with parameters that
    the plan leaves out (its forward would use weights no stage holds)."""
    model_type, plan, base = model.config.model_type, architecture_plan(model.config), model.base_model
    if plan.pp_problem:
        raise pipeline_refusal(model_type, plan.pp_problem, working=plan.working)
    plan = plan.pp or infer_pipeline_plan(list(base.named_children()), model.config.num_hidden_layers)
    if plan is None:
        raise pipeline_refusal(model_type, "has no pipeline plan, and no list of its decoder layers")
    planned = {*plan.first, plan.layers, *plan.last}
    outside = [name for name, child in base.named_children() if name not in planned and _has_parameters(child)]
    if outside or next(base.parameters(recurse=False), None) is not None:
        raise pipeline_refusal(model_type, "uses weights outside its pipeline plan "
                               f"({', '.join(outside) or 'its own parameters'})")
    if model.get_input_embeddings() is not base.get_submodule(plan.first[0] if plan.first else ""):
        raise pipeline_refusal(model_type, "has a pipeline plan that does not start with its token embedding")
    return plan


def _model_of(model_or_config: Any) -> Any:
    """The causal LM (a config gets a weightless one, on the meta device: enough for partitioning,
    tables and checkpoint names)."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    config = copy.deepcopy(model_or_config)  # (transformers picks its attention: sdpa where the class has it)
    with torch.device("meta"):
        return causal_lm_class(config)(config)


class LayerDescription:
    """What a DeepSpeed LayerSpec records (its module class, arguments, HF names), without
    importing DeepSpeed: the planner counts stages from these (`dsf plan` stays a light process)."""

    def __init__(self, typename: type, *args: Any, **kwargs: Any):
        self.typename, self.args, self.kwargs = typename, args, kwargs


class TiedLayerDescription(LayerDescription):
    def __init__(self, key: str, typename: type, *args: Any, **kwargs: Any):
        super().__init__(typename, *args, **kwargs)
        self.key = key


def pipeline_layer_descriptions(model_or_config: Any) -> list:
    """`pipeline_layer_specs` as `LayerDescription`s (same order, `hf_label`, `hf_names`)."""
    return pipeline_layer_specs(model_or_config, kinds=(LayerDescription, TiedLayerDescription))


def pipeline_layer_specs(model_or_config: Any, *, kinds: tuple[type, type] | None = None) -> list:
    """The causal LM as DeepSpeed LayerSpecs: embedding, one per decoder layer, final norm, head,
    cut where the architecture's pipeline plan says (models/plans.py).

    From a model, the specs' modules reference its submodules (same weights, trained in place);
    from a config, those of a weightless (meta) model of the same structure. Every spec carries
    `hf_label` (its HF name) and `hf_names` ({wrapper child: HF module paths}) for tables and
    checkpoint export.
    """
    if kinds is None:
        from deepspeed.pipe import LayerSpec, TiedLayerSpec
    else:
        LayerSpec, TiedLayerSpec = kinds  # noqa: N806 - DeepSpeed's names, standing in
    model = _model_of(model_or_config)
    plan, base = _checked_plan(model), model.base_model
    prefix = module_path(model, base)
    token = _child_name(base, model.get_input_embeddings())
    cfg, base_ref, plan_ref = _Ref(model.config, f"<{model.config.model_type} config>"), _Ref(base, prefix), \
        _Ref(plan, "<pipeline plan>")
    post = _Ref(None if model_or_config is not model else logit_postprocess(model), "<logits>")
    shared = {name: () for name in _parameterless_children(base)}  # buffers only: no HF tensors
    hf = {name: (f"{prefix}.{name}",) for name in (*plan.first, *plan.last)}
    embed_hf = {**shared, **{name: hf[name] for name in plan.first}}
    layers = [_spec(LayerSpec(DecoderLayerPipe, cfg, base_ref, plan_ref, i), label=f"{prefix}.{plan.layers}.{i}",
                    hf={**shared, "layer": (f"{prefix}.{plan.layers}.{i}",)})
              for i in range(len(getattr(base, plan.layers)))]
    norm = _spec(LayerSpec(FinalNormPipe, cfg, base_ref, plan_ref), label=f"{prefix}.{'+'.join(plan.last)}",
                 hf={**shared, **{name: hf[name] for name in plan.last}})
    head_name = _child_name(model, model.get_output_embeddings())
    if is_tied(model):  # one weight, two places: the embedding's file also names the head
        embed_hf[token] = (*embed_hf[token], head_name)
        attr = [f"{token}.weight"]
        embed = TiedLayerSpec(TIED_KEY, EmbeddingPipe, cfg, base_ref, plan_ref, token, tied_weight_attr=attr)
        head = _spec(TiedLayerSpec(TIED_KEY, EmbeddingPipe, cfg, base_ref, plan_ref, token, True,
                                   forward_fn=functools.partial(tied_lm_head, post=post.obj), tied_weight_attr=attr),
                     label=f"{head_name} (tied to {token})", hf={token: embed_hf[token]})
    else:
        embed = LayerSpec(EmbeddingPipe, cfg, base_ref, plan_ref, token)
        head = _spec(LayerSpec(LMHeadPipe, cfg, _Ref(model.get_output_embeddings(), head_name), post),
                     label=head_name, hf={"lm_head": (head_name,)})
    return [_spec(embed, label=f"{prefix}.{'+'.join(plan.first)}", hf=embed_hf), *layers, norm, head]


def check_stages_reproduce_forward(config: HFConfig) -> None:
    """UserError unless the stages, run one after the other, give the model's own logits, on a
    tiny random twin of `config` (its flags and layer kinds, tiny sizes; models/tiny.py): the glue
    between the plan's modules (positions, masks, rotary variants, scales) is checked for this
    architecture before any rank starts, not assumed. About 0.1 s."""
    twin = tiny_twin(config)
    twin._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = causal_lm_class(twin)(twin).float().eval()
        input_ids = torch.randint(0, twin.vocab_size, (2, 16))  # host: the check runs a tiny twin on the CPU
    with torch.no_grad():
        want, got = model(input_ids=input_ids).logits, input_ids
        for spec in pipeline_layer_specs(model):
            module = spec.build()
            got = spec.forward_fn(module, got) if getattr(spec, "forward_fn", None) else module(got)
    worst = (got - want).abs().max().item()
    if not worst <= 1e-4 * max(1.0, want.abs().max().item()):
        raise pipeline_refusal(config.model_type, f"has a forward its stages do not reproduce (logits differ by "
                               f"{worst:.3g} on a tiny random twin)")


def check_model_parallelism(config: HFConfig, dims: ParallelDims, *, seq_len: int | None = None) -> None:
    """UserError (one line) before any rank starts when `config`'s architecture cannot run at
    dims.tp / dims.pp: no plan, a style dsf lacks, heads tp does not divide (models/plans.py); a
    style applied to a module it cannot split (the plan run on a weightless model, rank 0's
    layout); a forward that uses weights outside its pipeline plan (the stages cut from it) or
    that its stages do not reproduce (`check_stages_reproduce_forward`); an attention context
    parallelism would change (models/plans.py `check_context_parallel`); experts that expert
    parallelism cannot split (models/experts.py `check_expert_parallel`)."""
    check_architecture(config, tp=dims.tp, pp=dims.pp)
    check_context_parallel(config, cp=dims.cp, seq_len=seq_len)
    check_expert_parallel(config, ep=dims.ep, autoep=dims.autoep)
    if dims.tp > 1:
        shard_model(_model_of(config), group=LayoutOnlyGroup(size=dims.tp, rank=0))
    if dims.pp > 1:
        pipeline_layer_specs(config)
        check_stages_reproduce_forward(config)


def is_decoder_layer(spec: Any) -> bool:
    """True for the specs of transformer layers (what partition_method='type:DecoderLayer' counts)."""
    return spec.typename is DecoderLayerPipe


# --- partitioning -------------------------------------------------------------------------------

def layer_parameter_counts(specs: list) -> list[int]:
    """Trainable parameters of each spec's module, as DeepSpeed's 'parameters' method counts them."""
    return [sum(p.numel() for p in spec.build().parameters() if p.requires_grad) for spec in specs]


def partition_layers(specs: list, num_stages: int, method: str = "parameters") -> list[int]:
    """Stage boundaries (stage s holds layers parts[s]:parts[s+1]), as PipelineModule computes them.

    Pure (no process group): DeepSpeed's partition_uniform/partition_balanced as
    PipelineModule._partition_layers calls them, from runtime_facts (the planner's stage shapes
    use the same; a unit test pins them to DeepSpeed's), so a table or a plan can be made before
    any rank starts.
    """
    method_l = method.lower()
    if method_l == "uniform":
        parts = partition_uniform(len(specs), num_stages)
    elif method_l == "parameters":
        parts = partition_balanced(layer_parameter_counts(specs), num_stages)
    elif method_l.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(spec.typename.__name__) else 0 for spec in specs]
        if not any(weights):
            names = sorted({spec.typename.__name__ for spec in specs})
            raise UserError("parallel.partition_method", method, "matches no layer type",
                            f"match one of {', '.join(names)} (e.g. type:DecoderLayer)")
        parts = partition_balanced(weights, num_stages)
    else:
        raise UserError("parallel.partition_method", method, "is not a partition method",
                        "use parameters, uniform or type:<regex>")
    return [int(p) for p in parts]


def stage_module_paths(model: Any, *, num_stages: int, stage: int, partition_method: str = "parameters") -> list[str]:
    """The HF module paths whose parameters stage `stage` holds, found before any stage is built
    (on a meta model: the partition is computed from shapes alone, as PipelineModule does), so a
    rank materialises only its own layers:

        stage_module_paths(model, num_stages=2, stage=1)  # ['lm_head', 'model.layers.1', 'model.norm', ...]
    """
    specs = pipeline_layer_specs(model)
    parts = partition_layers(specs, num_stages, partition_method)
    _check_parts(parts, specs, partition_method)
    return sorted({path for spec in specs[parts[stage]:parts[stage + 1]]
                   for paths in hf_names(spec).values() for path in paths})


def _check_parts(parts: list[int], specs: list, method: str) -> None:
    """Every stage needs at least one layer (an empty stage would wait forever in the schedule)."""
    num_stages = len(parts) - 1
    empty = [s for s in range(num_stages) if parts[s + 1] <= parts[s]]
    if empty:
        raise UserError("parallel.pp", num_stages,
                        f"leaves stage {empty[0]} without layers ({len(specs)} layers, "
                        f"partition_method={method}, boundaries {parts})",
                        f"choose pp <= {len(specs)} or another partition_method")


# --- the pipeline module ------------------------------------------------------------------------

def build_pipeline_module(model: Any, *, num_stages: int, partition_method: str = "parameters",
                          activation_checkpoint_interval: int = 0, topology: Any = None,
                          seed: int | None = None) -> Any:
    """The dense HF causal LM as a `deepspeed.pipe.PipelineModule` (needs torch.distributed).

    `model` provides the weights (build_model's output): each stage's layers are its submodules.
    partition_method: 'parameters' (balance trainable parameters), 'uniform' (balance layer count)
    or 'type:<regex>' (balance layers whose wrapper class matches, e.g. 'type:DecoderLayer').
    activation_checkpoint_interval: recompute every k layers in the backward pass (0: off); only
    decoder layers are checkpointed (DeepSpeed's reentrant checkpoint would detach the embedding,
    whose input is integer token ids). topology: a deepspeed ProcessTopology (pipe x data x model)
    whose 'pipe' size is num_stages; default pipe x data over the world. seed: with a seed,
    DeepSpeed reseeds the RNG before every layer (seed_layers) for reproducible dropout.
    """
    from deepspeed.pipe import PipelineModule

    if num_stages < 1:
        raise UserError("parallel.pp", num_stages, "must be >= 1", "use a positive number of stages")
    specs = pipeline_layer_specs(model)  # the model's own limits first, then the world's
    _check_parts(partition_layers(specs, num_stages, partition_method), specs, partition_method)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
    if topology is None and world is not None and world % num_stages:
        raise UserError("parallel.pp", num_stages, f"does not divide the world size {world}",
                        f"choose pp in {{{', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}}}")
    if topology is not None and topology.get_dim("pipe") != num_stages:
        raise UserError("parallel.pp", num_stages, f"differs from the topology's pipe size "
                        f"{topology.get_dim('pipe')}", "build the topology with the same pp")
    if activation_checkpoint_interval < 0:
        raise UserError("activation_checkpoint_interval", activation_checkpoint_interval, "must be >= 0",
                        "use 0 (off) or k >= 1 (recompute every k layers)")
    decoder_types = sorted({spec.typename.__name__ for spec in specs if is_decoder_layer(spec)})
    pipe = PipelineModule(layers=specs, num_stages=None if topology is not None else num_stages,
                          topology=topology, loss_fn=pipeline_loss_fn(model),
                          partition_method=partition_method,
                          activation_checkpoint_interval=activation_checkpoint_interval,
                          checkpointable_layers=decoder_types, seed_layers=seed is not None,
                          base_seed=1234 if seed is None else seed)
    mark_stage_parameters_for_grad_norm(pipe)
    return pipe


def mark_stage_parameters_for_grad_norm(pipe: Any) -> None:
    """Make DeepSpeed's ZeRO-0 gradient clipping count every stage's gradients, once.

    Without ZeRO, DeepSpeed clips fp32 gradients with `runtime.utils.clip_grad_norm_`, which counts
    a gradient only on rank 0 of the model group (all pipeline stages and tensor ranks of one
    replica) unless the parameter is marked `model_parallel`: so stages > 0 were left out of the
    norm and clipping was too weak. Marking every parameter of tensor rank 0 that is not a tied
    copy (`ds_pipe_replicated`, counted on the first stage) makes that norm the full-model norm.
    ZeRO-1 and the bf16/fp16 optimizers count by tensor rank, where tensor rank 0 counts all
    parameters anyway, so the mark changes nothing there; tensor-sharded parameters carry their
    own `tensor_model_parallel` mark, which is taken off the tied copy (tp x pp: the last stage's
    copy of a vocab-parallel embedding would otherwise be counted twice; ZeRO-1 skips
    `ds_pipe_replicated` parameters before it looks at that mark).
    """
    tensor_rank = pipe.mpu().get_slice_parallel_rank()
    for param in pipe.parameters():
        if getattr(param, "ds_pipe_replicated", False):
            param.tensor_model_parallel = False
        elif tensor_rank == 0:
            param.model_parallel = True


# --- tables and HF names ------------------------------------------------------------------------

def _stage_table(specs: list, parts: list[int]) -> str:
    counts = layer_parameter_counts(specs)
    rows = [("stage", "layer", "name", "module", "parameters")]
    for stage in range(len(parts) - 1):
        start, stop = parts[stage], parts[stage + 1]
        for idx in range(start, stop):
            spec = specs[idx]
            tied = f" [tied:{spec.key}]" if hasattr(spec, "key") else ""
            rows.append((str(stage) if idx == start else "", str(idx), getattr(spec, "hf_label", "?") + tied,
                         spec.typename.__name__, f"{counts[idx]:,}"))
        rows.append(("", "", f"stage {stage} total", "", f"{sum(counts[start:stop]):,}"))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    lines = ["  ".join(cell.rjust(w) if c in (0, 1, 4) else cell.ljust(w)
                       for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def stage_table(module: Any, parts: list[int] | None = None) -> str:
    """A readable table: stage -> layers (index, HF name, wrapper, trainable parameters).

    `module` is a PipelineModule (its specs and partition), or a spec list with `parts`.
    Tied layers count their shared weight on each stage that holds a copy.
    """
    if isinstance(module, list):
        assert parts is not None, "a spec list needs its stage boundaries (partition_layers)"
        return _stage_table(module, parts)
    return _stage_table(module._layer_specs, list(module.parts))


def hf_names(spec: Any) -> dict[str, tuple[str, ...]]:
    """{child of the spec's wrapper module: the HF module paths its tensors belong to}."""
    return spec.hf_names


Value = TypeVar("Value")  # what a state dict maps names to


def pipeline_state_dict_to_hf(layer_states: Mapping[int, Mapping[str, Value]], specs: list) -> dict[str, Value]:
    """HF state dict from per-layer state dicts ({layer index: that layer's state_dict}).

    E.g. layer 3's `layer.self_attn.q_proj.weight` -> `model.layers.2.self_attn.q_proj.weight`;
    a tied embedding's `embed_tokens.weight` -> `model.embed_tokens.weight` and `lm_head.weight`.
    The values go through as they are (tensors; or the keys, to map names only: checkpoints/export.py).
    """
    out: dict[str, Value] = {}
    for idx, state in sorted(layer_states.items()):
        names = hf_names(specs[idx])
        for key, tensor in state.items():
            child, _, rest = key.partition(".")
            if child not in names:
                raise KeyError(f"layer {idx} ({specs[idx].typename.__name__}): no HF name for {key!r}")
            for prefix in names[child]:
                out[f"{prefix}.{rest}"] = tensor
    return out


_LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


def read_layer_states(tag_dir: str | Path, *, tensor_rank: int | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """{layer index: state_dict} from a pipeline checkpoint tag directory (layer_XX-*.pt files).

    With tensor parallelism each layer has one file per tensor rank (layer_XX-model_YY-...):
    pass `tensor_rank` to read that rank's shards.
    """
    states: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(Path(tag_dir).iterdir()):
        match = _LAYER_FILE.match(path.name)
        if not match:
            continue
        file_rank = int(match.group(2) or 0)  # layer_XX-model_00-...: DeepSpeed names the axis at tp 1 too
        if file_rank > 0 and tensor_rank is None:
            raise UserError("checkpoint", str(tag_dir), "holds tensor-parallel layer files (layer_XX-model_YY)",
                            "read them one tensor rank at a time (tensor_rank=)")
        if file_rank != (tensor_rank or 0):
            continue
        states[int(match.group(1))] = torch.load(path, map_location="cpu", weights_only=True)
    if not states:
        which = "" if tensor_rank is None else f" of tensor rank {tensor_rank}"
        raise UserError("checkpoint", str(tag_dir), f"holds no layer_XX-model_states.pt files{which}",
                        "point to a tag directory of a pipeline-parallel checkpoint")
    return states
