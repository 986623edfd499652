"""Worker (run under the deepspeed launcher): the bytes autograd saves for backward on this rank
when a micro-batch of whole sequences runs context-parallel (DeepSpeed Ulysses over all ranks).

    deepspeed --num_gpus 2 cp_activations.py OUT_DIR MICRO_BATCH SEQ_LEN MODEL [MODEL ...]
    # -> OUT_DIR/<model>-rank<r>.json: {"saved_bytes": ..., "loss": ...}

The model, shard and loss are dsf train's own (build_model, use_ulysses_attention,
SequenceShard, sequence_shard_loss); what is counted is every distinct storage autograd packs,
parameters excluded (as tests/unit/test_planner.py measures the whole-sequence case).
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo, for tests.saved_tensors
from dsframework.config import ModelSpec
from dsframework.models.build import build_model, resolve_model
from dsframework.models.sequence_loss import SequenceShard, sequence_shard_loss
from dsframework.parallel.context import use_ulysses_attention
from dsframework.layout import ParallelDims
from dsframework.parallel.topology import build_grid
from dsframework.launching.supervise import exit_process
from dsframework.train.world import init_distributed, shutdown_distributed
from tests.saved_tensors import saved_bytes

VOCAB = 97


def main(argv: list[str]) -> None:
    out, micro_batch, seq_len, names = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    rank, world = init_distributed()
    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(world=world, cp=world))
    for name in names:
        source = resolve_model(ModelSpec(name=name))
        source.config.vocab_size = VOCAB
        model = build_model(source, source.config, seed=1).train()
        use_ulysses_attention(model, grid, micro_batch=micro_batch, seq_len=seq_len)
        input_ids = torch.randint(0, VOCAB, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
        shard = SequenceShard.of(input_ids, grid)
        measured, loss = saved_bytes(model, lambda: sequence_shard_loss(model, shard, grid=grid, vocab_size=VOCAB)[1].item())
        (out / f"{name}-rank{rank}.json").write_text(json.dumps({"saved_bytes": measured, "loss": loss}))
    shutdown_distributed()
    exit_process(0)


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")])
