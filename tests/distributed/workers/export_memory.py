"""Worker (one process): `export_checkpoint` with its peak resident memory measured around it.

    python export_memory.py CKPT_DIR OUT_DIR MAX_SHARD_SIZE
    # last line of stdout: {"baseline_bytes": ..., "peak_bytes": ..., "growth_bytes": ..., "seconds": ...}

The libraries the export uses are imported first, so the baseline holds their code and the growth
is what the export itself holds. The kernel's peak (VmHWM in /proc/self/status) is reset to the
current resident size just before the export (writing 5 to /proc/self/clear_refs); where that is
not allowed, the baseline is the peak so far. growth = VmHWM after - baseline.
"""
import json
import sys
import time
from pathlib import Path

import torch


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(ckpt_dir: str, out_dir: str, max_shard_size: str) -> None:
    import deepspeed.utils.zero_to_fp32  # noqa: F401  (the export's libraries, imported up front)
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    from dsframework.checkpoints.export import export_checkpoint

    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        baseline = status_bytes("VmRSS")
    except OSError:
        baseline = status_bytes("VmHWM")
    start = time.perf_counter()
    export_checkpoint(ckpt_dir, out_dir, max_shard_size=max_shard_size)
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    print(json.dumps({"baseline_bytes": baseline, "peak_bytes": peak, "growth_bytes": peak - baseline,
                      "seconds": round(seconds, 2)}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
