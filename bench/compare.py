"""`dsf train` against a plain DeepSpeed loop and `transformers.Trainer`: tokens/s per ZeRO stage.

    .venv/bin/python bench/compare.py                                  # ZeRO 1, 2, 3; 3 x (A B C); ~7 min on 2 cores
    .venv/bin/python bench/compare.py --stages 2 --repeats 1 --steps 20  # quick look
    .venv/bin/python bench/compare.py --smoke                          # end to end in ~1 min
    .venv/bin/python bench/compare.py --json                           # the same figures for machines

Three ways to train the same thing on the same 2 ranks (`deepspeed --num_gpus 2`, CPU ranks with
gloo here, one thread each), each its own launch, run in turn A B C A B C ... per stage:

  A  dsf      `deepspeed --num_gpus 2 $(which dsf) train launch/examples/tiny.yaml --set ...`
  B  raw      this file's `--worker raw`: `deepspeed.initialize(config=ds_config.json)` and a
              forward / backward / step loop, nothing else.
  C  Trainer  this file's `--worker trainer`: `transformers.Trainer` with
              `TrainingArguments(deepspeed=ds_config.json)`.

What is the same: the run config (tiny.yaml + the `--set` overrides of `run_overrides`), the
DeepSpeed JSON (dsframework.dsconfig.build_ds_config of that run config, written once per stage;
B and C read the file, dsf builds the identical dict itself), the tokenizer (trained once here),
the packed blocks (dsframework.data), the weights (dsframework.models.build_model, same seed;
under ZeRO-3 built inside zero.Init with the same JSON), the per-rank order of the blocks
(dsframework.data.BlockSampler; the Trainer gets a dataset laid out so that accelerate's sharding
hands each rank exactly those micro-batches), fp32, the optimizer, lr schedule, clipping and ZeRO
stage (all in the JSON; the TrainingArguments are set to match it, which HF checks), and the host
synchronisation: a loss all-reduce and `.item()` every --log-every steps (dsf's logging.every,
the Trainer's logging_steps), none in between. The Trainer has evaluation, saving, reporting,
tqdm, dataloader workers and torch.compile off.

Tokens/s of one launch = tokens / wall seconds on rank 0 over steps --warmup-steps-excluded+1 ..
--steps (start-up, the first steps and the final clean-up are not timed). For dsf that is read
from its metrics.jsonl windows (`tokens_per_s` every logging.every steps, the first windows left
out); B and C take time.perf_counter() at the same step boundaries. The table gives, per ZeRO
stage, the median launch of each way, the ratios dsf/raw and dsf/Trainer of the medians, and each
way's spread ((max - min) / median over its launches). A second table gives the loss at the last
step (mean over the global batch; the three should agree closely, since they train the same
thing) and each way's wall seconds per launch (start-up included). Logs of every launch are
kept under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY_YAML = REPO / "launch" / "examples" / "tiny.yaml"
WORLD = 2  # ranks of every launch
WAYS = {"dsf": "dsf train", "raw": "raw DeepSpeed", "trainer": "HF Trainer"}


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


def write_ds_config(overrides: list[str], path: Path) -> None:
    """The DeepSpeed JSON `dsf train` builds for this run config at dp=2, for raw and Trainer to read."""
    from dsframework.config import load_run_config
    from dsframework.dsconfig import build_ds_config, dumps

    run = load_run_config(TINY_YAML, overrides)
    path.write_text(dumps(build_ds_config(run.train, run.parallel, dp_size=WORLD)))


# --- launching ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script_and_args: list[str], log: Path) -> tuple[int, float]:
    """`deepspeed --num_gpus 2 <script> <args>`, one thread per rank, output to `log`;
    (exit code, wall seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    env.pop("RANK", None)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(WORLD), "--master_port", str(free_port()), *script_and_args]
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=1800).returncode
    return code, time.perf_counter() - start


def fail(way: str, code: int, log: Path) -> None:
    lines = log.read_text(errors="replace").splitlines()
    errors = [line.strip() for line in lines if re.search(r"(Error|Exception|Assertion)\b.*:", line)]
    last = (errors or [line.strip() for line in lines if line.strip()] or ["no output"])[-1][:300]
    sys.exit(f"{WAYS[way]} failed (exit {code}): {last}\n  log: {log}")


