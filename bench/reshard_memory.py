"""Resharding's memory (issue 24): a ZeRO-1 checkpoint saved at tp 2 x pp 2 converted for dp 4 by the
streamed route (dsframework/checkpoints/reshard.py) and by the route before it (reshard.py at
--old REV), each in a fresh process, and every tensor the two write compared with torch.equal.

    .venv/bin/python bench/reshard_memory.py                      # trains the 374M Llama first (~2 min, 4 CPU ranks)
    .venv/bin/python bench/reshard_memory.py --ckpt-dir DIR       # a checkpoint dir already saved (its latest tag)
    .venv/bin/python bench/reshard_memory.py --old none           # the streamed route alone
    .venv/bin/python bench/reshard_memory.py measure CKPT_DIR TAG OUT --route FILE   # one conversion (the worker)

The model: Llama, hidden 1024, 24 layers, 16 heads, SwiGLU 2816, vocab 32000 (373.9M parameters; the
largest, the embedding and lm_head, 32000 x 1024 fp32 = 131 MB), trained 2 steps of 2 x 32 tokens at
tp 2 x pp 2 x dp 1, ZeRO-1, fp32, and saved. Each route converts it in its own scratch checkpoint
directory (the saved tag's files hard-linked) for tp 1 x pp 1 x dp 4.

Peak growth: the converting process imports its libraries, resets the kernel's peak (writing 5 to
/proc/self/clear_refs: VmHWM := VmRSS), calls reshard() and reads VmHWM; growth = VmHWM - VmRSS
before. The bound: 4 x the largest parameter's fp32 bytes + 64 MB (64e6 bytes).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsframework.ports import free_port  # noqa: E402 (after the path)

LLAMA_374M = ("{vocab_size: 32000, hidden_size: 1024, intermediate_size: 2816, num_hidden_layers: 24, "
              "num_attention_heads: 16, num_key_value_heads: 16}")
TRAIN = ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "train.steps=2", "train.global_batch=2",
         "train.micro_batch=1", "data.seq_len=32", "data.num_examples=200", "train.precision=fp32",
         "train.warmup_steps=0", "checkpoint.every=0", "checkpoint.save_final=true", "logging.every=1",
         "logging.eval_every=0", "logging.progress=false", "train.compile=false"]
SLACK = 64_000_000


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def load_route(route: str):
    """The reshard module: the package's ("new"), or a file of it (reshard.py at an older commit)."""
    if route == "new":
        from dsframework.checkpoints import reshard

        return reshard
    spec = importlib.util.spec_from_file_location("reshard_route", route)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(ckpt_dir: str, tag: str, out: str, *, route: str, tp: int, pp: int) -> dict:
    """Worker: reshard `tag` of `ckpt_dir` for tp x pp on the saved world; its peak growth to `out` (json)."""
    import torch
    from transformers import AutoConfig

    from dsframework.checkpoints.checkpoint import read_manifest, saved_layout
    from dsframework.layout import ParallelDims
    from dsframework.models.hf import causal_lm_class

    torch.set_num_threads(1)
    module = load_route(route)
    config = AutoConfig.from_pretrained(Path(ckpt_dir) / "hf_config")
    causal_lm_class(config)  # the model's transformers module, imported before the baseline as the rest
    saved = saved_layout(read_manifest(Path(ckpt_dir), tag))
    target = ParallelDims(world=saved.world, tp=tp, pp=pp, zero_stage=saved.zero_stage)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        baseline = status_bytes("VmRSS")
    except OSError:
        baseline = status_bytes("VmHWM")
    start = time.perf_counter()
    name = module.reshard(ckpt_dir, tag, config, target=target)
    figures = {"baseline_bytes": baseline, "peak_bytes": status_bytes("VmHWM"), "seconds": time.perf_counter() - start,
               "tag": name}
    figures["growth_bytes"] = figures["peak_bytes"] - baseline
    Path(out).write_text(json.dumps(figures))
    return figures


def model_figures(ckpt_dir: Path) -> dict:
    """Parameters, the largest one's fp32 bytes and the bound, from the checkpoint's config."""
    from transformers import AutoConfig

    from dsframework.models.hf import hf_parameter_shapes

    shapes = hf_parameter_shapes(AutoConfig.from_pretrained(ckpt_dir / "hf_config"))
    largest = max(shapes, key=lambda name: shapes[name].numel())
    params = sum(shape.numel() for shape in shapes.values())
    return {"parameters": params, "largest": largest, "largest_fp32_bytes": 4 * shapes[largest].numel(),
            "states_bytes": 12 * params, "bound_bytes": 4 * 4 * shapes[largest].numel() + SLACK}


def saved_at(ckpt_dir: Path, tag: str) -> str:
    from dsframework.checkpoints.checkpoint import read_manifest, saved_layout

    return str(saved_layout(read_manifest(ckpt_dir, tag)))


def scratch_copy(ckpt_dir: Path, tag: str, where: Path) -> Path:
    """A checkpoint dir holding `tag`'s files as hard links (and hf_config), for one route to convert."""
    (where / tag).mkdir(parents=True)
    for path in (ckpt_dir / tag).iterdir():
        os.link(path, where / tag / path.name)
    shutil.copytree(ckpt_dir / "hf_config", where / "hf_config")
    return where


