"""One class per `dsf launch --launcher`: what it needs on this node, how it checks the hosts, the
command it builds, and how it starts.

    launcher = LAUNCHERS["pdsh"]()
    launcher.check_flags(hostfile=True, node_rank=None)
    job = LaunchJob(run_yaml=Path("run.yaml"), overrides=(), hostfile=Path("hostfile"), resources=resources,
                    active=active, master="worker-0", master_port=29500, env=env, explicit={})
    launcher.prepare(job)                 # the rules this launcher adds; the runner it drives
    for line in launcher.dry_run(job):    # what each node would run
        print(line)
    launcher.check(job)                   # --check: every host and tool, UserError naming the first failure
    sys.exit(launcher.start(job))         # runs the job to its end; its code as protocol/exits.py documents

pdsh, openmpi and mvapich are deepspeed's own runners (`PDSHRunner`, `OpenMPIRunner`,
`MVAPICHRunner`) fed the flags `deepspeed` would parse; no_ssh and slurm start one
`deepspeed --no_ssh --node_rank K` per node (slurm through `srun`, K = $SLURM_NODEID). The pure
pieces (hostfile, filters, env files, the runner's command line) are in hostfile.py.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator, Mapping, cast

import click

from dsframework.errors import UserError
from dsframework.launching import hostfile as hostfiles
from dsframework.launching.watch import SRUN_NODE, JobStop, Outcome, watch_job, watch_srun
from dsframework.protocol.exits import job_code, stop_signals

SLURM_NODEID = "__DSF_SLURM_NODEID__"  # replaced by $SLURM_NODEID once the line is quoted
MPI_ENTRY = "dsframework.commands.mpi_rank"  # `deepspeed --module dsframework.commands.mpi_rank MASTER:PORT train ...`
CHECK_TIMEOUT_S = 15.0
RANK_PROBE_S = 60.0  # a node's first `import torch, deepspeed` (a cold filesystem cache)


@dataclass
class LaunchJob:
    """What `dsf launch` starts: the run, the hosts and slots it gets, the master, every node's env."""

    run_yaml: Path
    overrides: tuple[str, ...]
    hostfile: Path | None
    resources: "OrderedDict[str, int]"  # the whole hostfile (the MPI runners take it as it is)
    active: "OrderedDict[str, list[int]]"  # after --include/--exclude/--num-nodes/--num-gpus
    master: str
    master_port: int
    env: Mapping[str, str]  # for every node: the forwarded defaults, then --env
    explicit: Mapping[str, str]  # --env alone
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    node_rank: int | None = None  # no_ssh: the one node this command starts
    skipped: list[str] = field(default_factory=list)  # defaults not forwarded, and why
    train_flags: tuple[str, ...] = ()  # --resume, --overwrite: passed on to dsf train
    output_dir: str = ""  # the run's: where dsf train marks a preemption (protocol/exits.py)

    @property
    def train_args(self) -> list[str]:
        return ["train", str(self.run_yaml), *[a for o in self.overrides for a in ("--set", o)], *self.train_flags]

    @property
    def deepspeed(self) -> str:
        return str(Path(sys.executable).with_name("deepspeed"))

    @property
    def dsf(self) -> str:
        return shutil.which("dsf") or str(Path(sys.executable).with_name("dsf"))

    def deepspeed_flags(self, *tail: str) -> list[str]:
        """The `deepspeed` runner's flags every launcher shares, then `tail`."""
        flags = ["--master_port", str(self.master_port)]
        if self.hostfile is None:  # one node, no hostfile: deepspeed starts `--num_gpus` ranks here
            return flags + (["--num_gpus", str(self.num_gpus)] if self.num_gpus > 0 else [])
        flags += ["--hostfile", str(self.hostfile.resolve()), "--master_addr", self.master]
        flags += ["--include", self.include] if self.include else ["--exclude", self.exclude] if self.exclude else []
        flags += ["--num_nodes", str(self.num_nodes)] if self.num_nodes > 0 else []
        flags += ["--num_gpus", str(self.num_gpus)] if self.num_gpus > 0 else []
        return flags + list(tail)


