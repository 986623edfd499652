"""`dsf launch`: a hostfile checked with deepspeed's own parser, the command each node runs.

    resources = parse_hostfile(Path("hostfile").read_text().splitlines(), origin="hostfile")
    active = select_resources(resources, include="worker-0:0,1@worker-1", exclude="")
    for host, command in node_commands(active, master_addr="10.0.0.1", master_port=29500,
                                       program=["dsf", "train", "run.yaml"]):
        print(host, shlex.join(command))
    flags = deepspeed_flags("pdsh", hostfile="/shared/hostfile", master_addr="worker-0", master_port=29500)
    runner = build_runner("pdsh", flags, program, resources, active)   # deepspeed's PDSHRunner
    print(shlex.join(runner_command(runner, active, exports={"OMP_NUM_THREADS": "4"})))

Parsing and filtering are deepspeed's (`launcher.runner._parse_hostfile`,
`parse_inclusion_exclusion`); dsf adds the checks deepspeed leaves out (slots=0, text after the
slots, host names a shell would read, filters that leave nothing) and turns every failure into a
one-line error that names the file, the line and the fix. The launcher lines are deepspeed's own
runners' (`multinode_runner.PDSHRunner`, `OpenMPIRunner`, `MVAPICHRunner`) fed the namespace
deepspeed's `runner.parse_args` builds from the flags `dsf launch` passes to `deepspeed`; the
slurm line is `srun` starting one `deepspeed --no_ssh --node_rank $SLURM_NODEID` per node.

Pure but for the last section (ssh/name checks, this machine's memory), which runs things.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from dsframework.errors import UserError

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


def world_info(active: "OrderedDict[str, list[int]]") -> str:
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


# --- launchers ------------------------------------------------------------------------------------

RUNNER_LAUNCHERS = ("pdsh", "openmpi", "mvapich")  # deepspeed's runner starts every node from here
SLURM_NODEID = "__DSF_SLURM_NODEID__"  # replaced by $SLURM_NODEID once the line is quoted


def check_launcher(launcher: str, *, hostfile: bool, node_rank: int | None) -> None:
    """The flag combinations no launcher accepts, before the hostfile is read."""
    if launcher != "pdsh" and not hostfile:
        raise UserError("--launcher", launcher, "needs --hostfile (the nodes to start on)",
                        "pass --hostfile with one `<host> slots=<n>` line per node")
    if node_rank is not None and launcher != "no_ssh":
        raise UserError("--node-rank", node_rank, f"only applies to --launcher no_ssh, not {launcher}",
                        "drop --node-rank, or pass --launcher no_ssh")


def node_rank_of(node_rank: int | None, active: Mapping[str, list[int]], *, required: bool) -> int | None:
    """--node-rank checked against the active hosts; None (every node) when not given and not required."""
    hosts = list(active)
    if node_rank is None:
        if len(hosts) == 1:
            return 0
        if required:
            raise UserError("--node-rank", None, f"is needed with --launcher no_ssh on {len(hosts)} nodes",
                            f"run on each node with its rank: {', '.join(f'{r} on {h}' for r, h in enumerate(hosts))}")
        return None
    if not 0 <= node_rank < len(hosts):
        raise UserError("--node-rank", node_rank, f"is not a node of the {len(hosts)} active host(s)",
                        f"use 0..{len(hosts) - 1}: {', '.join(f'{r} = {h}' for r, h in enumerate(hosts))}")
    return node_rank


def check_slurm_resources(active: Mapping[str, list[int]], *, include: str, exclude: str) -> None:
    """deepspeed's SlurmRunner rule: srun places tasks by count, so no slot ids, same count per host."""
    from deepspeed.launcher.multinode_runner import SlurmRunner

    try:
        SlurmRunner.validate_active_resources(active)
    except ValueError as err:
        rule = str(err).split(". ")[0].rstrip(".")
        flag, value = ("--include", include) if include else ("--exclude", exclude) if exclude else ("--hostfile", None)
        raise UserError(flag, value, f"with --launcher slurm: {rule}",
                        "filter whole hosts (e.g. --include worker-0@worker-1), or keep the first N slots of "
                        "every host with --num-gpus N") from None


