"""HF causal LM -> `deepspeed.pipe.LayerSpec` list -> `deepspeed.pipe.PipelineModule`.

    model = build_model(source, config, seed=run.train.seed)       # the dense model: its weights
    pipe = build_pipeline_module(model, num_stages=2, partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(),
                                           config=ds_config)        # ZeRO stage 0 or 1
    if engine.global_rank == 0:
        print(stage_table(pipe))
    batches = iter([(input_ids, input_ids)] * grad_accum)             # (inputs, labels) per micro-batch
    loss = engine.train_batch(batches)    # mean loss of the step, on every rank of the pipeline

The model becomes a flat list of layers, DeepSpeed cuts it into stages:

    index    Llama family (llama, mistral, qwen2)      GPT-2
    0        model.embed_tokens                        transformer.wte + transformer.wpe
    1..N     model.layers.{i-1}                        transformer.h.{i-1}
    N+1      model.norm                                transformer.ln_f
    N+2      lm_head (or the tied embedding)           lm_head = transformer.wte (tied)

What travels between stages is one tensor, the hidden states [batch, seq, hidden]; the first stage
takes the token ids, the last gives the logits, and models/loss.py's `causal_lm_loss(logits, labels)`
(HF's loss: shifted cross entropy, mean over tokens) runs on the last stage with labels = the token ids.
Each decoder layer rebuilds what HF's model computes once for all layers, from the sequence
length alone: position_ids = arange(seq), the rotary cos/sin (Llama family) and the causal mask
(`create_causal_mask`, None under sdpa, which then uses is_causal). Tied input/output embeddings
(GPT-2; Llama with tie_word_embeddings) are two `TiedLayerSpec`s under the key "embed": DeepSpeed
keeps one copy on the first and one on the last stage and all-reduces their gradients.

Weights: built from a model, every LayerSpec holds *references* to the dense model's submodules,
so each stage starts from exactly the dense model's weights (and trains them in place); the dense
model keeps the other stages' layers alive, which is fine for models that fit one host's memory.
Built from a config alone, the layers are new (random) modules of the same structure: enough for
partitioning, stage tables and mapping checkpoints back to HF names.

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
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from dsframework.errors import UserError
from dsframework.models.families import SUPPORTED, family_of
from dsframework.models.hf import causal_lm_class
from dsframework.models.loss import causal_lm_loss, vocab_parallel_token_loss
from dsframework.parallel.tensor import VocabParallelEmbedding, VocabParallelLMHead
from dsframework.runtime_facts import partition_balanced, partition_uniform

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


def _positions(hidden_states: torch.Tensor) -> torch.Tensor:
    """position_ids [1, seq], as HF's model builds them without a cache."""
    return torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)


def _uses_sliding_window(config: Any, layer_idx: int) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # qwen2: per-layer types
        return layer_types[layer_idx] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None  # mistral; llama has none


def _causal_mask(config: Any, hidden_states: torch.Tensor, position_ids: torch.Tensor, *,
                 sliding: bool) -> torch.Tensor | None:
    """The mask HF's model would pass its layers (None under sdpa: it uses is_causal instead)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make(config=config, inputs_embeds=hidden_states, attention_mask=None, cache=None,
                position_ids=position_ids)


def _hf_class(config: Any, suffix: str) -> type:
    """The transformers class `<Prefix><suffix>` of the config's architecture (e.g. LlamaRMSNorm)."""
    cls = causal_lm_class(config)
    prefix = cls.__name__.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
    return getattr(sys.modules[cls.__module__], prefix + suffix)


