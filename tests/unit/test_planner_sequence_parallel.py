"""The planner counts sequence parallelism (parallel.sequence_parallel; Layout.sequence_parallel):
Korthikanti et al. 2022's activations per layer fall from sbh(10 + 24/t + 5as/ht) to
sbh(34/t + 5as/ht), the norms and residual work of a layer split tp ways, one more gather of each
block's input in the backward; auto turns it on where the run does. What a live engine saves:
tests/distributed/test_sequence_parallel.py."""
from __future__ import annotations

import pytest

from dsframework.layout import ParallelDims
from dsframework.models.tiny import tiny_config
from dsframework.planner.cluster import cluster_preset
from dsframework.planner.memory import Layout, Workload, layer_activation_bytes, stage_memories
from dsframework.planner.model import describe_model
from dsframework.planner.speed import step_time
from dsframework.runtime_facts import sequence_parallel_auto


def _gpt(dropout: float = 0.1):
    """A GPT-3-shaped layer (LayerNorm, GeLU MLP of 4h, dropout), as in the paper."""
    config = tiny_config("gpt2", n_embd=1024, n_head=16, n_layer=4, n_positions=2048, vocab_size=50304,
                         attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
    return describe_model(config, name="gpt-1024")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_layer_saves_korthikantis_ten_sbh_split_tp_ways(tp):
    desc, s, b = _gpt(), 2048, 1
    kw = dict(micro_batch=b, seq_len=s, tp=tp, precision="bf16")
    without = layer_activation_bytes(desc, **kw)
    with_ = layer_activation_bytes(desc, **kw, sequence_parallel=True)
    # sbh(10 + 24/t + 5as/ht) - sbh(34/t + 5as/ht) = 10 sbh (1 - 1/t): the two LayerNorms' inputs and
    # outputs (the blocks' inputs) and the two dropout masks, now on a tp-th of the tokens
    assert without - with_ == pytest.approx(10 * s * b * desc.hidden * (1 - 1 / tp), rel=0.01)


def test_memory_and_step_time_count_it():
    desc, cluster = describe_model(tiny_config("llama", hidden_size=4096, intermediate_size=11008,
                                               num_attention_heads=32, num_key_value_heads=32,
                                               num_hidden_layers=8), name="llama-8l"), cluster_preset("h100-80gb")
    job = Workload(seq_len=4096, global_batch=8, precision="bf16")
    dims = ParallelDims(world=8, tp=8, zero_stage=1)
    off, on = (Layout(dims, micro_batch=1, grad_accum=8, sequence_parallel=sp) for sp in (False, True))
    assert stage_memories(desc, on, job)[0].activations < 0.8 * stage_memories(desc, off, job)[0].activations
    time_off, time_on = step_time(desc, off, job, cluster), step_time(desc, on, job, cluster)
    assert time_on.memory_bound < time_off.memory_bound  # the norms and residuals: a tp-th each
    assert time_on.tp_comm > time_off.tp_comm  # the backward's gathers of the blocks' inputs
    full = [Layout(dims, micro_batch=1, grad_accum=8, activation_checkpointing="full", sequence_parallel=sp)
            for sp in (False, True)]
    assert step_time(desc, full[1], job, cluster).tp_comm == step_time(desc, full[0], job, cluster).tp_comm


def test_auto_is_on_where_the_run_turns_it_on():
    assert sequence_parallel_auto(tp=2, cp=1, seq_len=4096)
    assert not sequence_parallel_auto(tp=1, cp=1, seq_len=4096)
    assert not sequence_parallel_auto(tp=2, cp=2, seq_len=4098)
    assert not sequence_parallel_auto(tp=2, cp=1, seq_len=4096, experts=8)
