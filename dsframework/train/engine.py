"""`dsf train`: a thin loop over `deepspeed.initialize`, one process per rank.

    deepspeed --num_gpus 2 $(which dsf) train launch/examples/tiny.yaml --set train.steps=50
    # or, in Python, inside each rank:
    from dsframework.config import load_run_config
    from dsframework.train.engine import train
    train(load_run_config("launch/examples/tiny.yaml"), resume=False)

Reads top to bottom: world -> output dir check -> tokenizer and data -> model (partitioned under
ZeRO-3) -> deepspeed.initialize -> optional resume -> loop of DeepSpeed steps with logging,
evaluation and checkpoints. DeepSpeed does gradient accumulation, clipping, the lr schedule and
ZeRO; this file only feeds it the right blocks and records what happened.
"""
from __future__ import annotations

import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.checkpoints.reshard import reshard, universal_tag
from dsframework.config import RunConfig, dump_run_config
from dsframework.data import (
    BlockSampler,
    eval_shard,
    load_texts,
    load_tokenizer,
    store_cache_dir,
    token_stores,
    train_tokenizer,
)
from dsframework.data.examples import use_chat_template
from dsframework.data.store import IGNORE_INDEX, describe_store
from dsframework.dsconfig import Batch, build_ds_config, resolve_batch
from dsframework.errors import UserError
from dsframework.layout import ParallelDims, check_model_layout
from dsframework.models.build import build_model, resolve_model
from dsframework.models.hf import count_parameters
from dsframework.models.construct import build_for_layout
from dsframework.models.lora import apply_lora
from dsframework.models.loss import check_chunked_loss_layout, use_chunked_loss
from dsframework.models.tensor_parallel import TensorParallelCausalLM
from dsframework.parallel.context import SequenceShard, sequence_shard_loss, use_ulysses_attention, zero_gradient_scale
from dsframework.parallel.pipeline import build_pipeline_module, stage_table
from dsframework.parallel.topology import build_grid, build_topology
from dsframework.runtime_facts import loss_chunk_tokens, loss_is_chunked, padded_vocab
from dsframework.train.compiling import (
    AUTO_PROBE_STEPS,
    auto_compile,
    compile_engine,
    compile_seconds,
    use_inductor_cache,
)
from dsframework.train.guards import NonFiniteWatch, StopRequest
from dsframework.train.metrics import check_no_previous_outputs, open_sinks, remove_previous_outputs
from dsframework.train.throughput import FlopsMeter
from dsframework.train.world import init_distributed, rank_zero_first


class Preempted(Exception):
    """Training stopped on SIGTERM after saving a checkpoint (`dsf train` exits 143)."""


def mean_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


# --- output directory ---------------------------------------------------------------------------

def check_output_dir(run: RunConfig, *, resume: bool, overwrite: bool) -> dict[str, Any] | None:
    """Refuse to clobber a previous run: resume it, or overwrite it only when asked to.

    On resume, checks every file of the latest checkpoint is there at its saved size and returns
    its manifest (None for a checkpoint without one)."""
    if resume and overwrite:
        raise UserError("--resume/--overwrite", None, "are mutually exclusive", "pass only one")
    tag = ckpt.latest_tag(run.checkpoint_dir)
    has_checkpoint = tag is not None
    if resume and has_checkpoint and not (run.checkpoint_dir / tag).is_dir():
        raise UserError("checkpoint", str(run.checkpoint_dir / "latest"), f"names {tag!r}, which is not there",
                        "restore that checkpoint folder or point `latest` at one that exists")
    has_metrics = (Path(run.output_dir) / "metrics.jsonl").exists()
    if resume and not has_checkpoint:
        raise UserError("output_dir", run.output_dir, "holds no checkpoint to resume from",
                        "run without --resume to start training")
    if not resume and not overwrite and (has_checkpoint or has_metrics):
        raise UserError("output_dir", run.output_dir, "already holds a run",
                        "pass --resume to continue it, --overwrite to replace it, "
                        "or --set output_dir=NEW_DIR")
    if not resume and not overwrite:  # TensorBoard / CSV directories outside output_dir
        check_no_previous_outputs(run.logging)
    return ckpt.verify(run.checkpoint_dir, tag) if resume else None


