"""Worker (run under the deepspeed launcher): `dsf train` with DeepSpeed's fp16 refusal on CPU lifted.

    deepspeed --num_gpus 2 fp16_on_cpu.py train RUN.yaml --set train.precision=fp16 ...
    # or, with a fault injected too: faults.py --fp16-on-cpu --fault nan@3 train ...

DeepSpeed's CPU accelerator reports fp16 unsupported on CPUs without AVX512-FP16 (this machine),
and `dsf train` refuses fp16 there. The fp16 optimizer and its dynamic loss scaler are plain
PyTorch and run on the CPU all the same, so this worker lifts only that capability check to let
the fault test watch DeepSpeed's loss scaler skip an overflowing step. Everything else is the
real `dsf train` (run in this process: the rank watcher is bypassed so the lifted check holds).
"""
import os

from dsframework.launching.supervise import CHILD_MARK


def lift_fp16_refusal() -> None:
    """CPU_Accelerator says fp16 is supported, in this process (which must then train itself)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    os.environ[CHILD_MARK] = "1"
    CPU_Accelerator.is_fp16_supported = lambda self: True


if __name__ == "__main__":
    lift_fp16_refusal()
    from dsframework.commands.cli import main  # after the patch, as dsf would import it

    main()
