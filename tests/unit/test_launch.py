"""Hostfiles and filters: the good ones give deepspeed's own resource map, each bad one a
one-line error naming the file, line or flag; `dsf launch --dry-run` prints each node's command."""
from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from deepspeed.launcher.runner import _parse_hostfile, parse_inclusion_exclusion

from dsframework.launching import hostfile as launch
from dsframework.commands.cli import cli
from dsframework.errors import UserError
from dsframework.launching.hostfile import node_commands, parse_hostfile, select_resources
from dsframework.launching.launchers import LAUNCHERS, LaunchJob, check_hosts, ssh_reason
from dsframework.commands.mpi_rank import mpi_rank_env

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
    assert "4 ranks = tp 2 x pp 1 x cp 1 x dp 2 on 2 node(s)" in lines[0] and lines[1].startswith("# memory per rank: ")
    assert lines[2].startswith("worker-0: ") and "--node_rank=0" in lines[2]
    assert lines[3].startswith("worker-1: ") and "--node_rank=1" in lines[3] and "--set parallel.tp=2" in lines[3]


def test_dsf_launch_refuses_a_layout_the_hosts_cannot_hold(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    for overrides, match in [(["parallel.tp=4"], "parallel.tp"), (["parallel.dp=2"], "parallel.dp"),
                             (["parallel.pp=4"], "parallel.pp")]:  # 4 slots; tiny-llama has 2 layers
        with pytest.raises(UserError, match=match):
            CliRunner().invoke(cli, ["launch", "launch/examples/tiny.yaml", "--hostfile", str(hostfile),
                                     "--dry-run", *[a for o in overrides for a in ("--set", o)]],
                               catch_exceptions=False, standalone_mode=False)


# --- launchers: what --dry-run prints is what each node would run --------------------------------

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "launch" / "examples" / "tiny.yaml")
SETS = ["--set", "parallel.tp=2", "--set", "train.steps=70"]


