"""Worker (run under the deepspeed launcher): several `dsf train` runs one after the other in one
process group, each with the torch.compile backend it names (tests/distributed/test_compile.py),
or eager (launcher.train_runs: every module that trains several layouts at one world size).

    deepspeed --num_gpus 2 train_matrix.py OUT_ROOT 'z1|eager|parallel.zero_stage=1' \
        'z1_compiled|aot_eager|parallel.zero_stage=1;train.compile=true' ...

Each spec is NAME|BACKEND|OVERRIDES (OVERRIDES `;`-separated, on top of the tests' BASE_OVERRIDES),
trained into OUT_ROOT/NAME with `dsframework.train.engine.train`, as `dsf train` does. BACKEND
patches `dsframework.train.compiling.BACKEND` (inductor in production): `aot_eager` traces the same dynamo and AOT autograd graphs through
DeepSpeed's hooks without generating kernels, which keeps a matrix of layouts cheap; `inductor` is
the real thing. A NAME ending in `_auto` expects no compile time, so that train.compile=auto compiles
mid-run. One launch saves each run its own start (imports and rendezvous, ~10-20 s).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.distributed.launcher

from dsframework.train import compiling
from dsframework.config import load_run_config
from dsframework.train.engine import train
from tests.distributed.launcher import TINY_YAML, run_overrides


def forget_previous_run() -> None:
    """DeepSpeed keeps the last engine's parallel groups in module globals (deepspeed.utils.groups:
    the mpu a tp, pp or cp run passed, hpZ's group), and an engine built without an mpu reads the
    old one (a tp=2 model-parallel size for a ZeRO-2 run after a tp2 run). `dsf train` builds one
    engine per process; a run here starts as in a fresh process.

    transformers likewise keeps the HfDeepSpeedConfig of a ZeRO-3 pretrained load (the last run's
    model holds it) in a module global, and builds every later model under zero.Init while it lives:
    a meta-device build after a ZeRO-3 LoRA run then failed ("Cannot copy out of meta tensor")."""
    import gc

    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    groups.mpu = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    unset_hf_deepspeed_config()
    gc.collect()


def main(root: str, specs: list[str]) -> None:
    for spec in specs:
        forget_previous_run()
        name, backend, overrides = spec.split("|")
        compiling.BACKEND = backend if backend != "eager" else compiling.BACKEND
        compiling.COMPILE_S = 0.0 if name.endswith("_auto") else 90.0
        run = load_run_config(TINY_YAML, run_overrides(Path(root) / name, [o for o in overrides.split(";") if o]))
        train(run)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1:])
