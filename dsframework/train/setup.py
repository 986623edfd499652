"""`dsf train`'s start-up in phases: from a run config to a DeepSpeed engine ready to train.

    from dsframework.train.setup import prepare
    session = prepare(run, resume=False, overwrite=False)   # in each rank (deepspeed launcher)
    session.engine, session.train_blocks, session.step       # what the loop (train/loop.py) runs

`prepare` runs these phases in order; each is a function that takes what it needs and returns a
value, and each is timed (StartupClock: rank 0 prints the breakdown once the engine is ready):

1. `preflight`: everything a user can get wrong (output directory and that it can be written,
   precision, model and layout, data.seq_len against the model's positions, the predicted memory
   against this node's), checked before a byte is written or deleted and before any rank waits at
   the rendezvous;
2. `form_world`: the process group, the layout at the world it reports, its groups;
3. `load_data`, rank 0 first: the texts, the tokenizer (`obtain_tokenizer`), the token stores and
   the model config, then `claim_outputs` (the output directory written, or the checkpoint's model
   checked against this run's on resume);
4. on resume, the checkpoint tag to load (checkpoints/resume.py, whose `ResumePlan` pre-flight
   read: one saved at another layout is converted first, by rank 0 when only dp changes, else by
   every rank, a share each);
5. the DeepSpeed JSON, built whole (`dsconfig.build_ds_config`) and never edited after;
6. `build_model_for_layout`: the model for this layout (partitioned under ZeRO-3, each rank's own shards with
   tp or pp, wrapped for pp, tp, cp, LoRA, activation checkpointing and the chunked loss);
7. `build_engine`: `deepspeed.initialize` (and `engine.compile()` with train.compile=true);
8. `restore` on resume: the checkpoint's weights, optimizer, schedule, RNG and data position.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, cast

from dsframework.checkpoints import checkpoint as ckpt
from dsframework.checkpoints.outputs import (TRAINER_OUTPUTS, hold_output_dir, refuse_if_held, remove_written,
                                             write_record)
from dsframework.checkpoints.resume import ResumePlan
from dsframework.config import RunConfig, dump_run_config
from dsframework.data import (
    load_texts,
    load_tokenizer,
    store_cache_dir,
    token_stores,
    train_tokenizer,
)
from dsframework.data.examples import use_chat_template
from dsframework.dsconfig import Batch, build_ds_config, resolve_batch
from dsframework.errors import UserError
from dsframework.jit import AdamChoice, adam_choice, load_adam_op
from dsframework.layout import ParallelDims, check_model_layout
from dsframework.models.attention import fork_tensor_parallel_rng, wrap_attention
from dsframework.models.autoep_compat import bridge_output_capture_registry
from dsframework.models.build import ModelSource, build_model, built_line, rank_placement, resolve_model
from dsframework.models.construct import build_for_layout, check_pretrained_files, host_peak
from dsframework.models.hf import causal_lm_class, check_positions, count_parameters
from dsframework.models.lora import apply_lora
from dsframework.models.loss import check_chunked_loss_layout, use_chunked_loss
from dsframework.models.tensor_parallel import (TensorParallelCausalLM, heads_are_split, sequence_parallel_problem,
                                                shard_model, use_sequence_parallel)
from dsframework.parallel.context import ContextParallelGrid, use_ulysses_attention
from dsframework.models.recompute import core_attention, use_selective_recompute
from dsframework.models.pipeline import (
    build_pipeline_module,
    check_model_parallelism,
    stage_table,
)
from dsframework.parallel.host import rank_zero_first
from dsframework.parallel.rng import checkpoint_contexts, seed_tensor_parallel_rng
from dsframework.parallel.tensor import LayoutOnlyGroup
from dsframework.parallel.topology import build_grid, build_topology
from dsframework.planner.cluster import local_cluster, local_gpu_preset
from dsframework.planner.count import model_counts
from dsframework.planner.run_fit import fit_run
from dsframework.runtime_facts import loss_chunking as rank_loss_chunking
from dsframework.train.compiling import compile_engine, use_inductor_cache
from dsframework.train.expert_load import ExpertLoad
from dsframework.train.metrics import check_no_previous_outputs, remove_previous_outputs
from dsframework.train.step import WHOLE, LossSetup
from dsframework.train.world import init_distributed
from dsframework.types import Engine, Grid, HFConfig, accelerator


def prepare(run: RunConfig, *, resume: bool = False, overwrite: bool = False, force: bool = False,
            clock: StartupClock | None = None) -> Session:
    """World, data, model and DeepSpeed engine; restored from the latest checkpoint on resume.
    `clock` (started by `engine.train` as the process's first dsf work) times the phases; `force`
    trains on where the predicted memory does not fit (a warning)."""
    clock = clock or StartupClock()
    with clock.phase("imports"):
        import_libraries()
    with clock.phase("checks"):
        resuming, source = preflight(run, resume=resume, overwrite=overwrite, force=force)
        run = resuming.keep_expert_blocks(run) if resuming else run
        adam = checked_adam(run)
    with clock.phase("rendezvous"):
        world = form_world(run, source)
    if resuming:  # every file of the checkpoint against its checksum, the ranks a share each
        with clock.phase("restore"):
            resuming = resuming.checked(run)
        if world.rank == 0:
            print(resuming.first_line(run), flush=True)
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=world.dims.dp)
    data = load_data(run, source, world, clock, resume=resume, overwrite=overwrite)
    with clock.phase("restore"):  # on resume at another layout, the ranks convert the checkpoint
        load_tag, universal = resuming.load_tag(run, world.dims, data.config) if resuming else (None, False)
    world.sequence_parallel = sequence_parallel_on(run, data.config, world)
    ds_config = build_ds_config(run.train, run.parallel, dp_size=world.dims.dp,
                                wall_clock_breakdown=run.logging.breakdown, load_universal=universal,
                                checkpoint_writer=run.checkpoint.writer, torch_adam=adam.torch_adam,
                                sequence_parallel=world.sequence_parallel)
    with clock.phase("model"):
        model = build_model_for_layout(run, source, data.config, world, ds_config, batch)
    with clock.phase("deepspeed.initialize"):
        engine = build_engine(run, model.module, ds_config, world)
    session = Session(run, world.rank, world.dims, world.dp_rank, batch, engine, data.tokenizer, data.train_blocks,
                      data.eval_blocks, model.num_parameters, data.config, built=model.construction,
                      grid=world.grid, loss_chunk_tokens=model.chunk_tokens,
                      expert_load=None if world.dims.pp_enabled else ExpertLoad.attach(engine.module, data.config),
                      loss_setup=loss_setup(world, data.config, chunked=model.chunk_tokens is not None),
                      sequence_parallel=world.sequence_parallel)
    if load_tag is not None:  # on resume (pre-flight read the checkpoint)
        with clock.phase("restore"), closing_writer_on_error(engine):
            restore(session, load_tag)
    if world.rank == 0:
        print(clock.line(), flush=True)
    return session


# --- the start-up clock -------------------------------------------------------------------------

def process_age() -> float:
    """Seconds since this process started (Linux: /proc), else 0: the interpreter's start-up and
    every import before `prepare` are the first part of the start-up line."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class StartupClock:
    """Seconds per start-up phase, summed per name; `line()` is what rank 0 prints:

        clock = StartupClock()            # counts the process's age so far as imports
        with clock.phase("data"):
            ...
        clock.line()  # 'dsf: start-up 14.2 s = imports 6.1 + checks 0.1 + rendezvous 0.4 + ...'
    """

    PHASES = ("imports", "checks", "rendezvous", "tokenizer", "data", "outputs", "model",
              "deepspeed.initialize", "restore")

    def __init__(self, *, age: float | None = None) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self.seconds["imports"] = process_age() if age is None else age

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def line(self) -> str:
        parts = " + ".join(f"{name} {seconds:.1f}" for name, seconds in self.seconds.items())
        return f"dsf: start-up {sum(self.seconds.values()):.1f} s = {parts}"


# --- the phases ---------------------------------------------------------------------------------

def import_libraries() -> None:
    """The libraries training needs and `dsf --help` does not (each takes seconds to import), so
    that the later phases' times are their own work: datasets, DeepSpeed, and transformers'
    configs and PreTrainedModel (resolving and building any model imports them)."""
    import datasets
    import deepspeed  # noqa: F401
    from transformers import CONFIG_MAPPING, PreTrainedModel  # noqa: F401

    datasets.disable_progress_bars()  # rank 0's own progress bar is the one that matters
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated")


def preflight(run: RunConfig, *, resume: bool, overwrite: bool,
              force: bool = False) -> tuple[ResumePlan | None, Any]:
    """(what a resume starts from, None without --resume; the model's source): everything a user can
    get wrong, checked before the first byte is written or deleted and before the rendezvous."""

    resuming = check_output_dir(run, resume=resume, overwrite=overwrite)
    check_writable(run)
    check_chunked_loss_layout(run.train.chunked_loss, pp=run.parallel.pp)
    use_tf32(run.train.tf32)
    use_inductor_cache()  # (before DeepSpeed imports inductor; train.compile=auto may compile later)
    if run.train.precision == "fp16" and not accelerator().is_fp16_supported():
        raise UserError("train.precision", "fp16", f"is not supported on this device ({accelerator().device_name()})",
                        "use train.precision=bf16 or fp32")
    source = resolve_model(run.model)
    # A model or layout that cannot run is named before the process group forms (no rank waits at
    # the rendezvous for it), then checked again at the world the group reports.
    dims = checked_layout(run, source.config, world=int(os.environ.get("WORLD_SIZE", "1")))
    if source.pretrained_dir is not None and (dims.tp_enabled or dims.pp_enabled):
        check_pretrained_files(source.pretrained_dir, source.config, sliced=True)
    check_model_fits(run, source.config, dims, force=force)
    if int(os.environ.get("RANK", "0")) == 0 and Path(run.output_dir).is_dir():  # every check passed: one run
        hold_output_dir(run.output_dir)  # per output directory from here, held to exit (a new one: at its first write)
    return resuming, source


def use_tf32(setting: bool | str) -> bool:
    """Whether this rank's fp32 matmuls and cuDNN convolutions run in TensorFloat-32 (train.tf32),
    set here for the process: auto turns it on for a CUDA device of compute capability >= 8
    (Ampere, Hopper, Blackwell), true on any CUDA device, false turns it off (torch's full fp32);
    true without a CUDA device is the user's error. Through torch's legacy switches only
    (set_float32_matmul_precision, cudnn.allow_tf32): torch >= 2.9 raises when code reads one API
    after another set the other, and inductor reads the new one, which the legacy one also sets.

        use_tf32("auto")   # True on an H100; False on the CPU (nothing changed there)"""
    import torch

    cuda = accelerator().device_name() == "cuda" and torch.cuda.is_available()
    if setting is True and not cuda:
        raise UserError("train.tf32", True, f"needs a CUDA device; this one is {accelerator().device_name()}",
                        "set train.tf32=auto (on where the GPU has it) or false")
    on = bool(setting) if setting != "auto" else cuda and torch.cuda.get_device_capability() >= (8, 0)
    if on or setting is False:
        torch.set_float32_matmul_precision("high" if on else "highest")
        torch.backends.cudnn.allow_tf32 = on
    return on


def tf32_in_use() -> bool:
    """Whether fp32 CUDA matmuls run in TF32 now (what use_tf32 set): for the run's summary line. Read
    through the new API where torch has it (the legacy getter raises once anything set the new one)."""
    import torch

    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None) or torch.get_float32_matmul_precision()
    return precision in ("tf32", "high", "medium") and accelerator().device_name() == "cuda"


