#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with torch, DeepSpeed, transformers and
# dsframework (editable, with test extras). Safe to run again: it only installs what is missing.
#   bash launch/setup_env.sh            # TORCH_SPEC=torch==2.13.0 by default (a CPU build here)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch first and pinned: an unpinned torch pulled in by deepspeed would be a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
# Reinstall dsframework only when setup.py changed since the last install.
stamp=.venv/.dsframework-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || ! .venv/bin/python -c "import dsframework, pytest, deepspeed" 2>/dev/null; then
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
echo "setup_env: .venv ready ($(.venv/bin/python -c 'import torch, deepspeed, transformers; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")' 2>/dev/null))"