def runner_mode(launcher: str, active: Mapping[str, list[int]], *, hostfile: bool) -> tuple[bool, list[str]]:
    """(remote, flags): whether deepspeed's runner starts the nodes itself (pdsh, mpirun), and the
    flags that make it do so as printed: with one host it runs here, so a remote one needs
    --force_multi, and a local one --no_ssh_check (or deepspeed would first ssh to this host)."""
    if launcher not in RUNNER_LAUNCHERS or not hostfile:
        return False, []
    if len(active) > 1:
        return True, []
    return (True, ["--force_multi"]) if next(iter(active)) not in local_names() else (False, ["--no_ssh_check"])


def deepspeed_flags(launcher: str, *, hostfile: str | None, master_addr: str, master_port: int,
                    include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1,
                    node_rank: int | str | None = None, extra: Iterable[str] = ()) -> list[str]:
    """The `deepspeed` runner's flags for `launcher`: what `dsf launch` runs, and what
    `deepspeed.launcher.runner.parse_args` reads back to build the launcher's own command."""
    flags = ["--master_port", str(master_port)]
    if hostfile is None:  # one node, no hostfile: deepspeed starts `--num_gpus` ranks here
        return flags + (["--num_gpus", str(num_gpus)] if num_gpus > 0 else [])
    flags += ["--hostfile", hostfile, "--master_addr", master_addr]
    flags += ["--include", include] if include else ["--exclude", exclude] if exclude else []
    flags += ["--num_nodes", str(num_nodes)] if num_nodes > 0 else []
    flags += ["--num_gpus", str(num_gpus)] if num_gpus > 0 else []
    if launcher in ("no_ssh", "slurm"):
        return flags + ["--no_ssh", "--node_rank", str(node_rank)]
    return flags + ["--launcher", launcher, *extra]


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
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher.runner import EXCLUDE_ENVS, EXPORT_ENVS

    env = dict(environ)
    here = os.path.abspath(".")
    env["PYTHONPATH"] = here + ":" + env["PYTHONPATH"] if "PYTHONPATH" in env else here
    excluded = [name for key, names in EXCLUDE_ENVS.items() if key in env for name in names]
    prefixes = EXPORT_ENVS + get_accelerator().export_envs()
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


def srun_command(node_argv: list[str], active: Mapping[str, list[int]]) -> list[str]:
    """srun starting `node_argv` once per active host, inside the allocation; its `--node_rank`
    is $SLURM_NODEID, single-quoted so that each node expands its own."""
    script = shlex.join(node_argv).replace(SLURM_NODEID, "$SLURM_NODEID")
    return ["srun", f"--nodes={len(active)}", "--ntasks-per-node=1", f"--nodelist={','.join(active)}",
            "--kill-on-bad-exit=1", "bash", "-c", script]


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


# --- checks that run things: ssh, names, this machine ----------------------------------------------

TOOLS = {"pdsh": ("pdsh",), "openmpi": ("mpirun",), "mvapich": ("mpirun",), "slurm": ("srun",), "no_ssh": ()}


def local_names() -> set[str]:
    """Names this host answers to without ssh."""
    name = socket.gethostname()
    return {"localhost", "127.0.0.1", "::1", name, name.split(".")[0], socket.getfqdn()}


