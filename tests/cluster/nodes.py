"""Real "nodes" on one machine: each a network + mount + UTS namespace with its own sshd, joined by
a bridge; optionally a SLURM cluster (munged, slurmctld, one slurmd per node) on top.

    cluster = Cluster(Path(tempfile.mkdtemp()), nodes=2)
    try:
        cluster.start()                         # node0 10.213.78.1, node1 10.213.78.2, sshd on both
        cluster.run(0, ["ssh", "node1", "hostname"])           # -> "node1"
        cluster.start_slurm()                   # sinfo: both nodes idle
        cluster.run(0, ["sbatch", "--wrap", "hostname"], env=cluster.slurm_env())
    finally:
        cluster.stop()                          # every process in the namespaces, the namespaces, files

Each node k is a long-lived holder process, `ip netns exec dsfc-<pid>-k unshare --mount --uts
--propagation private sh -c SETUP`, where SETUP sets the hostname to nodek, bind-mounts the test's
hosts file over /etc/hosts and the test's ssh client config over /etc/ssh/ssh_config (its key, its
known_hosts), mounts a fresh tmpfs over /run (sshd's privilege-separation directory /run/sshd lives
there) and /dev/shm, and then sleeps. Commands run on a node with `nsenter -t HOLDER -n -m -u`.
The filesystem is otherwise the machine's: every node sees the checkout, its .venv and /tmp at the
same paths, as cluster nodes see a shared filesystem. Each node's interface is called eth0 inside
its namespace (one GLOO_SOCKET_IFNAME, one btl_tcp_if_include for all); the other ends of the veth
pairs hang on a bridge inside a namespace of its own. The addresses (10.213.78.0/24) exist only
inside the namespaces. Nothing of the machine's own ssh, munge or slurm set-up is read or written:
keys, configs, sockets, pid files, spool and logs all live in the test directory.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.213.78"
TOOLS = {
    "core": ("ip", "unshare", "nsenter", "mount", "sshd", "ssh", "ssh-keygen"),
    "pdsh": ("pdsh",),
    "openmpi": ("mpirun", "ompi_info"),
    "slurm": ("slurmctld", "slurmd", "sbatch", "sinfo", "scancel", "squeue", "munged"),
}
INSTALL = ("install them with `sudo apt-get install openssh-server openssh-client pdsh openmpi-bin slurm-wlm munge "
           "iproute2 util-linux`, or run `sudo bash launch/setup_env.sh`")


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/local/sbin")


def missing(*groups: str) -> str | None:
    """Why the cluster tests of `groups` cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return f"needs root (network and mount namespaces, sshd): run them as root, with the tools they use; {INSTALL}"
    lacking = [tool for group in ("core", *groups) for tool in TOOLS[group] if _which(tool) is None]
    if lacking:
        return f"{', '.join(lacking)} not found; {INSTALL}"
    return None