def resume_tag(run: RunConfig, dims: ParallelDims, manifest: dict[str, Any] | None, config: Any) -> tuple[str, bool]:
    """(tag to load, whether it is a universal checkpoint) for resuming at `dims`.

    The ZeRO stage and the model stay as saved (the model is checked before this is called);
    tp, pp and dp may change, with the same global batch. Rank 0 converts the checkpoint once and
    every rank then loads its new shard of it (`checkpoint.load_universal`):
    - dp alone, at tp = pp = 1, ZeRO-1/2/3: deepspeed's ds_to_universal (`checkpoint.to_universal`);
    - tp or pp (and dp beside them), ZeRO-1/2: `reshard.reshard`, through the dense layout.
    ZeRO-0 states are whole on every rank of a layout: dp may change, tp and pp may not. ZeRO-3 with
    tensor parallelism, and context parallelism, resume at their saved layout only (cp itself may not
    change; zero_hpz may).
    """
    import torch.distributed

    tag = ckpt.latest_tag(run.checkpoint_dir)
    # (a manifest from before the ZeRO stage was recorded: taken to be this run's)
    was = ckpt.saved_layout(manifest, zero_stage=dims.zero_stage)
    if was is None:  # written before manifests: its layout is unknown, taken to be this one
        return tag, False
    stage = dims.zero_stage
    if was.zero_stage != stage:
        raise UserError("parallel.zero_stage", stage, f"differs from the checkpoint's {was.zero_stage} (a "
                        "resume keeps the ZeRO stage; tp, pp and dp may change)",
                        f"resume with parallel.zero_stage={was.zero_stage}")
    # zero_hpz may change: DeepSpeed never saves hpZ's secondary copy (same files, same tensors).
    if was.cp != dims.cp:
        raise UserError("parallel.cp", dims.cp, f"differs from the checkpoint's {was.cp} (a resume "
                        "keeps the context-parallel size; tp, pp and dp may change)",
                        f"resume with parallel.cp={was.cp}")
    if (was.tp, was.pp, was.dp) == (dims.tp, dims.pp, dims.dp):
        return tag, False
    if dims.cp_enabled:  # (the universal-checkpoint conversions below are not tested with cp's ZeRO groups)
        raise UserError("parallel.cp", dims.cp, f"runs resume at their saved layout only (saved {was}, now {dims})",
                        f"resume on {was.world} ranks with parallel.tp={was.tp}")
    change, keep = f"{was} -> {dims}", f"resume with parallel.tp={was.tp} parallel.pp={was.pp}"
    layers_move = (was.tp, was.pp) != (dims.tp, dims.pp)
    if stage == 0:
        if not layers_move:
            return tag, False
        raise UserError("parallel.zero_stage", 0, f"cannot resume at another tp or pp ({change}): ZeRO-0 "
                        "keeps its optimizer states in each layout's own files", keep)
    if stage == 3 and (was.tp_enabled or dims.tp_enabled):
        raise UserError("parallel.zero_stage", 3, f"with tensor parallelism resumes only at its saved layout "
                        f"({change}): DeepSpeed's universal loader does not cut a ZeRO-3 parameter into tensor "
                        "shards", f"{keep} on {was.world} ranks")
    dp_only = not layers_move and not dims.tp_enabled and not dims.pp_enabled
    target = tag + ckpt.UNIVERSAL if dp_only else universal_tag(tag, dims)
    with rank_zero_first():
        if torch.distributed.get_rank() == 0:
            print(f"dsf: resuming at {dims} from a checkpoint saved at {was}: "
                  f"converting {tag} into {target}", flush=True)
            if dp_only:
                ckpt.to_universal(run.checkpoint_dir, tag)
            else:
                reshard(run.checkpoint_dir, tag, config, saved=was, target=dims)
    return target, True


