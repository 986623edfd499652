#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with torch, DeepSpeed, transformers and
# dsframework (editable, with test extras). Safe to run again: it only installs what is missing.
#   bash launch/setup_env.sh            # TORCH_SPEC=torch==2.13.0 by default (a CPU build here)
# As root on Debian/Ubuntu it also installs, when missing, the system tools of the multi-node tests
# (tests/cluster: sshd, pdsh, mpirun, SLURM and munge, ip/unshare/nsenter), without starting their
# services; DSF_SYSTEM_PACKAGES=0 skips that. A failed install warns and the cluster tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
SYSTEM_PACKAGES="openssh-server openssh-client pdsh openmpi-bin slurm-wlm munge iproute2 util-linux"

system_packages() {
  command -v dpkg-query >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 || return 0  # not Debian
  local missing=() pkg
  for pkg in $SYSTEM_PACKAGES; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "setup_env: note: the multi-node tests (tests/cluster) skip without ${missing[*]}: sudo apt-get install ${missing[*]}" >&2
    return 0
  fi
  echo "setup_env: installing ${missing[*]} (apt-get; their services are not started)"
  # policy-rc.d exit 101: Debian's maintainer scripts start no service (no system sshd, munged or
  # slurmd left running: the tests start their own, with their own configs, inside namespaces).
  local policy=/usr/sbin/policy-rc.d made_policy=0 log
  log=$(mktemp)
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1; fi
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    echo "setup_env: warning: could not install ${missing[*]} (the tests in tests/cluster will skip); apt-get said:" >&2
    tail -n 5 "$log" >&2
  fi
  [ "$made_policy" = 1 ] && rm -f "$policy"
  rm -f "$log"
}

[ "${DSF_SYSTEM_PACKAGES:-1}" = 0 ] || system_packages || true

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch first and pinned: an unpinned torch pulled in by deepspeed would be a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
# dsframework and the tested stack: every version from launch/constraints.txt (DSF_CONSTRAINTS to
# try another file; bench/newest_stack.py tries the newest releases in a venv of its own).
# Installed again only when setup.py or the constraints changed since the last install, or an
# installed version differs from its pin.
constraints=${DSF_CONSTRAINTS:-launch/constraints.txt}
stamp=.venv/.dsframework-installed
stack_matches() {
  .venv/bin/python - "$constraints" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
import dsframework, pytest, deepspeed  # noqa: F401 - installed and importable
for line in open(sys.argv[1]):
    name, _, version = line.split("#")[0].strip().partition("==")
    try:
        installed = md.version(name) if version else version
    except md.PackageNotFoundError:  # not needed on this platform: pip leaves it out too
        continue
    if installed != version:
        sys.exit(f"{name} {installed} is not the pinned {version}")
PY
}
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ "$constraints" -nt "$stamp" ] || ! stack_matches; then
  .venv/bin/python -m pip install -q -c "$constraints" -e ".[dev]"
  touch "$stamp"
fi
# DeepSpeed's CPU ops (shm all-reduce, Adam), built once here as DS_BUILD_OPS builds them at install,
# not by the first training (about a minute each); cached in .venv/torch_extensions afterwards.
.venv/bin/python -m dsframework.jit 2>/dev/null | tail -n 1 || echo "setup_env: warning: DeepSpeed's CPU ops not built; the first run builds them" >&2
echo "setup_env: .venv ready ($(.venv/bin/python -c 'import torch, deepspeed, transformers; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")' 2>/dev/null))"
