"""`dsf train` against DeepSpeed and `transformers.Trainer` on the same job: two tables of tokens/s.

    .venv/bin/python bench/compare.py                      # both tables, small-llama; ~25 min on 2 cores (est.)
    .venv/bin/python bench/compare.py --table recommended  # "each tool as its docs recommend"; ~9 min (est.)
    .venv/bin/python bench/compare.py --table stages --stages 2 --repeats 1 --steps 20   # quick look
    .venv/bin/python bench/compare.py --model tiny-llama --seq-len 64   # the per-step overhead (~20 ms steps)
    .venv/bin/python bench/compare.py --smoke              # end to end in 2-4 min (tiny-llama; mostly compile)
    .venv/bin/python bench/compare.py --json               # the same figures for machines

The job (what is trained) is the same in every launch: `--model` (default small-llama: 4 layers,
hidden 256, 2.9M parameters with the counting task's 15-token vocabulary (7.1M at the preset's 8192), where
per-step overhead no longer dominates; tiny-llama shows that overhead), the
counting task's packed blocks (dsframework.data, tokenizer trained once here), `--seq-len`,
`--global-batch`, `--steps`, fp32, AdamW with the same lr schedule and clipping, the same weights
(dsframework.models.build.build_model, same seed, also under zero.Init), the same per-rank order of the
blocks (dsframework.data.BlockSampler; the Trainer gets a dataset laid out so that accelerate's
sharding hands each rank exactly those micro-batches), and a loss read every --log-every steps
(dsf's logging.every, the Trainer's logging_steps), none in between. Every launch is
`deepspeed --num_gpus 2 ...`: 2 CPU ranks with gloo here, one thread each. Launches run in turn
(A B C A B C ...) so drift in the machine hits every way alike.

Table "stages" (--table stages): the cost of each tool at the SAME DeepSpeed JSON, per ZeRO stage:

  A  dsf      `deepspeed --num_gpus 2 $(which dsf) train launch/examples/tiny.yaml --set ...`
  B  raw      this file's `--worker raw`: `deepspeed.initialize(config=ds_config.json)` and a
              forward / backward / step loop, nothing else.
  C  Trainer  this file's `--worker trainer`: `transformers.Trainer` with
              `TrainingArguments(deepspeed=ds_config.json)`.

The JSON is dsframework.dsconfig.build_ds_config of the run config, written once per stage (B and C
read the file, dsf builds the identical dict itself); micro-batch --micro-batch for all three.

Table "recommended" (--table recommended): the same job, each tool configured as its docs recommend:

  dsf      the plan: `dsf plan --model M --cluster C --nodes 1 --gpus-per-node 2 --seq-len S
           --global-batch G --precision fp32 -o DIR` (C: a `dsf calibrate --ranks 2` profile of
           this machine, or --cluster), whose run.yaml is used as written (layout, ZeRO stage and
           knobs, micro-batch) with only the job's fields put in (model, data, steps, optimizer, lr
           schedule, logging), plus `--set train.compile=true --set train.chunked_loss=true`.
  docs     the Trainer with the ZeRO-3 JSON of transformers' DeepSpeed guide
           (docs/source/en/deepspeed.md, "ZeRO-3"; HF_DOCS_ZERO3 below): "auto" values filled by
           the Trainer; its `offload_optimizer` / `offload_param` to the CPU dropped unless
           --docs-offload (the guide offers them for when GPU memory runs out; CPU ranks have no
           device memory to save, and offload only adds copies and swaps in DeepSpeed's CPU Adam).
  axolotl  the Trainer with Axolotl's preset deepspeed_configs/zero3.json (AXOLOTL_ZERO3 below),
           as is: its bf16/fp16 "auto" resolve to off from the TrainingArguments, so fp32 on
           CPU forces no change.

Both Trainer JSONs get the job's optimizer and lr schedule as "auto"-filled sections (AdamW, the
WarmupCosineLR dsf uses; the docs' and Axolotl's own YAML set these beside the JSON), per-device
batch --micro-batch, torch.compile off (neither preset turns it on). The final-loss check: each
Trainer's last-step loss must be within --loss-tolerance (relative) of dsf's, else the table says
DIFFERS. The table gives tokens/s per tool (median of --repeats launches) with its spread, compile
seconds separately (dsf's `compile_s`, from its metrics; the first window is outside tokens/s
anyway), and dsf / the better Trainer (goal in issue 14: >= 1.2 on this machine), with the range
over launches (worst dsf / best Trainer .. best dsf / worst Trainer).

Tokens/s of one launch = tokens / wall seconds on rank 0 over steps --warmup-steps-excluded+1 ..
--steps (start-up, compilation, the first steps and the final clean-up are not timed). For dsf that
is read from its metrics.jsonl windows (`tokens_per_s` every logging.every steps, the first windows
left out); B and C take time.perf_counter() at the same step boundaries. The stages table gives,
per ZeRO stage, the median launch of each way, the ratios dsf/raw and dsf/Trainer of the medians,
and each way's spread ((max - min) / median over its launches), then the loss at the last step
(mean over the global batch; the three should agree closely, since they train the same thing) and
each way's wall seconds per launch (start-up included), and its overhead: the launch less its timed
steps and (dsf) its compile seconds, i.e. start-up, the untimed first steps and tear-down (dsf prints
its start-up phases as `dsf: start-up ...` in each launch.log). Logs of every launch are kept under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dsframework.ports import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY_YAML = REPO / "launch" / "examples" / "tiny.yaml"
WORLD = 2  # ranks of every launch
WAYS = {"dsf": "dsf train", "raw": "raw DeepSpeed", "trainer": "HF Trainer"}
TOOLS = {"dsf": "dsf train, its plan + compile + chunked loss", "docs": "HF Trainer, transformers docs' ZeRO-3",
         "axolotl": "HF Trainer, Axolotl zero3.json"}

# transformers' DeepSpeed guide (huggingface/transformers docs/source/en/deepspeed.md at 019da1e8): the
# "ZeRO-3" example's zero_optimization, with the top-level keys of the guide's complete "auto" config.
HF_DOCS_ZERO3 = {
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
# Axolotl's preset (axolotl-ai-cloud/axolotl deepspeed_configs/zero3.json at 2341b2c0), as is.
AXOLOTL_ZERO3 = {
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "auto_cast": False, "loss_scale": 0, "initial_scale_power": 32,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
# What the job is (the same in every launch), as opposed to how a tool runs it: the train fields put
# into the plan's run.yaml (its model, data, logging and checkpoint sections are the job's whole).
JOB_TRAIN_FIELDS = ("steps", "global_batch", "optimizer", "lr", "betas", "eps", "weight_decay", "grad_clip",
                    "lr_schedule", "warmup_steps", "min_lr_ratio", "precision", "seed")


# --- the shared run -----------------------------------------------------------------------------

def run_overrides(args: argparse.Namespace, *, stage: int, tokenizer_dir: Path, output_dir: Path) -> list[str]:
    """The `--set` overrides of tiny.yaml all three ways train with."""
    return [f"model.name={args.model}", f"model.tokenizer={tokenizer_dir}", "data.dataset=counting",
            "data.num_examples=2000", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}",
            f"train.global_batch={args.global_batch}", f"train.micro_batch={args.micro_batch}",
            "train.grad_accum=null", "train.warmup_steps=2", "train.precision=fp32",
            f"parallel.zero_stage={stage}", f"logging.every={args.log_every}", "logging.eval_every=0",
            "logging.progress=false", "checkpoint.every=0", "checkpoint.save_final=false",
            f"output_dir={output_dir}"]


def save_tokenizer(directory: Path) -> None:
    """Train the task's tokenizer once, so every launch has the same vocabulary (and model)."""
    from dsframework.config import load_run_config
    from dsframework.data import load_texts, train_tokenizer

    run = load_run_config(TINY_YAML, ["data.dataset=counting", "data.num_examples=2000"])
    train_tokenizer(load_texts(run.data), run.data).save_pretrained(str(directory))