def checked_adam(run: RunConfig) -> AdamChoice:
    """The Adam this run's JSON asks for (jit.adam_choice), its op loaded or built now: a GPU run
    whose optimizer cannot be built stops here in one line, before the rendezvous."""

    offload = run.parallel.offload_optimizer != "none"
    choice = adam_choice(accelerator().device_name(), offload=offload)
    field, value = ("parallel.offload_optimizer", run.parallel.offload_optimizer) if offload else \
        ("train.optimizer", run.train.optimizer)
    load_adam_op(choice, field=field, value=value)
    return choice


@dataclass
class World:
    """This rank in the process group, and the layout's groups."""

    rank: int
    dims: ParallelDims
    topology: Any  # parallel.topology.build_topology
    grid: Grid | None  # tp or cp: the mpu deepspeed.initialize gets (ZeRO reduces over its data-parallel group)
    dp_rank: int
    sequence_parallel: bool = False  # tp > 1: the tensor ranks split the sequence (sequence_parallel_on)

    @property
    def layout_grid(self) -> Grid:
        """`grid`, asked for with tp or cp only (form_world builds it then)."""
        assert self.grid is not None, f"no grid at {self.dims}: form_world builds one for tp or cp"
        return self.grid


def form_world(run: RunConfig, source: ModelSource) -> World:
    """Join the process group and check the layout at the world it reports."""
    rank, world = init_distributed()
    dims = checked_layout(run, source.config, world=world)
    # The grid hands DeepSpeed its data-parallel group (ZeRO shards and gradients are reduced
    # across it only) and our layers their tensor-parallel group.
    topology = build_topology(dims)
    grid = build_grid(dims) if dims.tp_enabled or dims.cp_enabled else None
    return World(rank, dims, topology, grid, topology.get_coord(rank).data)