# --- the loop -----------------------------------------------------------------------------------

def _obtain_tokenizer(run: RunConfig, source: Any, texts: Any, *, resume: bool, rank: int) -> Any:
    """The run's tokenizer: the checkpoint's on resume, else the user's or the pretrained model's,
    else one trained on the data by rank 0 (the other ranks load what rank 0 saved)."""
    saved = run.checkpoint_dir / ckpt.TOKENIZER_DIR
    if resume and saved.is_dir():
        return load_tokenizer(saved, field="checkpoint tokenizer")
    if run.model.tokenizer:
        return load_tokenizer(run.model.tokenizer)
    if source.tokenizer_dir is not None:
        return load_tokenizer(source.tokenizer_dir, field="model.name")
    if rank == 0:
        return train_tokenizer(texts, run.data)
    return load_tokenizer(saved, field="checkpoint tokenizer")


def _check_same_model(run: RunConfig, config: Any) -> None:
    """On resume, the model config must be the checkpoint's (else its weights will not load)."""
    from transformers import AutoConfig

    saved = run.checkpoint_dir / ckpt.HF_CONFIG_DIR
    if not (saved / "config.json").is_file():
        return
    before = AutoConfig.from_pretrained(str(saved), local_files_only=True).to_dict()
    now = config.to_dict()
    changed = sorted(k for k in set(before) | set(now)
                     if not k.startswith("_") and k not in ("transformers_version", "architectures", "dtype")
                     and before.get(k) != now.get(k))
    if changed:
        key = changed[0]
        raise UserError(f"model (config.{key})", now.get(key), f"differs from the checkpoint's "
                        f"{before.get(key)!r}", "resume with the model settings the run started with")


def step_batches(blocks: Any, sampler: BlockSampler, consumed: int) -> list:
    """This rank's micro-batches of one step: rows copied out of the token store (data/store.py).

    With chat / prompt-completion data each carries the weight that makes the sum of its trained
    tokens' losses a share of the mean over the trained tokens of the whole global batch (every rank
    counts them in the same rows: no communication)."""
    weight = None
    if blocks.supervised:
        ranks_times_accum = sampler.dp_size * sampler.grad_accum  # DeepSpeed averages over both
        weight = ranks_times_accum / max(blocks.trained_tokens(sampler.global_indices(consumed)), 1)
    return [blocks.micro_batch(indices, weight=weight) for indices in sampler.micro_batches(consumed)]


def micro_batch_loss(engine: Any, input_ids: Any, *, grid: Any = None, context: bool = False,
                     tensor_group: Any = None, vocab_size: int = 0, gradient_scale: float = 1.0,
                     chunked: bool = False) -> tuple[Any, Any]:
    """(the loss to backpropagate, the micro-batch's mean loss detached) for whole sequences.

    With context parallelism each rank runs its slice of the sequences and backpropagates its
    share of the mean (parallel/context.py); otherwise the model's own causal LM loss. A
    supervised micro-batch (a dict, data/store.py) gives the sum of its trained tokens' losses
    times its loss_weight: examples packed in a row see only themselves (position ids restart at
    each example; transformers then masks attention block-diagonally)."""
    if isinstance(input_ids, dict):
        # Counted on the host copy: no device sync. Never 0: every packed example keeps a trained label.
        trained = int((input_ids["labels"][..., 1:] != IGNORE_INDEX).sum())
        batch = {key: value.to(engine.device) for key, value in input_ids.items() if key != "loss_weight"}
        mean = engine(**batch, use_cache=False).loss  # over this micro-batch's trained tokens
        loss = mean * (trained * input_ids["loss_weight"])
        return loss, loss.detach()
    input_ids = input_ids.to(engine.device)
    if context:
        return sequence_shard_loss(engine, SequenceShard.of(input_ids, grid), grid=grid, tensor_group=tensor_group,
                                   vocab_size=vocab_size, gradient_scale=gradient_scale, chunked=chunked)
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    return loss, loss.detach()