class LlamaEmbeddingPipe(nn.Module):
    """First stage: token ids [b, s] -> hidden states [b, s, h] (model.embed_tokens)."""

    def __init__(self, config: _Ref, embed_tokens: _Ref | None = None):
        super().__init__()
        cfg = config.obj
        self.embed_tokens = _unref(embed_tokens)
        if self.embed_tokens is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class LlamaDecoderLayerPipe(nn.Module):
    """One decoder layer; rebuilds positions, rotary cos/sin and the causal mask from the input."""

    def __init__(self, config: _Ref, layer_idx: int, layer: _Ref | None = None,
                 rotary_emb: _Ref | None = None):
        super().__init__()
        self.config = cfg = config.obj
        self.sliding = _uses_sliding_window(cfg, layer_idx)
        self.layer = _unref(layer)
        if self.layer is None:
            self.layer = _hf_class(cfg, "DecoderLayer")(cfg, layer_idx)
        self.rotary_emb = _unref(rotary_emb)  # shared with the other layers: buffers only
        if self.rotary_emb is None:
            self.rotary_emb = _hf_class(cfg, "RotaryEmbedding")(config=cfg)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        position_ids = _positions(hidden_states)
        return self.layer(hidden_states,
                          attention_mask=_causal_mask(self.config, hidden_states, position_ids,
                                                      sliding=self.sliding),
                          position_ids=position_ids,
                          position_embeddings=self.rotary_emb(hidden_states, position_ids=position_ids))


class GPT2EmbeddingPipe(nn.Module):
    """First stage: token ids -> wte(ids) + wpe(positions), dropout. With positions=False (the
    tied head's copy on the last stage) it holds only wte."""

    def __init__(self, config: _Ref, wte: _Ref | None = None, wpe: _Ref | None = None,
                 drop: _Ref | None = None, *, positions: bool = True):
        super().__init__()
        cfg = config.obj
        self.wte = _unref(wte)
        if self.wte is None:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if positions:
            self.wpe = _unref(wpe)
            if self.wpe is None:
                self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            self.drop = _unref(drop)
            if self.drop is None:
                self.drop = nn.Dropout(cfg.embd_pdrop)

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.wte

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids)
        return self.drop(hidden_states + self.wpe(_positions(hidden_states)))


class GPT2DecoderLayerPipe(nn.Module):
    """One GPT-2 block; rebuilds the causal mask from the input."""

    def __init__(self, config: _Ref, layer_idx: int, layer: _Ref | None = None):
        super().__init__()
        self.config = cfg = config.obj
        self.layer = _unref(layer)
        if self.layer is None:
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            self.layer = GPT2Block(cfg, layer_idx=layer_idx)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        position_ids = _positions(hidden_states)
        mask = _causal_mask(self.config, hidden_states, position_ids, sliding=False)
        return self.layer(hidden_states, attention_mask=mask, position_ids=position_ids)


class FinalNormPipe(nn.Module):
    """The final norm (model.norm, transformer.ln_f)."""

    def __init__(self, config: _Ref, norm: _Ref | None = None):
        super().__init__()
        cfg = config.obj
        self.norm = _unref(norm)
        if self.norm is None:
            if cfg.model_type == "gpt2":
                self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
            else:
                self.norm = _hf_class(cfg, "RMSNorm")(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)


class LMHeadPipe(nn.Module):
    """The untied output projection: hidden states -> logits (lm_head)."""

    def __init__(self, config: _Ref, lm_head: _Ref | None = None):
        super().__init__()
        cfg = config.obj
        self.lm_head = _unref(lm_head)
        if self.lm_head is None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