class Launcher:
    """A way of starting `deepspeed` on the active hosts. Subclasses say what differs."""

    name: ClassVar[str]
    tools: ClassVar[tuple[str, ...]] = ()  # what it runs on this node
    needs_hostfile: ClassVar[bool] = True
    # why `dsf launch --max-restarts` cannot restart a job it started (None: it can; launching/restarts.py)
    cannot_restart: ClassVar[str | None] = ("does not say which node failed (dsf's restarts read pdsh's per-node "
                                            "output to leave a node out)")

    def check_flags(self, *, hostfile: bool, node_rank: int | None) -> None:
        """The flag combinations this launcher refuses, before the hostfile is read."""
        if self.needs_hostfile and not hostfile:
            raise UserError("--launcher", self.name, "needs --hostfile (the nodes to start on)",
                            "pass --hostfile with one `<host> slots=<n>` line per node")
        if node_rank is not None:
            raise UserError("--node-rank", node_rank, f"only applies to --launcher no_ssh, not {self.name}",
                            "drop --node-rank, or pass --launcher no_ssh")

    def prepare(self, job: LaunchJob, *, starting: bool) -> None:
        """Rules on the active hosts; whatever `dry_run`, `check` and `start` share."""

    def probe(self, host: str) -> str | None:
        """None when `host` can take part, else why not (one line). Default: its name resolves."""
        return resolve_reason(host)

    def rank_probe(self, host: str) -> str | None:
        """`probe`, then: a rank could start on `host` (this Python imports torch and deepspeed there,
        over ssh); the pre-flight of a restart (launching/restarts.py)."""
        imports = (f"{shlex.quote(sys.executable)} -c 'import torch, deepspeed' >/dev/null 2>&1 || "
                   f"{{ echo 'cannot import torch and deepspeed with {sys.executable}'; exit 3; }}")
        return self.probe(host) or ssh_reason(host, imports, timeout_s=RANK_PROBE_S)

    def hosts_to_check(self, job: LaunchJob) -> list[str]:
        return [host for host in job.active if host not in hostfiles.local_names()]

    def missing_tools(self) -> list[tuple[str, str | None]]:
        """(tool, None or why not) for what this launcher runs on this node."""
        return [(tool, None if shutil.which(tool) else "is not on PATH") for tool in self.tools]

    def host_fix(self, host: str, why: str = "") -> str:
        return "write a name or address every node resolves in the hostfile"

    def check(self, job: LaunchJob) -> None:
        """--check: each host and this launcher's tools; a UserError naming the first failure."""
        hosts = self.hosts_to_check(job)
        for host in job.active:
            if host not in hosts:
                click.echo(f"{host}: this node, not checked")
        tools = self.missing_tools()
        probed = check_hosts(hosts, self.probe)
        for name, why in tools + probed:
            click.echo(f"{name}: {'ok' if why is None else why}")
        failed = [(name, why) for name, why in probed + tools if why is not None]
        if not failed:
            return click.echo(f"# {self.name}: every check passed")
        name, why = failed[0]
        if name in job.active:
            raise UserError("--check", name, why, self.host_fix(name, why))
        raise UserError("--check", name, why, self.tool_fix(name))

    def tool_fix(self, tool: str) -> str:
        return f"install {tool} on this node, or choose another --launcher"

    def dry_run(self, job: LaunchJob) -> Iterator[str]:
        raise NotImplementedError

    def start(self, job: LaunchJob) -> int:
        raise NotImplementedError


def resolve_reason(host: str) -> str | None:
    """None when HOST resolves to an address (what no_ssh and slurm nodes need of each other's names)."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        return f"Could not resolve hostname {host}: {err.strerror or err}"
    return None


def ssh_reason(host: str, remote_check: str = "true", timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """None when `ssh HOST REMOTE_CHECK` succeeds without a password, else the last line it printed."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, remote_check]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "ssh is not installed on this node"
    except subprocess.TimeoutExpired:
        return f"ssh did not finish within {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return lines[-1] if lines else f"ssh exited with code {proc.returncode}"


def check_hosts(hosts: list[str], probe) -> list[tuple[str, str | None]]:
    """(host, None or why not) for every host, concurrently."""
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(zip(hosts, pool.map(probe, hosts)))


