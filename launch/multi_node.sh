#!/usr/bin/env bash
# Train a run config on the nodes of a hostfile with `dsf launch`: it checks the hostfile, layout
# and memory, then starts deepspeed's runner (pdsh over passwordless ssh by default). Every node
# needs this checkout and its .venv at the same path.
#   HOSTFILE=hostfile bash launch/multi_node.sh RUN.yaml [--set key=value ...] [dsf launch flags]
#   HOSTFILE=hostfile bash launch/multi_node.sh RUN.yaml --check       # ssh pre-flight, then exit
#   HOSTFILE=hostfile bash launch/multi_node.sh RUN.yaml --dry-run     # print the commands, then exit
#   HOSTFILE=hostfile LAUNCHER=openmpi bash launch/multi_node.sh RUN.yaml
#   HOSTFILE=hostfile LAUNCHER=no_ssh NODE_RANK=K bash launch/multi_node.sh RUN.yaml   # on node K
# MASTER_ADDR (default: the first host) and MASTER_PORT (29500) are passed on when set.
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE to a file of '<host> slots=<n>' lines}"
HOSTFILE=$(realpath "$HOSTFILE")  # before the cd below
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
[ -x "$BIN/dsf" ] || BIN=$(dirname "$(command -v dsf)")
args=(--hostfile "$HOSTFILE" --launcher "${LAUNCHER:-pdsh}" --master-port "${MASTER_PORT:-29500}")
if [ -n "${MASTER_ADDR:-}" ]; then args+=(--master-addr "$MASTER_ADDR"); fi
if [ -n "${NODE_RANK:-}" ]; then args+=(--node-rank "$NODE_RANK"); fi
exec "$BIN/dsf" launch "$@" "${args[@]}"
