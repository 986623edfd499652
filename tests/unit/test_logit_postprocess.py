"""What a causal LM does to its logits after its head (models/logits.py) reaches dsf's chunked loss:
tiny random models of twelve architectures give transformers' own loss within 1e-5, with Gemma's
softcapping, Granite's and Cohere's logit scaling made to matter (the head's weights x20); a model
whose post-processing is not elementwise, or whose forward cannot be probed, is refused.

Decided once, applied as the elementwise op it is: every tiny type (models/tiny.py) whose forward
processes its logits gets an ElementwisePost equal to its forward within 1e-6 (no forward re-run per
head call), which runs on fake CUDA tensors without a host synchronisation; an elementwise processing
of no known form keeps the forward (ThroughForward), without a synchronisation per call either.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dsframework.errors import UserError
from dsframework.models.hf import causal_lm_class
from dsframework.models.logits import ElementwisePost, ThroughForward, logit_postprocess, processed_head
from dsframework.models.loss import chunked_causal_lm_loss, use_chunked_loss
from dsframework.models.tiny import SKIP, causal_lm_types_with_tp_plan, tiny_config
from dsframework.train.step import micro_batch_loss
from tests.device_discipline import CUDA, DeviceRules

torch.set_num_threads(1)

VOCAB = 256
PROCESSING = {"gemma2": {"final_logit_softcapping": 2.0, "head_dim": 16},
              "gemma3_text": {"final_logit_softcapping": 2.0, "head_dim": 16},
              "granite": {"logits_scaling": 0.25}, "cohere": {"logit_scale": 4.0}}
ARCHITECTURES = ["llama", "gemma2", "gemma3_text", "granite", "cohere", "qwen3", "phi3", "olmo2", "starcoder2",
                 "gpt_neox", "gpt2", "mixtral"]  # gpt2: `transformer`, a tied head; mixtral: a MoE decoder


def tiny(model_type: str) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=VOCAB, pad_token_id=0, bos_token_id=0,
                                  eos_token_id=0, **PROCESSING.get(model_type, {}))
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()  # no dropout (GPT-2's)
    with torch.no_grad():  # logits large enough for softcapping and scaling to change the loss
        model.get_output_embeddings().weight.mul_(20)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_chunked_loss_is_the_models_own(model_type):
    model = tiny(model_type)
    reference = copy.deepcopy(model)
    ids = tokens()
    want = reference(ids, labels=ids).loss
    use_chunked_loss(model, chunk_tokens=7)  # 24 tokens: chunks of 7, 7, 7, 3
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, want, rtol=1e-5, atol=1e-5)
    assert (logit_postprocess(model) is None) == (model_type not in PROCESSING)


def test_gemma2_softcapping_matters_and_reaches_the_gradients():
    model = tiny("gemma2")
    reference = copy.deepcopy(model)
    ids = tokens()
    want = reference(ids, labels=ids).loss
    hidden = reference.model(ids).last_hidden_state
    unprocessed = chunked_causal_lm_loss(reference.lm_head, hidden, ids, chunk_tokens=7)
    assert abs(unprocessed.item() - want.item()) > 0.1  # the test would catch a head without the softcapping
    want.backward()
    use_chunked_loss(model, chunk_tokens=7)
    model(input_ids=ids, labels=ids).loss.backward()
    for (name, got), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_micro_batch_loss_of_a_chunked_model():
    """train/step.py's loss, plain rows and supervised rows (summed over the global batch's count)."""
    model = tiny("gemma2")
    reference = copy.deepcopy(model)
    use_chunked_loss(model, chunk_tokens=5)
    ids = tokens()
    labels = ids.clone()
    labels[:, :6] = -100
    rows = {"input_ids": ids, "labels": labels, "loss_weight": torch.tensor(1 / 30)}
    for batch in (ids, rows):
        got, got_value = micro_batch_loss(model, batch)
        want, _ = micro_batch_loss(reference, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not got_value.requires_grad


def test_processed_head_and_the_cache():
    llama = tiny("llama")
    assert logit_postprocess(llama) is None and processed_head(llama) is llama.lm_head
    gemma = tiny("gemma2")
    post = logit_postprocess(gemma)
    assert logit_postprocess(gemma) is post  # probed once
    assert post == ElementwisePost(softcap=2.0)
    hidden = torch.randn(3, 5, 64)
    torch.testing.assert_close(processed_head(gemma)(hidden), 2.0 * torch.tanh(gemma.lm_head(hidden) / 2.0))
    vocab_slice = gemma.lm_head(hidden)[..., :100]  # what a tensor-parallel rank holds
    torch.testing.assert_close(post(vocab_slice), 2.0 * torch.tanh(vocab_slice / 2.0))
    assert logit_postprocess(copy.deepcopy(gemma)) == post


class LogSoftmaxLlama(LlamaForCausalLM):
    """Post-processing over the whole vocabulary: a chunk of tokens could, a vocab slice cannot."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits.log_softmax(-1)
        return out