def dry_run(tmp_path, *args: str, hosts: str = "worker-0 slots=4\nworker-1 slots=4\n") -> dict[str, list[str]]:
    """`dsf launch TINY --hostfile H --dry-run ARGS` run in tmp_path: {line prefix: [rest of line, ...]}."""
    (tmp_path / "hostfile").write_text(hosts)
    result = CliRunner().invoke(cli, ["launch", TINY, "--hostfile", str(tmp_path / "hostfile"), "--dry-run",
                                      "--master-port", "29555", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        key, _, rest = line.partition(": ")
        out.setdefault(key, []).append(rest)
    return out


def decoded_world_info(argv: list[str]) -> dict:
    info = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    return json.loads(base64.urlsafe_b64decode(info))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the .deepspeed_env dsf reads (and would write) is ./.deepspeed_env
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return tmp_path


def test_pdsh_dry_run_prints_each_node_and_deepspeeds_pdsh_line(in_tmp):
    out = dry_run(in_tmp, "--num-gpus", "2", "--env", "FOO=bar", *SETS)
    world = {"worker-0": [0, 1], "worker-1": [0, 1]}
    for rank, host in enumerate(world):
        (line,) = out[host]
        argv = shlex.split(line)
        assert decoded_world_info(argv) == world and f"--node_rank={rank}" in argv
        assert "--master_addr=worker-0" in argv and "--master_port=29555" in argv
        assert argv[-6:-4] == ["train", TINY] and argv[-4:] == SETS
    (pdsh,) = out["pdsh"]
    argv = shlex.split(pdsh)
    assert argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    assert "export FOO=bar;" in argv[6] and f"cd {in_tmp};" in argv
    assert decoded_world_info(argv) == world and "--node_rank=%n" in argv and "--master_port=29555" in argv
    assert argv[-4:] == SETS
    assert out[".deepspeed_env"] == ["FOO=bar"]


def test_no_ssh_dry_run_prints_the_command_for_each_node(in_tmp):
    out = dry_run(in_tmp, "--launcher", "no_ssh", "--num-gpus", "2", "--env", "FOO=bar", *SETS)
    for rank, host in enumerate(["worker-0", "worker-1"]):
        (line,) = out[host]
        argv = shlex.split(line)
        assert argv[:4] == ["cd", str(in_tmp), "&&", "FOO=bar"] and argv[4].endswith("deepspeed")
        assert flag(argv, "--node_rank") == str(rank) and "--no_ssh" in argv
        assert flag(argv, "--hostfile") == str(in_tmp / "hostfile") and flag(argv, "--num_gpus") == "2"
        assert flag(argv, "--master_addr") == "worker-0" and flag(argv, "--master_port") == "29555"
        assert argv[-6:-4] == ["train", TINY] and argv[-4:] == SETS
    only = dry_run(in_tmp, "--launcher", "no_ssh", "--node-rank", "1", "--num-gpus", "2", *SETS)
    assert "worker-0" not in only and "--node_rank 1" in only["worker-1"][0]


def test_slurm_dry_run_prints_one_srun_line(in_tmp):
    out = dry_run(in_tmp, "--launcher", "slurm", "--num-gpus", "2", *SETS)
    (line,) = out["srun"]
    assert "--node_rank $SLURM_NODEID" in line and "bash -c '" in line  # single quotes: each node expands it
    argv = shlex.split(line)
    assert argv[:7] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=worker-0,worker-1",
                        "--kill-on-bad-exit=1", "bash"]
    for node in ("0", "1"):  # what bash runs on node k
        script = shlex.split(argv[-1].replace("$SLURM_NODEID", node))
        assert flag(script, "--node_rank") == node and "--no_ssh" in script
        assert flag(script, "--master_addr") == "worker-0" and flag(script, "--num_gpus") == "2"
        assert script[-6:-4] == ["train", TINY] and script[-4:] == SETS


def test_openmpi_dry_run_prints_deepspeeds_mpirun_line(in_tmp):
    out = dry_run(in_tmp, "--launcher", "openmpi", *SETS, hosts="worker-0 slots=2\nworker-1 slots=2\n")
    (line,) = out["mpirun"]
    argv = shlex.split(line)
    assert argv[:5] == ["mpirun", "-n", "4", "-hostfile", str(in_tmp / "hostfile")]
    # each rank goes through dsframework.commands.mpi_rank, which turns OMPI_COMM_WORLD_* into RANK & co.
    i = argv.index("dsframework.commands.mpi_rank")
    assert argv[i - 1] == "-m" and argv[i + 1:i + 4] == ["worker-0:29555", "train", TINY] and argv[-4:] == SETS


def test_mpi_ranks_get_the_variables_torch_reads():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert mpi_rank_env(env, master="worker-0:29555") == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2",
        "CROSS_RANK": "1", "CROSS_SIZE": "2",  # node 1 of 2 (DeepSpeed's decoupled writer reads CROSS_SIZE)
        "MASTER_ADDR": "worker-0", "MASTER_PORT": "29555"}
    with pytest.raises(UserError, match="OMPI_COMM_WORLD_RANK"):
        mpi_rank_env({}, master="worker-0:29555")


def _job(active, hostfile=Path("hostfile")) -> LaunchJob:
    return LaunchJob(run_yaml=Path(TINY), overrides=(), hostfile=hostfile, resources=OrderedDict(), active=active,
               master=next(iter(active)), master_port=29500, env={}, explicit={})


def test_one_host_runs_here_without_ssh_and_one_remote_host_is_forced_multi():
    pdsh = LAUNCHERS["pdsh"]()
    assert pdsh.runner_mode(_job(OrderedDict(localhost=[0, 1]))) == (False, ["--no_ssh_check"])
    assert pdsh.runner_mode(_job(OrderedDict([("worker-9", [0])]))) == (True, ["--force_multi"])
    assert pdsh.runner_mode(_job(RESOURCES)) == (True, [])
    assert pdsh.runner_mode(_job(OrderedDict(localhost=[0, 1]), hostfile=None)) == (False, [])


# --- .deepspeed_env ----------------------------------------------------------------------------------

