"""The planner's host side: a node's RAM to build the ranks' shares (not dense copies), hold the
offloaded states, and export; the fit rule refuses a layout whose host side does not fit, in
`dsf plan` (search, table, JSON) as in `dsf launch` (check_fit, see test_launch.py)."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from dsframework.commands.cli import cli
from dsframework.config import ModelSpec
from dsframework.layout import ParallelDims
from dsframework.models.build import resolve_model
from dsframework.planner.cluster import GiB, Cluster
from dsframework.planner.fit import HOST_MEMORY_SHARE, check_fit
from dsframework.planner.memory import (BUILD_BYTES, EXPORT_SHARD_BYTES, Workload, Layout, build_bytes_per_rank,
                                        export_bytes, host_memory_per_node, largest_tensor, memory_per_rank,
                                        stage_shapes)
from dsframework.planner.model import describe_model
from dsframework.planner.search import search

LLAMA_7B = describe_model(resolve_model(ModelSpec(name="llama-7b")).config, name="llama-7b")
JOB = Workload(seq_len=2048, global_batch=64, precision="bf16")
# GPUs with room to spare (the device side fits every layout below), on a node with little RAM.
SMALL_HOST = dict(name="h200-small-host", nodes=1, gpus_per_node=8, memory_per_gpu=141e9,
                  peak_flops={"fp32": 67e12, "bf16": 989e12}, cpu_memory_per_node=64 * GiB)
FACTORIZATIONS_OF_8 = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if 8 % (tp * pp) == 0]


def _layout(tp: int, pp: int, zero_stage: int = 1, **kw) -> Layout:
    dp = 8 // (tp * pp)
    return Layout(ParallelDims(world=dp * tp * pp, tp=tp, pp=pp, zero_stage=zero_stage), micro_batch=1, grad_accum=JOB.global_batch // dp, **kw)


def test_largest_tensor_is_the_embedding_of_a_llama():
    assert largest_tensor(LLAMA_7B) == 32000 * 4096


@pytest.mark.parametrize("tp,pp", FACTORIZATIONS_OF_8)
def test_a_rank_builds_its_share_not_the_dense_model(tp, pp):
    """fp32 share of the busiest stage's tensor shard + one dense tensor in flight; ~1/(tp x pp)."""
    layout = _layout(tp, pp)
    got = build_bytes_per_rank(LLAMA_7B, layout)
    share = max(s.params for s in stage_shapes(LLAMA_7B, tp, pp))
    assert got == BUILD_BYTES * (share + largest_tensor(LLAMA_7B))
    dense = BUILD_BYTES * LLAMA_7B.total_params
    assert got - BUILD_BYTES * largest_tensor(LLAMA_7B) <= 1.2 * dense / (tp * pp)  # stages balance within 20%
    if layout.dims.dp > 1:  # ZeRO-3 partitions the share over dp at construction (zero.Init)
        zero3 = build_bytes_per_rank(LLAMA_7B, _layout(tp, pp, zero_stage=3))
        assert zero3 == BUILD_BYTES * (share / layout.dims.dp + largest_tensor(LLAMA_7B))


def test_the_node_figure_is_its_ranks_builds_plus_offload_or_the_export():
    layout = _layout(1, 1, zero_stage=3, offload_optimizer=True, offload_param=True)
    memory = memory_per_rank(LLAMA_7B, layout, JOB)
    host = host_memory_per_node(LLAMA_7B, layout, memory, ranks_per_node=8)
    assert host.build == 8 * build_bytes_per_rank(LLAMA_7B, layout)
    assert host.offload == 8 * memory.cpu_per_rank > 0
    assert host.peak == host.build + host.offload > host.export
    assert host.phase == "to build the model and hold its offloaded states"
    assert set(host.as_dict()) == {"build", "offload", "export", "peak"}


def test_export_holds_one_output_shard_and_one_input_tensor():
    largest = 4 * largest_tensor(LLAMA_7B)
    whole = 4 * LLAMA_7B.total_params
    assert whole < EXPORT_SHARD_BYTES  # 7B in fp32 is one shard at transformers' default
    assert export_bytes(LLAMA_7B) == whole + largest
    assert export_bytes(LLAMA_7B, shard_bytes=5e9) == 5e9 + largest
    assert export_bytes(LLAMA_7B, shard_bytes=1e6) == 2 * largest  # a tensor larger than a shard is its own