def dsf_ds_config(overrides: list[str]) -> dict:
    """The DeepSpeed JSON `dsf train` builds for this run config at dp=2."""
    from dsframework.config import load_run_config
    from dsframework.dsconfig import build_ds_config

    run = load_run_config(TINY_YAML, overrides)
    return build_ds_config(run.train, run.parallel, dp_size=WORLD)


def trainer_ds_config(preset: dict, job: dict, *, keep_offload: bool = False) -> dict:
    """A tool's preset JSON for the Trainer, plus the job's optimizer and lr schedule (`job`: dsf's
    JSON of the job) with "auto" wherever the Trainer fills a value from its TrainingArguments."""
    config = json.loads(json.dumps(preset))
    if not keep_offload:
        for key in ("offload_optimizer", "offload_param"):
            config["zero_optimization"].pop(key, None)
    optimizer, scheduler = job["optimizer"], job["scheduler"]
    config["optimizer"] = {"type": optimizer["type"], "params": dict.fromkeys(optimizer["params"], "auto")}
    config["scheduler"] = {"type": scheduler["type"],
                           "params": {**scheduler["params"], "total_num_steps": "auto", "warmup_num_steps": "auto"}}
    return config


def planned_run_yaml(plan_yaml: Path, job_overrides: list[str], path: Path) -> dict:
    """`dsf plan -o`'s run.yaml as written (layout, ZeRO stage and knobs, micro-batch) with the job's
    fields put in; written to `path`. Returns its train and parallel sections."""
    import yaml

    from dsframework.config import load_run_config

    job = load_run_config(TINY_YAML, job_overrides).model_dump(mode="json")
    planned = yaml.safe_load(plan_yaml.read_text())
    for section in ("model", "data", "logging", "checkpoint"):
        planned[section] = job[section]
    planned["train"].update({k: job["train"][k] for k in JOB_TRAIN_FIELDS})
    path.write_text(yaml.safe_dump(planned, sort_keys=False))
    return {"train": planned["train"], "parallel": planned["parallel"]}