@dataclass
class Data:
    tokenizer: Any
    train_blocks: Any
    eval_blocks: Any
    config: HFConfig  # the model's transformers config, for this tokenizer


def load_data(run: RunConfig, source: ModelSource, world: World, clock: StartupClock, *, resume: bool,
              overwrite: bool) -> Data:
    """Texts, tokenizer, token stores, model config; the output directory claimed. Rank 0 first: it
    validates the data, writes the token store and the tokenizer; then the others read them."""
    with rank_zero_first():
        with clock.phase("data"):
            texts = load_texts(run.data)
        with clock.phase("tokenizer"):
            tokenizer = obtain_tokenizer(run, source, texts, resume=resume, rank=world.rank)
            if run.data.format == "chat":
                use_chat_template(tokenizer, run.data)
        with clock.phase("data"):
            train_blocks, eval_blocks = token_stores(texts, tokenizer, run.data, cache_dir=store_cache_dir())
            if run.logging.eval_every and len(eval_blocks) < world.dims.dp:
                raise UserError("data.eval_fraction", run.data.eval_fraction,
                                f"leaves {len(eval_blocks)} eval blocks for {world.dims.dp} data-parallel ranks",
                                "raise data.eval_fraction or the amount of data, or set logging.eval_every=0")
        with clock.phase("outputs"):
            config = source.config_for(tokenizer)
            claim_outputs(run, config, tokenizer, resume=resume, overwrite=overwrite, rank=world.rank)
    return Data(tokenizer, train_blocks, eval_blocks, config)


