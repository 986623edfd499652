"""Worker: `dsf train` (a world of one, in this process) with the host synchronisations dsf's own
code makes counted per step, and the time a step spends getting its data.

    python hot_path.py OUT.json RUN.yaml --set k=v ...

Every Tensor.item / tolist / __float__ / __int__ / __bool__ / cpu() called from a dsframework
module while the loop runs is recorded with the step it fell in (a device-to-host copy that waits
for the device on a GPU), and so is every op whose output size or value the host must read first
(torch.equal, bincount, nonzero, unique, masked_select: the logit and expert-load code's old syncs,
tests/unit/test_logit_postprocess.py and test_device_discipline.py check those paths on fake CUDA
tensors); step.step_batches is timed, and the Python and C calls dsframework
code makes in each step are counted (sys.setprofile). DeepSpeed's own internals are not counted:
they are DeepSpeed's, the same under any wrapper.
"""
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

import dsframework.train.engine as engine_module
import dsframework.train.step as step_module  # the loop looks step_batches up there at each step
from dsframework.config import load_run_config
from dsframework.launching.supervise import exit_process
from dsframework.train.world import shutdown_distributed

PACKAGE = str(Path(engine_module.__file__).parent)
state = {"step": None}  # None until the loop's first step begins
syncs: Counter = Counter()
data_seconds = []


def counting(name, owner=torch.Tensor):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if state["step"] is not None:
            code = sys._getframe(1).f_code
            if code.co_filename.startswith(PACKAGE):
                syncs[f"{state['step']}:{Path(code.co_filename).name}:{code.co_name}:{name}"] += 1
        return original(*args, **kwargs)
    return wrapper


for method in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "equal", "bincount", "nonzero", "unique",
               "masked_select"):
    setattr(torch.Tensor, method, counting(method))
for function in ("equal", "bincount", "nonzero", "unique", "masked_select"):  # data-dependent: read back first
    setattr(torch, function, counting(function, torch))

original_batches = step_module.step_batches


def timed_batches(blocks, sampler, consumed):
    state["step"] = consumed // sampler.global_batch + 1  # the step these batches are for
    start = time.perf_counter()
    out = original_batches(blocks, sampler, consumed)
    data_seconds.append(time.perf_counter() - start)
    return out


step_module.step_batches = timed_batches
calls: Counter = Counter()  # step -> Python and C calls made by dsframework code in that step


def profile(frame, event, arg):
    if state["step"] is not None and event in ("call", "c_call") and frame.f_code.co_filename.startswith(PACKAGE):
        calls[state["step"]] += 1


sys.setprofile(profile)

out_path, yaml_path, *rest = sys.argv[1:]
overrides = [rest[i + 1] for i in range(0, len(rest), 2) if rest[i] == "--set"]
run = load_run_config(yaml_path, overrides)
last = engine_module.train(run)
sys.setprofile(None)
shutdown_distributed()
Path(out_path).write_text(json.dumps({"syncs": dict(syncs), "data_seconds": data_seconds, "calls": calls,
                                      "tokens_per_s": last["tokens_per_s"]}))
exit_process(0)  # without the interpreter's teardown of gloo's threads (see supervise.exit_process)