# --- launching ----------------------------------------------------------------------------------


def launch(script_and_args: list[str], log: Path, *, world: int = WORLD) -> tuple[int, float]:
    """`deepspeed --num_gpus <world> <script> <args>` (2 ranks here), one thread per rank, output to
    `log`; (exit code, wall seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    env.pop("RANK", None)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()), *script_and_args]
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=1800).returncode
    return code, time.perf_counter() - start


def fail(way: str, code: int, log: Path, *, label: str) -> None:
    lines = log.read_text(errors="replace").splitlines()
    errors = [line.strip() for line in lines if re.search(r"(Error|Exception|Assertion)\b.*:", line)]
    last = (errors or [line.strip() for line in lines if line.strip()] or ["no output"])[-1][:300]
    sys.exit(f"{way} ({label}) failed (exit {code}): {last}\n  log: {log}")


def run_way(way: str, args: argparse.Namespace, *, out: Path, overrides: list[str], ds_json: Path | None = None,
            dsf_yaml: Path = TINY_YAML) -> dict:
    """One launch of one way (dsf: `dsf train dsf_yaml`; raw or trainer: this file's worker on
    `ds_json`), `overrides` its --set list; its record: tokens_per_s, final_loss, final_lr, launch_s,
    engine (and compile_s for dsf)."""
    sets = [a for o in overrides for a in ("--set", o)]
    if way == "dsf":
        cmd = [str(BIN / "dsf"), "train", str(dsf_yaml), *sets, "--overwrite"]
    else:
        cmd = [str(Path(__file__).resolve()), "--worker", way,
               "--ds-config", str(ds_json), "--record", str(out / "record.json"),
               "--steps", str(args.steps), "--log-every", str(args.log_every),
               "--warmup-steps-excluded", str(args.warmup_steps_excluded), *sets]
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").unlink(missing_ok=True)
    code, wall = launch(cmd, out / "launch.log")
    if code:
        fail(way, code, out / "launch.log", label=" ".join(cmd[:3]) if way == "dsf" else f"--worker {way}")
    if way == "dsf":
        record = dsf_record(out, args)
        banner = re.search(r"ZeRO-(\d)", (out / "launch.log").read_text())
        record["engine"] = {"zero_stage": int(banner.group(1)) if banner else None}
    else:
        record = json.loads((out / "record.json").read_text())
    return {**record, "launch_s": wall}


def dsf_record(out: Path, args: argparse.Namespace) -> dict:
    """Tokens/s over the logged windows after the excluded steps: tokens / the windows' seconds."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    logged = [m for m in records if "tokens_per_s" in m]
    tokens_per_step = args.global_batch * args.seq_len
    seconds, previous = 0.0, 0
    for m in logged:
        if m["step"] > args.warmup_steps_excluded:
            seconds += tokens_per_step * (m["step"] - previous) / m["tokens_per_s"]
        previous = m["step"]
    timed = args.steps - args.warmup_steps_excluded
    return {"tokens_per_s": tokens_per_step * timed / seconds, "train_s": seconds,
            "final_loss": logged[-1]["loss"], "final_lr": logged[-1]["lr"], "compile_s": compile_seconds(out, records)}


def compile_seconds(out: Path, records: list[dict]) -> float | None:
    """dsf's compile seconds: the last `compile_s` of its metrics.jsonl (a running total; else of its
    log); None when it did not compile."""
    seconds = [float(r["compile_s"]) for r in records if r.get("compile_s") is not None] or \
        [float(s) for s in re.findall(r"\bcompile_s[=: ]+([\d.]+)", (out / "launch.log").read_text(errors="replace"))]
    return seconds[-1] if seconds else None


# --- the workers (one process per rank, under the launcher) -------------------------------------

class StepClock:
    """perf_counter at the end of each step (rank 0's is the one reported); tokens/s between two."""

    def __init__(self, *, tokens_per_step: int):
        self.tokens_per_step, self.times = tokens_per_step, {}

    def tick(self, step: int, *, boundary: bool) -> None:
        if boundary:  # a no-op on CPU; on a GPU the queued work must be done before the clock is read
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()
        self.times[step] = time.perf_counter()

    def tokens_per_s(self, first: int, last: int) -> float:
        return self.tokens_per_step * (last - first) / (self.times[last] - self.times[first])


def rank_inputs(overrides: list[str], ds_config: dict):
    """What every way shares, built by dsframework: run config, batch, packed blocks, model."""
    import datasets
    import torch.distributed as dist

    from dsframework.config import load_run_config
    from dsframework.data import load_texts, load_tokenizer, store_cache_dir, token_stores
    from dsframework.dsconfig import resolve_batch
    from dsframework.models.build import build_model, resolve_model

    datasets.disable_progress_bars()  # as dsf does
    run = load_run_config(TINY_YAML, overrides)
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch,
                          dp_size=dist.get_world_size())
    tokenizer = load_tokenizer(run.model.tokenizer)
    train_blocks, _ = token_stores(load_texts(run.data), tokenizer, run.data, cache_dir=store_cache_dir())
    source = resolve_model(run.model)
    # Partitioned at construction under ZeRO-3, as dsf and the Trainer (HF's zero.Init) do.
    zero3 = ds_config if ds_config.get("zero_optimization", {}).get("stage") == 3 else None
    model = build_model(source, source.config_for(tokenizer), seed=run.train.seed, zero3_ds_config=zero3)
    return run, batch, train_blocks, model


