"""train.compile: the model compiled with torch.compile (inductor) through DeepSpeed's `engine.compile()`.

    from dsframework.train.compiling import auto_compile, compile_engine, compile_seconds
    compile_engine(engine)              # lazily: the first forward / backward compile
    compile_seconds()                   # seconds dynamo and inductor have spent compiling so far
    auto_compile(step_seconds=0.21, steps_left=500)   # (True, "500 steps left x 0.21 s x 14% ...")

The compiled kernels go to one cache for every rank and every run (`inductor_cache_dir`: beside
the packed token stores, under datasets' cache), so a run whose graphs were compiled before (the
same model, shapes and layout; resuming; the other ranks of a node next time) loads them in
seconds. TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR set by the user win.

Compile time is kept out of tokens/s: the training loop subtracts the compile seconds spent
inside each logging window from its wall time, and reports them as `compile_s`.

`auto` (the default) trains the first steps of a session eager and times them (the mean over ranks
of steps 2..AUTO_PROBE_STEPS, after the first step's warm-up), then compiles when

    steps left x measured step seconds x EXPECTED_GAIN  >  expected compile seconds

EXPECTED_GAIN is the share of a step compilation saved where it was measured (1.16x on a
small-llama step on a CPU here, as torchtitan reports for Llama 3 8B on H100: 1 - 1/1.16 = 0.14);
COMPILE_S is the compile time expected, on the safe side: a cold cache (a cached graph loads in
seconds, but whether this run's graphs are cached shows only once they compile). A short run (a
test, a quick look) stays eager; a long one compiles. A SIGTERM that arrives while the model
compiles is honoured when that step ends: with a cold cache that can take longer than a
scheduler's grace period (SLURM's KillWait), so a job preempted in its first minutes may find no
checkpoint to save; train.compile=false avoids it.
"""
from __future__ import annotations

import os
from pathlib import Path

from dsframework.data import store_cache_dir
from dsframework.types import Engine

BACKEND = "inductor"  # torch.compile's backend (tests/distributed/workers may patch it)
EXPECTED_GAIN = 0.14  # share of a step's time compiling saves (1 - 1 / 1.16)
COMPILE_S = 90.0  # a small Llama's forward + backward graphs, compiled from nothing (CPU: 35-60 s)
AUTO_PROBE_STEPS = 4  # `auto` decides after this step: steps 2..4 timed eager
# Dynamo's timers (torch._dynamo.utils.compilation_time_metrics): the forward graph's compile and
# the backward graph's, which AOT autograd compiles lazily at the first backward.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def inductor_cache_dir() -> Path:
    """One cache of compiled kernels for every run and rank: beside the token stores."""
    return store_cache_dir().parent / "dsframework-inductor"


def use_inductor_cache() -> Path:
    """Point inductor (and triton) at `inductor_cache_dir` unless the user chose a directory. Done
    before DeepSpeed starts: its ZeRO optimizers import inductor, which then fixes its own default
    (/tmp/torchinductor_<user>) in the environment."""
    cache = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir())))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    return cache


def compile_engine(engine: Engine) -> None:
    """`engine.compile()` with inductor; the first forward and backward compile (lazily)."""
    use_inductor_cache().mkdir(parents=True, exist_ok=True)
    engine.compile(backend=BACKEND)


def compile_seconds() -> float:
    """Seconds this process has spent compiling graphs so far (0 before any compile)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without dynamo's timers: compile time is then not separated
        return 0.0
    return float(sum(sum(compilation_time_metrics.get(name, ())) for name in _COMPILE_TIMERS))


def auto_compile(*, step_seconds: float, steps_left: int) -> tuple[bool, str]:
    """train.compile=auto: (compile?, the reason in one line) for a run with `steps_left` steps
    whose eager steps take `step_seconds` (see the module docstring)."""
    saved = steps_left * step_seconds * EXPECTED_GAIN
    verdict = saved > COMPILE_S
    return verdict, (f"{steps_left} steps left x {step_seconds:.3g} s x {EXPECTED_GAIN:.0%} saved = {saved:.3g} s "
                     f"{'>' if verdict else '<='} {COMPILE_S:.0f} s to compile: "
                     + ("compiling" if verdict else "staying eager"))