def claim_outputs(run: RunConfig, config: HFConfig, tokenizer: Any, *, resume: bool, overwrite: bool,
                  rank: int) -> None:
    """On resume, check the checkpoint holds this run's model; else rank 0 replaces a previous run
    (with --overwrite) and writes the tokenizer, the model config and run.yaml."""
    if resume:
        _check_same_model(run, config)
        ckpt.check_same_adapters(run.checkpoint_dir, run.model.lora)
    elif rank == 0:
        hold_output_dir(run.output_dir)  # (taken in pre-flight when output_dir was there; else made and taken now)
        if overwrite:  # what the previous run recorded writing, nothing else (output_dir is locked: ours)
            remove_written(run.output_dir, fallback=TRAINER_OUTPUTS)
            remove_previous_outputs(run.logging)
        write_record(run.output_dir, [Path(run.output_dir) / name for name in TRAINER_OUTPUTS])
        run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(run.checkpoint_dir / ckpt.TOKENIZER_DIR))
        ckpt.save_run_files(run.checkpoint_dir, config=config, run_yaml=dump_run_config(run))


@dataclass
class Model:
    module: Any  # what deepspeed.initialize gets: the model, its PipelineModule, or a wrapper
    num_parameters: int
    construction: Any = None  # tp/pp: what this rank materialised and read (models.construct.Materialized)
    chunk_tokens: int | None = None  # the causal LM loss in chunks of this many tokens