def engine_facts(engine, ds_json: Path) -> dict:
    """What the DeepSpeed engine really runs with, and the keys of its config that differ from the file."""
    given = engine.config if isinstance(engine.config, dict) else json.loads(Path(engine.config).read_text())
    want = json.loads(ds_json.read_text())
    zero = {k: v for k, v in given.get("zero_optimization", {}).items() if k != "stage"}
    return {"zero_stage": engine.zero_optimization_stage(), "zero_optimization": zero,
            "optimizer": type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__,
            "scheduler": type(engine.lr_scheduler).__name__, "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "grad_accum": engine.gradient_accumulation_steps(), "grad_clip": engine.gradient_clipping(),
            "json_differs": {k: str(given.get(k)) for k in sorted(set(given) | set(want))
                             if given.get(k) != want.get(k)}}


def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


def raw_worker(overrides: list[str], ds_json: Path, record_path: Path, *, excluded: int) -> None:
    """B: deepspeed.initialize on the JSON file and a plain loop; rank 0 writes its record."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from dsframework.jit import pin_build_tools, release_shm_buffers

    pin_build_tools()  # the JIT-built CPU ops of this environment, as dsf uses (not rebuilt elsewhere)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    release_shm_buffers()
    rank = dist.get_rank()
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    run, batch, blocks, model = rank_inputs(overrides, json.loads(ds_json.read_text()))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=str(ds_json))
    clock, final_loss = plain_loop(engine, run, batch, blocks, excluded=excluded)
    steps = run.train.steps
    if rank == 0:
        write_record(record_path, {"tokens_per_s": clock.tokens_per_s(excluded, steps),
                                   "train_s": clock.times[steps] - clock.times[excluded], "final_loss": final_loss,
                                   "final_lr": engine.get_lr()[0], "engine": engine_facts(engine, ds_json)})
    dist.barrier()
    dist.destroy_process_group()


def plain_loop(engine, run, batch, blocks, *, excluded: int, after_step=None) -> tuple[StepClock, float | None]:
    """The raw way's loop: each rank's micro-batches of dsf's BlockSampler, forward / backward / step,
    the loss read every logging.every steps; (rank 0's clock, the last logged loss). `after_step(step)`
    runs after each step's update, before the loss is read (the caller's own measurements)."""
    import torch
    import torch.distributed as dist

    from dsframework.data import BlockSampler

    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = BlockSampler(len(blocks), micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                           dp_size=world, dp_rank=rank, seed=run.data.seed)
    steps, every = run.train.steps, run.logging.every
    clock = StepClock(tokens_per_step=batch.global_batch * run.data.seq_len)
    final_loss = None
    for step in range(1, steps + 1):
        losses = []
        for indices in sampler.micro_batches((step - 1) * batch.global_batch):
            input_ids = blocks[indices].to(engine.device)
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        if after_step is not None:
            after_step(step)
        if step % every == 0:  # the one host synchronisation: the logged loss, mean over ranks
            mean = torch.stack(losses).mean().double()
            dist.all_reduce(mean)
            final_loss = mean.item() / world
            if rank == 0:
                print(f"raw: step={step} loss={final_loss:.4g}", flush=True)
        clock.tick(step, boundary=step in (excluded, steps))
    return clock, final_loss


class OrderedBlocks:
    """A torch map-style dataset of packed blocks in a given order; labels = input_ids."""

    def __init__(self, blocks, order: list[int]):
        self.blocks, self.order = blocks, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        ids = self.blocks[self.order[i]]
        return {"input_ids": ids, "labels": ids}


def trainer_order(run, batch, num_blocks: int, world: int) -> list[int]:
    """Block order that makes accelerate's sharding (batch b of a sequential loader goes to rank
    b % world) hand each rank the micro-batches BlockSampler gives it in dsf."""
    from dsframework.data import BlockSampler

    samplers = [BlockSampler(num_blocks, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                             dp_size=world, dp_rank=r, seed=run.data.seed) for r in range(world)]
    order = []
    for step in range(run.train.steps):
        per_rank = [s.micro_batches(step * batch.global_batch) for s in samplers]
        for k in range(batch.grad_accum):
            for r in range(world):
                order += per_rank[r][k]
    return order


def trainer_worker(overrides: list[str], ds_json: Path, record_path: Path, *, excluded: int) -> None:
    """C: transformers.Trainer with deepspeed=<the JSON>; rank 0 writes its record."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from deepspeed.accelerator import get_accelerator
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from dsframework.config import load_run_config
    from dsframework.dsconfig import resolve_batch
    from dsframework.jit import pin_build_tools, release_shm_buffers

    pin_build_tools()
    # TrainingArguments(deepspeed=...) starts accelerate's state without a backend, which on a
    # machine without CUDA leaves it a world of one (every rank trains on all the data, alone).
    # Starting that state first, for DeepSpeed with the accelerator's backend (gloo on CPU), is
    # accelerate's way in; the TrainingArguments then use it (use_configured_state).
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    state = PartialState(backend=get_accelerator().communication_backend_name())
    release_shm_buffers()
    rank, world = state.process_index, state.num_processes
    assert world == dist.get_world_size() == WORLD, f"accelerate sees {world} processes"
    run = load_run_config(TINY_YAML, overrides)
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=world)
    t = run.train
    args = TrainingArguments(
        output_dir=str(record_path.parent / "trainer"), deepspeed=str(ds_json),
        accelerator_config={"use_configured_state": True},
        max_steps=t.steps, per_device_train_batch_size=batch.micro_batch, gradient_accumulation_steps=batch.grad_accum,
        # Must equal the JSON's values (HF refuses a mismatch); the JSON's optimizer and scheduler run.
        learning_rate=t.lr, adam_beta1=t.betas[0], adam_beta2=t.betas[1], adam_epsilon=t.eps,
        weight_decay=t.weight_decay, max_grad_norm=t.grad_clip, warmup_steps=t.warmup_steps,
        bf16=False, fp16=False, seed=t.seed, train_sampling_strategy="sequential",
        logging_strategy="steps", logging_steps=run.logging.every, eval_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, log_level="warning", dataloader_num_workers=0,
        dataloader_pin_memory=False, dataloader_drop_last=True, remove_unused_columns=False,
        torch_compile=False)  # activation checkpointing is off by default
    # As HF builds a model under ZeRO-3: after the TrainingArguments, inside zero.Init with their
    # DeepSpeed config (the file with the Trainer's "auto" values filled).
    run, batch, blocks, model = rank_inputs(overrides, args.hf_deepspeed_config.config)
    clock = StepClock(tokens_per_step=batch.global_batch * run.data.seq_len)
    facts = {}

    class Clock(TrainerCallback):
        """Times step ends; after the last one, that step's loss from the Trainer's running sum
        `_tr_loss`, to which each micro-batch adds (its summed token losses) / (tokens of the global
        batch) * world: the sum over ranks / world is the global batch's mean loss, as dsf logs it."""

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == t.steps - 1:
                facts["before_last"] = trainer._tr_loss.clone()

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            clock.tick(step, boundary=step in (excluded, t.steps))
            if step == t.steps:
                last = (trainer._tr_loss - facts["before_last"]).double()
                dist.all_reduce(last)
                facts["final_loss"] = last.item() / world

    dataset = OrderedBlocks(blocks, trainer_order(run, batch, len(blocks), world))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Clock()])
    trainer.train()
    if rank == 0:
        engine = trainer.model_wrapped
        write_record(record_path, {"tokens_per_s": clock.tokens_per_s(excluded, t.steps),
                                   "train_s": clock.times[t.steps] - clock.times[excluded],
                                   "final_loss": facts["final_loss"], "final_lr": engine.get_lr()[0],
                                   "engine": engine_facts(engine, ds_json)})
    torch.distributed.barrier()
    state.destroy_process_group()


