"""Worker (run under the deepspeed launcher): `dsf train` with DeepSpeed's fp16 refusal on CPU lifted.

    deepspeed --num_gpus 2 fp16_on_cpu.py train RUN.yaml --set train.precision=fp16 ...

DeepSpeed's CPU accelerator reports fp16 unsupported on CPUs without AVX512-FP16 (this machine),
and `dsf train` refuses fp16 there. The fp16 optimizer and its dynamic loss scaler are plain
PyTorch and run on the CPU all the same, so this worker lifts only that capability check to let
the fault test watch DeepSpeed's loss scaler skip an overflowing step. Everything else is the
real `dsf train` (run in this process: the rank watcher is bypassed so the lifted check holds).
"""
import os

from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from dsframework.supervise import CHILD_MARK

os.environ[CHILD_MARK] = "1"
CPU_Accelerator.is_fp16_supported = lambda self: True

from dsframework.cli import main  # noqa: E402  (after the patch, as dsf would import it)

main()