def _train_step(engine: Any, micro_batches: list, *, pipeline: bool, **loss_kw: Any) -> Any:
    """One optimizer step over this rank's micro-batches; their mean loss (a float64 tensor).
    `loss_kw` go to `micro_batch_loss` (looked up in this module at each call: the fault tests'
    worker wraps it)."""
    import torch

    if pipeline:  # DeepSpeed's pipeline engine runs the 1F1B schedule over all micro-batches
        data = iter([(ids, ids) for ids in micro_batches])
        return engine.train_batch(data_iter=data).detach().double()
    total = torch.zeros((), dtype=torch.float64)
    for input_ids in micro_batches:
        loss, value = micro_batch_loss(engine, input_ids, **loss_kw)
        engine.backward(loss)
        engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
        total += value.double()
    return total / len(micro_batches)


def _evaluate(engine: Any, eval_blocks: Any, *, micro_batch: int, dp_size: int, dp_rank: int,
              pipeline: bool, **loss_kw: Any) -> float:
    """Mean loss over the held-out blocks, every rank running the same number of forwards
    (all micro-batches hold the same number of blocks); with chat / prompt-completion data, the
    mean over every trained token of the held-out rows."""
    import torch
    import torch.distributed as dist

    shard = eval_shard(len(eval_blocks), micro_batch=micro_batch, dp_size=dp_size, dp_rank=dp_rank)
    if eval_blocks.supervised:
        engine.eval()
        with torch.no_grad():
            sums = torch.zeros(2, dtype=torch.float64)  # (summed loss, trained tokens) of this rank's rows
            for indices in shard:
                sums[0] += micro_batch_loss(engine, eval_blocks.micro_batch(indices, weight=1.0), **loss_kw)[1].item()
                sums[1] += eval_blocks.trained_tokens(indices)
        engine.train()
        dist.all_reduce(sums)  # (tensor ranks hold the same rows: both sums count them alike)
        return (sums[0] / sums[1].clamp(min=1)).item()
    batches = [eval_blocks[indices] for indices in shard]
    engine.eval()
    with torch.no_grad():
        if pipeline:
            mean = engine.eval_batch(iter([(ids, ids) for ids in batches]),
                                     num_micro_batches=len(batches)).item()
        else:
            mean = sum(micro_batch_loss(engine, ids, **loss_kw)[1].item() for ids in batches) / max(len(batches), 1)
    engine.train()
    return mean_over_ranks(mean)


class StepBreakdown:
    """Milliseconds per optimizer step in forward, backward, the gradient reduction DeepSpeed waits
    for at the end of backward (exposed communication) and the optimizer step, averaged over a
    logging window, from DeepSpeed's wall-clock timers (`wall_clock_breakdown`, on with
    logging.breakdown; rank 0 reports its own).

    DeepSpeed resets its timers after every step (printing them), keeping a copy for clients:
    `get_wall_clock_timers()`, read here once per step - a dict, no device synchronisation.
    """

    TIMERS = {"forward_ms": "fwd", "backward_ms": "bwd", "allreduce_ms": "bwd_allreduce", "optimizer_ms": "step"}

    def __init__(self, engine: Any, *, enabled: bool) -> None:
        self.engine, self.enabled = engine, enabled
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add_step(self) -> None:
        if not self.enabled:
            return
        timers = self.engine.get_wall_clock_timers() or {}
        for key, name in self.TIMERS.items():
            if name in timers:
                self.sums[key] = self.sums.get(key, 0.0) + timers[name]
        self.steps += 1

    def read(self) -> dict[str, float]:
        out = {key: total / self.steps for key, total in self.sums.items()} if self.steps else {}
        self.sums, self.steps = {}, 0
        return out