# --- the tables ---------------------------------------------------------------------------------

def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per way: the median of its launches' tokens/s, their spread, losses, lr, times, engine."""
    figures = {}
    for way, records in runs.items():
        rates = [r["tokens_per_s"] for r in records]
        median = statistics.median(rates)
        compiles = [r["compile_s"] for r in records if r.get("compile_s") is not None]
        figures[way] = {"median_tokens_per_s": median, "runs_tokens_per_s": rates,
                        "spread": (max(rates) - min(rates)) / median,
                        "final_loss": [r["final_loss"] for r in records], "final_lr": records[0]["final_lr"],
                        "median_launch_s": statistics.median(r["launch_s"] for r in records),
                        "median_train_s": statistics.median(r["train_s"] for r in records),
                        "median_compile_s": statistics.median(compiles) if compiles else None,
                        # start-up and tear-down: the launch less its timed steps and dsf's compile seconds
                        "runs_overhead_s": [r["launch_s"] - r["train_s"] - (r.get("compile_s") or 0.0) for r in records],
                        "engine": records[0]["engine"]}
        figures[way]["median_overhead_s"] = statistics.median(figures[way]["runs_overhead_s"])
    return figures


def summarize_stage(runs: dict[str, list[dict]]) -> dict:
    figures = summarize(runs)
    figures["dsf_over_raw"] = figures["dsf"]["median_tokens_per_s"] / figures["raw"]["median_tokens_per_s"]
    figures["dsf_over_trainer"] = figures["dsf"]["median_tokens_per_s"] / figures["trainer"]["median_tokens_per_s"]
    return figures


