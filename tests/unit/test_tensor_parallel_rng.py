"""parallel/rng.py and models/attention.py without a process group: the tensor-parallel stream is
its own, a recompute under torch's checkpoint draws the forward's mask from it, and a wrapped
attention computes what the model's own did (its mask function follows the new name).
The masks across real tensor ranks, and a resume: tests/distributed/test_sequence_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dsframework.models.attention import fork_tensor_parallel_rng, wrap_attention
from dsframework.models.tiny import tiny_config
from dsframework.parallel.rng import (checkpoint_contexts, seed_tensor_parallel_rng, set_tracked_rng_states,
                                      tensor_parallel_rng, tracked_rng_states)


@pytest.fixture
def streams():
    seed_tensor_parallel_rng(seed=7, tensor_rank=1)
    yield
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    get_cuda_rng_tracker().reset()


def test_the_stream_is_seeded_per_tensor_rank_and_leaves_the_default_alone(streams):
    torch.manual_seed(0)
    with tensor_parallel_rng():
        drawn = torch.rand(8)
    after = torch.rand(8)
    assert torch.equal(drawn, torch.rand(8, generator=torch.Generator().manual_seed(7 + 2718 + 1)))
    assert torch.equal(after, torch.rand(8, generator=torch.Generator().manual_seed(0)))
    saved = tracked_rng_states()
    with tensor_parallel_rng():
        first = torch.rand(8)
    set_tracked_rng_states(saved)
    with tensor_parallel_rng():
        assert torch.equal(torch.rand(8), first)


def _dropped(x: torch.Tensor) -> torch.Tensor:
    with tensor_parallel_rng():
        return F.dropout(x * 2, p=0.5, training=True)


@pytest.mark.parametrize("contexts, same", [(True, True), (False, False)])
def test_a_recompute_draws_the_forwards_mask(streams, contexts, same):
    x = torch.ones(64, requires_grad=True)
    _dropped(x).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    seed_tensor_parallel_rng(seed=7, tensor_rank=1)
    kwargs = {"context_fn": checkpoint_contexts} if contexts else {}
    checkpoint(_dropped, x, use_reentrant=False, **kwargs).sum().backward()
    assert torch.equal(x.grad, plain) is same


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_wrapped_attention_computes_what_the_models_own_did(implementation):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", attn_implementation=implementation)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    want = model(input_ids=ids).logits
    name = wrap_attention(model.config, fork_tensor_parallel_rng, tag="test")
    assert model.config._attn_implementation == name
    got = model(input_ids=ids).logits
    assert torch.equal(got, want)