@dataclass
class Session:
    """Everything a rank needs to train: the engine, its data and where in the run it stands."""

    run: RunConfig
    rank: int
    dims: ParallelDims
    dp_rank: int
    batch: Batch
    engine: Any
    tokenizer: Any
    train_blocks: Any
    eval_blocks: Any
    num_parameters: int
    model_config: Any
    step: int = 0
    consumed_samples: int = 0
    built: Any = None  # tp/pp: what this rank materialised and read (models.construct.Materialized)
    grid: Any = None  # tp or cp: the mpu deepspeed.initialize got (parallel.topology.build_grid)
    loss_chunk_tokens: int | None = None  # the causal LM loss in chunks of this many tokens (models/loss.py)

    @property
    def loss_kw(self) -> dict[str, Any]:
        """How `micro_batch_loss` computes this run's loss (context parallelism, vocab-parallel)."""
        if not self.dims.cp_enabled:
            return {}

        return {"grid": self.grid, "context": True, "vocab_size": self.model_config.vocab_size,
                "tensor_group": self.grid.get_slice_parallel_group() if self.dims.tp_enabled else None,
                "gradient_scale": zero_gradient_scale(cp=self.dims.cp, zero_stage=self.dims.zero_stage),
                "chunked": self.loss_chunk_tokens is not None}


def loss_chunking(run: RunConfig, config: Any, dims: ParallelDims, micro_batch: int) -> int | None:
    """Tokens per chunk of the causal LM loss (train.chunked_loss), or None for the whole logits.
    The pipeline's last stage gets its logits from its head layer and keeps the plain loss."""
    if dims.pp_enabled:  # (true is refused before the run starts: check_chunked_loss_layout)
        return None
    rows = padded_vocab(config.vocab_size, tp=dims.tp) // dims.tp  # this rank's vocab slice
    tokens = micro_batch * run.data.seq_len // dims.cp
    if not loss_is_chunked(run.train.chunked_loss, tokens=tokens, vocab_rows=rows,
                           chunk_tokens=run.train.loss_chunk_tokens):
        return None
    return loss_chunk_tokens(rows, chunk_tokens=run.train.loss_chunk_tokens)