def run_way(way: str, args: argparse.Namespace, *, stage: int, work: Path, index: int) -> dict:
    """One launch of one way; its record: tokens_per_s, final_loss, final_lr, launch_s, engine."""
    out = work / f"z{stage}" / f"{way}{index}"
    overrides = run_overrides(args, stage=stage, tokenizer_dir=work / "tokenizer", output_dir=out)
    sets = [a for o in overrides for a in ("--set", o)]
    if way == "dsf":
        cmd = [str(BIN / "dsf"), "train", str(TINY_YAML), *sets, "--overwrite"]
    else:
        cmd = [str(Path(__file__).resolve()), "--worker", way,
               "--ds-config", str(work / f"z{stage}" / "ds_config.json"), "--record", str(out / "record.json"),
               "--steps", str(args.steps), "--log-every", str(args.log_every),
               "--warmup-steps-excluded", str(args.warmup_steps_excluded), *sets]
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").unlink(missing_ok=True)
    code, wall = launch(cmd, out / "launch.log")
    if code:
        fail(way, code, out / "launch.log")
    if way == "dsf":
        record = dsf_record(out, args)
        banner = re.search(r"ZeRO-(\d)", (out / "launch.log").read_text())
        record["engine"] = {"zero_stage": int(banner.group(1)) if banner else None}
    else:
        record = json.loads((out / "record.json").read_text())
    return {**record, "launch_s": wall}


def dsf_record(out: Path, args: argparse.Namespace) -> dict:
    """Tokens/s over the logged windows after the excluded steps: tokens / the windows' seconds."""
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    logged = [m for m in logged if "tokens_per_s" in m]
    tokens_per_step = args.global_batch * args.seq_len
    seconds, previous = 0.0, 0
    for m in logged:
        if m["step"] > args.warmup_steps_excluded:
            seconds += tokens_per_step * (m["step"] - previous) / m["tokens_per_s"]
        previous = m["step"]
    timed = args.steps - args.warmup_steps_excluded
    return {"tokens_per_s": tokens_per_step * timed / seconds, "train_s": seconds,
            "final_loss": logged[-1]["loss"], "final_lr": logged[-1]["lr"]}


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
    from dsframework.models import build_model, resolve_model

    datasets.disable_progress_bars()  # as dsf does
    run = load_run_config(TINY_YAML, overrides)
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch,
                          dp_size=dist.get_world_size())
    tokenizer = load_tokenizer(run.model.tokenizer)
    train_blocks, _ = token_stores(load_texts(run.data), tokenizer, run.data, cache_dir=store_cache_dir())
    source = resolve_model(run.model)
    zero3 = ds_config if run.parallel.zero_stage == 3 else None  # partitioned at construction, as dsf does
    model = build_model(source, source.config_for(tokenizer), seed=run.train.seed, zero3_ds_config=zero3)
    return run, batch, train_blocks, model


def engine_facts(engine, ds_json: Path) -> dict:
    """What the DeepSpeed engine really runs with, and the keys of its config that differ from the file."""
    given = engine.config if isinstance(engine.config, dict) else json.loads(Path(engine.config).read_text())
    want = json.loads(ds_json.read_text())
    return {"zero_stage": engine.zero_optimization_stage(),
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
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from dsframework.data import BlockSampler
    from dsframework.jit import pin_build_tools, release_shm_buffers

    pin_build_tools()  # the JIT-built CPU ops of this environment, as dsf uses (not rebuilt elsewhere)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    release_shm_buffers()
    rank, world = dist.get_rank(), dist.get_world_size()
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    run, batch, blocks, model = rank_inputs(overrides, json.loads(ds_json.read_text()))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=str(ds_json))
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
        if step % every == 0:  # the one host synchronisation: the logged loss, mean over ranks
            mean = torch.stack(losses).mean().double()
            dist.all_reduce(mean)
            final_loss = mean.item() / world
            if rank == 0:
                print(f"raw: step={step} loss={final_loss:.4g}", flush=True)
        clock.tick(step, boundary=step in (excluded, steps))
    if rank == 0:
        write_record(record_path, {"tokens_per_s": clock.tokens_per_s(excluded, steps),
                                   "train_s": clock.times[steps] - clock.times[excluded], "final_loss": final_loss,
                                   "final_lr": engine.get_lr()[0], "engine": engine_facts(engine, ds_json)})
    dist.barrier()
    dist.destroy_process_group()


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
    run, batch, blocks, model = rank_inputs(overrides, json.loads(ds_json.read_text()))
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
    figures = {}
    for way, records in runs.items():
        rates = [r["tokens_per_s"] for r in records]
        median = statistics.median(rates)
        figures[way] = {"median_tokens_per_s": median, "runs_tokens_per_s": rates,
                        "spread": (max(rates) - min(rates)) / median,
                        "final_loss": [r["final_loss"] for r in records], "final_lr": records[0]["final_lr"],
                        "median_launch_s": statistics.median(r["launch_s"] for r in records),
                        "median_train_s": statistics.median(r["train_s"] for r in records),
                        "engine": records[0]["engine"]}
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
             "| launch s dsf / raw / Trainer | timed s dsf / raw / Trainer |", "|---:|---|---|---|---|---|"]
    for stage, f in stages.items():
        loss = " / ".join(f"{f[w]['final_loss'][0]:.5f}" for w in WAYS)
        lrs = {f"{f[w]['final_lr']:.4g}" for w in WAYS}
        engines = " / ".join(str(f[w]["engine"]["zero_stage"]) for w in WAYS)
        launch = " / ".join(f"{f[w]['median_launch_s']:.1f}" for w in WAYS)
        timed = " / ".join(f"{f[w]['median_train_s']:.2f}" for w in WAYS)
        rows.append(f"| {stage} | {loss} | {' / '.join(sorted(lrs))} | {engines} | {launch} | {timed} |")
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


