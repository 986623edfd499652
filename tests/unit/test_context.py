"""Context parallelism's pure parts: every rank of a context group gets the same samples and its own
slice of each sequence, with global positions and the labels of the whole sequence."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsframework.data import BlockSampler
from dsframework.models.sequence_loss import SequenceShard
from dsframework.parallel.context import zero_gradient_scale
from dsframework.layout import ParallelDims
from dsframework.parallel.topology import build_topology
from dsframework.ports import free_port
from dsframework.train.step import LossSetup, to_device
from tests.device_discipline import DeviceRules

REPO = Path(__file__).resolve().parents[2]


class _Group:
    """The two questions SequenceShard asks the grid."""

    def __init__(self, cp: int, rank: int):
        self.cp, self.rank = cp, rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp

    def get_sequence_parallel_rank(self) -> int:
        return self.rank


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_cover_the_sequence_with_global_positions_and_whole_sequence_labels(cp):
    input_ids = torch.arange(3 * 16).view(3, 16)
    shards = [SequenceShard.of(input_ids, _Group(cp, r)) for r in range(cp)]
    assert torch.equal(torch.cat([s.input_ids for s in shards], dim=1), input_ids)
    assert torch.equal(torch.cat([s.position_ids for s in shards], dim=1), torch.arange(16).expand(3, 16))
    labels = torch.cat([s.labels for s in shards], dim=1)
    assert torch.equal(labels[:, :-1], input_ids[:, 1:]) and (labels[:, -1] == -100).all()
    # every shard divides by the tokens the whole micro-batch predicts: the shares add up to its mean
    assert all(s.predicted == 3 * 15 for s in shards)
    per_token = torch.rand(3, 16)
    shares = [(per_token[:, r * 16 // cp:(r + 1) * 16 // cp] * (s.labels != -100)).sum() / s.predicted
              for r, s in enumerate(shards)]
    assert torch.allclose(sum(shares), per_token[:, :-1].mean())


def test_the_predicted_tokens_are_counted_on_the_host_before_the_ids_move():
    """A micro-batch's count, which each rank divides its share by, read back from the device would
    make a GPU rank wait at every micro-batch: train/step.py's to_device counts the host copy, and
    SequenceShard.of cuts the device ids without reading them."""
    ids = torch.arange(3 * 16).view(3, 16)
    engine = SimpleNamespace(device=torch.device("cpu"))
    moved = to_device(engine, ids, LossSetup(grid=_Group(2, 0)))
    assert moved.predicted == SequenceShard.count(ids) == 3 * 15
    assert to_device(engine, ids).predicted is None  # only the context-parallel loss needs it
    with DeviceRules(host_group=None) as rules:
        shard = SequenceShard.of(moved.batch, _Group(2, 1), predicted=moved.predicted)
    assert rules.syncs == [] and shard.predicted == 3 * 15
    with DeviceRules(host_group=None) as rules:
        SequenceShard.of(moved.batch, _Group(2, 1))
    assert rules.syncs == ["item"]  # counted from the ids it cuts: what a GPU would wait for


@pytest.mark.parametrize("tp,cp,dp", [(1, 2, 1), (1, 2, 2), (2, 2, 1), (1, 4, 2)])
def test_every_rank_of_a_context_group_reads_the_same_samples(tp, cp, dp):
    """The sampler's data-parallel rank is the grid's data coordinate: the context (and tensor)
    ranks of a replica share it, the replicas' shards are disjoint and cover the global batch."""
    topo = build_topology(ParallelDims(world=tp * cp * dp, tp=tp, cp=cp))
    reads = {}
    for rank in range(tp * cp * dp):
        sampler = BlockSampler(100, micro_batch=2, grad_accum=2, dp_size=dp, dp_rank=topo.get_coord(rank).data, seed=3)
        reads[rank] = sampler.micro_batches(consumed_samples=8)
    for rank in reads:
        same_replica = [r for r in reads if topo.get_coord(r).data == topo.get_coord(rank).data]
        assert len(same_replica) == tp * cp and all(reads[r] == reads[rank] for r in same_replica)
    replicas = {topo.get_coord(r).data: sum(reads[r], []) for r in reads}
    assert sorted(sum(replicas.values(), [])) == sorted(BlockSampler(
        100, micro_batch=2, grad_accum=2, dp_size=dp, dp_rank=0, seed=3).global_indices(8))


def test_zero3_gradient_scale_only_where_deepspeed_averages_over_context_ranks():
    assert zero_gradient_scale(cp=2, zero_stage=3) == 2.0
    assert [zero_gradient_scale(cp=2, zero_stage=s) for s in (0, 1, 2)] == [1.0, 1.0, 1.0]
    assert zero_gradient_scale(cp=1, zero_stage=3) == 1.0