def checked_layout(run: RunConfig, config: Any, *, world: int) -> ParallelDims:
    """tp x pp x cp x dp of `world` ranks, by the rules of parallel.topology for this model config."""
    dims = ParallelDims.of(run.parallel, world=world)
    check_model_layout(dims, config, dp=run.parallel.dp, seq_len=run.data.seq_len,
                       ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return dims


def prepare(run: RunConfig, *, resume: bool = False, overwrite: bool = False) -> Session:
    """World, data, model and DeepSpeed engine; restored from the latest checkpoint on resume."""
    import datasets
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # Everything a user can get wrong is checked before the first byte is written or deleted.
    manifest = check_output_dir(run, resume=resume, overwrite=overwrite)
    check_chunked_loss_layout(run.train.chunked_loss, pp=run.parallel.pp)
    use_inductor_cache()  # (before DeepSpeed imports inductor; train.compile=auto may compile later)
    if run.train.precision == "fp16" and not get_accelerator().is_fp16_supported():
        raise UserError("train.precision", "fp16", f"is not supported on this device ({get_accelerator().device_name()})",
                        "use train.precision=bf16 or fp32")
    datasets.disable_progress_bars()  # rank 0's own progress bar is the one that matters
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated")
    source = resolve_model(run.model)
    # A model or layout that cannot run is named before the process group forms (no rank waits at
    # the rendezvous for it), then checked again at the world the group reports.
    checked_layout(run, source.config, world=int(os.environ.get("WORLD_SIZE", "1")))
    rank, world = init_distributed()
    dims = checked_layout(run, source.config, world=world)
    # The grid hands DeepSpeed its data-parallel group (ZeRO shards and gradients are reduced
    # across it only) and our layers their tensor-parallel group.
    topology = build_topology(dims)
    grid = build_grid(dims) if dims.tp_enabled or dims.cp_enabled else None
    dp_rank = topology.get_coord(rank).data
    ds_config = build_ds_config(run.train, run.parallel, dp_size=dims.dp)
    ds_config["wall_clock_breakdown"] = run.logging.breakdown
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=dims.dp)

    with rank_zero_first():  # rank 0 validates the data and writes the tokenizer; then the others
        texts = load_texts(run.data)
        tokenizer = _obtain_tokenizer(run, source, texts, resume=resume, rank=rank)
        if run.data.format == "chat":
            use_chat_template(tokenizer, run.data)
        train_blocks, eval_blocks = token_stores(texts, tokenizer, run.data, cache_dir=store_cache_dir())
        if run.logging.eval_every and len(eval_blocks) < dims.dp:
            raise UserError("data.eval_fraction", run.data.eval_fraction,
                            f"leaves {len(eval_blocks)} eval blocks for {dims.dp} data-parallel ranks",
                            "raise data.eval_fraction or the amount of data, or set logging.eval_every=0")
        config = source.config_for(tokenizer)
        if resume:
            _check_same_model(run, config)
            ckpt.check_same_adapters(run.checkpoint_dir, run.model.lora)
        elif rank == 0:
            if overwrite:
                shutil.rmtree(run.checkpoint_dir, ignore_errors=True)
                (Path(run.output_dir) / "metrics.jsonl").unlink(missing_ok=True)
                remove_previous_outputs(run.logging)
            run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            tokenizer.save_pretrained(str(run.checkpoint_dir / ckpt.TOKENIZER_DIR))
            ckpt.save_run_files(run.checkpoint_dir, config=config, run_yaml=dump_run_config(run))
    # On resume at another layout, rank 0 converts the checkpoint (the model is checked above).
    load_tag, universal = resume_tag(run, dims, manifest, config) if resume else (None, False)
    if universal:
        ds_config["checkpoint"] = {"load_universal": True}
    # Under ZeRO-3 the model is built partitioned (no rank holds it whole). With tensor or pipeline
    # parallelism it is built on the meta device and each rank materialises only its own shards of
    # its own stage (models/construct.py); under ZeRO-3 those are partitioned as they are made.
    zero3 = ds_config if run.parallel.zero_stage == 3 else None
    checkpointing = run.parallel.activation_checkpointing == "full"
    if dims.tp_enabled or dims.pp_enabled:
        built = build_for_layout(
            source, config, seed=run.train.seed,
            tp_group=grid.get_slice_parallel_group() if dims.tp_enabled else None,
            pipeline=(dims.pp, topology.get_coord(rank).pipe) if dims.pp_enabled else None,
            partition_method=run.parallel.partition_method, zero3_ds_config=zero3,
            mpu=grid)
        model, num_parameters, construction = built.model, built.num_parameters, built.report
    else:
        construction = None
        model = build_model(source, config, seed=run.train.seed, zero3_ds_config=zero3)
        if run.model.lora is not None:  # peft adapters on the frozen base: only they train and are saved
            model = apply_lora(model, run.model.lora, seed=run.train.seed)
        num_parameters = count_parameters(model)
    if dims.pp_enabled:
        # Each stage's LayerSpecs reference the modules this rank materialised (the others are meta).
        model = build_pipeline_module(model, num_stages=dims.pp, partition_method=run.parallel.partition_method,
                                      activation_checkpoint_interval=int(checkpointing), topology=topology)
        if rank == 0:
            print("dsf: pipeline stages" + (f" (parameters per tensor rank of {dims.tp})" if dims.tp_enabled
                                            else "") + "\n" + stage_table(model), flush=True)
    else:
        if checkpointing:  # non-reentrant: works with ZeRO-3's parameter hooks and frozen inputs
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if dims.tp_enabled:
            model = TensorParallelCausalLM(model, group=grid.get_slice_parallel_group())
        if dims.cp_enabled:
            use_ulysses_attention(model, grid, micro_batch=batch.micro_batch, seq_len=run.data.seq_len, tp=dims.tp)
    chunk_tokens = loss_chunking(run, config, dims, batch.micro_batch)
    if chunk_tokens:
        use_chunked_loss(model, chunk_tokens=chunk_tokens)
    # A PipelineModule brings its own grid (DeepSpeed refuses an mpu beside it).
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config,
        mpu=None if dims.pp_enabled else grid)
    if run.train.compile is True:  # (auto decides after timing the first steps: _loop)
        compile_engine(engine)
    session = Session(run, rank, dims, dp_rank, batch, engine, tokenizer, train_blocks, eval_blocks,
                      num_parameters, config, built=construction, grid=grid, loss_chunk_tokens=chunk_tokens)
    if resume:
        state = ckpt.load(engine, run.checkpoint_dir, tag=load_tag)
        session.step, session.consumed_samples = state["step"], state["consumed_samples"]
    return session