def node_checkout_check() -> str:
    """The shell line that fails, saying what is missing, unless this node's checkout, Python and
    dsf are at the paths every other node will run (deepspeed's runners `cd` there and start this
    Python)."""
    here, python = os.path.abspath("."), sys.executable
    dsf = shutil.which("dsf") or str(Path(python).with_name("dsf"))
    tests = [(f"-d {shlex.quote(here)}", f"the working directory {here} does not exist there"),
             (f"-x {shlex.quote(python)}", f"{python} does not exist there"),
             (f"-x {shlex.quote(dsf)}", f"{dsf} does not exist there")]
    return "; ".join(f"[ {test} ] || {{ echo {shlex.quote(why)}; exit 3; }}" for test, why in tests)


# --- deepspeed's runners: pdsh, openmpi, mvapich ---------------------------------------------------------

class RunnerLauncher(Launcher):
    """deepspeed's multinode runners: this node starts every node (pdsh over ssh, or mpirun)."""

    mpi: ClassVar[bool] = True  # mpirun starts each rank (mpi_rank turns its variables into RANK & co.)

    def prepare(self, job: LaunchJob, *, starting: bool) -> None:
        self.remote, self.mode_flags = self.runner_mode(job)
        self.program = self.program_of(job)
        self.runner = hostfiles.build_runner(self.name, self.flags(job), self.program, job.resources,
                                          job.active) if self.remote else None
        self.env_file, self.env_new = env_file_lines(job.env, job.explicit) if self.remote else (None, {})
        for why in job.skipped if self.remote else ():  # only .deepspeed_env forwards the default set
            click.echo(f"dsf: warning: {why}", err=True)

    def runner_mode(self, job: LaunchJob) -> tuple[bool, list[str]]:
        """(remote, flags): whether deepspeed's runner starts the nodes itself, and the flags that
        make it do so as printed: with one host it runs here, so a remote one needs --force_multi,
        and a local one --no_ssh_check (or deepspeed would first ssh to this host). dsf checks
        ssh itself before a remote start (`check`), so deepspeed's own check is skipped then too."""
        if job.hostfile is None:
            return False, []
        if len(job.active) > 1:
            return True, []
        return (True, ["--force_multi"]) if next(iter(job.active)) not in hostfiles.local_names() else \
            (False, ["--no_ssh_check"])

    def program_of(self, job: LaunchJob) -> list[str]:
        if self.remote and self.mpi:
            return [MPI_ENTRY, f"{job.master}:{job.master_port}", *job.train_args]
        return [job.dsf, *job.train_args]

    def flags(self, job: LaunchJob, *, starting: bool = False) -> list[str]:
        tail = ["--launcher", self.name, *self.mode_flags, *(["--module"] if self.remote and self.mpi else [])]
        if starting and self.remote and "--no_ssh_check" not in tail:
            tail.append("--no_ssh_check")  # dsf's own check just ran (deepspeed's raises a traceback)
        return job.deepspeed_flags(*tail) if job.hostfile is not None else job.deepspeed_flags()

    @property
    def tools(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("mpirun",) if self.remote else ()

    def hosts_to_check(self, job: LaunchJob) -> list[str]:
        # deepspeed's runners ssh to every host of a multi-node job, this one included
        return list(job.active) if self.remote else []

    def probe(self, host: str) -> str | None:
        return ssh_reason(host, node_checkout_check())

    def host_fix(self, host: str, why: str = "") -> str:
        if why.endswith("does not exist there"):  # ssh works; the node lacks this checkout or venv
            return (f"put the same checkout and virtual environment at the same path on {host} (a shared "
                    f"filesystem, or a copy), and launch from a directory that exists there")
        return f"set up passwordless ssh from this node to {host} (ssh-copy-id {host}) and check the name resolves"

    def dry_run(self, job: LaunchJob) -> Iterator[str]:
        """Each node's deepspeed.launcher.launch line (pdsh and one-node runs), the pdsh or mpirun
        line from deepspeed's own runner, and the .deepspeed_env it would read."""
        if self.runner is None or not self.mpi:  # pdsh runs deepspeed's per-node launcher on each node
            for host, argv in hostfiles.node_commands(job.active, master_addr=job.master, master_port=job.master_port,
                                                   program=self.program):
                yield f"{host}: {hostfiles.shell_line(argv, job.explicit if self.runner is None else None)}"
        if self.runner is None:
            return
        assert self.env_file is not None  # set with the runner: a remote start
        old, new = self.env_file_texts()
        home = hostfiles.env_file_path(home=True)  # read first, as deepspeed's runner does
        files = [home.read_text()] if home.is_file() and home.resolve() != self.env_file.resolve() else []
        files = [hostfiles.read_env_file(text, origin=str(self.env_file)) for text in [*files, old + new]]
        cmd = hostfiles.runner_command(self.runner, job.active, exports=hostfiles.runner_exports(os.environ, files))
        yield f"{'mpirun' if self.mpi else 'pdsh'}: {shlex.join(cmd)}"
        yield f"# {self.env_file}: {f'would append {len(self.env_new)} line(s)' if new else 'unchanged'}"
        for line in (old + new).splitlines():
            yield f"{self.env_file}: {line}"

    def env_file_texts(self) -> tuple[str, str]:
        """(the .deepspeed_env as it is, ending in a newline when not empty; the lines dsf appends)."""
        assert self.env_file is not None  # a remote start's (dry_run, start)
        old = self.env_file.read_text() if self.env_file.is_file() else ""
        old += "\n" if old and not old.endswith("\n") else ""
        return old, "".join(f"{k}={v}\n" for k, v in self.env_new.items())

    def start(self, job: LaunchJob) -> int:
        if self.runner is not None:
            with warnings.catch_warnings():  # MVAPICHRunner warns on stderr when mpiname is missing
                warnings.simplefilter("ignore")
                if not self.runner.backend_exists():
                    raise UserError("--launcher", self.name, f"is not installed on this node ({self.runner.name} "
                                    "backend not found)", "install it, or choose another --launcher (no_ssh, slurm)")
            self.check_quietly(job)
        if self.env_new:  # append, never rewrite: the user's lines stay as they are
            assert self.env_file is not None  # env_new is set with it: a remote start
            old = self.env_file.read_text() if self.env_file.is_file() else ""
            with self.env_file.open("a") as out:
                out.write(("\n" if old and not old.endswith("\n") else "") + self.env_file_texts()[1])
            click.echo(f"dsf: added {', '.join(self.env_new)} to {self.env_file}", err=True)
        argv = [job.deepspeed, *self.flags(job, starting=True), *self.program]
        return self.run(argv, job)

    def check_quietly(self, job: LaunchJob) -> None:
        """Before a remote start: every host reachable over ssh, with the checkout and the venv."""
        for host, why in check_hosts(self.hosts_to_check(job), self.probe):
            if why is not None:
                raise UserError("--hostfile", host, f"cannot be started: {why}", self.host_fix(host, why))

    def run(self, argv: list[str], job: LaunchJob) -> int:
        return run_mapped(argv, {**os.environ, **job.explicit}, job)


class Pdsh(RunnerLauncher):
    """`pdsh -w HOSTS` over ssh runs deepspeed's per-node launcher on every node; dsf watches its
    output and stops the whole job when one node fails (pdsh alone waits for every node)."""

    name = "pdsh"
    needs_hostfile = False  # without one, deepspeed starts --num-gpus ranks here
    mpi = False
    cannot_restart = None

    @property
    def tools(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("pdsh",) if self.remote else ()

    def run(self, argv: list[str], job: LaunchJob) -> int:
        """The job run to its end and watched, on every node or on this one (no pdsh); its exit
        code as protocol/exits.py documents it (143 for a preemption, whatever deepspeed returned)."""
        started = time.time()
        self.outcome = watch_job(argv, env={**os.environ, **job.explicit}, hosts=list(job.active),
                                 world_info=hostfiles.world_info(job.active), local=not self.remote)
        self.outcome.code = job_code(self.outcome.code, job.output_dir, since=started,
                                     signalled=self.outcome.stopped)
        return self.outcome.code

    def start_watched(self, job: LaunchJob) -> Outcome:
        """`start`: how the job ended (launching/restarts.py)."""
        self.start(job)
        return self.outcome


class OpenMPI(RunnerLauncher):
    name = "openmpi"
    ROOT_VARS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")

    def start(self, job: LaunchJob) -> int:
        # mpirun refuses root with a page of text unless told twice; say it in one line, before anything starts
        if self.remote and os.geteuid() == 0 and not all(os.environ.get(v) == "1" for v in self.ROOT_VARS):
            raise UserError("--launcher", self.name, "runs mpirun as root, which OpenMPI refuses unless "
                            "OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set",
                            "launch as a regular user, or export both variables")
        return super().start(job)

    def tool_fix(self, tool: str) -> str:
        return "install OpenMPI (e.g. apt-get install openmpi-bin) on every node, or choose another --launcher"


class MVAPICH(RunnerLauncher):
    """Built as deepspeed builds it; not run on a cluster by dsf's tests (no MVAPICH here)."""

    name = "mvapich"


# --- one deepspeed per node: no_ssh, slurm -------------------------------------------------------------

class NoSsh(Launcher):
    """`deepspeed --no_ssh --node_rank K` run on each node by hand (or by another scheduler)."""

    name = "no_ssh"
    cannot_restart = "starts one node per command: no one command sees the whole job to restart it"

    def check_flags(self, *, hostfile: bool, node_rank: int | None) -> None:
        super().check_flags(hostfile=hostfile, node_rank=None)

    def prepare(self, job: LaunchJob, *, starting: bool) -> None:
        job.node_rank = node_rank_of(job.node_rank, job.active, required=starting)

    def flags(self, job: LaunchJob, node: int | str | None) -> list[str]:
        return job.deepspeed_flags("--no_ssh", "--node_rank", str(node))

    def dry_run(self, job: LaunchJob) -> Iterator[str]:
        for node, host in enumerate(job.active):
            if job.node_rank is None or node == job.node_rank:
                argv = [job.deepspeed, *self.flags(job, node), job.dsf, *job.train_args]
                yield f"{host}: cd {shlex.quote(os.getcwd())} && {hostfiles.shell_line(argv, job.env)}"

    def start(self, job: LaunchJob) -> int:
        return run_mapped([job.deepspeed, *self.flags(job, job.node_rank), job.dsf, *job.train_args],
                          {**os.environ, **job.explicit}, job)


class Slurm(NoSsh):
    """Inside an allocation: `srun` starts one `deepspeed --no_ssh --node_rank $SLURM_NODEID` per node."""

    name = "slurm"
    tools = ("srun",)
    cannot_restart = None  # srun steps inside the allocation, on the nodes that remain
    check_flags = Launcher.check_flags  # --node-rank is SLURM's to give

    def prepare(self, job: LaunchJob, *, starting: bool) -> None:
        check_slurm_resources(job.active, include=job.include, exclude=job.exclude)

    def missing_tools(self) -> list[tuple[str, str | None]]:
        return super().missing_tools() + [("SLURM_JOB_ID", None if os.environ.get("SLURM_JOB_ID") else
                                           "is not set: not inside an allocation (sbatch launch/slurm.sbatch, or salloc)")]

    def tool_fix(self, tool: str) -> str:
        return ("run dsf launch inside the job (launch/slurm.sbatch) or an salloc shell" if tool == "SLURM_JOB_ID"
                else super().tool_fix(tool))

    def srun(self, job: LaunchJob, *, labelled: bool = False) -> list[str]:
        return srun_command([job.deepspeed, *self.flags(job, SLURM_NODEID), job.dsf, *job.train_args], job.active,
                            labelled=labelled)

    def hosts_to_check(self, job: LaunchJob) -> list[str]:
        return list(job.active)  # through srun: this node too, as a step of the allocation

    def rank_probe(self, host: str) -> str | None:
        """None when a one-task srun step on `host` imports torch and deepspeed with this Python: the
        node is up in SLURM's eyes, inside the allocation, and can start a rank."""
        srun = shutil.which("srun") or "srun"
        # (no --immediate: the failed step's tasks may still be ending, and srun then waits for them)
        cmd = [srun, "--nodes=1", "--ntasks=1", f"--nodelist={host}", sys.executable, "-c", "import torch, deepspeed"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RANK_PROBE_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"an srun step on {host} did not finish within {RANK_PROBE_S:.0f} s"
        lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        return None if proc.returncode == 0 else (lines[-1] if lines else f"srun exited with code {proc.returncode}")

    def start_watched(self, job: LaunchJob) -> Outcome:
        """`start`, with srun's output labelled by task, so that a failure names its node
        (launching/watch.watch_srun); the Outcome, its code as protocol/exits.py documents it."""
        self.start(job, watched=True)
        return self.outcome

    def dry_run(self, job: LaunchJob) -> Iterator[str]:
        yield f"srun: {hostfiles.shell_line(self.srun(job), job.env)}"

    def start(self, job: LaunchJob, *, watched: bool = False) -> int:
        for name, why in self.missing_tools():
            if why is not None:
                raise UserError("--launcher", "slurm", f"{name} {why}",
                                "run inside the allocation: sbatch launch/slurm.sbatch, or salloc")
        argv = self.srun(job, labelled=watched)
        argv[0] = cast(str, shutil.which("srun"))  # on PATH: missing_tools said so just above
        if not watched:
            return run_mapped(argv, {**os.environ, **job.explicit}, job)
        started = time.time()
        self.outcome = watch_srun(argv, env={**os.environ, **job.explicit}, hosts=list(job.active))
        self.outcome.code = job_code(self.outcome.code, job.output_dir, since=started,
                                     signalled=self.outcome.stopped)
        return self.outcome.code


LAUNCHERS: dict[str, type[Launcher]] = {cls.name: cls for cls in (Pdsh, OpenMPI, MVAPICH, Slurm, NoSsh)}


# --- helpers ----------------------------------------------------------------------------------------------

def run_mapped(argv: list[str], env: Mapping[str, str], job: LaunchJob) -> int:
    """Run `argv` to its end, SIGTERM, SIGINT and SIGHUP passed on to its process group (srun: SIGTERM
    to srun, which signals every task); its exit code as protocol/exits.py documents it (a preemption
    is 143 here, though srun passes on deepspeed's 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.time()
    child = subprocess.Popen(argv, env=dict(env), start_new_session=True)
    stop = JobStop(child, local=Path(argv[0]).name != "srun")
    old = {sig: signal.signal(sig, stop.forward) for sig in stop_signals()}
    try:
        code = stop.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return job_code(code, job.output_dir, since=started, signalled=bool(stop.signum))


def env_file_lines(env: Mapping[str, str], explicit: Mapping[str, str]) -> tuple[Path, dict[str, str]]:
    """The .deepspeed_env deepspeed's runner reads here, and the lines dsf would append to it."""
    home = hostfiles.env_file_path(home=True)  # deepspeed's runner reads it too, and fails on a line it cannot split
    if home.is_file():
        hostfiles.read_env_file(home.read_text(), origin=str(home))
    path = hostfiles.env_file_path()
    existing = hostfiles.read_env_file(path.read_text(), origin=str(path)) if path.is_file() else None
    return path, hostfiles.merge_env_file(existing, env, explicit=explicit, origin=str(path))


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


def srun_command(node_argv: list[str], active: Mapping[str, list[int]], *, labelled: bool = False) -> list[str]:
    """srun starting `node_argv` once per active host, inside the allocation; its `--node_rank`
    is $SLURM_NODEID, single-quoted so that each node expands its own. `labelled`: every line
    carries its task's number (--label), and each task first names its node (watch.SRUN_NODE)."""
    # scancel --signal=TERM (preemption) signals every process of the step. deepspeed's runner has no
    # handler and would die at once, ending the task, and SLURM then kills what is left of the step
    # (the launcher, the ranks saving their checkpoint). Ignored here, the runner (SIG_IGN survives
    # exec) waits for its launcher, which passes TERM on; the ranks and the launcher set their own.
    script = "trap '' TERM; " + shlex.join(node_argv).replace(SLURM_NODEID, "$SLURM_NODEID")
    if labelled:
        script = f'echo "{SRUN_NODE}$SLURMD_NODENAME"; ' + script
    # --ntasks too: srun takes the allocation's SLURM_NTASKS as its default, which would put two
    # launchers on a node when the job runs on fewer nodes than it was given (a node left out)
    return ["srun", f"--nodes={len(active)}", f"--ntasks={len(active)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(active)}",
            "--kill-on-bad-exit=1", *(["--label"] if labelled else []), "bash", "-c", script]
