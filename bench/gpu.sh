#!/usr/bin/env bash
# One prepared benchmark for a machine with one NVIDIA GPU (an H200 when one is at hand).
#
#   bash bench/gpu.sh              # llama-1b (1.24B, vocab 128256), bf16: the plan compiled, then a ZeRO-3 baseline
#   bash bench/gpu.sh --dry-run    # tiny-llama, 2 steps, on whatever device is here (the test suite's check)
#   COMPILE=true bash bench/gpu.sh --dry-run   # the dry run compiling the planned row too (+40-80 s on a CPU)
#   STEPS=40 SEQ_LEN=2048 GLOBAL=16 bash bench/gpu.sh
#
# Installs nothing and reaches no network: it uses the checkout's .venv (launch/setup_env.sh) or
# the python on PATH, the built-in data task and a tokenizer trained on it. It measures the bf16
# matmul peak of this GPU first (an 8192^3 matmul; 1024^3 in the dry run) and writes it as a
# cluster profile, peak.json (the GPU's dsf preset, a100/h100/h200, with the measured bf16 peak and
# this device's and host's memory). Then two trainings, each with `logging.cluster` = peak.json so
# the MFU in metrics.jsonl is against the measured peak, not the datasheet:
#
#   planned   what `dsf plan --model $MODEL --cluster peak.json --nodes 1 --gpus-per-node 1
#             --seq-len $SEQ_LEN --global-batch $GLOBAL --precision bf16 -o $OUT/plan` writes
#             (ZeRO stage, its knobs, micro-batch x accumulation), trained as written with the job's
#             data / steps / logging put in and train.compile=true, train.chunked_loss=true.
#   baseline  ZeRO-3 (the stage the Trainer's docs and presets hand out), micro-batch $MICRO,
#             eager, the full logits (train.compile=false, train.chunked_loss=false): what the plan,
#             compilation and the chunked loss are measured against. It replaces the former
#             ZeRO-2 / ZeRO-3 rows (on one GPU ZeRO-2 and -3 only shard over dp = 1).
#
# Prints one table: compile seconds (the first window; not in tokens/s), tokens/s, model TFLOP/s
# per GPU and MFU over the steps after the first logging window (start-up, compilation and
# warm-up excluded); the goal on an H200 is 50% MFU for the planned row. Expect ~6-8 minutes on an
# H100/H200: two ~1 min trainings, model init, and the planned row's first compile (~1-3 min;
# inductor's cache makes a second run quicker). The dry run trains the planned row eager unless
# COMPILE=true: compiling tiny-llama on a CPU costs the suite 40-80 s, and compiled training is
# tests/distributed/test_compile.py's to check (inductor, ZeRO-3, the chunked loss).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
OUT=${OUT:-$(mktemp -d /tmp/dsf-gpu-bench.XXXXXX)}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$DRY" = 1 ]; then
  MODEL=tiny-llama; STEPS=2; SEQ_LEN=64; MICRO=2; GLOBAL=4; EVERY=1; EXAMPLES=2000; VOCAB=; SIZE=1024
  COMPILE=${COMPILE:-false}
else
  MODEL=${MODEL:-llama-1b}; STEPS=${STEPS:-30}; SEQ_LEN=${SEQ_LEN:-2048}; MICRO=${MICRO:-4}
  GLOBAL=${GLOBAL:-8}; EVERY=${EVERY:-10}; EXAMPLES=${EXAMPLES:-60000}; VOCAB=${VOCAB:-128256}; SIZE=8192
  COMPILE=${COMPILE:-true}
fi

echo "# dsf GPU bench: $MODEL, bf16, seq $SEQ_LEN, global batch $GLOBAL, $STEPS steps; out $OUT"
"$PY" - "$OUT/peak.json" "$SIZE" <<'EOF'
import json, os, sys
from dataclasses import replace
import torch
from dsframework.train.throughput import matmul_flops
from dsframework.planner.cluster import Cluster, cluster_preset, local_gpu_preset
path, size = sys.argv[1], int(sys.argv[2])
peak = matmul_flops("bf16", size=size)
found = local_gpu_preset()  # (preset, device name) on an A100 / H100 / H200, else None
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 16 * 2**30
base = cluster_preset(found[0], nodes=1, gpus_per_node=1) if found else \
    Cluster(name=name, nodes=1, gpus_per_node=1, memory_per_gpu=memory)
