"""Hostfiles and filters: the good ones give deepspeed's own resource map, each bad one a
one-line error naming the file, line or flag; `dsf launch --dry-run` prints each node's command."""
from __future__ import annotations

import base64
import json
from collections import OrderedDict

import pytest
from click.testing import CliRunner
from deepspeed.launcher.runner import _parse_hostfile, parse_inclusion_exclusion

from dsframework.cli import cli
from dsframework.errors import UserError
from dsframework.launch import node_commands, parse_hostfile, select_resources

GOOD = [
    "worker-0 slots=8\nworker-1 slots=8\n",
    "# a comment\n\n10.0.0.1 slots=4\n10.0.0.2   slots=4   \n",
    "node_a slots=2\n",
]


@pytest.mark.parametrize("text", GOOD)
def test_good_hostfiles_give_deepspeeds_map(text):
    lines = text.splitlines()
    assert parse_hostfile(lines) == _parse_hostfile(lines)


BAD_HOSTFILES = {  # text: what the message must name
    "": "lists no hosts",
    "# only a comment\n": "lists no hosts",
    "worker-0\n": "hostfile:1",
    "worker-0 slots=\n": "hostfile:1",
    "worker-0 slots=-1\n": "hostfile:1",
    "worker-0 slots=four\n": "hostfile:1",
    "worker-0 slots=0\n": "no slots",
    "worker-0 slots=4 gpus=2\n": "hostfile:1",
    "worker-0 slots=4\nworker-0 slots=4\n": "listed twice",
    "worker-0 slots=4\nworker;rm slots=4\n": "hostfile:2",
    "slots=4\n": "hostfile:1",
    "worker-0 slot=4\n": "hostfile:1",
}


@pytest.mark.parametrize("text,expect", list(BAD_HOSTFILES.items()), ids=range(len(BAD_HOSTFILES)))
def test_bad_hostfiles_are_one_line_errors(text, expect):
    with pytest.raises(UserError) as err:
        parse_hostfile(text.splitlines())
    assert expect in str(err.value) and "\n" not in str(err.value)


RESOURCES = OrderedDict([("worker-0", 4), ("worker-1", 4)])


@pytest.mark.parametrize("include,exclude", [("worker-0:0,1@worker-1:2,3", ""), ("", "worker-1:3"),
                                             ("worker-1", "")])
def test_filters_match_deepspeeds(include, exclude):
    assert select_resources(RESOURCES, include=include, exclude=exclude) == parse_inclusion_exclusion(
        RESOURCES, include, exclude)


BAD_FILTERS = [
    (dict(include="worker-2"), "--include"),
    (dict(include="worker-0:7"), "--include"),
    (dict(exclude="worker-9"), "--exclude"),
    (dict(include="worker-0", exclude="worker-1"), "mutually exclusive"),
    (dict(exclude="worker-0@worker-1"), "leaves no slots"),
    (dict(num_nodes=3), "--num-nodes"),
    (dict(num_gpus=5), "--num-gpus"),
]


@pytest.mark.parametrize("kwargs,expect", BAD_FILTERS, ids=range(len(BAD_FILTERS)))
def test_bad_filters_are_one_line_errors(kwargs, expect):
    with pytest.raises(UserError, match=expect.replace("-", r"\-")):
        select_resources(RESOURCES, **kwargs)


def test_node_commands_carry_deepspeeds_world_info_and_node_ranks():
    active = select_resources(RESOURCES, num_gpus=2)
    commands = node_commands(active, master_addr="worker-0", master_port=29501, program=["dsf", "train", "r.yaml"])
    assert [host for host, _ in commands] == ["worker-0", "worker-1"]
    for rank, (_, argv) in enumerate(commands):
        info = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
        assert json.loads(base64.urlsafe_b64decode(info)) == {"worker-0": [0, 1], "worker-1": [0, 1]}
        assert f"--node_rank={rank}" in argv and "--master_addr=worker-0" in argv
        assert argv[-3:] == ["dsf", "train", "r.yaml"]


def test_dsf_launch_dry_run_for_two_nodes(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    result = CliRunner().invoke(cli, ["launch", "launch/examples/tiny.yaml", "--hostfile", str(hostfile),
                                      "--dry-run", "--set", "parallel.tp=2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "4 ranks = tp 2 x pp 1 x dp 2 on 2 node(s)" in lines[0]
    assert lines[1].startswith("worker-0: ") and "--node_rank=0" in lines[1]
    assert lines[2].startswith("worker-1: ") and "--node_rank=1" in lines[2] and "--set parallel.tp=2" in lines[2]


def test_dsf_launch_refuses_a_layout_the_hosts_cannot_hold(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    for overrides, match in [(["parallel.tp=4"], "parallel.tp"), (["parallel.dp=2"], "parallel.dp"),
                             (["parallel.pp=4"], "parallel.pp")]:  # 4 slots; tiny-llama has 2 layers
        with pytest.raises(UserError, match=match):
            CliRunner().invoke(cli, ["launch", "launch/examples/tiny.yaml", "--hostfile", str(hostfile),
                                     "--dry-run", *[a for o in overrides for a in ("--set", o)]],
                               catch_exceptions=False, standalone_mode=False)