class HiddenStatesLlama(LlamaForCausalLM):
    """A forward that needs more of its decoder's output than the last hidden state."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + out.hidden_states[0].mean()
        return out


@pytest.mark.parametrize("cls, problem", [(LogSoftmaxLlama, "not elementwise"), (HiddenStatesLlama, "could not run")])
def test_a_forward_dsf_cannot_follow_is_refused(cls, problem):
    model = cls(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2))
    modules = dict(model.named_children())
    state = torch.random.get_rng_state()
    with pytest.raises(UserError, match=f"model.name='llama'.*{problem}.*chunked_loss=false"):
        use_chunked_loss(model, chunk_tokens=7)
    assert dict(model.named_children()) == modules  # the stubs are gone
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe drew from its own generator


# --- decided once, applied as the elementwise op it is ----------------------------------------------

# Each number a forward's post-processing reads, at a value that changes the logits (tiny.py's configs
# keep the types' defaults, which leave Granite's, Gemma 3's and Falcon-H1's logits as they are)
KNOBS = {"final_logit_softcapping": 2.0, "logit_scale": 4.0, "logits_scaling": 0.25, "lm_head_multiplier": 0.5,
         "output_multiplier": 0.5}
PROCESSING_TYPES = {"gemma2", "gemma3_text", "granite", "granitemoe", "cohere", "cohere2", "falcon_h1", "vaultgemma",
                    "beam", "inkling2_text"}  # beam, inkling2: an upcast to float32 before the softcap


def tiny_with_knobs(model_type: str) -> torch.nn.Module:
    config = tiny_config(model_type)
    for holder in {id(c): c for c in (config, config.get_text_config())}.values():
        for name, value in KNOBS.items():
            if name in holder.to_dict():  # (a property of the same name, MiniCPM3's, is not a knob)
                setattr(holder, name, value)
    torch.manual_seed(0)
    return causal_lm_class(config)(config).eval()


def random_logits(vocab: int, *, dtype=torch.float32) -> torch.Tensor:
    return (10 * torch.randn(3, 5, vocab, generator=torch.Generator().manual_seed(2))).to(dtype)


def test_every_tiny_type_that_processes_its_logits_gets_an_elementwise_op():
    """Every type of models/tiny.py: its decided op, against its own forward on other random logits
    than the probe's, in float32 and bfloat16 (an upcast shows in the dtype). ~10 s for all types."""
    decided, wrong = {}, {}
    for model_type in sorted(set(causal_lm_types_with_tp_plan()) - set(SKIP)):
        model = tiny_with_knobs(model_type)
        try:
            post = logit_postprocess(model)
        except UserError:  # a forward dsf cannot follow (test_a_forward_dsf_cannot_follow_is_refused)
            continue
        if post is None:
            continue
        decided[model_type] = post
        for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 0.0)):
            logits = random_logits(model.config.get_text_config().vocab_size, dtype=dtype)
            want, got = ThroughForward(model)(logits), post(logits)
            if (not isinstance(post, ElementwisePost) or got.dtype != want.dtype
                    or not torch.allclose(got.float(), want.float(), rtol=0, atol=tolerance)):
                wrong[f"{model_type} {dtype}"] = post
    assert not wrong, wrong
    assert PROCESSING_TYPES <= set(decided), sorted(decided)
    assert decided["granite"] == ElementwisePost(divide=0.25) and decided["falcon_h1"] == ElementwisePost(multiply=0.5)
    assert decided["beam"] == ElementwisePost(upcast=True, softcap=2.0)


@pytest.mark.parametrize("model_type", sorted(PROCESSING_TYPES))
def test_the_decided_op_runs_on_cuda_without_a_host_sync(model_type):
    """Under FakeTensorMode (cuda:0 tensors on this CPU build, a host tensor mixed in refused), the
    op a head applies at every loss chunk: on the device, no read back (tests/device_discipline.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    post = logit_postprocess(tiny_with_knobs(model_type))
    with FakeTensorMode(), DeviceRules(host_group=None) as rules:
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.empty(2, 7, 256, dtype=dtype, device=CUDA)
            out = post(logits)
            assert out.device == CUDA and out.shape == logits.shape
        assert rules.syncs == []


class ShiftedLlama(LlamaForCausalLM):
    """Elementwise, but of no form dsf knows: the forward itself is kept."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2 + 1
        return out


class SyncWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a tensor's values back to the host (torch.equal, .item())."""

    READS = ("aten::equal", "aten::_local_scalar_dense", "aten::is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_an_unknown_elementwise_form_keeps_the_forward_without_a_sync_per_call():
    model = ShiftedLlama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2))
    post = logit_postprocess(model)
    assert isinstance(post, ThroughForward) and post.lm is model
    logits = random_logits(VOCAB)
    with SyncWatch() as watch:
        out = post(logits)
    assert watch.reads == []  # the hidden-state check was made once, at the probe
    torch.testing.assert_close(out, logits * 2 + 1)
    twin = copy.deepcopy(model)  # its own post-processing, over its own modules
    assert logit_postprocess(twin) is not post and logit_postprocess(twin).lm is twin
