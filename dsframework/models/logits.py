"""What a transformers causal LM does to its logits after its output head, for the heads dsf
computes itself (the chunked loss, the tensor-parallel head, the pipeline's last stage).

    post = logit_postprocess(lm)     # None for Llama & co.; Gemma 2/3: ElementwisePost(softcap=30.0), ...
    logits = post(lm.lm_head(hidden)) if post is not None else lm.lm_head(hidden)
    head = processed_head(lm)        # the same as one callable: hidden -> post(head(hidden)), or the head itself
    extra = router_loss(lm, decoder_output)  # a mixture of experts: coef x its load-balancing loss, or None
    loss = chunked_causal_lm_loss(head, hidden, labels, chunk_tokens=512)   # == lm(ids, labels=labels).loss

Why from the model's own forward: the CausalLM forward is the reference for what its logits are
(Gemma 2/3's `final_logit_softcapping`, Granite's `/ logits_scaling`, Cohere's `* logit_scale`,
Falcon-H1's `* lm_head_multiplier`, whatever the next architecture adds). Once per model, the probe
runs that forward (`type(lm).forward`, so no hook runs and an instance-level forward such as
use_chunked_loss's is skipped) on random logits, with the decoder (`lm.base_model_prefix`) swapped
for a stub returning a [1, T, 1] hidden state and the output embeddings for a stub returning the
logits (`ThroughForward`); the modules are put back whatever happens (one call at a time per model:
the swap is not thread-safe). From what the forward returned:

- the logits unchanged: None, so the heads of Llama-like models run exactly as before;
- processing that is not elementwise is refused, because the chunked loss applies it to a chunk of
  tokens and the tensor-parallel head to a slice of the vocabulary (each half of the tokens, of the
  vocabulary, processed alone must equal that half of the whole); so is a forward the stubs cannot
  run (one that needs more of its decoder's outputs) or one that changes the hidden states before
  its head: a UserError naming the model type;
- otherwise the forms transformers' forwards use, built from the numbers the model and its config
  hold (`ElementwisePost`: an upcast to float32, `x * m`, `x / d`, the softcap `tanh(x / c) * c`,
  in that order), fewest operations first: the first the forward's own output confirms is the
  answer, a few torch ops per head call, no forward re-run and nothing that waits for the device;
- an elementwise processing of no known form keeps `ThroughForward` itself: the forward with its
  stubs at each head call (its checks were made at the probe: none per call).

The answer is cached on the model (a deepcopy of the model gets its own copy, a `ThroughForward`
one holding the copy).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from dsframework.errors import UserError

_CACHE = "_dsf_logit_postprocess"  # the model's attribute holding logit_postprocess's answer
_POINTS = "_dsf_swap_points"  # ... and router_loss's swap points
_WHOLE_LOGITS = ("set train.chunked_loss=false and parallel.tp=1, parallel.pp=1: the model's own forward then "
                 "computes the whole logits")


@functools.cache
def _decoder_output_class() -> type:
    """transformers' BaseModelOutputWithPast whose other fields, named or not, are None (GPT-2's
    forward reads `cross_attentions`, MoE forwards `router_logits`: the stub has nothing to add).
    One class for the process: transformers registers each output class with torch's pytrees."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class DecoderOutput(BaseModelOutputWithPast):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return DecoderOutput


class _Hidden(nn.Module):
    """The decoder's stand-in: a [1, tokens, 1] last hidden state (the head's stand-in ignores it)."""

    def __init__(self, like: torch.Tensor, decoder: nn.Module) -> None:
        super().__init__()
        self.like = like
        object.__setattr__(self, "decoder", decoder)  # not a child: read for its plain attributes only

    def __getattr__(self, name: str) -> Any:
        """The real decoder's other attributes (Falcon-H1's forward multiplies by
        `self.model.lm_head_multiplier`)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "decoder"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Distinct values, so that a forward that changes the hidden states before its head is seen
        hidden = torch.arange(1, self.like.shape[1] + 1, dtype=self.like.dtype, device=self.like.device)
        return _decoder_output_class()(last_hidden_state=hidden.view(1, -1, 1))


class _Logits(nn.Module):
    """The output head's stand-in: returns the given logits."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return self.logits


def _swap_points(lm: Any) -> tuple[tuple[nn.Module, str], tuple[nn.Module, str]]:
    """((parent, name) of the decoder, (parent, name) of the output embeddings), the latter found
    by identity with `lm.get_output_embeddings()` (lm_head, embed_out, ...)."""
    prefix = getattr(lm, "base_model_prefix", "")
    if not prefix or not isinstance(getattr(lm, prefix, None), nn.Module):
        raise LookupError(f"no decoder at the base_model_prefix {prefix!r}")
    head = lm.get_output_embeddings()
    for path, module in lm.named_modules():
        if path and module is head:
            parent, _, name = path.rpartition(".")
            return (lm, prefix), (lm.get_submodule(parent), name)
    raise LookupError("no output embeddings among its modules")


