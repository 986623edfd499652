#!/usr/bin/env bash
# The main job: the built-in default (a tiny Llama learns to count) on 2 ranks with the deepspeed
# launcher, then an export to a transformers directory, and a sample from it (dsf generate).
# Idempotent: it replaces its own output.
#   bash launch/quickstart.sh           # output in runs/quickstart (OUTPUT_DIR to change)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUTPUT_DIR:-runs/quickstart}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --overwrite: this demo owns $OUT; a real run would use --resume or a new output_dir instead.
bash launch/single_node.sh launch/examples/tiny.yaml --set "output_dir=$OUT" --overwrite
.venv/bin/dsf export "$OUT/checkpoints" "$OUT/hf" --overwrite
.venv/bin/python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
print(f"quickstart: eval loss {evals[0]:.3f} -> {evals[-1]:.3f} ({evals[-1] / evals[0]:.1%} of the start); "
      f"model in {sys.argv[1]}/hf")
PY
# A greedy sample from the exported model: it should go on counting (numbers and commas, then EOS).
sample=$(.venv/bin/dsf generate "$OUT/hf" --prompt "17,18,19," --max-new-tokens 16)
echo "quickstart: dsf generate $OUT/hf --prompt 17,18,19, -> $sample"