profile = replace(base, name=f"measured {name}", memory_per_gpu=memory, peak_flops={"bf16": peak},
                  cpu_memory_per_node=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
json.dump(profile.to_dict(), open(path, "w"), indent=1)
print(f"# measured bf16 matmul peak on {name}: {peak / 1e12:.1f} TFLOP/s ({size}^3)")
EOF

"$PY" -m dsframework.commands.cli plan --model "$MODEL" --cluster "$OUT/peak.json" --nodes 1 --gpus-per-node 1 \
  --seq-len "$SEQ_LEN" --global-batch "$GLOBAL" --precision bf16 --top 3 -o "$OUT/plan" --force > "$OUT/plan.txt" 2>&1 \
  || { echo "dsf plan failed; its output ($OUT/plan.txt):"; tail -20 "$OUT/plan.txt"; exit 1; }
grep '^best:' "$OUT/plan.txt" | sed 's/^/# plan: /'

# The job, the same for both rows: model, data, steps, logging (the layout is each row's own).
JOB=(--set "model.name=$MODEL" --set train.precision=bf16 --set data.dataset=counting
     --set "data.seq_len=$SEQ_LEN" --set "data.num_examples=$EXAMPLES" --set "train.steps=$STEPS"
     --set "train.global_batch=$GLOBAL" --set train.warmup_steps=1
     --set "logging.every=$EVERY" --set logging.eval_every=0 --set logging.progress=false
     --set "logging.cluster=$OUT/peak.json" --set checkpoint.every=0 --set checkpoint.save_final=false)
[ -n "$VOCAB" ] && JOB+=(--set "model.overrides.vocab_size=$VOCAB")

train() {  # NAME YAML SETS...: one training, its log in $OUT/NAME.log
  local name=$1 yaml=$2; shift 2
  "$PY" -m dsframework.commands.cli train "$yaml" "${JOB[@]}" "$@" --set "output_dir=$OUT/$name" --overwrite \
    > "$OUT/$name.log" 2>&1 \
    || { echo "$name failed; the end of its log ($OUT/$name.log):"; tail -20 "$OUT/$name.log"; exit 1; }
}
train planned "$OUT/plan/run.yaml" --set "train.compile=$COMPILE" --set train.chunked_loss=true
train baseline launch/examples/tiny.yaml --set parallel.zero_stage=3 --set "train.micro_batch=$MICRO" \
  --set train.grad_accum=null --set train.compile=false --set train.chunked_loss=false

"$PY" - "$OUT" planned baseline <<'EOF'
import json, re, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
print("| run | ZeRO | micro x accum | compile s | tokens/s | model TFLOP/s per GPU | MFU | steps timed |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for name in names:
    log = (out / f"{name}.log").read_text(errors="replace")
    stage = re.search(r"\| ZeRO-(\d)", log).group(1)
    micro, accum = re.search(r"\| batch (\d+) x (\d+) x", log).groups()
    records = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines() if l]
    windows = [w for w in records if "tokens_per_s" in w]
    compiled = [w["compile_s"] for w in records if w.get("compile_s") is not None]
    timed = windows[1:] or windows          # the first window holds start-up, compilation and warm-up
    mean = lambda key: sum(w[key] for w in timed) / len(timed)
    print(f"| {name} | {stage} | {micro}x{accum} | {f'{compiled[-1]:.1f}' if compiled else '-'} "
          f"| {mean('tokens_per_s'):,.0f} | {mean('tflops_per_rank'):.1f} | {mean('mfu'):.1%} "
          f"| {timed[-1]['step'] - (windows[0]['step'] if len(windows) > 1 else 0)} |")
print("# MFU against the measured bf16 matmul peak (peak.json); goal for the planned row on an H200: 50%")
EOF