# --- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages, comma separated")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps-excluded", type=int, default=None,
                        help="steps of each launch left out of the timing (a multiple of --log-every; "
                             "default: one --log-every window)")
    parser.add_argument("--log-every", type=int, default=10, help="dsf's logging.every = the Trainer's logging_steps")
    parser.add_argument("--repeats", type=int, default=3, help="launches of each way per stage, in turn A B C A B C")
    parser.add_argument("--model", default="tiny-llama", help="a model preset (dsf presets)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8, help="per rank; accumulation is derived")
    parser.add_argument("--smoke", action="store_true",
                        help="quick end-to-end check: --stages 1 --repeats 1 --steps 6 --log-every 2")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, not tables")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_compare", help="logs of every launch")
    parser.add_argument("--worker", choices=["raw", "trainer"], help=argparse.SUPPRESS)  # set by this file
    parser.add_argument("--ds-config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], dest="overrides", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the launcher's
    args = parser.parse_args(argv)
    if args.smoke:
        args.stages, args.repeats, args.steps, args.log_every = "1", 1, 6, 2
    if args.warmup_steps_excluded is None:
        args.warmup_steps_excluded = args.log_every
    if args.steps % args.log_every or args.warmup_steps_excluded % args.log_every \
            or not 0 < args.warmup_steps_excluded < args.steps:
        parser.error(f"--steps {args.steps} and --warmup-steps-excluded {args.warmup_steps_excluded} must be "
                     f"multiples of --log-every {args.log_every}, with 0 < excluded < steps")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker = {"raw": raw_worker, "trainer": trainer_worker}[args.worker]
        worker(args.overrides, args.ds_config, args.record, excluded=args.warmup_steps_excluded)
        from dsframework.supervise import exit_process

        exit_process(0)  # as dsf train ends: torch's teardown can abort a finished rank (see its docstring)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    save_tokenizer(work / "tokenizer")
    stages = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        (work / f"z{stage}").mkdir(exist_ok=True)
        overrides = run_overrides(args, stage=stage, tokenizer_dir=work / "tokenizer", output_dir=work)
        write_ds_config(overrides, work / f"z{stage}" / "ds_config.json")
        runs: dict[str, list[dict]] = {way: [] for way in WAYS}
        for index in range(args.repeats):  # in turn, so drift in the machine hits every way alike
            for way in WAYS:
                runs[way].append(run_way(way, args, stage=stage, work=work, index=index))
                print(f"ZeRO-{stage} {way} {index + 1}/{args.repeats}: {runs[way][-1]['tokens_per_s']:,.0f} tokens/s",
                      file=sys.stderr, flush=True)
        stages[stage] = summarize(runs)
    if args.json:
        print(json.dumps({"settings": {k: v for k, v in vars(args).items() if k in (
            "model", "steps", "warmup_steps_excluded", "log_every", "repeats", "seq_len", "global_batch",
            "micro_batch")} | {"world": WORLD}, "stages": stages}, indent=2))
    else:
        print(markdown(stages, args))


if __name__ == "__main__":
    main()
