"""Property test: whatever the model and cluster, the planner never emits an invalid layout.

For 200 random Llama-family models (100 in the fast tier, `-m "not distributed"`) (heads, kv heads, layers, widths, vocabularies) on random
clusters (GPU type, nodes, GPUs per node) and jobs (sequence length, global batch, precision),
every candidate obeys the rules (tensor, pipeline, context parallel and hpZ axes alike: the
layout dsf train would check, ParallelDims with cp and zero_hpz, is accepted by
check_model_layout), and the DeepSpeed JSON of the ones `dsf plan` shows (the top fitting
layouts, the closest misses, and the best context-parallel and hpZ ones) passes DeepSpeed's own
DeepSpeedConfig at its data-parallel size, with the run config `dsf train` would read.
"""
from __future__ import annotations


from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsframework.config import build_run_config
from dsframework.dsconfig import build_ds_config, validate_ds_config
from dsframework.layout import ParallelDims, check_model_layout
from dsframework.planner.cluster import CLUSTER_PRESETS, cluster_preset
from dsframework.planner.memory import Workload
from dsframework.planner.model import describe_model
from dsframework.planner.report import run_config_dict
from dsframework.planner.search import search

SHOWN_FITTING, SHOWN_MISSES = 8, 3
EXAMPLES = 100  # each a meta-device model (~0.15 s); hypothesis draws new ones every run


@st.composite
def models(draw):
    from transformers import LlamaConfig

    kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([16, 64, 128]))
    return LlamaConfig(vocab_size=draw(st.integers(100, 160_000)), hidden_size=heads * head_dim,
                       intermediate_size=draw(st.integers(1, 64)) * 128,
                       num_hidden_layers=draw(st.integers(1, 96)), num_attention_heads=heads,
                       num_key_value_heads=kv_heads, tie_word_embeddings=draw(st.booleans()))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=models(), cluster_name=st.sampled_from(CLUSTER_PRESETS), nodes=st.sampled_from([1, 2, 3, 4, 16, 64]),
       gpus_per_node=st.sampled_from([1, 2, 4, 8]), seq_len=st.sampled_from([128, 512, 2048, 8192, 131072]),
       batch_factor=st.integers(1, 64), precision=st.sampled_from(["fp32", "bf16", "fp16"]))
def test_every_candidate_is_valid(config, cluster_name, nodes, gpus_per_node, seq_len, batch_factor, precision):
    desc = describe_model(config, name="random")
    cluster = cluster_preset(cluster_name, nodes=nodes, gpus_per_node=gpus_per_node)
    job = Workload(seq_len=seq_len, global_batch=batch_factor * gpus_per_node, precision=precision)
    plan = search(desc, cluster, job, suggest=False)
    for c in plan.candidates:
        lay = c.layout
        assert lay.dims.dp * lay.dims.tp * lay.dims.pp * lay.dims.cp == cluster.world == lay.dims.world
        assert lay.micro_batch * lay.grad_accum * lay.dims.dp == job.global_batch
        assert lay.dims.pp == 1 or lay.dims.zero_stage <= 1, "the pipeline engine takes ZeRO 0/1 only"
        # the rules dsf train and dsf launch apply (one rule set) accept it
        dims = ParallelDims(world=cluster.world, tp=lay.dims.tp, pp=lay.dims.pp, cp=lay.dims.cp, zero_stage=lay.dims.zero_stage,
                            zero_hpz=lay.dims.zero_hpz)
        assert dims == lay.dims and dims.dp == lay.dims.dp and dims.zero_ranks == lay.dims.zero_ranks
        check_model_layout(dims, config, ranks_per_node=gpus_per_node, dp=lay.dims.dp, seq_len=seq_len)
        assert config.num_attention_heads % lay.dims.tp == 0 and config.num_key_value_heads % lay.dims.tp == 0
        assert lay.dims.cp == 1 or (lay.dims.pp == 1 and seq_len % lay.dims.cp == 0)
        assert lay.dims.zero_hpz == 1 or (lay.dims.zero_stage == 3 and lay.dims.tp == 1 and lay.dims.zero_ranks % lay.dims.zero_hpz == 0
                                     and lay.dims.zero_hpz <= gpus_per_node)
        assert lay.dims.tp <= gpus_per_node and lay.dims.pp <= config.num_hidden_layers
        assert not lay.offload_param or (lay.dims.zero_stage == 3 and lay.offload_optimizer)
        assert c.memory.total > 0 and c.time.total > 0
    misses = [c for c in plan.candidates if not c.fits]
    shown = plan.fitting[:SHOWN_FITTING] + misses[:SHOWN_MISSES]
    for axis in (lambda lay: lay.dims.cp > 1, lambda lay: lay.dims.zero_hpz > 1):  # the best of each new axis too
        shown += [c for c in plan.candidates if axis(c.layout)][:1]
    for c in shown:
        run = build_run_config(run_config_dict(c, model_name="tiny-llama", seq_len=seq_len,
                                               global_batch=job.global_batch, precision=precision))
        ds = build_ds_config(run.train, run.parallel, dp_size=c.layout.dims.dp)
        assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
                                          * c.layout.dims.dp)
        assert (run.parallel.cp, run.parallel.zero_hpz) == (c.layout.dims.cp, c.layout.dims.zero_hpz)
        assert ds.get("sequence_parallel_size", 1) == c.layout.dims.cp
        assert ds["zero_optimization"].get("zero_hpz_partition_size", 1) == c.layout.dims.zero_hpz
        validate_ds_config(ds, dp_size=c.layout.dims.dp)