def build_model_for_layout(run: RunConfig, source: ModelSource, config: HFConfig, world: World,
                           ds_config: dict[str, Any], batch: Batch) -> Model:
    """The model as this rank trains it: its shards, wrapped for its layout and loss."""
    with host_peak() as peak:  # the host's peak resident memory while this rank builds
        model = materialise(run, source, config, world, ds_config)
    if world.rank == 0:
        print(built_line(model.module, peak), flush=True)
    model.module = wrap_for_layout(run, model.module, world, batch)
    model.chunk_tokens = loss_chunking(run, config, world.dims, batch.micro_batch)
    if model.chunk_tokens:
        use_chunked_loss(model.module, chunk_tokens=model.chunk_tokens)
    return model


def materialise(run: RunConfig, source: ModelSource, config: HFConfig, world: World,
                ds_config: dict[str, Any]) -> Model:
    """Under ZeRO-3 the model is built partitioned (no rank holds it whole). With tensor or pipeline
    parallelism it is built on the meta device and each rank materialises only its own shards of
    its own stage (models/construct.py); under ZeRO-3 those are partitioned as they are made."""
    dims = world.dims
    zero3 = ds_config if run.parallel.zero_stage == 3 else None
    if dims.tp_enabled or dims.pp_enabled:
        built = build_for_layout(
            source, config, seed=run.train.seed,
            tp_group=world.layout_grid.get_slice_parallel_group() if dims.tp_enabled else None,
            pipeline=(dims.pp, world.topology.get_coord(world.rank).pipe) if dims.pp_enabled else None,
            partition_method=run.parallel.partition_method, zero3_ds_config=zero3,
            mpu=world.grid)
        return Model(built.model, built.num_parameters, construction=built.report)
    # ZeRO 0-2: made on the engine's device in the training dtype, module by module (never whole on the host)
    device, dtype = (None, None) if zero3 else rank_placement(run.train.precision)
    model = build_model(source, config, seed=run.train.seed, zero3_ds_config=zero3, device=device, dtype=dtype)
    if run.model.lora is not None:  # peft adapters on the frozen base: only they train and are saved
        model = apply_lora(model, run.model.lora, seed=run.train.seed)
    return Model(model, count_parameters(model))


