"""The chunked causal LM loss (models/loss.py) equals transformers' loss, never holds the whole
logits, and the auto-compile rule (compiling.py) decides as documented.

Same loss and gradients as `model(input_ids, labels=...).loss` within 1e-5 (Llama with untied and
GPT-2 with tied output embeddings, Mixtral and Qwen3-MoE whose loss adds the router's
load-balancing loss; chunks that do and do not divide the tokens; labels with -100
as chat data has them); the tensors saved for backward hold no logits-sized tensor; and a step's
peak memory (peak RSS of a fresh process at a 32,000-token vocabulary) drops by most of the
logits it no longer holds.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from dsframework.train.compiling import COMPILE_S, EXPECTED_GAIN, auto_compile
from dsframework.errors import UserError
from dsframework.models.loss import check_chunked_loss_layout, chunked_causal_lm_loss, use_chunked_loss
from dsframework.runtime_facts import LOSS_CHUNK_LOGITS, loss_chunk_tokens, loss_chunking, loss_is_chunked

VOCAB = 32000


def llama(vocab: int = 5000) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=32, n_layer=1, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def mixture_of_experts(model_type: str):
    """A tiny random MoE whose loss adds its router's load-balancing loss (coefficient raised so it matters)."""
    from dsframework.models.experts import train_router_loss
    from dsframework.models.hf import causal_lm_class
    from dsframework.models.tiny import tiny_config

    config = tiny_config(model_type)
    assert train_router_loss(config)
    config.router_aux_loss_coef = 0.5
    torch.manual_seed(0)
    return causal_lm_class(config)(config).float()


def batch(vocab: int, *, supervised: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 40), generator=generator)
    labels = ids.clone()
    if supervised:  # prompts masked as chat data masks them
        labels[:, :15] = -100
        labels[1, 30:] = -100
    return ids, labels


def loss_and_grads(model, ids, labels):
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [llama, gpt2, lambda: mixture_of_experts("mixtral"),
                                   lambda: mixture_of_experts("qwen3_moe")],
                         ids=["llama", "gpt2-tied", "mixtral-router-loss", "qwen3_moe-router-loss"])