def _run(cmd: list[str], *, timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def wait_until(predicate, *, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class NamespacesUnavailable(RuntimeError):
    """Root, but this machine (a container) does not let us make namespaces: the tests skip."""


def remove_stale() -> None:
    """Namespaces of an earlier session that was killed before its tear-down (its pid is gone)."""
    listing = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    for ns in {line.split()[0] for line in listing if line.startswith("dsfc-")}:
        owner = ns.split("-")[1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)


class Cluster:
    """N namespace nodes with sshd (and, on demand, SLURM) under `root`, a scratch directory."""

    def __init__(self, root: Path, *, nodes: int = 2, hidden: dict[int, list[str]] | None = None) -> None:
        self.root = Path(root)
        self.count = nodes
        self.hidden = hidden or {}  # node -> paths a tmpfs hides on that node (a node missing the venv)
        tag = os.getpid()
        self.bridge_ns = f"dsfc-{tag}-br"
        self.namespaces = [f"dsfc-{tag}-{k}" for k in range(nodes)]
        self.names = [f"node{k}" for k in range(nodes)]
        self.addrs = [f"{SUBNET}.{k + 1}" for k in range(nodes)]
        self.made: list[str] = []
        self.holders: list[subprocess.Popen] = []
        self.sshd: dict[int, subprocess.Popen] = {}
        self.slurm: list[subprocess.Popen] = []
        self.logs = self.root / "logs"
        self.start_seconds = 0.0  # how long start() took

    # --- set-up ------------------------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        remove_stale()
        for sub in ("ssh", "logs", "etc"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._network()
        self._files()
        for k in range(self.count):
            self._holder(k)
        for k in range(self.count):
            self.start_sshd(k)
        for k in range(self.count):  # every node reaches every node over ssh by name
            wait_until(lambda k=k: self.port_open(0, self.addrs[k], 22), timeout=10, what=f"sshd on {self.names[k]}")
        self.start_seconds = time.monotonic() - started

    def _network(self) -> None:
        try:
            _run(["ip", "netns", "add", self.bridge_ns])
        except RuntimeError as err:
            raise NamespacesUnavailable(f"cannot create network namespaces here ({err}); a container needs "
                                        "CAP_SYS_ADMIN and CAP_NET_ADMIN (e.g. docker run --privileged)") from None
        self.made.append(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        for k, ns in enumerate(self.namespaces):
            _run(["ip", "netns", "add", ns])
            self.made.append(ns)
            port = f"port{k}"
            # Made in the bridge's namespace, the node's end moved into its own: nothing in the root one.
            _run(["ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                  "netns", ns])
            _run(["ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addrs[k]}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _files(self) -> None:
        ssh = self.root / "ssh"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dsf-cluster-test", "-f", str(ssh / "id_ed25519")])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dsf-cluster-host", "-f", str(ssh / "host_key")])
        shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
        host_pub = (ssh / "host_key.pub").read_text().split()[:2]
        (ssh / "known_hosts").write_text("".join(f"{name},{addr} {' '.join(host_pub)}\n"
                                                 for name, addr in zip(self.names, self.addrs)))
        (self.root / "etc" / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in zip(self.names, self.addrs)))
        (self.root / "etc" / "ssh_config").write_text(
            "Host *\n"
            f"    IdentityFile {ssh / 'id_ed25519'}\n"
            f"    UserKnownHostsFile {ssh / 'known_hosts'}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    LogLevel ERROR\n"
            "    ConnectTimeout 5\n")
        for k in range(self.count):
            (self.root / "etc" / f"sshd_config.{k}").write_text(
                f"ListenAddress {self.addrs[k]}\nPort 22\n"
                f"HostKey {ssh / 'host_key'}\n"
                f"PidFile {self.root / 'logs' / f'sshd.{k}.pid'}\n"
                f"AuthorizedKeysFile {ssh / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nUseDNS no\n"
                "PermitUserEnvironment no\nPrintMotd no\nMaxStartups 100:30:200\nMaxSessions 100\n")

    def _holder(self, k: int) -> None:
        ready = self.root / "logs" / f"holder.{k}.ready"
        hide = "".join(f"mount -t tmpfs -o size=1m,mode=755 tmpfs {p}\n" for p in self.hidden.get(k, []))
        setup = (
            "set -e\n"
            f"hostname {self.names[k]}\n"
            f"mount --bind {self.root / 'etc' / 'hosts'} /etc/hosts\n"
            f"mount --bind {self.root / 'etc' / 'ssh_config'} /etc/ssh/ssh_config\n"
            "mount -t tmpfs -o mode=755 tmpfs /run\n"
            "mkdir -p /run/sshd /run/lock && ln -s /dev/shm /run/shm\n"
            "mount -t tmpfs -o mode=1777 tmpfs /dev/shm\n"
            # slurmd loads a cgroup plugin even with proctrack/pgid; `ip netns exec` left a bare /sys.
            "mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup 2>/dev/null || true\n"
            f"{hide}"
            f"touch {ready}\n"
            "exec sleep infinity\n")
        log = open(self.logs / f"holder.{k}.log", "w")
        holder = subprocess.Popen(["ip", "netns", "exec", self.namespaces[k], "unshare", "--mount", "--uts",
                                   "--propagation", "private", "--", "sh", "-c", setup],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        log.close()
        self.holders.append(holder)

        def up() -> bool:
            if holder.poll() is not None:
                raise RuntimeError(f"node{k} set-up failed: {(self.logs / f'holder.{k}.log').read_text()}")
            return ready.exists()

        wait_until(up, timeout=15, what=f"node{k}'s namespaces")

    # --- running things on a node ------------------------------------------------------------------

    def enter(self, node: int, cmd: list[str], *, cwd: Path | str = "/") -> list[str]:
        """`cmd` as it runs on `node` in directory `cwd`: inside its network, mount and UTS namespaces
        (entering a mount namespace resets the working directory, hence --wd)."""
        return ["nsenter", "-t", str(self.holders[node].pid), "-n", "-m", "-u", f"--wd={cwd}", "--", *cmd]

    def run(self, node: int, cmd: list[str], *, timeout: float = 60, cwd: Path | str = "/",
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.enter(node, cmd, cwd=cwd), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, **kw)

    def popen(self, node: int, cmd: list[str], *, log: Path, cwd: Path | str = "/", **kw) -> subprocess.Popen:
        """`cmd` on `node` in its own session, output to `log` (a file: nothing to block on)."""
        with open(log, "w") as out:
            return subprocess.Popen(self.enter(node, cmd, cwd=cwd), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **kw)

    def port_open(self, node: int, addr: str, port: int) -> bool:
        probe = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=1).close()"
        return self.run(node, ["python3", "-c", probe], timeout=10).returncode == 0

    def pids(self, node: int) -> list[int]:
        """Every process in `node`'s network namespace."""
        out = _run(["ip", "netns", "pids", self.namespaces[node]], check=False).stdout
        return [int(p) for p in out.split()]

    def processes(self, node: int, *words: str) -> list[tuple[int, str]]:
        """(pid, command line) of `node`'s live processes whose command line holds any of `words`."""
        found = []
        for pid in self.pids(node):
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            line = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            if state != "Z" and any(w in line for w in words):
                found.append((pid, line))
        return found

    # --- sshd ------------------------------------------------------------------------------------

    def start_sshd(self, k: int) -> None:
        log = self.logs / f"sshd.{k}.log"
        with open(log, "a") as out:
            self.sshd[k] = subprocess.Popen(
                self.enter(k, [_which("sshd"), "-D", "-e", "-f", str(self.root / "etc" / f"sshd_config.{k}")]),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: self.sshd[k].poll() is None and self.port_open(k, self.addrs[k], 22)
                   or self._dead(self.sshd[k], log), timeout=10, what=f"sshd on node{k}")

    def stop_sshd(self, k: int) -> None:
        """Stop node k's sshd (the listener only: like `systemctl stop ssh`, sessions stay)."""
        proc = self.sshd.pop(k)
        proc.terminate()
        proc.wait(timeout=10)

    @staticmethod
    def _dead(proc: subprocess.Popen, log: Path) -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {log.read_text()[-2000:]}")
        return False

    # --- SLURM -------------------------------------------------------------------------------------

    def slurm_env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.root / "slurm" / "slurm.conf")}

    def start_slurm(self, *, timeout: float = 30) -> None:
        slurm, munge = self.root / "slurm", self.root / "munge"
        for d in (slurm / "state", *[slurm / "spool" / n for n in self.names], munge):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(munge, 0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        socket = munge / "munge.socket"
        cpus = os.cpu_count() or 1
        nodes = "".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN\n" for n, a in zip(self.names, self.addrs))
        (slurm / "slurm.conf").write_text(
            f"ClusterName=dsftest\nSlurmctldHost={self.names[0]}({self.addrs[0]})\n"
            f"AuthType=auth/munge\nAuthInfo=socket={socket}\nCredType=cred/munge\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"StateSaveLocation={slurm / 'state'}\nSlurmdSpoolDir={slurm / 'spool'}/%n\n"
            f"SlurmctldPidFile={slurm / 'slurmctld.pid'}\nSlurmdPidFile={slurm / 'slurmd.%n.pid'}\n"
            f"SlurmctldLogFile={slurm / 'slurmctld.log'}\nSlurmdLogFile={slurm / 'slurmd.%n.log'}\n"
            f"PlugStackConfig={slurm / 'plugstack.conf'}\n"
            "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\nSwitchType=switch/none\nMpiDefault=none\n"
            "SchedulerType=sched/builtin\nSelectType=select/linear\nReturnToService=2\n"
            "SlurmdParameters=config_overrides\n"
            "SlurmdTimeout=30\nSlurmctldTimeout=30\nMessageTimeout=10\nKillWait=5\nInactiveLimit=0\n"
            "MinJobAge=300\nSlurmctldDebug=info\nSlurmdDebug=info\n"
            f"{nodes}PartitionName=main Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP\n")
        (slurm / "plugstack.conf").write_text("")
        (slurm / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        env = {**os.environ, **self.slurm_env()}
        daemons = [
            (0, "munged", [_which("munged"), "--foreground", "--force", f"--socket={socket}", f"--key-file={key}",
                           f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                           f"--seed-file={munge / 'munged.seed'}"]),
            (0, "slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(slurm / "slurm.conf")]),
            *[(k, f"slurmd.{k}", [_which("slurmd"), "-D", "-f", str(slurm / "slurm.conf")]) for k in range(self.count)],
        ]
        for node, name, cmd in daemons:
            log = self.logs / f"{name}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(self.enter(node, cmd), stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True, env=env)
            self.slurm.append(proc)
            if name == "munged":
                wait_until(lambda: socket.exists() or self._dead(proc, log), timeout=10, what="munged")

        def idle() -> bool:
            for proc in self.slurm:
                if proc.poll() is not None:
                    raise RuntimeError(f"a SLURM daemon exited {proc.returncode}: {' '.join(proc.args)}\n"
                                       + self.slurm_logs())
            out = self.run(0, ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, timeout=15).stdout.split()
            return sorted(out) == sorted([*self.names, *["idle"] * self.count])

        wait_until(idle, timeout=timeout, what="sinfo to show every node idle", every=0.3)

    def slurm_logs(self) -> str:
        out = []
        for path in sorted([*self.logs.glob("slurm*.log"), *(self.root / "slurm").glob("*.log"),
                            *self.logs.glob("munged.log")]):
            out.append(f"--- {path.name} ---\n{path.read_text()[-2000:]}")
        return "\n".join(out)

    # --- tear-down -------------------------------------------------------------------------------

    def kill_all(self, node: int, *, keep: set[int] = frozenset()) -> None:
        for pid in self.pids(node):
            if pid not in keep:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        """Every process in the namespaces killed, the namespaces (and so every link) deleted."""
        for ns in self.made:
            for _ in range(3):  # a process may fork while we kill
                pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.1)
        for proc in [*self.holders, *self.sshd.values(), *self.slurm]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self.made):
            _run(["ip", "netns", "del", ns], check=False)
        self.made.clear()
