"""What a causal LM does to its logits after its head (models/logits.py) reaches dsf's chunked loss:
tiny random models of twelve architectures give transformers' own loss within 1e-5, with Gemma's
softcapping, Granite's and Cohere's logit scaling made to matter (the head's weights x20); a model
whose post-processing is not elementwise, or whose forward cannot be probed, is refused.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dsframework.errors import UserError
from dsframework.models.logits import logit_postprocess, processed_head
from dsframework.models.loss import chunked_causal_lm_loss, use_chunked_loss
from dsframework.train.step import micro_batch_loss

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
    hidden = torch.randn(3, 5, 64)
    torch.testing.assert_close(processed_head(gemma)(hidden), 2.0 * torch.tanh(gemma.lm_head(hidden) / 2.0))
    vocab_slice = gemma.lm_head(hidden)[..., :100]  # what a tensor-parallel rank holds
    torch.testing.assert_close(post(vocab_slice), 2.0 * torch.tanh(vocab_slice / 2.0))
    twin = copy.deepcopy(gemma)  # its own post-processing, over its own modules
    assert logit_postprocess(twin) is not post and logit_postprocess(twin).lm is twin


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