@pytest.mark.parametrize("chunk", [37, 120])
@pytest.mark.parametrize("supervised", [False, True], ids=["text", "masked"])
def test_same_loss_and_gradients_as_the_whole_logits(build, chunk, supervised):
    plain = build()
    chunked = use_chunked_loss(copy.deepcopy(plain), chunk_tokens=chunk)
    ids, labels = batch(plain.config.vocab_size, supervised=supervised)
    want_loss, want = loss_and_grads(plain, ids, labels)
    got_loss, got = loss_and_grads(chunked, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():  # evaluation: the same, without a backward
        torch.testing.assert_close(chunked(input_ids=ids, labels=labels).loss, want_loss, rtol=1e-5, atol=1e-5)


def test_a_lora_model_chunks_its_base_models_loss():
    """peft's wrapper calls the causal LM inside it, whose forward use_chunked_loss replaced: the
    adapters' gradients (all that trains) are the plain loss's."""
    from dsframework.config import LoraSpec
    from dsframework.models.lora import apply_lora

    plain = apply_lora(llama(), LoraSpec(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]), seed=3)
    plain.base_model.model.lm_head.weight.data.normal_()  # (zero-initialised B leaves no gradient worth comparing)
    for name, param in plain.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1)
    chunked = use_chunked_loss(copy.deepcopy(plain), chunk_tokens=50)
    ids, labels = batch(5000, supervised=True)
    want_loss, want = loss_and_grads(plain, ids, labels)
    got_loss, got = loss_and_grads(chunked, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    assert sorted(got) == sorted(want) and all("lora_" in name for name in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_the_forward_without_labels_is_the_models_own():
    plain = llama(vocab=500)
    chunked = use_chunked_loss(copy.deepcopy(plain), chunk_tokens=16)
    ids, _ = batch(500, supervised=False)
    torch.testing.assert_close(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_shifted_labels_of_a_sequence_shard():
    """A context-parallel shard hands its labels already shifted (its last token's label is the
    next shard's first token): the mean over them, as the whole logits give it."""
    model = llama(vocab=500)
    ids, _ = batch(500, supervised=False)
    shifted = ids[:, 1:21]  # the first 20 tokens' labels, the last one from beyond the slice
    hidden = model.model(input_ids=ids[:, :20]).last_hidden_state
    want = torch.nn.functional.cross_entropy(model.lm_head(hidden).flatten(0, 1), shifted.flatten())
    got = chunked_causal_lm_loss(model.lm_head, hidden, shifted=shifted, chunk_tokens=7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def saved_tensor_elements(model, ids, labels) -> list[int]:
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return sizes


def test_no_logits_sized_tensor_is_saved_for_backward():
    plain = llama(VOCAB)
    chunked = use_chunked_loss(copy.deepcopy(plain), chunk_tokens=32)
    ids, labels = batch(VOCAB, supervised=False)
    logits = ids.numel() * VOCAB
    assert max(saved_tensor_elements(plain, ids, labels)) >= logits  # the whole logits (and their log-softmax)
    assert max(saved_tensor_elements(chunked, ids, labels)) < 32 * VOCAB  # at most one chunk's, never the whole


PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from dsframework.models.loss import use_chunked_loss
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024))
    if sys.argv[1] == "chunked":
        use_chunked_loss(model, chunk_tokens=256)
    ids = torch.randint(0, 32000, (4, 512))
    def kib(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    before = kib("VmRSS:")
    model(input_ids=ids, labels=ids).loss.backward()
    print((kib("VmHWM:") - before) * 1024)
""")


@pytest.mark.distributed
def test_peak_memory_of_a_step_is_lower_at_a_32k_vocabulary():
    """Peak RSS growth of one forward + backward in a fresh process (VmHWM, reset before the
    step, less VmRSS then: what start-up peaked at does not hide it): the plain loss holds the
    2,048 tokens' fp32 logits (262 MB), their log-softmax and gradient; the chunked one a 256-token
    chunk's (33 MB) at a time."""
    def peak(kind: str) -> int:
        # A fixed mmap threshold: glibc's dynamic one (raised after a large free) would keep the
        # chunks' freed 33 MB buffers in the heap, and the RSS would count memory no tensor holds.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, kind], capture_output=True, text=True, timeout=120,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.split()[-1])

    logits_bytes = 4 * 512 * VOCAB * 4
    plain, chunked = peak("plain"), peak("chunked")
    assert plain > 2 * logits_bytes, (plain, chunked)  # logits, log-softmax, their gradient
    assert chunked < plain - logits_bytes and chunked < plain / 2, (plain, chunked)  # (measured: 802 MB vs 124 MB)


def test_chunk_size_and_when_auto_chunks():
    # 256 MiB of fp32 logits is 523 tokens at 128k: rounded down to a multiple of 512
    assert LOSS_CHUNK_LOGITS // 128256 == 523 and loss_chunk_tokens(128256) == 512
    assert loss_chunk_tokens(32000) == 2048 and LOSS_CHUNK_LOGITS // 32000 == 2097  # 4 x 512, not 2097
    assert loss_chunk_tokens(512) == LOSS_CHUNK_LOGITS // 512 and loss_chunk_tokens(10**9) == 512  # at least 512
    assert all(loss_chunk_tokens(rows) % 512 == 0 for rows in (1000, 50257, 151936, 256000))
    assert loss_chunk_tokens(32000, chunk_tokens=100) == 100  # the user's own size, as given
    # never more tokens than the micro-batch has: 300 tokens are one chunk of 300
    assert loss_chunking(True, vocab=128256, tp=1, pp=1, cp=1, micro_batch=1, seq_len=300) == 300
    assert loss_chunking("auto", vocab=128256, tp=1, pp=1, cp=1, micro_batch=4, seq_len=2048) == 512
    assert loss_is_chunked("auto", tokens=4 * 2048, vocab_rows=128256)  # llama-1b's micro-batch: 16 chunks
    assert not loss_is_chunked("auto", tokens=16 * 64, vocab_rows=512)  # the tiny model: whole logits
    assert loss_is_chunked(True, tokens=8, vocab_rows=512) and not loss_is_chunked(False, tokens=10**6, vocab_rows=10**5)


def test_chunked_loss_is_refused_with_a_pipeline():
    with pytest.raises(UserError, match=r"train.chunked_loss=True.*parallel.pp=2"):
        check_chunked_loss_layout(True, pp=2)
    check_chunked_loss_layout("auto", pp=2)
    check_chunked_loss_layout(True, pp=1)


def test_auto_compile_compiles_when_the_steps_left_pay_for_it():
    long_run, why = auto_compile(step_seconds=0.2, steps_left=5000)
    assert long_run and why.endswith("compiling") and f"{COMPILE_S:.0f} s to compile" in why
    assert not auto_compile(step_seconds=0.05, steps_left=200)[0]  # a test-sized run
    breakeven = COMPILE_S / (0.2 * EXPECTED_GAIN)
    assert not auto_compile(step_seconds=0.2, steps_left=int(breakeven) - 1)[0]
    assert auto_compile(step_seconds=0.2, steps_left=int(breakeven) + 1)[0]


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_why_not_deepspeeds_tiled_loss(scale):
    """models/loss.py's reason not to use DeepSpeed's TiledFusedLogitsLoss: with the loss scaled
    after it (DeepSpeed's engine.backward divides by gradient_accumulation_steps), the head's
    weight gradient comes out 1 / scale times too large, while ours stays right. (Should DeepSpeed
    fix it, this fails, and the library's version can replace ours.)"""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 100, bias=False)
    hidden = torch.randn(2, 12, 16)
    targets = torch.randint(0, 100, (2, 12))

    def head_grad(loss_of) -> torch.Tensor:
        head.zero_grad()
        (loss_of() * scale).backward()
        return head.weight.grad.clone()

    want = head_grad(lambda: torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), targets.flatten()))
    ours = head_grad(lambda: chunked_causal_lm_loss(head, hidden, shifted=targets, chunk_tokens=6))
    tiled = head_grad(lambda: TiledFusedLogitsLoss.apply(
        lambda self, x, y: torch.nn.functional.cross_entropy(self(x), y), head, hidden.requires_grad_(), targets,
        None, 4, [head.weight], "mean"))
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled, want / scale, rtol=1e-5, atol=1e-6)
