"""The rank grid: every factorization of the world, tensor-parallel ranks innermost, and the
layout rules with their one-line errors."""
from __future__ import annotations

import itertools

import pytest

from dsframework.config import build_run_config
from dsframework.errors import UserError
from dsframework.layout import ParallelDims, check_layout, check_model_layout
from dsframework.parallel.topology import build_topology


def _factorizations(world):
    for tp, pp, cp in itertools.product(range(1, world + 1), repeat=3):
        if world % (tp * pp * cp) == 0 and not (cp > 1 and pp > 1):  # cp and pp do not compose
            yield tp, pp, cp, world // (tp * pp * cp)


LAYOUTS = [(w, *f) for w in (1, 2, 4, 8) for f in _factorizations(w)]


@pytest.mark.parametrize("world,tp,pp,cp,dp", LAYOUTS)
def test_every_factorization_builds_a_grid_with_tp_innermost_then_cp(world, tp, pp, cp, dp):
    dims = ParallelDims(world=world, tp=tp, pp=pp, cp=cp)
    assert dims.dp == dp and dims.tp_enabled == (tp > 1) and dims.pp_enabled == (pp > 1)
    assert dims.cp_enabled == (cp > 1) and dims.zero_ranks == dp * cp
    topo = build_topology(dims)
    assert topo.world_size() == world
    assert (topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("model")) == (pp, dp, tp)
    assert topo.get_dim("seq") == (cp if cp > 1 else 0)  # no seq axis without context parallelism
    for rank in range(world):
        coord = topo.get_coord(rank)
        # tensor peers are consecutive ranks, context peers next: rank = ((pipe*dp + data)*cp + seq)*tp + model
        assert rank == ((coord.pipe * dp + coord.data) * cp + getattr(coord, "seq", 0)) * tp + coord.model
    tp_groups = topo.get_axis_comm_lists("model")
    if tp > 1:
        assert all(group == list(range(group[0], group[0] + tp)) for group in tp_groups)
    if cp > 1:
        assert all(group == list(range(group[0], group[0] + cp * tp, tp)) for group in topo.get_axis_comm_lists("seq"))


@pytest.mark.parametrize("world,tp,pp", [(8, 3, 1), (6, 2, 2), (2, 4, 1)])
def test_world_not_divisible_names_the_choices(world, tp, pp):
    with pytest.raises(UserError, match=r"not divisible by tp\*pp\*cp") as err:
        ParallelDims(world=world, tp=tp, pp=pp)
    assert "\n" not in str(err.value)


LLAMA = dict(num_heads=4, num_kv_heads=2, num_layers=2)


@pytest.mark.parametrize("dims,kwargs,match", [
    (ParallelDims(world=4, tp=4), dict(LLAMA), r"parallel.tp=4: does not divide num_key_value_heads=2; choose tp in \{1, 2\}"),
    (ParallelDims(world=3, tp=3), dict(LLAMA), r"parallel.tp=3: does not divide num_attention_heads=4; choose tp in \{1, 2, 4\}"),
    (ParallelDims(world=4, pp=4), dict(LLAMA), r"parallel.pp=4: exceeds num_hidden_layers=2; choose pp in 1..2"),
    (ParallelDims(world=4, tp=2), dict(LLAMA, ranks_per_node=1), r"parallel.tp=2: exceeds the 1 ranks on one node"),
    (ParallelDims(world=8, tp=2, pp=2), dict(LLAMA, dp=4), r"parallel.dp=4: but world 8 / \(tp\*pp\*cp = 4\) = 2"),
    (ParallelDims(world=8, cp=8), dict(LLAMA), r"parallel.cp=8: does not divide the 4 attention heads; choose cp in \{1, 2, 4\}"),
    (ParallelDims(world=8, tp=2, cp=4), dict(LLAMA), r"parallel.cp=4: does not divide the 2 attention heads per tensor rank \(tp=2\)"),
    (ParallelDims(world=3, cp=3), dict(num_heads=6, num_kv_heads=2, num_layers=2),
     r"parallel.cp=3: neither divides nor is a multiple of the 2 key/value heads; choose cp in \{1, 2\} or a multiple of 2"),
    (ParallelDims(world=4, cp=2), dict(LLAMA, seq_len=63), r"parallel.cp=2: does not divide data.seq_len=63"),
    (ParallelDims(world=4, cp=2, pp=2), dict(LLAMA), r"parallel.cp=2: does not compose with parallel.pp=2.*supported: "),
    (ParallelDims(world=6, zero_stage=3, zero_hpz=4), dict(LLAMA),
     r"parallel.zero_hpz=4: does not divide the 6 ranks ZeRO shards across \(dp=6 x cp=1\); choose zero_hpz in \{1, 2, 3, 6\}"),
    (ParallelDims(world=4, zero_stage=2, zero_hpz=2), dict(LLAMA), r"parallel.zero_hpz=2: needs zero_stage=3"),
    (ParallelDims(world=4, tp=2, zero_stage=3, zero_hpz=2), dict(LLAMA), r"parallel.zero_hpz=2: does not compose with parallel.tp=2"),
])
def test_layout_rules(dims, kwargs, match):
    with pytest.raises(UserError, match=match):
        check_layout(dims, **kwargs)


def test_a_fitting_layout_passes():
    check_layout(ParallelDims(world=8, tp=2, pp=2), num_heads=32, num_kv_heads=8, num_layers=32,
                 ranks_per_node=8, dp=2)
    check_layout(ParallelDims(world=8, cp=4, zero_stage=3, zero_hpz=8), num_heads=32, num_kv_heads=8,
                 num_layers=32, seq_len=4096, dp=2)
    # Ulysses copies key/value heads when cp is a multiple of them (MQA at cp 4)
    check_layout(ParallelDims(world=4, cp=4), num_heads=8, num_kv_heads=1, num_layers=2, seq_len=64)


