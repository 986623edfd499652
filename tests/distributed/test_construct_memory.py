"""No rank holds more than its share while the model is built: a 348M-parameter Llama (hidden
1024, 24 layers, vocab 32000; built, not trained) at tp2, pp2, tp2 x pp2 and tp2 x dp2 under
ZeRO-3. Each rank's peak resident memory (VmHWM) at the end of construction, less its peak after
building a tiny model first in the same process (the process baseline), is at most 1.3 x that rank's share of the
parameters plus the largest single tensor (the one dense tensor a rank may hold while it cuts
its shard). A dense build needs the whole model on every rank (1.4 GB here): see docs/parallel-layouts.md's
"Sharded construction" figures, measured with the same worker and --dense."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import launch

WORKER = Path(__file__).parent / "workers" / "construct_memory.py"
BIG = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
       "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8,
       "max_position_embeddings": 512}
TINY = dict(BIG, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
LAYOUTS = {  # name: (worker flags, ranks)
    "tp2": (["--tp", "2"], 2),
    "pp2": (["--pp", "2"], 2),
    "tp2_pp2": (["--tp", "2", "--pp", "2"], 4),
    "tp2_dp2_zero3": (["--tp", "2", "--zero3"], 4),
}
MB = 2**20


def measure(tmp_path: Path, flags: list[str], ranks: int) -> tuple[list[dict], list[dict]]:
    """(big, tiny) records per rank: one launch builds TINY (the baseline), then BIG."""
    paths = []
    for name, config in (("tiny", TINY), ("big", BIG)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(config))
    out = tmp_path / "out"
    launch([str(WORKER), str(out), *map(str, paths), *flags], num_ranks=ranks)
    records = {name: [json.loads((out / f"rank{r}-{name}.json").read_text()) for r in range(ranks)]
               for name in ("big", "tiny")}
    return records["big"], records["tiny"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_builds_only_its_share(tmp_path, layout):
    flags, ranks = LAYOUTS[layout]
    big, tiny = measure(tmp_path, flags, ranks)
    assert big[0]["total"] > 300e6 * 4, "the bound means something only for a big model"
    for got, baseline in zip(big, tiny):
        share = got["held"]  # what the rank keeps: its tensor shard of its stage (/ dp under ZeRO-3)
        growth = got["vm_hwm"] - baseline["vm_hwm"]
        bound = 1.3 * share + got["largest"]
        print(f"{layout} rank {got['rank']}: peak +{growth / MB:.0f} MB, share {share / MB:.0f} MB, "
              f"bound {bound / MB:.0f} MB, dense model {got['total'] / MB:.0f} MB")
        assert growth <= bound, (layout, got["rank"], growth / MB, bound / MB)
        assert share < 0.6 * got["total"], "each rank keeps a part, not the model"
        if got["zero3"]:
            assert got["partitioned"], "ZeRO-3 x tp: every parameter partitioned at construction"
            assert share <= 0.3 * got["total"], "a quarter of the model: tp2, then dp2"