def tied_lm_head(embedding: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The tied head's forward_fn: logits = hidden @ token_embedding.weight^T (as nn.Linear);
    with a vocab-parallel embedding, this rank's vocab slice of them (VocabParallelLMHead)."""
    if isinstance(embedding.token_embedding, VocabParallelEmbedding):
        return VocabParallelLMHead.tied_to(embedding.token_embedding)(hidden_states)
    return F.linear(hidden_states, embedding.token_embedding.weight)


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


def _family(config: Any) -> str:
    family = family_of(config.model_type)
    if family is None:
        raise UserError("model.name", config.model_type, "has no pipeline adapter (parallel.pp > 1)",
                        f"use a model of type {', '.join(SUPPORTED)}, or set parallel.pp=1")
    return family


def _is_tied(model: Any, config: Any) -> bool:
    if model is not None:
        return model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return bool(getattr(config, "tie_word_embeddings", False))


def pipeline_layer_specs(model_or_config: Any) -> list:
    """The causal LM as DeepSpeed LayerSpecs: embedding, one per decoder layer, final norm, head.

    From a model, the specs' modules reference its submodules (same weights, trained in place);
    from a config, they are new modules of the same structure. Every spec carries `hf_label` (its
    HF name) and `hf_names` ({wrapper child: HF module paths}) for tables and checkpoint export.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    is_model = isinstance(model_or_config, nn.Module)
    model = model_or_config if is_model else None
    config = model.config if is_model else copy.deepcopy(model_or_config)
    if not is_model and config._attn_implementation is None:
        config._attn_implementation = "sdpa"  # what build_model's models use on this torch
    family = _family(config)
    tied = _is_tied(model, config)
    cfg = _Ref(config, f"<{config.model_type} config>")

    def ref(path: str) -> _Ref | None:
        return None if model is None else _Ref(model.get_submodule(path), path)

    if family == "llama":
        embed_label, embed_cls, tied_child = "model.embed_tokens", LlamaEmbeddingPipe, "embed_tokens"
        embed_args, head_args, head_kwargs = (ref("model.embed_tokens"),), (ref("model.embed_tokens"),), {}
        embed_hf = {"embed_tokens": ("model.embed_tokens",)}
        layer_path, layer_cls, norm_path = "model.layers", LlamaDecoderLayerPipe, "model.norm"
        layer_extra, layer_extra_hf = (ref("model.rotary_emb"),), {"rotary_emb": ()}  # buffers only
    else:
        embed_label, embed_cls, tied_child = "transformer.wte+wpe", GPT2EmbeddingPipe, "wte"
        embed_args = (ref("transformer.wte"), ref("transformer.wpe"), ref("transformer.drop"))
        head_args, head_kwargs = (ref("transformer.wte"),), {"positions": False}  # no wpe on the head
        embed_hf = {"wte": ("transformer.wte",), "wpe": ("transformer.wpe",), "drop": ()}
        layer_path, layer_cls, norm_path = "transformer.h", GPT2DecoderLayerPipe, "transformer.ln_f"
        layer_extra, layer_extra_hf = (), {}

    layers = [_spec(LayerSpec(layer_cls, cfg, i, ref(f"{layer_path}.{i}"), *layer_extra),
                    label=f"{layer_path}.{i}", hf={"layer": (f"{layer_path}.{i}",), **layer_extra_hf})
              for i in range(config.num_hidden_layers)]
    norm = _spec(LayerSpec(FinalNormPipe, cfg, ref(norm_path)), label=norm_path, hf={"norm": (norm_path,)})
    if tied:  # one weight, two places: the embedding's file also names lm_head.weight
        embed_hf[tied_child] = (*embed_hf[tied_child], "lm_head")
        attr = [f"{tied_child}.weight"]
        embed = TiedLayerSpec(TIED_KEY, embed_cls, cfg, *embed_args, tied_weight_attr=attr)
        head = _spec(TiedLayerSpec(TIED_KEY, embed_cls, cfg, *head_args, forward_fn=tied_lm_head,
                                   tied_weight_attr=attr, **head_kwargs),
                     label=f"lm_head (tied to {tied_child})", hf={tied_child: embed_hf[tied_child]})
    else:
        embed = LayerSpec(embed_cls, cfg, *embed_args)
        head = _spec(LayerSpec(LMHeadPipe, cfg, ref("lm_head")), label="lm_head", hf={"lm_head": ("lm_head",)})
    return [_spec(embed, label=embed_label, hf=embed_hf), *layers, norm, head]


def is_decoder_layer(spec: Any) -> bool:
    """True for the specs of transformer layers (what partition_method='type:DecoderLayer' counts)."""
    return spec.typename in (LlamaDecoderLayerPipe, GPT2DecoderLayerPipe)


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


def pipeline_state_dict_to_hf(layer_states: Mapping[int, Mapping[str, torch.Tensor]],
                              specs: list) -> dict[str, torch.Tensor]:
    """HF state dict from per-layer state dicts ({layer index: that layer's state_dict}).

    E.g. layer 3's `layer.self_attn.q_proj.weight` -> `model.layers.2.self_attn.q_proj.weight`;
    a tied embedding's `embed_tokens.weight` -> `model.embed_tokens.weight` and `lm_head.weight`.
    """
    out: dict[str, torch.Tensor] = {}
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
