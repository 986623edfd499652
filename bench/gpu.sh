#!/usr/bin/env bash
# One prepared benchmark for a machine with one NVIDIA GPU (an H200 when one is at hand).
#
#   bash bench/gpu.sh              # llama-1b (1.24B, vocab 128256), bf16, ZeRO-2 then ZeRO-3
#   bash bench/gpu.sh --dry-run    # tiny-llama, 2 steps, on whatever device is here (the test suite's check)
#   STEPS=40 SEQ_LEN=2048 bash bench/gpu.sh
#
# Installs nothing and reaches no network: it uses the checkout's .venv (launch/setup_env.sh) or
# the python on PATH, the built-in data task and a tokenizer trained on it. It measures the bf16
# matmul peak of this GPU first (an 8192^3 matmul; 1024^3 in the dry run), writes it as a cluster
# profile, and trains with `logging.cluster` pointing at it, so the MFU in metrics.jsonl is against
# the measured peak, not the datasheet. Prints one table: tokens/s, model TFLOP/s per GPU and MFU
# per ZeRO stage, over the steps after the first logging window (start-up and warm-up excluded).
# Runs well under 8 minutes on an H100/H200 (two ~1 min trainings plus model init).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
OUT=${OUT:-$(mktemp -d /tmp/dsf-gpu-bench.XXXXXX)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$DRY" = 1 ]; then
  MODEL=tiny-llama; STEPS=2; SEQ_LEN=64; MICRO=2; GLOBAL=4; EVERY=1; EXAMPLES=2000; VOCAB=; SIZE=1024
  STAGES="2 3"
else
  MODEL=${MODEL:-llama-1b}; STEPS=${STEPS:-30}; SEQ_LEN=${SEQ_LEN:-2048}; MICRO=${MICRO:-4}
  GLOBAL=${GLOBAL:-8}; EVERY=${EVERY:-10}; EXAMPLES=${EXAMPLES:-60000}; VOCAB=${VOCAB:-128256}; SIZE=8192
  STAGES="2 3"
fi

echo "# dsf GPU bench: $MODEL, bf16, seq $SEQ_LEN, batch $MICRO x $((GLOBAL / MICRO)) = $GLOBAL, $STEPS steps; out $OUT"
"$PY" - "$OUT/peak.json" "$SIZE" <<'EOF'
import json, sys
import torch
from dsframework.calibrate import matmul_flops
path, size = sys.argv[1], int(sys.argv[2])
peak = matmul_flops("bf16", size=size)
memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 16 * 2**30
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
json.dump({"name": f"measured {name}", "memory_per_gpu": memory, "peak_flops": {"bf16": peak}}, open(path, "w"))
print(f"# measured bf16 matmul peak on {name}: {peak / 1e12:.1f} TFLOP/s ({size}^3)")
EOF

for STAGE in $STAGES; do
  SETS=(--set "model.name=$MODEL" --set train.precision=bf16 --set "parallel.zero_stage=$STAGE"
        --set "data.seq_len=$SEQ_LEN" --set "data.num_examples=$EXAMPLES" --set "train.steps=$STEPS"
        --set "train.global_batch=$GLOBAL" --set "train.micro_batch=$MICRO" --set train.warmup_steps=1
        --set "logging.every=$EVERY" --set logging.eval_every=0 --set logging.progress=false
        --set "logging.cluster=$OUT/peak.json" --set checkpoint.every=0 --set checkpoint.save_final=false
        --set "output_dir=$OUT/zero$STAGE")
  [ -n "$VOCAB" ] && SETS+=(--set "model.overrides.vocab_size=$VOCAB")
  "$PY" -m dsframework.cli train launch/examples/tiny.yaml "${SETS[@]}" --overwrite > "$OUT/zero$STAGE.log" 2>&1 \
    || { echo "ZeRO-$STAGE failed; the end of its log ($OUT/zero$STAGE.log):"; tail -20 "$OUT/zero$STAGE.log"; exit 1; }
done

"$PY" - "$OUT" $STAGES <<'EOF'
import json, sys
from pathlib import Path
out, stages = Path(sys.argv[1]), sys.argv[2:]
print("| ZeRO | tokens/s | model TFLOP/s per GPU | MFU | steps timed |")
print("|---|---:|---:|---:|---:|")
for stage in stages:
    windows = [json.loads(l) for l in (out / f"zero{stage}" / "metrics.jsonl").read_text().splitlines() if l]
    windows = [w for w in windows if "tokens_per_s" in w]
    timed = windows[1:] or windows          # the first window holds start-up and warm-up
    mean = lambda key: sum(w[key] for w in timed) / len(timed)
    print(f"| {stage} | {mean('tokens_per_s'):,.0f} | {mean('tflops_per_rank'):.1f} | {mean('mfu'):.1%} | "
          f"{timed[-1]['step'] - (windows[0]['step'] if len(windows) > 1 else 0)} |")
EOF
