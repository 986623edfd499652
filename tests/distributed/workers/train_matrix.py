"""Worker (run under the deepspeed launcher): several `dsf train` runs one after the other in one
process group, each with the torch.compile backend it names (tests/distributed/test_compile.py),
or eager (launcher.train_runs: every module that trains several layouts at one world size).

    deepspeed --num_gpus 2 train_matrix.py OUT_ROOT 'z1|eager|parallel.zero_stage=1' \
        'z1_compiled|aot_eager|parallel.zero_stage=1;train.compile=true' ...

Each spec is NAME|BACKEND|OVERRIDES[|resume] (OVERRIDES `;`-separated, on top of the tests'
BASE_OVERRIDES), trained into OUT_ROOT/NAME with `dsframework.train.engine.train`, as `dsf train`
does (`dsf train --resume` with `|resume`: from OUT_ROOT/NAME's latest checkpoint). BACKEND
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
from dsframework.launching.supervise import exit_process
from dsframework.train.engine import train
from dsframework.train.world import shutdown_distributed
from tests.distributed.launcher import TINY_YAML, forget_previous_run, run_overrides


def main(root: str, specs: list[str]) -> None:
    for spec in specs:
        forget_previous_run()
        name, backend, overrides, *flags = spec.split("|")
        compiling.BACKEND = backend if backend != "eager" else compiling.BACKEND
        compiling.COMPILE_S = 0.0 if name.endswith("_auto") else 90.0
        run = load_run_config(TINY_YAML, run_overrides(Path(root) / name, [o for o in overrides.split(";") if o]))
        train(run, resume="resume" in flags)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1:])
    shutdown_distributed()
    exit_process(0)  # without the interpreter's teardown of gloo's threads (CI: SIGABRT after 8 runs of test_zero)