class ThroughForward:
    """post(logits [..., vocab]) -> the logits as `lm`'s forward returns them when its head outputs
    `logits` (an object rather than a closure: a deepcopy of the model copies it with the model).
    The probe's tool, and the answer for an elementwise processing of no known form."""

    def __init__(self, lm: Any) -> None:
        self.lm = lm
        self.points: Any = None  # _swap_points(lm), found at the first call (by name: a replaced head is found too)

    def __repr__(self) -> str:
        return f"ThroughForward({type(self.lm).__name__}.forward after its head)"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.run(logits)[0]

    def run(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the processed logits, the hidden state the forward handed its head: None if it did not)."""
        lm, batched = self.lm, logits.reshape(1, -1, logits.shape[-1])
        self.points = self.points or _swap_points(lm)
        (base_parent, base_name), (head_parent, head_name) = self.points
        base, head = base_parent._modules[base_name], head_parent._modules[head_name]
        stub_head = _Logits(batched)
        base_parent._modules[base_name], head_parent._modules[head_name] = _Hidden(batched, base), stub_head
        try:  # the class's forward: no hooks, no instance-level forward (use_chunked_loss installs one)
            ids = torch.zeros(batched.shape[:2], dtype=torch.long, device=logits.device)
            out = type(lm).forward(lm, input_ids=ids).logits
        finally:
            base_parent._modules[base_name], head_parent._modules[head_name] = base, head
        return out.reshape(*logits.shape[:-1], out.shape[-1]), getattr(stub_head, "hidden", None)


@dataclass(frozen=True)
class ElementwisePost:
    """post(logits) in the forms transformers' CausalLM forwards use after the head, applied in this
    order (fields left None are skipped): torch ops on the logits' device, no host synchronisation.

        ElementwisePost(softcap=30.0)(logits)     # Gemma 2/3: tanh(logits / 30) * 30
        ElementwisePost(divide=16.0)(logits)      # Granite: logits / logits_scaling
    """

    upcast: bool = False  # the forward casts the head's output to float32 first (Beam, Inkling 2)
    multiply: float | None = None  # Cohere's logit_scale, Falcon-H1's lm_head_multiplier, ...
    divide: float | None = None  # Granite's logits_scaling
    softcap: float | None = None  # final_logit_softcapping: tanh(x / c) * c

    @property
    def operations(self) -> int:
        return sum(value is not None for value in (self.multiply, self.divide, self.softcap))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            logits = logits.float()
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# ElementwisePost's fields -> the names transformers' models and configs give their numbers
# (HyperCLOVA X multiplies by a `logits_scaling` that Granite divides by: the probe tells which)
_FORMS = {"multiply": ("logit_scale", "lm_head_multiplier", "output_multiplier", "logits_scaling"),
          "divide": ("logits_scaling",), "softcap": ("final_logit_softcapping",)}


def _numbers(lm: Any, names: tuple[str, ...]) -> list[float]:
    """The distinct plain numbers named `names` on the model, its decoder (Falcon-H1 multiplies by
    `self.model.lm_head_multiplier`), its config and its text config."""
    holders = [lm, getattr(lm, "base_model", None), lm.config, lm.config.get_text_config()]
    found: list[float] = []
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) not in found:
                found.append(float(value))
    return found


def _known_form(lm: Any, post: ThroughForward, logits: torch.Tensor, whole: torch.Tensor) -> ElementwisePost | None:
    """The first ElementwisePost (fewest operations first) built from `lm`'s numbers that gives the
    forward's own output `whole` on the probe's `logits`, in float32 and in bfloat16; None if none does."""
    options = {field: [None, *_numbers(lm, names)] for field, names in _FORMS.items()}
    forms = sorted((ElementwisePost(multiply=m, divide=d, softcap=c) for m in options["multiply"]
                    for d in options["divide"] for c in options["softcap"]), key=lambda form: form.operations)
    form = next((form for form in forms if form.operations
                 and torch.allclose(form(logits), whole, rtol=1e-5, atol=1e-6)), None)
    if form is None:
        return None
    half = logits.bfloat16()  # what a bf16 run hands the head: an upcast shows in the output's dtype
    want = post(half)
    form = replace(form, upcast=want.dtype == torch.float32)
    got = form(half)
    if got.dtype != want.dtype or not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
        return None
    return form


def _elementwise(post: Callable, logits: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether each half of the tokens and of the vocabulary, processed alone, is that half of `whole`."""
    if whole.shape != logits.shape:
        return False
    tokens, vocab = logits.shape[1] // 2, logits.shape[2] // 2
    halves = [(slice(None), slice(None, tokens)), (slice(None), slice(tokens, None)),
              (slice(None), slice(None), slice(None, vocab)), (slice(None), slice(None), slice(vocab, None))]
    return all(torch.allclose(post(logits[part]), whole[part], rtol=1e-5, atol=1e-6) for part in halves)