def wrap_for_layout(run: RunConfig, model: Any, world: World, batch: Batch) -> Any:
    """The pipeline's stages, or the tensor-parallel head and Ulysses attention, and activation
    checkpointing, around this rank's model."""
    dims, checkpointing = world.dims, run.parallel.activation_checkpointing == "full"
    if world.sequence_parallel:
        use_sequence_parallel(model, group=world.layout_grid.get_slice_parallel_group(), regather=not checkpointing)
    if dims.tp_enabled:  # the attention core's own stream, before selective recompute wraps it
        tensor_parallel_streams(run, model, world)
    if run.parallel.activation_checkpointing == "selective":  # inside each layer: every layout runs it
        use_selective_recompute(model)
    if dims.pp_enabled:
        # Each stage's LayerSpecs reference the modules this rank materialised (the others are meta).
        model = build_pipeline_module(model, num_stages=dims.pp, partition_method=run.parallel.partition_method,
                                      activation_checkpoint_interval=int(checkpointing), topology=world.topology)
        if world.rank == 0:
            print("dsf: pipeline stages" + (f" (parameters per tensor rank of {dims.tp})" if dims.tp_enabled
                                            else "") + "\n" + stage_table(model), flush=True)
        return model
    if checkpointing:  # non-reentrant: works with ZeRO-3's parameter hooks and frozen inputs
        # (context_fn: a recompute draws the tensor-parallel stream where the forward did)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, **({"context_fn": checkpoint_contexts} if dims.tp_enabled else {})})
    if dims.tp_enabled:
        model = TensorParallelCausalLM(model, group=world.layout_grid.get_slice_parallel_group())
    if dims.cp_enabled:  # (build_grid's ContextParallelGrid)
        use_ulysses_attention(model, cast(ContextParallelGrid, world.layout_grid), micro_batch=batch.micro_batch,
                              seq_len=run.data.seq_len, tp=dims.tp, core=core_attention(model))
    return model


def sequence_parallel_on(run: RunConfig, config: HFConfig, world: World) -> bool:
    """parallel.sequence_parallel for this model (found on its weightless twin, sharded as tensor
    rank 0 shards it): auto stays off for an architecture that cannot (said once); true refuses it
    in one line."""
    if not run.sequence_parallel:
        return False
    import torch

    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    problem = sequence_parallel_problem(shard_model(model, group=LayoutOnlyGroup(size=world.dims.tp, rank=0)))
    if problem is None:
        return True
    if run.parallel.sequence_parallel is True:
        raise UserError("parallel.sequence_parallel", True, f"cannot split {model.config.model_type}'s sequence "
                        f"between its blocks: {problem}", "set parallel.sequence_parallel=auto or false")
    if world.rank == 0:
        print(f"dsf: sequence parallelism off (auto): {problem}", flush=True)
    return False


def tensor_parallel_streams(run: RunConfig, model: Any, world: World) -> None:
    """tp > 1: each tensor rank's own random stream, seeded from train.seed, drawn by the attention
    core's dropout where its heads are its own (models/tensor_parallel.heads_are_split); the default
    generator stays the same on every tensor rank, for the replicated regions (parallel/rng.py):
    seeded again here, as each rank's build drew from it according to the shards it made."""
    import torch

    torch.manual_seed(run.train.seed)
    seed_tensor_parallel_rng(seed=run.train.seed, tensor_rank=world.layout_grid.get_slice_parallel_rank())
    if heads_are_split(model):
        wrap_attention(model.config, fork_tensor_parallel_rng, tag="tp_rng")


def build_engine(run: RunConfig, model: Any, ds_config: dict[str, Any], world: World) -> Any:
    """`deepspeed.initialize` on the complete JSON; compiled now with train.compile=true (auto
    decides after timing the first steps: train/loop.py)."""
    import deepspeed

    if world.dims.autoep_blocks:
        bridge_output_capture_registry()  # DeepSpeed 0.19.8's AutoEP on transformers 5.24
    # A PipelineModule brings its own grid (DeepSpeed refuses an mpu beside it).
    with ckpt.writer_spared_by_sigterm(run.checkpoint.writer == "decoupled"):  # it may spawn the writer
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=ds_config, mpu=None if world.dims.pp_enabled else world.grid,
            # (DeepSpeed annotates model_parameters as a Module; it takes the parameters, as passed here)
            model_parameters=[p for p in model.parameters() if p.requires_grad])  # pyright: ignore[reportArgumentType]
    if ckpt.use_decoupled_writer(engine):  # checkpoint.writer=decoupled (checkpoints/checkpoint.py)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        sharded_over = world.dims.zero_ranks if world.dims.zero_stage else 1
        ckpt.check_shm_for_snapshot(ckpt.snapshot_bytes(engine.module, zero_ranks=sharded_over), ranks_per_node=local)
    if run.train.compile is True:
        compile_engine(engine)
    return engine