BAD_ENV = ["A", "=x", "1A=x", "A-B=x", "A=$HOME", "A=$(id)", "A=`id`", "A=a b", "A=\"x", "A=it's", "A=x\ny",
           "A=x\\"]


@pytest.mark.parametrize("text", BAD_ENV, ids=range(len(BAD_ENV)))
def test_bad_env_values_are_one_line_errors(text):
    with pytest.raises(UserError) as err:
        launch.parse_env([text])
    assert "--env" in str(err.value) and "\n" not in str(err.value)


def test_env_defaults_come_from_the_launching_environment_and_env_flags_win():
    environ = {"HF_HOME": "/data/hf", "NCCL_DEBUG": "INFO", "HOME": "/root", "OMP_NUM_THREADS": "4"}
    assert launch.node_env(environ, {"OMP_NUM_THREADS": "8"}) == (
        {"HF_HOME": "/data/hf", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8"}, [])
    env, skipped = launch.node_env({"NCCL_X": "$oops", "HF_HOME": "/my hf"}, {})  # not asked for: left out
    assert env == {} and len(skipped) == 2 and "NCCL_X=$oops" in skipped[1]


def test_an_existing_env_file_is_appended_to_never_rewritten():
    existing = launch.read_env_file("A=1\nB=2\n", origin=".deepspeed_env")
    assert launch.merge_env_file(existing, {"A": "1", "C": "3"}, explicit=["C"], origin="f") == {"C": "3"}
    assert launch.merge_env_file(existing, {"B": "9"}, explicit=[], origin="f") == {}  # the file's B wins
    with pytest.raises(UserError, match="already sets B=2"):
        launch.merge_env_file(existing, {"B": "9"}, explicit=["B"], origin="f")
    for text in ("A=1\n\nB=2\n", "# note\n", "A=1\nexport B=2\n"):  # lines deepspeed's reader breaks on
        with pytest.raises(UserError, match=r"\.deepspeed_env:\d"):
            launch.read_env_file(text, origin=".deepspeed_env")


def test_dry_run_shows_the_env_file_with_the_users_lines_first(in_tmp):
    (in_tmp / ".deepspeed_env").write_text("MINE=1")  # no newline at the end
    out = dry_run(in_tmp, "--env", "FOO=bar", *SETS, hosts="worker-0 slots=2\nworker-1 slots=2\n")
    assert out[".deepspeed_env"] == ["MINE=1", "FOO=bar"] and "export MINE=1; export FOO=bar;" in out["pdsh"][0]
    assert (in_tmp / ".deepspeed_env").read_text() == "MINE=1"  # a dry run writes nothing


@pytest.mark.distributed
def test_launch_writes_the_env_file_named_by_ds_env_file_and_forwards_deepspeeds_exit_code(tmp_path):
    """A real (non-dry) launch with stand-ins for ssh (every host answers) and pdsh (exits 99): the
    env file gets dsf's lines appended before deepspeed's runner starts, and the runner's exit code
    is dsf's. Without the ssh stand-in dsf's own check stops it first: one line naming the host,
    exit 2, the env file untouched."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "pdsh").write_text("#!/bin/sh\nexit 99\n")
    (fake / "ssh").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("pdsh", "ssh"):
        (fake / tool).chmod(0o755)
    (tmp_path / "hostfile").write_text("nohost-dsf-test.invalid slots=1\nnohost2-dsf-test.invalid slots=1\n")
    (tmp_path / "my.env").write_text("MINE=1")
    env = {k: v for k, v in os.environ.items()
           if k not in launch.DEFAULT_ENV and not k.startswith(("NCCL", "TORCH_NCCL"))}
    env.update(DS_ENV_FILE="my.env", NCCL_DEBUG="INFO")
    args = [str(Path(sys.executable).with_name("dsf")), "launch", TINY, "--hostfile", "hostfile",
            "--env", "FOO=bar", "--set", "train.global_batch=2", "--set", "train.micro_batch=1"]

    (fake / "ssh").rename(fake / "ssh.off")
    refused = subprocess.run(args, cwd=tmp_path, env={**env, "PATH": f"{fake}:{os.environ['PATH']}"},
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    (line,) = refused.stderr.splitlines()
    assert line.startswith("dsf: error: --hostfile='nohost-dsf-test.invalid': cannot be started: ") and "ssh" in line
    assert (tmp_path / "my.env").read_text() == "MINE=1"  # nothing started, nothing written

    (fake / "ssh.off").rename(fake / "ssh")
    proc = subprocess.run(args, cwd=tmp_path, env={**env, "PATH": f"{fake}:{os.environ['PATH']}"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 99, proc.stderr[-2000:]
    assert (tmp_path / "my.env").read_text().splitlines() == ["MINE=1", "NCCL_DEBUG=INFO", "FOO=bar"]
    assert not (tmp_path / ".deepspeed_env").exists()


# --- --check, the memory refusal, the scripts ---------------------------------------------------------

@pytest.mark.distributed
def test_check_names_the_unreachable_hosts_fast(tmp_path):
    (tmp_path / "hostfile").write_text("localhost slots=1\nnohost-dsf-test.invalid slots=1\n")
    start = time.monotonic()
    proc = subprocess.run([str(Path(sys.executable).with_name("dsf")), "launch", TINY, "--hostfile", "hostfile",
                           "--check", "--launcher", "no_ssh", "--set", "train.global_batch=2",
                           "--set", "train.micro_batch=1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("dsf: error: --check='nohost-dsf-test.invalid'") and "resolve" in line
    assert "localhost: this node, not checked" in proc.stdout


@pytest.mark.distributed
def test_ssh_check_reports_ssh_own_reason():
    (result,) = check_hosts(["nohost-dsf-test.invalid"], ssh_reason)
    assert result[0] == "nohost-dsf-test.invalid"
    assert "nohost-dsf-test.invalid" in result[1]  # ssh: Could not resolve hostname ... (or ssh is missing)


LLAMA_7B = ["--set", "model.name=llama-7b", "--set", "parallel.zero_stage=0", "--set", "parallel.tp=1",
            "--set", "parallel.pp=1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default cluster is this node's GPU here")
def test_memory_refusal_names_both_figures_and_force_goes_on(in_tmp):
    args = ["launch", TINY, "--num-gpus", "2", "--dry-run", *LLAMA_7B]
    with pytest.raises(UserError) as err:
        CliRunner().invoke(cli, args, catch_exceptions=False, standalone_mode=False)
    message = str(err.value)
    assert re.search(r"predicted \d+\.\d GiB per rank > \d+\.\d GiB available \(cpu-local: this node's", message)
    assert "dsf plan --model llama-7b" in message and "--force" in message
    result = CliRunner().invoke(cli, [*args, "--force"], catch_exceptions=False)
    assert result.exit_code == 0 and "launching anyway (--force)" in result.stderr
    assert "localhost: " in result.stdout and "does not fit" in result.stdout
    tiny = CliRunner().invoke(cli, ["launch", TINY, "--num-gpus", "2", "--dry-run"], catch_exceptions=False)
    assert tiny.exit_code == 0 and re.search(r"# memory per rank: predicted 0\.\d+ GiB of", tiny.stdout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default cluster is this node's GPU here")
def test_memory_fix_names_the_runs_cluster_not_cpu_local_on_a_node_without_a_gpu(in_tmp):
    """From a login node (no GPU, no --cluster) the fix's `dsf plan` gets the run's own cluster
    (logging.cluster, which `dsf plan -o` writes), else a placeholder for the GPU preset, never cpu-local."""
    def refusal(*extra: str) -> str:
        with pytest.raises(UserError) as err:
            CliRunner().invoke(cli, ["launch", TINY, "--num-gpus", "2", "--dry-run", *LLAMA_7B, *extra],
                               catch_exceptions=False, standalone_mode=False)
        return str(err.value)

    unknown = refusal()
    assert "dsf plan --model llama-7b --cluster <your GPU preset, e.g. h100-80gb> --nodes 1" in unknown
    assert "--cluster cpu-local" not in unknown and "pass --cluster <their preset> to dsf launch" in unknown
    own = refusal("--set", "logging.cluster=h100-80gb")
    assert "dsf plan --model llama-7b --cluster h100-80gb --nodes 1" in own
    assert "pass --cluster h100-80gb to dsf launch" in own
    given = refusal("--cluster", "a100-40gb", "--set", "logging.cluster=h100-80gb")
    assert "dsf plan --model llama-7b --cluster a100-40gb" in given and "this node has no GPU" not in given


def test_plan_cluster_prefers_the_flag_then_the_run_then_this_gpu():
    from dsframework.launching.steps import plan_cluster

    assert plan_cluster("a100-80gb", "h100-80gb", on_gpu=False) == ("a100-80gb", False)
    assert plan_cluster(None, "h100-80gb", on_gpu=False) == ("h100-80gb", False)
    assert plan_cluster(None, None, on_gpu=False) == ("<your GPU preset, e.g. h100-80gb>", True)


def test_memory_check_refuses_a_build_the_hosts_cannot_hold(in_tmp):
    """8 GPUs of 141 GB hold llama-7b at ZeRO-2 either way; 64 GiB of RAM (51.2 usable) holds 8
    ranks building eighths of it (tp 8), not 8 dense fp32 builds."""
    profile = in_tmp / "small-host.json"
    profile.write_text(json.dumps({"name": "h200-small-host", "memory_per_gpu": 141e9, "cpu_memory_per_node": 64 * 2**30,
                                   "peak_flops": {"fp32": 67e12, "bf16": 989e12}}))
    args = ["launch", TINY, "--num-gpus", "8", "--dry-run", "--cluster", str(profile), "--set", "model.name=llama-7b",
            "--set", "parallel.zero_stage=2"]
    with pytest.raises(UserError) as err:
        CliRunner().invoke(cli, [*args, "--set", "train.micro_batch=4"], catch_exceptions=False, standalone_mode=False)
    message = str(err.value)
    assert message.startswith("host memory per node: predicted 204.7 GiB of host memory per node to build the model "
                              "> 51.2 GiB available"), message
    assert "tp 1 x pp 1 x cp 1 x dp 8" in message and "dsf plan --model llama-7b" in message and "--force" in message
    sharded = CliRunner().invoke(cli, [*args, "--set", "parallel.tp=8"], catch_exceptions=False)
    assert sharded.exit_code == 0, sharded.output
    assert re.search(r"# memory per rank: predicted \d+\.\d+ GiB of 130\.3 GiB available .*; "
                     r"host 2\d\.\d+ GiB of 51\.2 GiB per node", sharded.stdout), sharded.stdout


def test_a_lora_run_of_70b_passes_where_full_fine_tuning_is_refused(in_tmp):
    """llama-70b at ZeRO-3 on 8 nodes of 8 H100s, sequences of 2048: full fine-tuning needs ~93 GiB a
    GPU; with model.lora (all-linear, r 8) only the adapters have gradients and Adam states (~74 GiB)."""
    hosts = in_tmp / "hostfile"
    hosts.write_text("".join(f"worker-{i} slots=8\n" for i in range(8)))
    sets = ["model.name=llama-70b", "parallel.zero_stage=3", "train.precision=bf16", "data.seq_len=2048",
            "train.global_batch=64", "train.micro_batch=1"]
    args = ["launch", TINY, "--hostfile", str(hosts), "--cluster", "h100-80gb", "--dry-run",
            *[a for o in sets for a in ("--set", o)]]
    with pytest.raises(UserError, match=r"memory per rank: predicted 9\d\.\d GiB per rank > 79\.0 GiB available"):
        CliRunner().invoke(cli, args, catch_exceptions=False, standalone_mode=False)
    lora = CliRunner().invoke(cli, [*args, "--set", "model.lora.r=8"], catch_exceptions=False)
    assert lora.exit_code == 0, lora.output
    assert re.search(r"# memory per rank: predicted 7\d\.\d+ GiB of 79\.0 GiB available \(h100-80gb\); .*"
                     r"LoRA: 103,546,880 of 69,\d{3},\d{3},\d{3} parameters train", lora.stdout), lora.stdout
    assert sum(line.startswith("worker-") for line in lora.stdout.splitlines()) == 8  # each node's command


def test_fit_agrees_with_the_planners_search():
    """The launch check is search.evaluate's rule: same fit for every layout of a small search."""
    from dsframework.planner.cluster import cluster_preset
    from dsframework.planner.fit import check_fit
    from dsframework.planner.memory import Workload
    from dsframework.planner.model import describe_model
    from dsframework.planner.search import search
    from dsframework.models.presets import PRESETS
    from transformers import LlamaConfig

    fields = {k: v for k, v in PRESETS["llama-7b"].items() if k != "model_type"}
    desc = describe_model(LlamaConfig(**fields), name="llama-7b")
    cluster = cluster_preset("a100-40gb", nodes=1, gpus_per_node=4)
    plan = search(desc, cluster, Workload(seq_len=1024, global_batch=8, precision="bf16"), suggest=False)
    assert {c.fits for c in plan.candidates} == {True, False}
    for c in plan.candidates:
        assert check_fit(desc, c.layout, plan.job, cluster).fits == c.fits


@pytest.mark.distributed
def test_launch_scripts_parse_and_multi_node_sh_runs_dsf_launch(tmp_path):
    for script in ("multi_node.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=True)
    assert "#SBATCH --ntasks-per-node=1" in (REPO / "launch" / "slurm.sbatch").read_text()
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    env = {**os.environ, "HOSTFILE": str(tmp_path / "hostfile"), "LAUNCHER": "no_ssh", "MASTER_PORT": "29556"}
    proc = subprocess.run(["bash", str(REPO / "launch" / "multi_node.sh"), TINY, "--dry-run", *SETS],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("worker-")]
    assert len(lines) == 2 and all("--master_port 29556" in line for line in lines)


def refused_launch(tmp_path, *flags: str, drop_env: str) -> str:
    """`dsf launch TINY --hostfile H FLAGS` (two hosts) without the variables starting with
    `drop_env`: its one stderr line, after checking exit 2, no traceback, nothing written."""
    (tmp_path / "hostfile").write_text("worker-0 slots=1\nworker-1 slots=1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_env)}
    proc = subprocess.run([str(Path(sys.executable).with_name("dsf")), "launch", TINY, "--hostfile", "hostfile",
                           *flags, "--set", "train.global_batch=2", "--set", "train.micro_batch=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostfile"]  # nothing started, no .deepspeed_env
    (line,) = proc.stderr.splitlines()
    return line


@pytest.mark.distributed
def test_slurm_outside_an_allocation_is_one_line_and_starts_nothing(tmp_path):
    line = refused_launch(tmp_path, "--launcher", "slurm", drop_env="SLURM_")
    assert line.startswith("dsf: error: --launcher='slurm': ") and ("SLURM_JOB_ID is not set" in line
                                                                     or "srun is not on PATH" in line)
    assert "sbatch launch/slurm.sbatch" in line


def test_resume_and_overwrite_reach_every_nodes_dsf_train(in_tmp):
    out = dry_run(in_tmp, "--launcher", "no_ssh", "--resume", *SETS, hosts="worker-0 slots=2\nworker-1 slots=2\n")
    for host in ("worker-0", "worker-1"):
        argv = shlex.split(out[host][0])
        assert argv[-5:] == [*SETS, "--resume"] and argv[-7:-5] == ["train", TINY]
    (srun,) = dry_run(in_tmp, "--launcher", "slurm", "--overwrite", *SETS,
                      hosts="worker-0 slots=2\nworker-1 slots=2\n")["srun"]
    assert shlex.split(shlex.split(srun)[-1])[-1] == "--overwrite"


@pytest.mark.skipif(os.geteuid() != 0, reason="mpirun's refusal of root applies to root only")
@pytest.mark.distributed
def test_openmpi_as_root_without_openmpis_consent_is_one_line(tmp_path):
    line = refused_launch(tmp_path, "--launcher", "openmpi", drop_env="OMPI_")
    assert line.startswith("dsf: error: --launcher='openmpi': ") and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in line