def _probed_forward(lm: Any, post: ThroughForward, logits: torch.Tensor) -> torch.Tensor:
    """The forward's processed `logits`, after checking that it handed its head the decoder's hidden
    state unchanged (dsf's heads take them as the decoder gives them)."""
    whole, seen = post.run(logits)
    if seen is None or not torch.equal(seen.flatten(), torch.arange(1, seen.numel() + 1, dtype=seen.dtype,
                                                                     device=seen.device)):
        raise ValueError("its forward changes the hidden states before the head (dsf's heads take them as the "
                         "decoder gives them)")
    return whole


def _probe(lm: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """logit_postprocess's answer, from runs of the forward on random logits."""
    model_type = getattr(lm.config, "model_type", type(lm).__name__)
    post = ThroughForward(lm)
    vocab = max(getattr(lm.config, "vocab_size", 0) or 0, 2)
    # a generator of its own: the probe leaves the global random state (weight init, dropout) alone
    logits = 10 * torch.randn(1, 4, vocab, generator=torch.Generator().manual_seed(0))  # host: a probe, no model
    try:
        whole = _probed_forward(lm, post, logits)
    except Exception as err:  # the forward needs more of its decoder than the stubs give
        raise UserError("model.name", model_type, f"dsf could not run {type(lm).__name__}'s forward to find what it "
                        f"does to its logits after the head ({type(err).__name__}: {err})", _WHOLE_LOGITS) from err
    if torch.equal(whole, logits):
        return None
    if not _elementwise(post, logits, whole):
        raise UserError("model.name", model_type, f"{type(lm).__name__}'s forward processes its logits after the "
                        "head in a way that is not elementwise: dsf's chunked loss applies it per chunk of tokens "
                        "and its tensor-parallel head per slice of the vocabulary", _WHOLE_LOGITS)
    return _known_form(lm, post, logits, whole) or post


def logit_postprocess(lm: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the transformers causal LM `lm` does to the output of its head: a function of the
    head's output [..., vocab] (or of a chunk of its tokens, or of a slice of its vocabulary),
    or None when its forward returns the head's output unchanged. Found from `lm`'s own forward
    (module docstring) once per model; a UserError names a model whose forward cannot be probed or
    whose processing is not elementwise."""
    if _CACHE not in vars(lm):
        vars(lm)[_CACHE] = _probe(lm)
    return vars(lm)[_CACHE]


def processed_head(lm: Any, head: Any = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden -> logits as `lm`'s forward returns them: `head` (default: `lm`'s output embeddings;
    a tensor-parallel head gives its vocab slice) followed by `logit_postprocess(lm)`; the head
    itself when there is nothing to apply. The head is still called as a module (its hooks run)."""
    head = lm.get_output_embeddings() if head is None else head
    post = logit_postprocess(lm)
    if post is None:
        return head
    return lambda hidden: post(head(hidden))


class _Output(nn.Module):
    """A stand-in returning a given value (the decoder's real output; the head's input unchanged)."""

    def __init__(self, output: Any = None) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output if self.output is not None else args[0]


def router_loss(lm: Any, decoder_output: Any, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """What `lm`'s forward adds to its loss beside the cross entropy: for a mixture of experts that
    records its routing (`output_router_logits`), `router_aux_loss_coef` x the load-balancing loss
    its forward computes from `decoder_output.router_logits`; None for every other model.

    A head dsf computes itself (the chunked loss) must add it, or the router trains without its
    balancing term. The aux loss comes from the model's own forward (`type(lm).forward`, the
    decoder swapped for a stub returning `decoder_output` and the head for one returning its input),
    so each architecture's own load_balancing_loss_func runs; transformers' MoE forwards all add
    `self.router_aux_loss_coef * aux_loss` to the loss when given labels."""
    if getattr(decoder_output, "router_logits", None) is None:
        return None
    if _POINTS not in vars(lm):  # found once per model: named_modules walks all of them
        vars(lm)[_POINTS] = _swap_points(lm)
    (base_parent, base_name), (head_parent, head_name) = vars(lm)[_POINTS]
    base, head = base_parent._modules[base_name], head_parent._modules[head_name]
    base_parent._modules[base_name], head_parent._modules[head_name] = _Output(decoder_output), _Output()
    try:
        ids = torch.zeros(decoder_output.last_hidden_state.shape[:2], dtype=torch.long,
                          device=decoder_output.last_hidden_state.device)
        aux = type(lm).forward(lm, input_ids=ids, attention_mask=attention_mask).aux_loss
    finally:
        base_parent._modules[base_name], head_parent._modules[head_name] = base, head
    if aux is None:
        return None
    coef = getattr(lm, "router_aux_loss_coef", None)
    return aux * (lm.config.router_aux_loss_coef if coef is None else coef)
