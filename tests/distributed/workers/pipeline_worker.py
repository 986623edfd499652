"""Worker (run under the deepspeed launcher): train cases on DeepSpeed's pipeline engine and
write, per case and rank, the per-step losses, the stage boundaries and the stage table.

    deepspeed --num_gpus 2 pipeline_worker.py OUT_DIR CASE [CASE ...]
    # CASE = model:partition_method:activation_checkpoint_interval:zero_stage[:save]
    # e.g. tiny-llama:parameters:0:1:save  -> OUT_DIR/<case>-rank<r>.json; with save also the
    # checkpoint OUT_DIR/<case>-ckpt and each stage's weights by HF name, OUT_DIR/<case>-stage<s>.pt

It also defines the problem (data, weights, DeepSpeed JSON) that the test's single-process
reference shares: `Case`, `global_batches`, `dense_model`, `ds_config`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dsframework.launching.supervise import exit_process

VOCAB, SEQ, MICRO, ACCUM, STEPS, SEED = 64, 16, 2, 4, 8, 7
GLOBAL = MICRO * ACCUM  # pp2 x dp1: the global batch is micro-batch x accumulation
LR, WARMUP, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, 2, (0.9, 0.95), 1e-8, 0.1, 1.0


@dataclass(frozen=True)
class Case:
    model: str
    partition: str = "parameters"
    ckpt_interval: int = 0
    zero: int = 1
    save: bool = False

    @classmethod
    def parse(cls, text: str) -> "Case":
        model, partition, interval, zero, *save = text.split(":")
        return cls(model, partition, int(interval), int(zero), save == ["save"])

    @property
    def arg(self) -> str:
        return f"{self.model}:{self.partition}:{self.ckpt_interval}:{self.zero}" + (":save" if self.save else "")

    @property
    def name(self) -> str:
        return self.arg.replace(":", "-")


def global_batches() -> torch.Tensor:
    """[STEPS, GLOBAL, SEQ] token ids: arithmetic sequences mod VOCAB (learnable), seeded."""
    gen = torch.Generator().manual_seed(SEED)
    start = torch.randint(0, VOCAB, (STEPS * GLOBAL, 1), generator=gen)
    stride = torch.randint(1, 4, (STEPS * GLOBAL, 1), generator=gen)
    return ((start + stride * torch.arange(SEQ)) % VOCAB).view(STEPS, GLOBAL, SEQ)


def dense_model(model: str):
    """The dense HF model every rank and the reference start from (seeded, vocab VOCAB)."""
    from dsframework.config import ModelSpec
    from dsframework.models.build import build_model, resolve_model

    source = resolve_model(ModelSpec(name=model))
    source.config.vocab_size = VOCAB
    return build_model(source, source.config, seed=SEED)


def scheduler_section() -> dict:
    return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                            "warmup_num_steps": WARMUP, "warmup_type": "linear"}}


def ds_config(case: Case) -> dict:
    return {
        "train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "scheduler": scheduler_section(),
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": case.zero},
        "steps_per_print": 10_000, "wall_clock_breakdown": False,
    }


def micro_batches():
    """(inputs, labels) per micro-batch, all steps in order: what train_batch pulls, ACCUM a step."""
    for batch in global_batches():
        for micro in batch.split(MICRO):
            yield micro, micro


def live_layer_states(pipe) -> dict[int, dict[str, torch.Tensor]]:
    """{layer index: state_dict} of a live PipelineModule's stage, as its layer files hold them
    (a tied layer under its index on this stage)."""
    states = {int(name): child.state_dict() for name, child in pipe.named_children() if name.isdigit()}
    for key, tied in pipe.tied_modules.items():
        local = range(pipe._local_start, pipe._local_stop)
        idx = next(i for i in local if getattr(pipe._layer_specs[i], "key", None) == key)
        states[idx] = tied.state_dict()
    return states


def run_case(case: Case, out_dir: Path) -> None:
    import deepspeed

    from dsframework.models.pipeline import (build_pipeline_module, partition_layers,
                                               pipeline_layer_specs, pipeline_state_dict_to_hf,
                                               stage_table)

    model = dense_model(case.model)
    expected_parts = partition_layers(pipeline_layer_specs(model), 2, case.partition)
    pipe = build_pipeline_module(model, num_stages=2, partition_method=case.partition,
                                 activation_checkpoint_interval=case.ckpt_interval, seed=None)
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()],
                                           config=ds_config(case))
    data = micro_batches()
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    rank = engine.global_rank
    if case.save:  # the layer files DeepSpeed writes, and this stage's weights under HF names
        engine.save_checkpoint(str(out_dir / f"{case.name}-ckpt"), tag="final")
        live = live_layer_states(pipe)  # this stage's layers, mapped to HF names as export maps the files
        torch.save(pipeline_state_dict_to_hf(live, pipe._layer_specs), out_dir / f"{case.name}-stage{engine.stage_id}.pt")
    result = {"losses": losses, "parts": [int(p) for p in pipe.parts], "expected_parts": expected_parts,
              "stage": engine.stage_id, "table": stage_table(pipe),
              "checkpointed": [bool(x) for x in pipe.is_checkpointable_results]}
    (out_dir / f"{case.name}-rank{rank}.json").write_text(json.dumps(result))


def main(argv: list[str]) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from dsframework.train.world import shutdown_distributed
    from dsframework.jit import pin_build_tools, release_shm_buffers

    args = [a for a in argv if not a.startswith("--local_rank")]
    pin_build_tools()  # the same ninja as every other run, or DeepSpeed rebuilds its CPU ops
    out_dir, cases = Path(args[0]), [Case.parse(a) for a in args[1:]]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    release_shm_buffers()  # DeepSpeed never removes its /dev/shm buffers
    for case in cases:
        run_case(case, out_dir)
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    exit_process(0)  # without the interpreter's teardown of gloo's threads (see supervise.exit_process)
