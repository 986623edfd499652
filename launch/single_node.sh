#!/usr/bin/env bash
# Train a run config on this node with the deepspeed launcher, one rank per GPU (or CPU rank).
#   NUM_GPUS=8 bash launch/single_node.sh RUN.yaml [--set key=value ...] [--resume|--overwrite]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
[ -x "$BIN/dsf" ] || BIN=$(dirname "$(command -v dsf)")
exec "$BIN/deepspeed" --num_gpus "${NUM_GPUS:-2}" --master_port "${MASTER_PORT:-29500}" "$BIN/dsf" train "$@"