def markdown(stages: dict[int, dict], args: argparse.Namespace) -> str:
    rows = ["| ZeRO | dsf tokens/s | raw tokens/s | Trainer tokens/s | dsf/raw | dsf/Trainer "
            "| spread dsf / raw / Trainer |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for stage, f in stages.items():
        rates = " | ".join(f"{f[w]['median_tokens_per_s']:,.0f}" for w in WAYS)
        spread = " / ".join(f"{100 * f[w]['spread']:.1f}%" for w in WAYS)
        rows.append(f"| {stage} | {rates} | {f['dsf_over_raw']:.3f} | {f['dsf_over_trainer']:.3f} | {spread} |")
    rows += ["", "| ZeRO | last-step loss dsf / raw / Trainer | final lr (all) | engine stage dsf / raw / Trainer "
             "| launch s dsf / raw / Trainer | timed s dsf / raw / Trainer | overhead s dsf / raw / Trainer "
             "(range) |", "|---:|---|---|---|---|---|---|"]
    for stage, f in stages.items():
        loss = " / ".join(f"{f[w]['final_loss'][0]:.5f}" for w in WAYS)
        lrs = {f"{f[w]['final_lr']:.4g}" for w in WAYS}
        engines = " / ".join(str(f[w]["engine"]["zero_stage"]) for w in WAYS)
        launch = " / ".join(f"{f[w]['median_launch_s']:.1f}" for w in WAYS)
        timed = " / ".join(f"{f[w]['median_train_s']:.2f}" for w in WAYS)
        overhead = " / ".join(f"{f[w]['median_overhead_s']:.1f} ({min(f[w]['runs_overhead_s']):.1f}.."
                              f"{max(f[w]['runs_overhead_s']):.1f})" for w in WAYS)
        rows.append(f"| {stage} | {loss} | {' / '.join(sorted(lrs))} | {engines} | {launch} | {timed} | {overhead} |")
    rows.append(f"\n{args.model}, world {WORLD}, {args.steps} steps of {args.global_batch} x {args.seq_len} tokens "
                f"(micro-batch {args.micro_batch} per rank), fp32; timed steps {args.warmup_steps_excluded + 1}.."
                f"{args.steps}; {args.repeats} launch(es) of each way per stage, in turn; medians.")
    for stage, f in stages.items():
        for way in ("raw", "trainer"):
            e = f[way]["engine"]
            rows.append(f"ZeRO-{stage} {WAYS[way]} engine: stage {e['zero_stage']}, {e['optimizer']}, "
                        f"{e['scheduler']}, micro {e['micro_batch']} x accum {e['grad_accum']}, clip {e['grad_clip']}; "
                        f"config keys that differ from the file: "
                        f"{', '.join(f'{k}={v}' for k, v in e['json_differs'].items()) or 'none'}")
    return "\n".join(rows)


def summarize_recommended(runs: dict[str, list[dict]], *, tolerance: float) -> dict:
    """Per tool as `summarize`, each Trainer's loss check against dsf, and dsf / the better Trainer
    (of the medians, and its range over launches)."""
    figures = summarize(runs)
    dsf_loss = statistics.median(figures["dsf"]["final_loss"])
    for tool in ("docs", "axolotl"):
        gap = (statistics.median(figures[tool]["final_loss"]) - dsf_loss) / dsf_loss
        figures[tool]["loss_vs_dsf"] = gap
        figures[tool]["loss_agrees"] = abs(gap) <= tolerance
    best = max(("docs", "axolotl"), key=lambda tool: figures[tool]["median_tokens_per_s"])
    dsf, other = figures["dsf"]["runs_tokens_per_s"], figures[best]["runs_tokens_per_s"]
    figures["best_trainer"] = best
    figures["dsf_over_best"] = figures["dsf"]["median_tokens_per_s"] / figures[best]["median_tokens_per_s"]
    figures["dsf_over_best_range"] = [min(dsf) / max(other), max(dsf) / min(other)]
    figures["loss_tolerance"] = tolerance
    return figures


def run_recommended(args: argparse.Namespace, work: Path) -> dict:
    """The "same job, each tool as its docs recommend" table: plan, JSONs, launches in turn."""
    home = work / "recommended"
    home.mkdir(parents=True, exist_ok=True)
    job = run_overrides(args, stage=3, tokenizer_dir=work / "tokenizer", output_dir=home)
    cluster = args.cluster
    if cluster == "calibrate":  # this machine measured, as the README says to plan for it
        cluster = str(home / "cluster.json")
        subprocess.run([str(BIN / "dsf"), "calibrate", "--ranks", str(WORLD), "-o", cluster, "--force"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    plan = subprocess.run([str(BIN / "dsf"), "plan", "--model", args.model, "--cluster", cluster, "--nodes", "1",
                           "--gpus-per-node", str(WORLD), "--seq-len", str(args.seq_len),
                           "--global-batch", str(args.global_batch), "--precision", "fp32", "--top", "3",
                           "-o", str(home / "plan"), "--force"], check=True, cwd=REPO, capture_output=True, text=True)
    (home / "plan.txt").write_text(plan.stdout)
    planned = planned_run_yaml(home / "plan" / "run.yaml", job, home / "dsf_run.yaml")
    job_json = dsf_ds_config(job)
    for tool, preset in (("docs", HF_DOCS_ZERO3), ("axolotl", AXOLOTL_ZERO3)):
        config = trainer_ds_config(preset, job_json, keep_offload=args.docs_offload and tool == "docs")
        (home / f"{tool}.json").write_text(json.dumps(config, indent=1))
    dsf_sets = ["train.compile=true", "train.chunked_loss=true"]
    runs: dict[str, list[dict]] = {tool: [] for tool in TOOLS}
    for index in range(args.repeats):
        for tool in TOOLS:
            out = home / f"{tool}{index}"
            if tool == "dsf":
                record = run_way("dsf", args, out=out, overrides=[f"output_dir={out}", *dsf_sets],
                                 dsf_yaml=home / "dsf_run.yaml")
            else:
                record = run_way("trainer", args, out=out, overrides=job, ds_json=home / f"{tool}.json")
            runs[tool].append(record)
            print(f"recommended {tool} {index + 1}/{args.repeats}: {record['tokens_per_s']:,.0f} tokens/s",
                  file=sys.stderr, flush=True)
    figures = summarize_recommended(runs, tolerance=args.loss_tolerance)
    t, par = planned["train"], planned["parallel"]
    dp = WORLD // (par["tp"] * par["pp"] * par["cp"])
    figures["dsf"]["plan"] = {"cluster": cluster, "micro_batch": t["micro_batch"],
                              "grad_accum": t["grad_accum"] or args.global_batch // (t["micro_batch"] * dp),
                              "parallel": par, "sets": dsf_sets,
                              "best_line": next((line for line in plan.stdout.splitlines()
                                                 if line.startswith("best:")), "")}
    return figures


def markdown_recommended(f: dict, args: argparse.Namespace) -> str:
    plan = f["dsf"]["plan"]
    par = plan["parallel"]
    knobs = ", ".join(f"{k} {v}" for k, v in (par.get("zero_knobs") or {}).items() if v is not None)
    configs = {"dsf": f"plan: ZeRO-{par['zero_stage']}, tp {par['tp']} pp {par['pp']} cp {par['cp']}, "
                      f"offload {par['offload_optimizer']}/{par['offload_param']}"
                      + (f", knobs: {knobs}" if knobs else "") + "; compile, chunked loss",
               "docs": "docs' ZeRO-3, \"auto\"" + (", CPU offload" if args.docs_offload else ", offload dropped"),
               "axolotl": "zero3.json as is, \"auto\""}
    rows = ["| tool | config | ZeRO | micro x accum | tokens/s | spread | compile s | last-step loss | vs dsf "
            "| launch s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for tool, name in TOOLS.items():
        t = f[tool]
        e = t["engine"]
        micro = f"{plan['micro_batch']}x{plan['grad_accum']}" if tool == "dsf" else \
            f"{e['micro_batch']}x{e['grad_accum']}"
        compile_s = "-" if t["median_compile_s"] is None else f"{t['median_compile_s']:.1f}"
        check = "-" if tool == "dsf" else \
            f"{100 * t['loss_vs_dsf']:+.2f}% " + ("ok" if t["loss_agrees"] else "**DIFFERS**")
        rows.append(f"| {name.split(',')[0]} | {configs[tool]} | {e['zero_stage']} | {micro} "
                    f"| {t['median_tokens_per_s']:,.0f} | {100 * t['spread']:.1f}% | {compile_s} "
                    f"| {statistics.median(t['final_loss']):.5f} | {check} | {t['median_launch_s']:.1f} |")
    low, high = f["dsf_over_best_range"]
    rows += ["", f"dsf / the better Trainer ({TOOLS[f['best_trainer']]}): **{f['dsf_over_best']:.3f}** "
             f"(launches: {low:.3f}-{high:.3f}; goal >= 1.2); losses within {100 * f['loss_tolerance']:g}% of dsf's: "
             f"{'yes' if all(f[t]['loss_agrees'] for t in ('docs', 'axolotl')) else 'NO'}.",
             f"{args.model}, world {WORLD}, {args.steps} steps of {args.global_batch} x {args.seq_len} tokens, fp32; "
             f"timed steps {args.warmup_steps_excluded + 1}..{args.steps} (compile outside); {args.repeats} "
             f"launch(es) of each tool, in turn; medians. dsf's plan on {plan['cluster']}: {plan['best_line']}"]
    for tool in ("docs", "axolotl"):
        zero = f[tool]["engine"]["zero_optimization"]
        rows.append(f"{TOOLS[tool]}, the engine's zero_optimization (\"auto\" filled): "
                    + ", ".join(f"{k}={v}" for k, v in zero.items()))
    return "\n".join(rows)


# --- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", choices=["stages", "recommended", "both"], default="both",
                        help="stages: dsf / raw DeepSpeed / Trainer at the same JSON per ZeRO stage; recommended: "
                             "dsf's plan vs the Trainer with transformers' and Axolotl's ZeRO-3 JSONs")
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages of the stages table, comma separated")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps-excluded", type=int, default=None,
                        help="steps of each launch left out of the timing (a multiple of --log-every; "
                             "default: one --log-every window)")
    parser.add_argument("--log-every", type=int, default=10, help="dsf's logging.every = the Trainer's logging_steps")
    parser.add_argument("--repeats", type=int, default=3, help="launches of each way, in turn A B C A B C")
    parser.add_argument("--model", default=None,
                        help="a model preset (dsf presets); default small-llama (7M), tiny-llama for per-step overhead")
    parser.add_argument("--seq-len", type=int, default=None, help="default 128 (64 with --smoke)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="per rank, for all but dsf's plan (which chooses its own); accumulation is derived")
    parser.add_argument("--cluster", default=None,
                        help="what dsf plans for: 'calibrate' (default: `dsf calibrate --ranks 2` here, ~20 s), "
                             "a preset (cpu-local) or a profile file")
    parser.add_argument("--docs-offload", action="store_true",
                        help="keep the CPU offload of the transformers docs' ZeRO-3 example (dropped by default)")
    parser.add_argument("--loss-tolerance", type=float, default=0.01,
                        help="relative gap of a Trainer's last-step loss to dsf's flagged as DIFFERS")
    parser.add_argument("--smoke", action="store_true",
                        help="quick end-to-end check: --stages 1 --repeats 1 --steps 6 --log-every 2, "
                             "tiny-llama at seq 64 and the cpu-local preset unless given")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, not tables")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_compare", help="logs of every launch")
    parser.add_argument("--worker", choices=["raw", "trainer"], help=argparse.SUPPRESS)  # set by this file
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.stages, args.repeats, args.steps, args.log_every = "1", 1, 6, 2
    defaults = ("tiny-llama", 64, "cpu-local") if args.smoke else ("small-llama", 128, "calibrate")
    args.model, args.seq_len, args.cluster = (given if given is not None else default for given, default in
                                              zip((args.model, args.seq_len, args.cluster), defaults))
    if args.warmup_steps_excluded is None:
        args.warmup_steps_excluded = args.log_every
    check_timed_steps(parser, args)
    return args


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden arguments a bench's own worker gets from the launch this file builds (and the
    launcher's --local_rank)."""
    parser.add_argument("--ds-config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], dest="overrides", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the launcher's


def check_timed_steps(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--steps and --warmup-steps-excluded are whole --log-every windows, some of them timed."""
    if args.steps % args.log_every or args.warmup_steps_excluded % args.log_every \
            or not 0 < args.warmup_steps_excluded < args.steps:
        parser.error(f"--steps {args.steps} and --warmup-steps-excluded {args.warmup_steps_excluded} must be "
                     f"multiples of --log-every {args.log_every}, with 0 < excluded < steps")


def run_stages(args: argparse.Namespace, work: Path) -> dict[int, dict]:
    """The per-ZeRO-stage table: dsf, raw DeepSpeed and the Trainer at the same JSON, in turn."""
    stages = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        home = work / f"z{stage}"
        home.mkdir(exist_ok=True)
        ds_json = home / "ds_config.json"
        ds_json.write_text(json.dumps(dsf_ds_config(
            run_overrides(args, stage=stage, tokenizer_dir=work / "tokenizer", output_dir=work)), indent=2))
        runs: dict[str, list[dict]] = {way: [] for way in WAYS}
        for index in range(args.repeats):  # in turn, so drift in the machine hits every way alike
            for way in WAYS:
                out = home / f"{way}{index}"
                overrides = run_overrides(args, stage=stage, tokenizer_dir=work / "tokenizer", output_dir=out)
                runs[way].append(run_way(way, args, out=out, overrides=overrides, ds_json=ds_json))
                print(f"ZeRO-{stage} {way} {index + 1}/{args.repeats}: {runs[way][-1]['tokens_per_s']:,.0f} tokens/s",
                      file=sys.stderr, flush=True)
        stages[stage] = summarize_stage(runs)
    return stages


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker = {"raw": raw_worker, "trainer": trainer_worker}[args.worker]
        worker(args.overrides, args.ds_config, args.record, excluded=args.warmup_steps_excluded)
        from dsframework.launching.supervise import exit_process

        exit_process(0)  # as dsf train ends: torch's teardown can abort a finished rank (see its docstring)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    save_tokenizer(work / "tokenizer")
    stages = run_stages(args, work) if args.table in ("stages", "both") else {}
    recommended = run_recommended(args, work) if args.table in ("recommended", "both") else None
    if args.json:
        print(json.dumps({"settings": {k: v for k, v in vars(args).items() if k in (
            "model", "steps", "warmup_steps_excluded", "log_every", "repeats", "seq_len", "global_batch",
            "micro_batch", "cluster", "docs_offload", "loss_tolerance")} | {"world": WORLD},
            "stages": stages, "recommended": recommended}, indent=2))
    else:
        print("\n\n".join(([markdown(stages, args)] if stages else [])
                           + ([markdown_recommended(recommended, args)] if recommended else [])))


if __name__ == "__main__":
    main()