def test_model_layout_reads_heads_kv_heads_and_layers_from_the_config():
    from transformers import GPT2Config, LlamaConfig

    llama = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, hidden_size=64)
    check_model_layout(ParallelDims(world=2, tp=2), llama)
    with pytest.raises(UserError, match="does not divide num_key_value_heads=2"):
        check_model_layout(ParallelDims(world=4, tp=4), llama)
    with pytest.raises(UserError, match="exceeds num_hidden_layers=2"):
        check_model_layout(ParallelDims(world=4, pp=4), llama)
    gpt2 = GPT2Config(n_head=4, n_layer=3, n_embd=64)  # no kv heads: they are the heads
    check_model_layout(ParallelDims(world=4, tp=4), gpt2)
    with pytest.raises(UserError, match="exceeds the 2 ranks on one node"):
        check_model_layout(ParallelDims(world=4, tp=4), gpt2, ranks_per_node=2)


@pytest.mark.parametrize("overrides,match", [
    (["parallel.pp=2", "parallel.zero_stage=2"], "parallel.pp=2: needs zero_stage 0 or 1"),
    (["parallel.pp=2", "parallel.zero_stage=3"], "parallel.pp=2: needs zero_stage 0 or 1"),
    (["parallel.partition_method=best"], "must be parameters, uniform or type:<regex>"),
    (["parallel.partition_method=type:("], "invalid regex"),
    (["parallel.tp=0"], "parallel.tp=0"),
    (["parallel.cp=0"], "parallel.cp=0"),
    (["parallel.cp=2", "parallel.pp=2"], r"^parallel.cp=2: does not compose with parallel.pp=2.*supported: tp x pp x dp"),
    (["parallel.zero_hpz=2", "parallel.zero_stage=2"], r"^parallel.zero_hpz=2: needs zero_stage=3"),
    (["parallel.zero_hpz=2", "parallel.zero_stage=3", "parallel.tp=2"], r"^parallel.zero_hpz=2: does not compose with"),
    (["parallel.zero_quantized=gradients"], r"^parallel.zero_quantized='gradients': is not offered: .*CPU backend"),
])
def test_static_parallel_rules(overrides, match):
    with pytest.raises(UserError, match=match):
        build_run_config({}, overrides)


def test_pipeline_with_zero_1_and_regex_partition_is_fine():
    run = build_run_config({}, ["parallel.pp=2", "parallel.zero_stage=1", "parallel.partition_method=type:Decoder"])
    assert run.parallel.pp == 2 and run.parallel.partition_method == "type:Decoder"


@pytest.mark.parametrize("dims", [ParallelDims(world=8, tp=2, pp=2, zero_stage=1),
                                  ParallelDims(world=8, cp=2, zero_stage=3, zero_hpz=4)])
def test_a_manifest_stores_and_reads_the_whole_layout(dims):
    """Every axis, the ZeRO stage and hpZ; dp is written for a reader's eye and derived on reading."""
    stored = dims.as_dict()
    assert stored["dp"] == dims.dp and ParallelDims.from_dict(stored) == dims
    assert ParallelDims.from_dict(stored, zero_stage=0).zero_stage == dims.zero_stage  # the manifest's wins


@pytest.mark.parametrize("old,want", [
    ({"world": 4, "tp": 2, "pp": 1, "dp": 2}, ParallelDims(world=4, tp=2, zero_stage=1)),  # the first form
    ({"world": 4, "tp": 1, "pp": 1, "cp": 2, "dp": 2}, ParallelDims(world=4, cp=2, zero_stage=1)),
    ({"world": 4, "tp": 1, "pp": 1, "dp": 4, "zero_stage": 3}, ParallelDims(world=4, zero_stage=3)),
    ({"world": 4, "tp": 1, "pp": 1, "cp": 1, "dp": 4, "zero_stage": 3, "zero_hpz": 2},
     ParallelDims(world=4, zero_stage=3, zero_hpz=2)),
])
def test_older_manifest_forms_still_read(old, want):
    """A manifest written before cp, zero_stage or zero_hpz were recorded: the missing axes are 1 and
    the missing stage the reader's (a resume's own; checkpoint.saved_layout passes it)."""
    assert ParallelDims.from_dict(old, zero_stage=1) == want


def test_the_layout_renders_as_one_text():
    assert str(ParallelDims(world=8, tp=2, pp=2)) == "tp 2 x pp 2 x cp 1 x dp 2"
    assert str(ParallelDims(world=8, cp=2, zero_stage=3, zero_hpz=2)) == "tp 1 x pp 1 x cp 2 x dp 4, hpZ 2"


def test_export_reads_the_tensor_parallel_size_the_checkpoint_was_saved_at(tmp_path):
    """A run trained at tp 2 and resumed at tp 1 keeps its run.yaml (tp: 2); its new checkpoint's
    manifest says tp 1, and that is what export reads. Without a manifest: run.yaml's."""
    import json

    from dsframework.checkpoints import checkpoint as ckpt
    from dsframework.checkpoints.export import tensor_parallel_size

    (tmp_path / ckpt.RUN_YAML).write_text("parallel:\n  tp: 2\n")
    for tag, layout in (("global_step2", ParallelDims(world=2, tp=2, zero_stage=1)),
                        ("global_step4", ParallelDims(world=2, zero_stage=1))):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / ckpt.MANIFEST).write_text(json.dumps({"step": 0, "layout": layout.as_dict(), "files": {}}))
    (tmp_path / "global_step1").mkdir()
    assert [tensor_parallel_size(tmp_path, tag) for tag in ("global_step1", "global_step2", "global_step4")] == [2, 2, 1]
