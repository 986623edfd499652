"""`dsf launch`: a hostfile checked with deepspeed's own parser, the command each node runs.

    resources = parse_hostfile(Path("hostfile").read_text().splitlines(), origin="hostfile")
    active = select_resources(resources, include="worker-0:0,1@worker-1", exclude="")
    for host, command in node_commands(active, master_addr="10.0.0.1", master_port=29500,
                                       program=["dsf", "train", "run.yaml"]):
        print(host, shlex.join(command))
    flags = ["--hostfile", "/shared/hostfile", "--master_addr", "worker-0", "--launcher", "pdsh"]
    runner = build_runner("pdsh", flags, program, resources, active)   # deepspeed's PDSHRunner
    print(shlex.join(runner_command(runner, active, exports={"OMP_NUM_THREADS": "4"})))

Parsing and filtering are deepspeed's (`launcher.runner._parse_hostfile`,
`parse_inclusion_exclusion`); dsf adds the checks deepspeed leaves out (slots=0, text after the
slots, host names a shell would read, filters that leave nothing) and turns every failure into a
one-line error that names the file, the line and the fix. The launcher lines are deepspeed's own
runners' (`multinode_runner.PDSHRunner`, `OpenMPIRunner`, `MVAPICHRunner`) fed the namespace
deepspeed's `runner.parse_args` builds from the flags `dsf launch` passes to `deepspeed`. Each
launcher's own rules, checks and start are in launchers.py.

Pure but for the last section (this machine's names).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import socket
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from dsframework.errors import UserError
from dsframework.types import accelerator

HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-_:]*$")  # names, IPv4 and IPv6 addresses
LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def parse_hostfile(lines: Iterable[str], *, origin: str = "hostfile") -> "OrderedDict[str, int]":
    """{host: slots} in file order, as deepspeed's parser reads it, after dsf's stricter checks."""
    from deepspeed.launcher.runner import _parse_hostfile

    lines = list(lines)
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{origin}:{number}"
        match = LINE.match(line)
        if match is None:
            raise UserError(where, line, "is not `<host> slots=<n>`", "write one host per line, e.g. `worker-1 slots=8`")
        host, slots = match.group(1), int(match.group(2))
        if not HOST_NAME.match(host):
            raise UserError(where, host, "is not a host name or address",
                            "use letters, digits, '.', '-', '_' or an IP address")
        if slots == 0:
            raise UserError(where, line, "gives the host no slots", "set slots to the GPUs on that host, or remove it")
        if host in seen:
            raise UserError(where, host, f"is listed twice (first on line {seen[host]})", "keep one line per host")
        seen[host] = number
    if not seen:
        raise UserError(origin, None, "lists no hosts", "add lines such as `worker-1 slots=8`")
    return _parse_hostfile(lines)  # the same map deepspeed's launcher will build


def select_resources(resources: "OrderedDict[str, int]", *, include: str = "", exclude: str = "",
                     num_nodes: int = -1, num_gpus: int = -1) -> "OrderedDict[str, list[int]]":
    """{host: slot ids} after deepspeed's --include/--exclude filter and --num_nodes/--num_gpus."""
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

    if include and exclude:
        raise UserError("--include/--exclude", f"{include} / {exclude}", "are mutually exclusive", "pass one of them")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):  # deepspeed's runner refuses the mix
        flag, value = ("--num-gpus", num_gpus) if num_gpus > 0 else ("--num-nodes", num_nodes)
        raise UserError(flag, value, f"cannot be combined with {'--include' if include else '--exclude'}",
                        "select hosts and slots with the filter alone, or with the counts alone")
    try:
        active = parse_inclusion_exclusion(resources, include, exclude)
    except ValueError as err:
        flag = "--include" if include else "--exclude"
        raise UserError(flag, include or exclude, str(err).rstrip("."),
                        f"name hosts and slots of the hostfile: {', '.join(f'{h} (slots 0-{n - 1})' for h, n in resources.items())}") from None
    active = OrderedDict((host, slots) for host, slots in active.items() if slots)
    if not active:
        raise UserError("--include/--exclude", include or exclude, "leaves no slots", "keep at least one host")
    if num_nodes > len(active):
        raise UserError("--num-nodes", num_nodes, f"exceeds the {len(active)} hosts left", f"use --num-nodes <= {len(active)}")
    fewest = min(len(slots) for slots in active.values())
    if num_gpus > fewest:
        raise UserError("--num-gpus", num_gpus, f"exceeds the {fewest} slots of a host", f"use --num-gpus <= {fewest}")
    return apply_num_nodes_and_gpus(active, num_nodes, num_gpus)


