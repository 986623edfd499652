"""checkpoints/experts.py without processes: how a streamed AutoEP export puts a weight together from the
pieces of ZeRO partitions, and AutoEP's names back to transformers' (the checkpoints themselves:
tests/distributed/test_export_experts_stream.py and test_experts.py)."""
from __future__ import annotations

import pytest
import torch

from dsframework.checkpoints.experts import _expert_counts, _stitched, transformers_entries
from dsframework.errors import UserError
from dsframework.models.tiny import tiny_config

BLOCK = "model.layers.0.mlp"


def layer(placement: list[list[int]] | None = None, *, block: str = BLOCK, experts: int = 4, ep: int = 2) -> dict:
    """One entry of `ds_autoep_layers` as DeepSpeed 0.19.8 saves it (the fields export reads)."""
    ranks = placement or [list(range(k * experts // ep, (k + 1) * experts // ep)) for k in range(ep)]
    return {"module_path": block, "expert_key_prefix": f"{block}.experts", "num_experts": experts, "ep_size": ep,
            "num_local_experts": experts // ep,
            "expert_placement": {"version": 1, "num_experts": experts, "ep_size": ep,
                                 "ranks": [{"rank": k, "experts": e} for k, e in enumerate(ranks)]}}


def test_a_weight_is_its_pieces_in_partition_order_and_ep_ranks_in_order():
    """Each ep rank's pieces (given in any order) joined by partition rank and cut to the local size
    (the last one's padding dropped); the ep ranks' runs one after the other: [experts, ...]."""
    local = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)  # 2 experts a rank, 12 elements
    pad = torch.full((2,), -1.0)
    found = {f"{BLOCK}.experts.w1": {1: {1: torch.cat([100 + local.flatten()[7:], pad]), 0: 100 + local.flatten()[:7]},
                                      0: {0: local.flatten()[:7], 1: torch.cat([local.flatten()[7:], pad])}},
             "dense": {0: {1: torch.tensor([4.0, 5.0, -1.0]), 0: torch.tensor([1.0, 2.0, 3.0])}}}
    shapes = {f"{BLOCK}.experts.w1": local.shape, "dense": torch.Size([5])}
    entries = _stitched(found, shapes, {f"{BLOCK}.experts.w1": 4}, "ckpt")
    assert torch.equal(entries[f"{BLOCK}.experts.w1"].contiguous(), torch.cat([local, 100 + local]))
    assert torch.equal(entries["dense"].contiguous(), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    with pytest.raises(ValueError, match=r"hold 3 of the 5 elements of dense"):
        _stitched({"dense": {0: {0: torch.ones(3)}}}, shapes, {}, "ckpt")


def test_only_autoeps_default_placement_is_read():
    """Experts k * E/ep ... on ep rank k is the order the runs are joined in; another placement is
    refused rather than written in the wrong order."""
    assert _expert_counts([layer()], "ckpt") == {f"{BLOCK}.experts.{w}": 4 for w in ("w1", "w2", "w3")}
    with pytest.raises(ValueError, match=r"ckpt: AutoEP places the experts of model.layers.0.mlp other than evenly"):
        _expert_counts([layer([[0, 2], [1, 3]])], "ckpt")


def test_autoeps_names_back_to_transformers():
    """router.gate -> gate (its alias gate.gate dropped), gate_up_proj = [w1 | w3] and down_proj = w2
    (Qwen3-MoE's fused layout); experts that do not fit the config are a one-line error."""
    config = tiny_config("qwen3_moe", num_hidden_layers=1)
    experts, ffn, hidden = 4, config.moe_intermediate_size, config.hidden_size
    w1, w3, w2 = (torch.randn(experts, ffn, hidden), torch.randn(experts, ffn, hidden),
                  torch.randn(experts, hidden, ffn))
    router = torch.randn(experts, hidden)
    raw = {f"{BLOCK}.router.gate.weight": router, f"{BLOCK}.gate.gate.weight": router,
           "model.norm.weight": torch.ones(3), f"{BLOCK}.experts.w1": w1, f"{BLOCK}.experts.w3": w3,
           f"{BLOCK}.experts.w2": w2}
    entries = transformers_entries(raw, [layer()], config)
    assert sorted(entries) == sorted([f"{BLOCK}.gate.weight", "model.norm.weight", f"{BLOCK}.experts.gate_up_proj",
                                      f"{BLOCK}.experts.down_proj"])
    assert entries[f"{BLOCK}.gate.weight"] is router
    assert torch.equal(entries[f"{BLOCK}.experts.gate_up_proj"].contiguous(), torch.cat([w1, w3], dim=1))
    assert torch.equal(entries[f"{BLOCK}.experts.down_proj"].contiguous(), w2)
    raw[f"{BLOCK}.experts.w3"] = w3[:, :-1]
    with pytest.raises(UserError, match=r"checkpoint: holds AutoEP experts of shape \(4, 31, 64\) that do not join "
                                        r"into the config's \(4, 64, 64\); export with the hf_config"):
        transformers_entries(raw, [layer()], config)[f"{BLOCK}.experts.gate_up_proj"].contiguous()
