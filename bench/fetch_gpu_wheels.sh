#!/usr/bin/env bash
# Fetch, here, the wheels bench/gpu_smoke.sh installs on a GPU machine that has no network.
#
#   bash bench/fetch_gpu_wheels.sh          # into .whl/ (ignored by git); idempotent; prints the list and total
#
# The GPU machine (python 3.12, torch 2.11 + CUDA 13, transformers 5.17, nvcc; no DeepSpeed, no
# datasets, no pydantic, no network) gets our pinned stack: every package `dsf train` needs beside
# torch, at the versions of launch/constraints.txt, as CPython 3.12 manylinux x86_64 wheels (or
# py3-none-any). That is transformers 5.25.0 (the pinned one; with its tokenizers, huggingface_hub,
# safetensors, ...), not the image's 5.17: it fits, ~30 MiB of the 64 MiB allowed.
#
# CARRY is that list: the requirement closure of dsframework's install_requires (setup.py), its
# environment markers read for CPython 3.12 on Linux x86_64, without descending into IMAGE.
# IMAGE is what the machine's image already holds and we must not shadow: torch (its CUDA build)
# and the binary data stack whose ABI is tied to the image's numpy: numpy, pyarrow (its wheel alone
# is 55 MB, over the budget with everything else), pandas. datasets 5.2.0 needs pyarrow >= 24:
# gpu_smoke.sh's first check reads the image's versions against what the carried wheels require.
# tests/unit/test_gpu_smoke_script.py checks that CARRY + IMAGE cover that closure and every
# third-party module dsframework imports (the metric sinks' libraries aside: the smoke run
# configures none).
#
# DeepSpeed publishes only a source archive on PyPI: its pure-Python wheel is built here with every
# op off (DS_BUILD_OPS=0; ops JIT-build on first use there, where nvcc is). After the downloads the
# script checks each wheel's Requires-Dist against CARRY (and its pinned version) + IMAGE, drops
# wheels in .whl/ that are not in the list (one version of each package), and fails when the total
# is over 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${WHEEL_DIR:-.whl}
LIMIT_MIB=64
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)

CARRY=(
  accelerate annotated-doc annotated-types anyio click datasets deepspeed dill einops filelock fsspec h11
  hf-xet hjson httpcore2 httpx2 huggingface_hub idna kernels markdown-it-py mdurl msgpack multiprocess ninja
  packaging peft psutil py-cpuinfo pydantic pydantic_core Pygments PyYAML regex rich safetensors shellingham
  tokenizers tomlkit tqdm transformers truststore typer typing_extensions typing-inspection xxhash
)
IMAGE=(torch numpy pyarrow pandas)

mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# name==version of each carried package (from launch/constraints.txt) that .whl/ lacks; stale wheels removed
plan() {
  "$PY" - "$DEST" launch/constraints.txt "${CARRY[@]}" <<'EOF'
import sys
from pathlib import Path
from packaging.utils import canonicalize_name, parse_wheel_filename

dest, constraints, carry = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
pins = {}
for line in constraints.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if "==" in line:
        name, version = line.split("==", 1)
        pins[canonicalize_name(name)] = version.strip()
missing = [name for name in carry if canonicalize_name(name) not in pins]
if missing:
    sys.exit(f"fetch_gpu_wheels: not pinned in {constraints}: {', '.join(missing)}")
wanted = {canonicalize_name(name): pins[canonicalize_name(name)] for name in carry}
have = set()
for wheel in sorted(dest.glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(wheel.name)
    if wanted.get(name) == str(version) and name not in have:
        have.add(name)
    else:
        print(f"fetch_gpu_wheels: removing {wheel.name} (not in the list, or another version)", file=sys.stderr)
        wheel.unlink()
for name, version in wanted.items():
    if name not in have:
        print(f"{name}=={version}")
EOF
}

pip_quiet() {  # pip, without the warnings this machine's pip config gives for its local indexes; pip's status
  local err rc=0
  err=$(mktemp)
  "$PY" -m pip "$@" 2>"$err" || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$err" >&2 || true
  rm -f "$err"
  return "$rc"
}
PLAN=$(plan)  # (set -e: a package missing from launch/constraints.txt stops here)
NEEDED=() DOWNLOADS=()
[ -z "$PLAN" ] || mapfile -t NEEDED <<< "$PLAN"
for spec in "${NEEDED[@]}"; do
  if [ "${spec%%==*}" = deepspeed ]; then
    echo "fetch_gpu_wheels: building $spec (source archive only on PyPI; DS_BUILD_OPS=0)" >&2
    DS_BUILD_OPS=0 pip_quiet wheel -q --no-deps --no-cache-dir --no-binary deepspeed -w "$DEST" "$spec"
  else
    DOWNLOADS+=("$spec")
  fi
done
if [ "${#DOWNLOADS[@]}" -gt 0 ]; then
  echo "fetch_gpu_wheels: downloading ${#DOWNLOADS[@]} wheels" >&2
  pip_quiet download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$DEST" "${DOWNLOADS[@]}"
fi

# Every carried package present once, its requirements met by CARRY or IMAGE, DeepSpeed's ops off, the total.
"$PY" - "$DEST" "$LIMIT_MIB" "${IMAGE[*]}" "${CARRY[@]}" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

dest, limit_mib, image, carry = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(), sys.argv[4:]
image = {canonicalize_name(n) for n in image}
target = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
wheels = {parse_wheel_filename(w.name)[0]: w for w in sorted(dest.glob("*.whl"))}
versions = {name: parse_wheel_filename(w.name)[1] for name, w in wheels.items()}
problems = [f"no wheel for {n}" for n in carry if canonicalize_name(n) not in wheels]
for name, wheel in wheels.items():
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
        if name == "deepspeed":
            info = archive.read("deepspeed/git_version_info_installed.py").decode()
            built = re.findall(r"'(\w+)': True", info)
            if built:
                problems.append(f"deepspeed wheel has prebuilt ops {built}: build it with DS_BUILD_OPS=0")
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(target):
            continue
        need = canonicalize_name(req.name)
        if need in image:
            continue
        if need not in versions:
            problems.append(f"{name} needs {req}: neither carried nor in the image (add it to CARRY or IMAGE)")
        elif not req.specifier.contains(versions[need], prereleases=True):
            problems.append(f"{name} needs {req}, carried {need} {versions[need]}")
total = 0
for name, wheel in sorted(wheels.items(), key=lambda item: -item[1].stat().st_size):
    size = wheel.stat().st_size
    total += size
    print(f"{size / 2**20:7.2f} MiB  {wheel.name}")
print(f"fetch_gpu_wheels: {len(wheels)} wheels, {total / 2**20:.1f} MiB of {limit_mib:.0f} MiB in {dest}/")
if total > limit_mib * 2**20:
    problems.append(f"{total / 2**20:.1f} MiB is over the {limit_mib:.0f} MiB limit")
for problem in problems:
    print(f"fetch_gpu_wheels: error: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
