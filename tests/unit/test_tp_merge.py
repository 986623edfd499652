"""Merging tensor-parallel shards (what `dsf export` does for tp > 1, through its own reader)
gives back the dense weights exactly: the plans' shards of a dense model, merged, equal it bit for bit, including
vocab padding (a vocabulary not divisible by tp) and GPT-2's per-head q|k|v split."""
from __future__ import annotations

import copy

import pytest
import torch

from dsframework.config import ModelSpec
from dsframework.models.build import build_model, resolve_model
from dsframework.checkpoints.export import TensorParallelReader, TensorReader, weights_to_write
from dsframework.models.tensor_parallel import shard_layouts, shard_model
from dsframework.parallel.tensor import LayoutOnlyGroup


def dense_model(name: str, vocab: int = 61):
    source = resolve_model(ModelSpec(name=name))
    source.config.vocab_size = vocab  # 61: padded to 62 at tp=2, to 64 at tp=4
    return build_model(source, source.config, seed=3)


def shards_of(model, tp: int) -> list[dict[str, torch.Tensor]]:
    """Each tensor rank's state dict, as the plan slices it (no process group needed)."""
    return [shard_model(copy.deepcopy(model), group=LayoutOnlyGroup(size=tp, rank=rank)).state_dict()
            for rank in range(tp)]


def export_merge(shards: list[dict[str, torch.Tensor]], model) -> dict[str, torch.Tensor]:
    """What `dsf export` writes from the tp ranks' tensors: {name: dense tensor}, a tied weight once."""
    reader = TensorParallelReader([TensorReader(shard, mapped=frozenset()) for shard in shards], model.config)
    return {name: reader.read(found) for name, (found, _) in weights_to_write(model, reader, where="test").items()}


@pytest.mark.parametrize("name,tp", [("tiny-llama", 2), ("tiny-gpt2", 2), ("tiny-gpt2", 4)])
def test_merged_shards_equal_the_dense_model(name, tp):
    model = dense_model(name)
    shards = shards_of(model, tp)
    assert shards[0]["lm_head.weight"].shape[0] == 128, "each rank holds a padded vocab slice (128 rows: Megatron's)"
    merged = export_merge(shards, model)
    want = model.state_dict()
    left_out = set(want) - set(merged)  # only second names of a tied weight (written once, tied on load)
    assert all(any(want[n].data_ptr() == want[m].data_ptr() for m in merged) for n in left_out), left_out
    assert set(merged) <= set(want) and len(merged) == len({t.data_ptr() for t in want.values()})
    for key, tensor in ((k, want[k]) for k in merged):
        assert merged[key].shape == tensor.shape, key
        assert torch.equal(merged[key], tensor), key


def test_layouts_mark_padding_and_fused_heads():
    model = dense_model("tiny-gpt2")
    config = model.config
    layouts = shard_layouts(config, 2)
    dim, index, _ = layouts[0]["transformer.wte.weight"]  # 61 rows padded to 128 x tp
    assert dim == 0 and index.tolist() == [*range(61), *[-1] * 67]  # rank 0: rows 0..60 and 67 pad rows
    assert layouts[1]["transformer.wte.weight"][1].tolist() == [-1] * 128  # rank 1: padding alone
    dim, rows, transposed = layouts[0]["transformer.h.0.attn.c_attn.weight"]
    hidden, half = config.n_embd, config.n_embd // 2
    assert transposed and dim == 0 and rows.tolist() == [*range(0, half), *range(hidden, hidden + half),
                                          *range(2 * hidden, 2 * hidden + half)]  # q, k, v heads of rank 0
    assert "transformer.h.0.ln_1.weight" not in layouts[0], "norms are replicated"


def test_ranks_disagreeing_on_a_replicated_tensor_is_an_error():
    model = dense_model("tiny-llama")
    shards = shards_of(model, 2)
    shards[1]["model.norm.weight"] = shards[1]["model.norm.weight"] + 1
    with pytest.raises(ValueError, match="model.norm.weight"):
        export_merge(shards, model)


def test_a_tied_copy_missing_from_a_rank_is_left_to_the_tie():
    """zero_to_fp32 may list a tied weight (GPT-2's lm_head.weight) under one name only."""
    model = dense_model("tiny-gpt2")
    shards = shards_of(model, 2)
    del shards[1]["lm_head.weight"]
    merged = export_merge(shards, model)
    assert "lm_head.weight" not in merged
    assert torch.equal(merged["transformer.wte.weight"], model.state_dict()["transformer.wte.weight"])