@pytest.mark.parametrize("now,match", [
    (dict(world=2, cp=2), r"^parallel.cp=2: runs resume at their saved layout only \(saved tp 1 x pp 1 x cp 2 x "
                          r"dp 2, hpZ 2, now tp 1 x pp 1 x cp 2 x dp 1\); resume on 4 ranks"),
    (dict(world=4, cp=1), r"^parallel.cp=1: differs from the checkpoint's 2"),
])
def test_a_context_parallel_checkpoint_resumes_at_its_layout_only(tmp_path, now, match):
    """Refused before anything is converted or loaded (the universal-checkpoint paths are not tested
    with cp's ZeRO groups); zero_hpz may change (its secondary copy is never saved)."""
    from dsframework.config import build_run_config
    from dsframework.checkpoints.manifest import Manifest
    from dsframework.checkpoints.resume import resume_tag
    from dsframework.errors import UserError

    run = build_run_config({}, [f"output_dir={tmp_path}", "parallel.zero_stage=3", f"parallel.cp={now['cp']}"])
    run.checkpoint_dir.mkdir(parents=True)
    (run.checkpoint_dir / "latest").write_text("global_step4")
    saved = Manifest(step=4, layout={"world": 4, "tp": 1, "pp": 1, "cp": 2, "dp": 2, "zero_stage": 3, "zero_hpz": 2},
                     files={})
    with pytest.raises(UserError, match=match):
        resume_tag(run, ParallelDims.of(run.parallel, world=now["world"]), saved, config=None)
    same = build_run_config({}, [f"output_dir={tmp_path}", "parallel.zero_stage=3", "parallel.cp=2"])
    assert resume_tag(same, ParallelDims.of(same.parallel, world=4), saved, None) == ("global_step4", False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints", "latest"]


# --- Ulysses attention: for the model it was set up for only --------------------------------------

def _ulysses_scope_worker() -> None:
    """(Child process: a real one-rank gloo group) Ulysses set up on model A; model B, built after
    it in the same process without cp, runs transformers' own sdpa: the registry's sdpa entry is
    the one transformers started with, B never reaches the Ulysses wrapper, and B's logits equal
    those of a model built before any of it."""
    import os

    import torch.distributed as tdist
    from deepspeed import comm
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dsframework.config import ModelSpec
    from dsframework.jit import pin_build_tools
    from dsframework.models.build import build_model, resolve_model
    from dsframework.parallel.context import use_ulysses_attention

    pin_build_tools()  # DeepSpeed's comm loads its shm op from dsf's prebuilt cache
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    tdist.init_process_group("gloo", rank=0, world_size=1)
    comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

    class Grid:  # what use_ulysses_attention asks of ContextParallelGrid
        def get_sequence_parallel_world_size(self):
            return 1

        def get_sequence_parallel_group(self):
            return tdist.group.WORLD

    source = resolve_model(ModelSpec(name="tiny-llama"))
    ids = torch.randint(0, source.config.vocab_size, (2, 16))
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    before = build_model(source, source.config, seed=1).eval()(input_ids=ids).logits
    model_a = build_model(source, source.config, seed=1).eval()
    name = use_ulysses_attention(model_a, Grid(), micro_batch=2, seq_len=16)
    calls = []
    wrapper = ALL_ATTENTION_FUNCTIONS[name]
    ALL_ATTENTION_FUNCTIONS.register(name, lambda *a, **k: calls.append(1) or wrapper(*a, **k))
    logits_a = model_a(input_ids=ids).logits
    used_by_a = len(calls)
    other = resolve_model(ModelSpec(name="tiny-llama"))  # a second model of its own (config and all)
    model_b = build_model(other, other.config, seed=1).eval()
    logits_b = model_b(input_ids=ids).logits
    print(json.dumps({"name": name, "a_impl": model_a.config._attn_implementation,
                      "b_impl": model_b.config._attn_implementation, "sdpa_untouched": ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa,
                      "calls_a": used_by_a, "calls_b": len(calls) - used_by_a,
                      "b_equals_fresh": bool(torch.equal(logits_b, before)),
                      "a_close_to_fresh": bool(torch.allclose(logits_a, before, atol=1e-5))}))


@pytest.mark.distributed
def test_ulysses_attention_is_for_the_model_it_was_set_up_for_only():
    proc = subprocess.run([sys.executable, "-c", "from tests.unit.test_context import _ulysses_scope_worker; "
                           "_ulysses_scope_worker()"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    layers = 2  # tiny-llama's decoder layers: A calls the wrapper once per layer, B never
    assert got["a_impl"] == got["name"] != "sdpa" and got["b_impl"] == "sdpa", got
    assert got["sdpa_untouched"] and got["calls_b"] == 0 and got["calls_a"] == layers, got
    assert got["b_equals_fresh"] and got["a_close_to_fresh"], got  # one rank: Ulysses is sdpa
