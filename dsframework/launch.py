"""`dsf launch`: a hostfile checked with deepspeed's own parser, the command each node runs.

    resources = parse_hostfile(Path("hostfile").read_text().splitlines(), origin="hostfile")
    active = select_resources(resources, include="worker-0:0,1@worker-1", exclude="")
    for host, command in node_commands(active, master_addr="10.0.0.1", master_port=29500,
                                       program=["dsf", "train", "run.yaml"]):
        print(host, shlex.join(command))

Parsing and filtering are deepspeed's (`launcher.runner._parse_hostfile`,
`parse_inclusion_exclusion`); dsf adds the checks deepspeed leaves out (slots=0, text after the
slots, host names a shell would read, filters that leave nothing) and turns every failure into a
one-line error that names the file, the line and the fix. Pure: no ssh, no processes.
"""
from __future__ import annotations

import re
import sys
from collections import OrderedDict
from typing import Iterable

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