def train(run: RunConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train as configured; returns the last logged metrics (on every rank)."""
    session = prepare(run, resume=resume, overwrite=overwrite)
    # Rank 0's metric sinks (metrics.jsonl, TensorBoard, CSV, W&B): closed however the loop ends
    # (done, a UserError, SIGTERM's Preempted), so every file holds every logged step.
    sinks = open_sinks(run, resume_step=session.step if resume else None, enabled=session.rank == 0)
    try:
        return _loop(run, session, sinks, resume=resume)
    finally:
        sinks.close()


def _loop(run: RunConfig, session: Session, sinks: Any, *, resume: bool) -> dict[str, Any]:
    """The steps from where `session` stands to the end (or to train.stop_after, or SIGTERM)."""
    from tqdm import tqdm

    rank, dims, batch, engine = session.rank, session.dims, session.batch, session.engine
    train_blocks, eval_blocks = session.train_blocks, session.eval_blocks
    step, consumed = session.step, session.consumed_samples
    sampler = BlockSampler(len(train_blocks), micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                           dp_size=dims.dp, dp_rank=session.dp_rank, seed=run.data.seed)
    meter = FlopsMeter.for_run(run, session.model_config, world=dims.world)
    breakdown = StepBreakdown(engine, enabled=run.logging.breakdown and not dims.pp_enabled)
    tokens_per_step = batch.global_batch * run.data.seq_len
    if rank == 0:
        print(f"dsf: {session.num_parameters:,} parameters | world {dims.world} = {dims} "
              f"| ZeRO-{dims.zero_stage} | batch {batch.micro_batch} x {batch.grad_accum} x {dims.dp}"
              f" = {batch.global_batch} | {len(train_blocks):,} train / {len(eval_blocks):,} eval "
              f"blocks of {run.data.seq_len} tokens | peak {meter.peak_per_rank / 1e12:.3g} TFLOP/s per rank "
              f"({meter.peak_source}) | compile {str(run.train.compile).lower()} | loss "
              + (f"in chunks of {session.loss_chunk_tokens} tokens" if session.loss_chunk_tokens else "whole logits"),
              flush=True)

        print("dsf: data " + describe_store(train_blocks) + f" | store {train_blocks.directory}", flush=True)

    loss_kw = session.loss_kw  # how each micro-batch's loss is computed (context parallelism)

    def evaluate() -> float:
        return _evaluate(engine, eval_blocks, micro_batch=batch.micro_batch, dp_size=dims.dp,
                         dp_rank=session.dp_rank, pipeline=dims.pp_enabled, **loss_kw)

    last: dict[str, Any] = {}
    if not resume and run.logging.eval_every:
        last = {"step": 0, "eval_loss": evaluate()}  # the baseline the run is judged against
        sinks.log(last, step=0)
    bar = tqdm(total=run.train.steps, initial=step, disable=rank != 0 or not run.logging.progress,
               dynamic_ncols=True, desc="train")
    # Each logging window's tokens/s is over its training time: compile seconds are taken out
    # (reported as compile_s), and so are the evaluation and checkpoints after its last step.
    window_start, window_steps, window_compile = time.perf_counter(), 0, compile_seconds()
    stop = min(run.train.steps, run.train.stop_after or run.train.steps)
    auto = run.train.compile == "auto"  # decided after AUTO_PROBE_STEPS eager steps
    session_steps, probe_start, compiled_note = 0, 0.0, run.train.compile is True
    stop_request = StopRequest()
    nonfinite = NonFiniteWatch(enabled=run.train.precision != "fp16", device=engine.device)

    def check_finite() -> None:
        bad = nonfinite.first_step()
        if bad is not None:
            good = ckpt.latest_tag(run.checkpoint_dir)
            raise UserError("loss", None, f"is not finite (nan or inf) at step {bad}; training stopped, "
                            + (f"{run.checkpoint_dir / good} is the last good checkpoint" if good
                               else "no checkpoint was saved"),
                            "lower train.lr or raise train.warmup_steps, then dsf train --resume")

    while step < stop:
        step_loss = _train_step(engine, step_batches(train_blocks, sampler, consumed),
                                pipeline=dims.pp_enabled, **loss_kw)
        step, consumed, window_steps = step + 1, consumed + batch.global_batch, window_steps + 1
        session_steps += 1
        if auto and session_steps == 1:
            probe_start = time.perf_counter()
        elif auto and session_steps == AUTO_PROBE_STEPS:
            auto = False
            step_seconds = mean_over_ranks((time.perf_counter() - probe_start) / (AUTO_PROBE_STEPS - 1))
            verdict, why = auto_compile(step_seconds=step_seconds, steps_left=stop - step)
            if rank == 0:
                print(f"dsf: train.compile=auto: {why}", flush=True)
            if verdict:
                compile_engine(engine)
                compiled_note = True
        nonfinite.update(step, step_loss)
        breakdown.add_step()
        bar.update(1)
        done = step == stop
        logged = step % run.logging.every == 0 or done
        if logged:
            check_finite()
            loss_value = mean_over_ranks(step_loss.item())
            compiling = compile_seconds() - window_compile
            elapsed = time.perf_counter() - window_start - compiling
            last = {"step": step, "loss": loss_value, "lr": engine.get_lr()[0],
                    "tokens_per_s": tokens_per_step * window_steps / elapsed}
            last.update(meter.report(tokens_per_s=last["tokens_per_s"]))
            last.update(breakdown.read())
            if compiling > 0:
                last["compile_s"] = compiling
            if compiled_note and rank == 0:
                print(f"dsf: compiled the model in {compile_seconds():.1f} s so far (kept out of tokens/s; "
                      f"kernels cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", flush=True)
                compiled_note = False
            if run.logging.eval_every and (step % run.logging.eval_every == 0 or done):
                last["eval_loss"] = evaluate()
            if run.train.precision == "fp16":
                last["skipped_steps"] = engine.skipped_steps  # overflowing steps the loss scaler dropped
            sinks.log(last, step=step)
            bar.set_postfix({k: f"{v:.4g}" for k, v in last.items() if k != "step"}, refresh=False)
            if rank == 0 and not run.logging.progress:
                print("dsf: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in last.items()), flush=True)
        preempted = stop_request.agreed()
        stopped_early = done and step < run.train.steps  # train.stop_after: always with a checkpoint to resume
        if (preempted and not done) or (run.checkpoint.every and step % run.checkpoint.every == 0) or (
                done and run.checkpoint.save_final) or stopped_early:
            check_finite()  # a diverged model is never saved over the last good one
            ckpt.save(engine, run.checkpoint_dir, step=step, consumed_samples=consumed, layout=dims)
        if logged:  # the next window starts after this step's evaluation and checkpoint
            window_start, window_steps, window_compile = time.perf_counter(), 0, compile_seconds()
        if preempted and not done:  # (on the last step the run is simply finished)
            stop_request.close()
            bar.close()
            if rank == 0:
                print(f"dsf: stopped by SIGTERM at step {step}; checkpoint {ckpt.tag_for(step)} saved; "
                      f"continue with `dsf train ... --resume`", flush=True)
            raise Preempted(step)
    stop_request.close()
    bar.close()
    if rank == 0:
        print(f"dsf: done at step {step}; checkpoints in {run.checkpoint_dir}", flush=True)
    return last