@pytest.mark.parametrize("tp,pp", FACTORIZATIONS_OF_8)
def test_the_dense_build_is_refused_where_the_sharded_one_fits(tp, pp):
    """64 GiB of RAM (51.2 usable) for 8 ranks of a 7B model: 8 dense fp32 builds (205 GiB) do not
    fit, 8 eighths (29 GiB) do; the GPUs hold every layout."""
    cluster = Cluster(**SMALL_HOST)
    fit = check_fit(LLAMA_7B, _layout(tp, pp), JOB, cluster)
    assert fit.need <= fit.available, "the device side fits"
    assert fit.host_available == HOST_MEMORY_SHARE * 64 * GiB
    assert fit.fits == (tp * pp == 8)
    if not fit.fits:
        assert re.fullmatch(r"predicted \d+\.\d GiB of host memory per node to build the model > 51\.2 GiB available",
                            fit.why_not), fit.why_not
    if tp * pp == 1:
        assert fit.why_not == "predicted 204.7 GiB of host memory per node to build the model > 51.2 GiB available"
        assert check_fit(LLAMA_7B, _layout(1, 1, zero_stage=3), JOB, cluster).fits, "ZeRO-3 builds partitioned"


def test_an_export_that_does_not_fit_a_host_refuses_the_layout():
    """2 nodes x 4 ranks of tp 4 x pp 2 build 14.5 GiB per node; the 7B export (one 25.1 GiB
    shard + the 0.5 GiB embedding, on one host) does not fit 24 GiB, 5 GB shards do."""
    cluster = Cluster(**{**SMALL_HOST, "nodes": 2, "gpus_per_node": 4, "cpu_memory_per_node": 30 * GiB})
    fit = check_fit(LLAMA_7B, _layout(4, 2), JOB, cluster)
    assert fit.need <= fit.available and fit.host.build < fit.host_available < fit.host.export
    assert fit.why_not == ("predicted 25.6 GiB of host memory per node to export the model (dsf export, one host) "
                           "> 24.0 GiB available")
    smaller_shards = check_fit(LLAMA_7B, _layout(4, 2), JOB, cluster, export_shard_bytes=5e9)
    assert smaller_shards.fits and smaller_shards.host_need == smaller_shards.host.build


def test_dsf_plan_marks_layouts_whose_host_side_does_not_fit(tmp_path):
    plan = search(LLAMA_7B, Cluster(**SMALL_HOST), JOB)
    assert plan.fitting and all(c.layout.dims.tp * c.layout.dims.pp == 8 or c.layout.dims.zero_stage == 3 for c in plan.fitting)
    refused = [c for c in plan.candidates if "of host memory per node" in c.why_not]
    assert any(c.layout.dims.tp == c.layout.dims.pp == 1 and c.layout.dims.zero_stage < 3 for c in refused)
    assert all(c.host.peak > HOST_MEMORY_SHARE * 64 * GiB for c in refused)

    profile = tmp_path / "small-host.json"
    profile.write_text(json.dumps(SMALL_HOST))
    args = ["plan", "--model", "llama-7b", "--cluster", str(profile), "--seq-len", "2048", "--global-batch", "64"]
    table = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert table.exit_code == 0 and "host GiB" in table.output and "64.0 GiB RAM" in table.output
    assert re.search(r"ZeRO-1 \+ offload \(optimizer\): needs \d+\.\d GiB of host memory per node to build the "
                     r"model and hold its offloaded states > 51\.2 GiB at best", table.output), table.output
    records = json.loads(CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False).stdout)["candidates"]
    assert all(set(r["host_memory"]) == {"build", "offload", "export", "peak"} for r in records)
    over = [r for r in records if r["host_memory"]["peak"] > HOST_MEMORY_SHARE * 64 * GiB]
    assert over and not any(r["fits"] for r in over)
    assert any(r["fits"] for r in records)