@contextmanager
def closing_writer_on_error(engine: Engine) -> Iterator[None]:
    """End checkpoint.writer=decoupled's process if the block raises (a checkpoint that will not load):
    the run ends before train()'s own close, and the writer would otherwise outlive it, waiting for work."""
    try:
        yield
    except BaseException:
        ckpt.close_writer(engine)
        raise


def restore(session: Session, tag: str) -> None:
    """Load checkpoint `tag` into the engine; the session continues from its step and samples."""
    state = ckpt.load(session.engine, session.run.checkpoint_dir, tag=tag)
    session.step, session.consumed_samples = state["step"], state["consumed_samples"]


# --- what the phases check ----------------------------------------------------------------------

def check_output_dir(run: RunConfig, *, resume: bool, overwrite: bool) -> ResumePlan | None:
    """Refuse to clobber a previous run: resume it, or overwrite it only when asked to, and never a
    directory another run holds (rank 0 takes its lock at the end of pre-flight). On resume,
    what it starts from (checkpoints/resume.ResumePlan: the latest checkpoint, its files checked)."""
    if resume and overwrite:
        raise UserError("--resume/--overwrite", None, "are mutually exclusive", "pass only one")
    if int(os.environ.get("RANK", "0")) == 0:
        refuse_if_held(run.output_dir)
    resuming = ResumePlan.read(run) if resume else None
    if not resume:
        has_checkpoint = ckpt.latest_tag(run.checkpoint_dir) is not None
        has_metrics = (Path(run.output_dir) / "metrics.jsonl").exists()
        if not overwrite and (has_checkpoint or has_metrics):
            raise UserError("output_dir", run.output_dir, "already holds a run",
                            "pass --resume to continue it, --overwrite to replace it, "
                            "or --set output_dir=NEW_DIR")
        if not overwrite:  # TensorBoard / CSV directories outside output_dir
            check_no_previous_outputs(run.logging)
    return resuming


def check_writable(run: RunConfig) -> None:
    """output_dir can be written on this rank's host: a probe file made and removed in it (or in its
    nearest existing parent, where dsf train makes it), and in its checkpoints/ when there is one.
    A read-only filesystem or a file in the way is one line here, not an OSError after the data.

        check_writable(run)   # output_dir='/mnt/ro/run': cannot be written (Read-only file system ...)
    """
    wanted = Path(run.output_dir).absolute()
    place = wanted
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        where = "is a file" if place == wanted else f"lies under {place}, which is a file"
        raise UserError("output_dir", run.output_dir, f"{where}, not a directory",
                        "set output_dir to a directory (--set output_dir=NEW_DIR)")
    for folder in (place, run.checkpoint_dir.absolute()) if run.checkpoint_dir.is_dir() else (place,):
        try:  # os.access would not do: it lets root write anywhere, even where a read-only mount refuses
            handle, probe = tempfile.mkstemp(prefix=".dsf-write-probe-", dir=folder)
            os.close(handle)
            os.unlink(probe)
        except OSError as err:
            raise UserError("output_dir", run.output_dir, f"cannot be written ({err.strerror}: {folder})",
                            "make it writable, or set output_dir to a writable directory") from None