def world_info(active: Mapping[str, list[int]]) -> str:
    """deepspeed.launcher.launch's --world_info: base64 of the {host: slots} JSON (deepspeed's)."""
    from deepspeed.launcher.runner import encode_world_info

    return encode_world_info(active)


def node_commands(active: "OrderedDict[str, list[int]]", *, master_addr: str, master_port: int,
                  program: list[str], python: str = sys.executable) -> list[tuple[str, list[str]]]:
    """(host, argv) of deepspeed's per-node launcher, as pdsh or `--no_ssh` runs it on each node."""
    info = world_info(active)
    return [(host, [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}",
                    f"--node_rank={rank}", f"--master_addr={master_addr}", f"--master_port={master_port}",
                    *program])
            for rank, host in enumerate(active)]


# --- deepspeed's runners (pdsh, mpirun): their command line ------------------------------------------

@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """deepspeed's logger prints on stdout ("Running on the following workers ..."); keep the
    dry-run output to the commands."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def build_runner(launcher: str, flags: list[str], program: list[str], resources: Mapping[str, int],
                 active: Mapping[str, list[int]]):
    """deepspeed's PDSHRunner / OpenMPIRunner / MVAPICHRunner, built as `deepspeed FLAGS PROGRAM` does."""
    from deepspeed.launcher.runner import LAUNCHER_CLASSES, parse_args

    args = parse_args([*flags, *program])
    cls = LAUNCHER_CLASSES[launcher]
    try:
        with _quiet_deepspeed():
            if launcher == "pdsh":
                return cls(args, world_info(active))
            return cls(args, world_info(active), OrderedDict(resources))  # the whole pool, as runner.main
    except ValueError as err:  # validate_args: the MPI runners take the hostfile as it is
        raise UserError("--launcher", launcher, str(err).rstrip("."),
                        "drop --include/--exclude/--num-nodes/--num-gpus and list only the hosts and slots "
                        "to use in the hostfile") from None


def runner_exports(environ: Mapping[str, str], env_files: Iterable[Mapping[str, str]]) -> "OrderedDict[str, str]":
    """The variables deepspeed's runner exports to every node: PYTHON*, MLFLOW*, MV2*, UCX* and the
    accelerator's (NCCL* on CUDA) from this environment, then each .deepspeed_env (read_env_file).
    Mirrors runner.main, where this is inline code, not a function one could call."""
    from deepspeed.launcher.runner import EXCLUDE_ENVS, EXPORT_ENVS

    env = dict(environ)
    here = os.path.abspath(".")
    env["PYTHONPATH"] = here + ":" + env["PYTHONPATH"] if "PYTHONPATH" in env else here
    excluded = [name for key, names in EXCLUDE_ENVS.items() if key in env for name in names]
    prefixes = EXPORT_ENVS + accelerator().export_envs()
    exports = OrderedDict((k, v) for k, v in env.items()
                          if any(k.startswith(p) for p in prefixes) and k not in excluded)
    for env_file in env_files:
        exports.update(env_file)
    return exports


def runner_command(runner, active: Mapping[str, list[int]], *, exports: Mapping[str, str]) -> list[str]:
    """The pdsh or mpirun line deepspeed's runner would start (pdsh need not be installed)."""
    for key, value in exports.items():
        runner.add_export(key, value)
    with _quiet_deepspeed():
        try:
            cmd = runner.get_cmd(dict(os.environ), OrderedDict(active))
        except ValueError as err:  # MPICH/MVAPICH: the same slots on every host
            raise UserError("--hostfile", None, f"with --launcher {runner.name}: {str(err).rstrip('.')}",
                            "give every host the same slots") from None
    return cmd[0] if isinstance(cmd, tuple) else cmd  # PDSHRunner also returns its kill command


def shell_line(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """`K=V ... argv` as one shell line; the srun script keeps its single quotes."""
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return prefix + shlex.join(argv)


# --- environment for every node (.deepspeed_env) --------------------------------------------------

# Forwarded from the launching environment when set; deepspeed's runner already forwards PYTHON*
# (PYTHONPATH with the working directory in front), MLFLOW*, MV2*, UCX* and, on CUDA, NCCL*.
DEFAULT_ENV = ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_CACHE",
               "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS", "TOKENIZERS_PARALLELISM")