def _ssh_reason(host: str, timeout_s: float) -> str | None:
    """None when `ssh HOST true` works without a password, else the last line ssh printed."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, "true"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "ssh is not installed on this node"
    except subprocess.TimeoutExpired:
        return f"ssh did not finish within {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"ssh exited with code {proc.returncode}"


def _resolve_reason(host: str) -> str | None:
    """None when HOST resolves to an address (what no_ssh and slurm nodes need of each other's names)."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        return f"Could not resolve hostname {host}: {err.strerror or err}"
    return None


def check_hosts(hosts: Iterable[str], *, launcher: str, timeout_s: float = 15.0) -> list[tuple[str, str | None]]:
    """(host, None or why not), concurrently: `ssh -o BatchMode=yes HOST true` for the launchers that
    reach nodes over ssh, name resolution for no_ssh and slurm; this host's own names are skipped."""
    hosts = [h for h in hosts if h not in local_names()]
    probe = _ssh_reason if launcher in RUNNER_LAUNCHERS else lambda h, _t: _resolve_reason(h)
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(zip(hosts, pool.map(lambda h: probe(h, timeout_s), hosts)))


def check_tools(launcher: str, environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """(tool, None or why not) for what `launcher` runs on this node."""
    import shutil

    out = [(tool, None if shutil.which(tool) else "is not on PATH") for tool in TOOLS[launcher]]
    if launcher == "slurm":
        out.append(("SLURM_JOB_ID", None if environ.get("SLURM_JOB_ID") else
                    "is not set: not inside an allocation (sbatch launch/slurm.sbatch, or salloc)"))
    return out


def local_cluster(*, nodes: int, ranks_per_node: int):
    """This machine as a planner Cluster: the local GPU's memory when CUDA is there, else the
    `cpu-local` preset with host RAM / ranks per node for each rank. Also a phrase saying so."""
    from dataclasses import replace

    import torch

    from dsframework.planner.cluster import GiB, cluster_preset, local_gpu_preset

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        preset, _ = local_gpu_preset() or ("h100-80gb", props.name)  # a GPU without a preset: Hopper's rates
        cluster = replace(cluster_preset(preset, nodes=nodes, gpus_per_node=ranks_per_node),
                          name="local-gpu", memory_per_gpu=float(props.total_memory))
        return cluster, f"this node's {props.name}, {props.total_memory / GiB:.1f} GiB"
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    cluster = replace(cluster_preset("cpu-local", nodes=nodes, gpus_per_node=ranks_per_node),
                      memory_per_gpu=ram / ranks_per_node, cpu_memory_per_node=ram)
    ranks = f"{ranks_per_node} rank" + ("s" if ranks_per_node > 1 else "")
    return cluster, f"cpu-local: this node's {ram / GiB:.1f} GiB RAM / {ranks}"


# --- each rank under mpirun (openmpi, mvapich) ------------------------------------------------------

# deepspeed's OpenMPI/MVAPICH runners start every rank with mpirun, which names ranks its own way;
# torch.distributed and dsf read RANK & co. (dsf train without RANK would train a world of one).
MPI_RANK_VARS = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}
MPI_ENTRY = "dsframework.launch"  # `deepspeed --module dsframework.launch MASTER:PORT train ...`


def mpi_rank_env(environ: Mapping[str, str], *, master: str) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT from mpirun's variables.

        mpi_rank_env({"OMPI_COMM_WORLD_RANK": "3", ...}, master="worker-0:29500")["RANK"]  # '3'
    """
    out = {}
    for name, sources in MPI_RANK_VARS.items():
        value = next((environ[source] for source in sources if source in environ), None)
        if value is None:
            raise UserError("mpirun", None, f"set none of {', '.join(sources)}",
                            "start this entry point through dsf launch --launcher openmpi or mvapich")
        out[name] = value
    addr, _, port = master.rpartition(":")
    return {**out, "LOCAL_SIZE": out["LOCAL_WORLD_SIZE"], "MASTER_ADDR": addr, "MASTER_PORT": port}


def mpi_main(argv: list[str] | None = None) -> None:
    """One rank under mpirun: `python -u -m dsframework.launch MASTER:PORT train RUN.yaml ...`."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        os.environ.update(mpi_rank_env(os.environ, master=argv[0] if argv else ""))
    except UserError as err:
        print(f"dsf: error: {err}", file=sys.stderr)
        sys.exit(2)
    from dsframework.cli import main

    main(argv[1:])


if __name__ == "__main__":
    mpi_main()