def check_model_fits(run: RunConfig, config: HFConfig, dims: ParallelDims, *, force: bool) -> None:
    """data.seq_len within the model's positions (models/hf.py check_positions: past a learned table
    refused, past unscaled rotary ones a warning from rank 0), and the memory `dsf launch` predicts
    for this layout (planner/run_fit.py fit_run) within this node's: on CPU ranks each rank's share of
    the RAM and the node's RAM to build and offload; on GPU ranks the host's part alone. Every rank
    checks its own node; with --force a refusal is rank 0's warning.

        check_model_fits(run, source.config, dims, force=False)   # llama-7b, 2 CPU ranks, 24 GiB: UserError
    """
    rank0 = os.environ.get("RANK", "0") == "0"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", dims.world)))
    nodes = max(dims.world // ranks, 1)
    cluster, source = local_cluster(nodes=nodes, ranks_per_node=ranks)
    found = None if cluster.is_cpu else local_gpu_preset()
    preset = run.logging.cluster or (found[0] if found else "cpu-local")
    try:
        warning = check_positions(model_counts(config).model, seq_len=run.data.seq_len)
        fit = fit_run(run, config, dims, cluster)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a model the planner cannot count still trains (gemma3n's per-layer
        if rank0:             # widths, llama4's multimodal config): the check is skipped, and said so
            print(f"dsf: warning: pre-flight memory check skipped: the planner cannot count this "
                  f"{getattr(config, 'model_type', 'model')} ({type(err).__name__}: {err})"[:300], file=sys.stderr, flush=True)
        return
    if warning and rank0:
        print(f"dsf: warning: {warning}", file=sys.stderr, flush=True)
    error = fit.refusal(run, source=source, preset=preset, nodes=nodes, ranks_per_node=ranks,
                        device=cluster.is_cpu, verb="train")
    if error is None:
        return
    if not force:
        raise error
    if rank0:
        print(f"dsf: warning: {error}; training anyway (--force)", file=sys.stderr, flush=True)


def checked_layout(run: RunConfig, config: HFConfig, *, world: int) -> ParallelDims:
    """tp x pp x cp x dp of `world` ranks, by the rules of parallel.topology for this model config."""
    dims = ParallelDims.of(run.parallel, world=world)
    check_model_layout(dims, config, dp=run.parallel.dp, seq_len=run.data.seq_len,
                       ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    check_model_parallelism(config, dims, seq_len=run.data.seq_len)
    return dims


def obtain_tokenizer(run: RunConfig, source: ModelSource, texts: Any, *, resume: bool, rank: int) -> Any:
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


def _check_same_model(run: RunConfig, config: HFConfig) -> None:
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


def loss_setup(world: World, config: HFConfig, *, chunked: bool) -> LossSetup:
    """How this rank computes a micro-batch's loss: the model's own, or with context parallelism its
    share over its slice of the sequences (train/step.py LossSetup)."""
    if not world.dims.cp_enabled:
        return WHOLE
    return LossSetup.context_parallel(world.layout_grid, world.dims, vocab_size=config.vocab_size, chunked=chunked)


def loss_chunking(run: RunConfig, config: HFConfig, dims: ParallelDims, micro_batch: int) -> int | None:
    """Tokens per chunk of the causal LM loss (train.chunked_loss), or None for the whole logits:
    runtime_facts.loss_chunking, the decision the planner counts too."""
    return rank_loss_chunking(run.train.chunked_loss, vocab=config.vocab_size, tp=dims.tp, pp=dims.pp, cp=dims.cp,
                              micro_batch=micro_batch, seq_len=run.data.seq_len,
                              chunk_tokens=run.train.loss_chunk_tokens)


@dataclass
class Session:
    """Everything a rank needs to train: the engine, its data and where in the run it stands."""

    run: RunConfig
    rank: int
    dims: ParallelDims
    dp_rank: int
    batch: Batch
    engine: Engine
    tokenizer: Any
    train_blocks: Any
    eval_blocks: Any
    num_parameters: int
    model_config: HFConfig
    step: int = 0
    consumed_samples: int = 0
    built: Any = None  # tp/pp: what this rank materialised and read (models.construct.Materialized)
    grid: Grid | None = None  # tp or cp: the mpu deepspeed.initialize got (parallel.topology.build_grid)
    loss_chunk_tokens: int | None = None  # the causal LM loss in chunks of this many tokens (models/loss.py)
    expert_load: Any = None  # a mixture of experts' router figures (train/expert_load.py), else None
    loss_setup: LossSetup = WHOLE  # how every micro-batch's loss is computed (train/step.py), set once
    sequence_parallel: bool = False  # tp > 1: the tensor ranks split the sequence between blocks