DEFAULT_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# deepspeed writes `export K="V";` into the remote shell line (pdsh) or `-x K="V"` into mpirun's argv:
# a value must mean the same in both, so nothing a shell expands or unquotes, and no blanks.
ENV_UNSAFE = {"\n": "a newline", "\r": "a carriage return", "$": "'$' (the remote shell would expand it)",
              "`": "a backtick (the remote shell would run it)", '"': "a double quote", "'": "a single quote",
              "\\": "a backslash", " ": "a space", "\t": "a tab"}


def check_env(key: str, value: str, *, source: str) -> None:
    """UserError unless KEY=VALUE reaches every node unchanged under every launcher."""
    if not ENV_KEY.match(key):
        raise UserError(source, f"{key}={value}", f"{key!r} is not a variable name",
                        "use letters, digits and '_', not starting with a digit")
    bad = next((what for char, what in ENV_UNSAFE.items() if char in value), None)
    if bad is None and any(ord(c) < 32 for c in value):
        bad = "a control character"
    if bad is not None:
        raise UserError(source, f"{key}={value}", f"the value of {key} holds {bad}",
                        f"give {key} a literal value without quotes, blanks or '$' (let your shell expand it "
                        f"here: --env {key}=\"$VAR\")")


def parse_env(assignments: Iterable[str]) -> "OrderedDict[str, str]":
    """--env KEY=VALUE flags, each checked."""
    out: OrderedDict[str, str] = OrderedDict()
    for text in assignments:
        if "=" not in text:
            raise UserError("--env", text, "is not KEY=VALUE", f"write e.g. --env {text or 'NCCL_DEBUG'}=INFO")
        key, value = text.split("=", 1)
        check_env(key, value, source="--env")
        out[key] = value
    return out


def node_env(environ: Mapping[str, str], explicit: Mapping[str, str]) -> tuple["OrderedDict[str, str]", list[str]]:
    """(DEFAULT_ENV and DEFAULT_ENV_PREFIXES from `environ`, then --env, which wins; why each default
    left out was left out). A default that fails check_env is not forwarded rather than refused:
    the user did not ask for it."""
    out: OrderedDict[str, str] = OrderedDict()
    skipped = []
    for key in sorted(environ):
        if (key in DEFAULT_ENV or key.startswith(DEFAULT_ENV_PREFIXES)) and key not in explicit:
            try:
                check_env(key, environ[key], source=f"environment variable {key}")
                out[key] = environ[key]
            except UserError as err:
                skipped.append(f"not forwarding {err.value}: {err.rule}")
    out.update(explicit)
    return out, skipped


def env_file_path(*, home: bool = False) -> Path:
    """./.deepspeed_env (or ~/), as deepspeed's runner names it: $DS_ENV_FILE replaces the name."""
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME

    return Path(os.path.join(os.path.expanduser("~") if home else ".", DEEPSPEED_ENVIRONMENT_NAME))


def read_env_file(text: str, *, origin: str) -> "OrderedDict[str, str]":
    """{key: value} of an existing .deepspeed_env, as deepspeed's runner splits each line."""
    out: OrderedDict[str, str] = OrderedDict()
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        key, sep, value = line.partition("=")
        if not sep or not ENV_KEY.match(key.strip()):
            raise UserError(f"{origin}:{number}", line.strip(), "is not KEY=VALUE, and deepspeed's runner "
                            "reads every line as one (no blank lines or comments)", f"fix or remove line {number}")
        out[key.strip()] = value.strip()
    return out


def merge_env_file(existing: Mapping[str, str] | None, wanted: Mapping[str, str], *, explicit: Iterable[str],
                   origin: str) -> "OrderedDict[str, str]":
    """The lines to append to the .deepspeed_env: the user's file is never rewritten. A key it sets
    to another value wins over the launching environment and is refused for --env."""
    existing = existing or {}
    explicit = set(explicit)
    new: OrderedDict[str, str] = OrderedDict()
    for key, value in wanted.items():
        if key not in existing:
            new[key] = value
        elif existing[key] != value and key in explicit:
            raise UserError("--env", f"{key}={value}", f"{origin} already sets {key}={existing[key]}",
                            f"edit {key} in {origin}, or drop --env {key}")
    return new


# --- this machine ----------------------------------------------------------------------------------

def local_names() -> set[str]:
    """Names this host answers to without ssh."""
    name = socket.gethostname()
    return {"localhost", "127.0.0.1", "::1", name, name.split(".")[0], socket.getfqdn()}