def run_route(ckpt_dir: Path, tag: str, route: str, work: Path, args) -> dict:
    """One conversion in a fresh process; its figures and the directory it wrote."""
    where = scratch_copy(ckpt_dir, tag, work / Path(route).stem)
    out = work / f"{Path(route).stem}.json"
    cmd = [sys.executable, __file__, "measure", str(where), tag, str(out), "--route", route,
           "--tp", str(args.tp), "--pp", str(args.pp)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    figures = json.loads(out.read_text())
    figures["dir"] = str(where / figures["tag"])
    return figures


def same(a, b) -> bool:
    """Equal: tensors bit for bit (torch.equal; dtype, shape and requires_grad too), through dicts,
    lists, tuples and the attributes of objects without an == of their own (DeepSpeed's LossScaler)."""
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
                and (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (type(a) is type(b) and hasattr(a, "__dict__") and same(vars(a), vars(b)))


def compare(new: Path, old: Path) -> tuple[int, list[str]]:
    """(files compared, those that differ) of the two universal checkpoints' zero/ trees, one file at a time."""
    import torch

    files = sorted(p.relative_to(new) for p in (new / "zero").rglob("*.pt"))
    olds = sorted(p.relative_to(old) for p in (old / "zero").rglob("*.pt"))
    differ = sorted({str(p) for p in set(files) ^ set(olds)})
    for rel in files:
        if (old / rel).is_file() and not same(torch.load(new / rel, weights_only=False),
                                              torch.load(old / rel, weights_only=False)):
            differ.append(str(rel))
    return len(files), differ


def train(work: Path) -> Path:
    """The 374M Llama trained 2 steps at tp 2 x pp 2 on 4 CPU ranks, saved: its checkpoint dir."""
    port = free_port()
    sets = [arg for o in [f"model.overrides={LLAMA_374M}", *TRAIN, f"output_dir={work / 'run'}"]
            for arg in ("--set", o)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NUM_GPUS="4", MASTER_PORT=str(port))
    subprocess.run(["bash", "launch/single_node.sh", "launch/examples/tiny.yaml", *sets, "--overwrite"],
                   check=True, cwd=REPO, env=env)
    return work / "run" / "checkpoints"


def old_route(rev: str, work: Path) -> str:
    """reshard.py at git `rev`, written to a file."""
    path = work / "old_reshard.py"
    path.write_text(subprocess.run(["git", "show", f"{rev}:dsframework/checkpoints/reshard.py"], cwd=REPO,
                                   check=True, capture_output=True, text=True).stdout)
    return str(path)


def report(model: dict, routes: dict[str, dict], compared: tuple[int, list[str]] | None) -> None:
    mb = 1e6
    print(f"\n{next(iter(routes.values()))['tag']}: a checkpoint saved at {model['saved']}, resharded")
    print(f"model: {model['parameters'] / 1e6:.1f}M parameters, states {model['states_bytes'] / mb:.0f} MB "
          f"(fp32 + exp_avg + exp_avg_sq); largest {model['largest']} {model['largest_fp32_bytes'] / mb:.0f} MB fp32")
    print(f"bound: 4 x {model['largest_fp32_bytes'] / mb:.0f} MB + 64 MB = {model['bound_bytes'] / mb:.0f} MB\n")
    print("| route | peak RSS growth | / bound | seconds |\n|---|---:|---:|---:|")
    for name, fig in routes.items():
        print(f"| {name} | {fig['growth_bytes'] / mb:,.0f} MB | {fig['growth_bytes'] / model['bound_bytes']:.2f} "
              f"| {fig['seconds']:.1f} |")
    if compared is not None:
        count, differ = compared
        print(f"\n{count} files of zero/ compared (torch.equal): " + ("all identical" if not differ else
                                                                      f"{len(differ)} differ: {differ[:5]}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, help="a checkpoint dir (default: train the 374M Llama)")
    parser.add_argument("--old", default="31affa5", help="git revision of the route before, or 'none'")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="reshard_memory."))
    try:
        ckpt_dir = args.ckpt_dir or train(work)
        tag = (ckpt_dir / "latest").read_text().strip()
        model = model_figures(ckpt_dir)
        model["saved"] = saved_at(ckpt_dir, tag)
        routes = {"streamed (new)": run_route(ckpt_dir, tag, "new", work, args)}
        if args.old != "none":
            routes[f"whole model on rank 0 ({args.old})"] = run_route(ckpt_dir, tag, old_route(args.old, work),
                                                                      work, args)
        dirs = [Path(fig["dir"]) for fig in routes.values()]
        compared = compare(*dirs) if len(dirs) == 2 else None
        report(model, routes, compared)
        if args.json:
            args.json.write_text(json.dumps({"model": model, "routes": routes, "differ": compared}, indent=1))
        return 1 if compared and compared[1] else 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        parser = argparse.ArgumentParser()
        for positional in ("ckpt_dir", "tag", "out"):
            parser.add_argument(positional)
        parser.add_argument("--route", default="new")
        parser.add_argument("--tp", type=int, default=1)
        parser.add_argument("--pp", type=int, default=1)
        a = parser.parse_args(sys.argv[2:])
        measure(a.ckpt_dir, a.tag, a.out, route=a.route, tp=a.tp, pp=a.pp)
    else:
        sys.exit(main())
