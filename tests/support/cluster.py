"""A cluster on one machine: hosts as network namespaces, joined by a switch.

Each host is a network namespace with one interface, an address of its own
on a private subnet that exists only inside the namespaces made here, and a
host name of its own (a UTS namespace per command) that, as on Debian's and
Ubuntu's default ``/etc/hosts``, resolves to ``127.0.1.1``: the set-up on
which gloo's own choice of address is loopback. The hosts' interfaces are
veth pairs whose other ends sit on a bridge in a namespace of its own (the
switch), so nothing is added to this machine's own network. A link can be
rate-limited with ``tbf`` (this kernel has no ``netem``, so no added latency),
cut, or its host killed whole.

Every process a host runs is in its namespace, so :meth:`NamespaceCluster.kill_host`
and the tear-down kill exactly the processes the cluster started (``ip netns
pids``), and the tear-down always removes what it made. It needs root and
``ip netns``; :func:`unavailable` says why not, and ``tests/conftest.py``
deselects the tests marked ``cluster`` with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

#: Host names start from this, and namespace names from the prefix and this process's id.
_PREFIX = "pdt"
_SUBNET = "10.231.0"


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or ``None`` if they can."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on the PATH"
    probe = f"{_PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    """One host of the cluster."""

    name: str  #: its host name (``hostname`` inside it)
    namespace: str
    interface: str  #: its one network interface, inside its namespace
    address: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NamespaceCluster:
    """``hosts`` hosts on one switch; links limited to ``rate`` (``"1gbit"``) if given.

    Use it as a context manager: leaving it kills every process it started
    and removes its namespaces, whatever happened inside.
    """

    def __init__(self, hosts: int, rate: str | None = None) -> None:
        tag = f"{_PREFIX}{os.getpid() % 100000}"
        self._switch = f"{tag}sw"
        self.hosts = [
            Host(f"host{i}", f"{tag}h{i}", f"eth{i}", f"{_SUBNET}.{i + 1}") for i in range(hosts)
        ]
        self._rate = rate
        self._processes: list[subprocess.Popen[str]] = []

    def __enter__(self) -> NamespaceCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self._switch)
        _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._switch, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            _ip("netns", "add", host.namespace)
            port = f"port{index}"
            _ip("link", "add", host.interface, "netns", host.namespace,
                "type", "veth", "peer", "name", port, "netns", self._switch)  # fmt: skip
            _ip("-n", self._switch, "link", "set", port, "master", "br0")
            _ip("-n", self._switch, "link", "set", port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if self._rate:
                self.limit(host, self._rate)
            # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: the
            # host's own name resolves to loopback, as on a stock Debian node.
            etc = Path("/etc/netns") / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n")

    def limit(self, host: Host, rate: str) -> None:
        """Limit what ``host`` sends to ``rate`` (a token bucket on its interface)."""
        subprocess.run(
            ["ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev",
             host.interface, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms"],
            check=True, capture_output=True,
        )  # fmt: skip

    def start(
        self,
        host: Host,
        command: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[str]:
        """Start ``command`` on ``host`` (in its namespace, under its host name)."""
        wrapped = [
            "ip", "netns", "exec", host.namespace, "unshare", "--uts",
            "sh", "-c", f'hostname {host.name} && exec "$@"', "sh", *command,
        ]  # fmt: skip
        process = subprocess.Popen(
            wrapped,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._processes.append(process)
        return process

    def hydra_launcher(self, directory: Path) -> Path:
        """A script, written into ``directory``, that MPICH's ``mpiexec`` can use
        in place of ``ssh`` (``-launcher ssh -launcher-exec SCRIPT -hosts ADDRESSES``):
        given a host's address and a command, it runs the command on that host."""
        cases = "\n".join(
            f"    {host.address}) ns={host.namespace} name={host.name} ;;" for host in self.hosts
        )
        script = directory / "enter_host.sh"
        script.write_text(
            "#!/bin/sh\n"
            "# Hydra's ssh: [options] HOST COMMAND... runs COMMAND on namespace host HOST.\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\n'
            'case "$1" in\n'
            f"{cases}\n"
            '    *) echo "no namespace host $1" >&2; exit 255 ;;\n'
            "esac\n"
            "shift\n"
            'exec ip netns exec "$ns" unshare --uts '
            'sh -c \'hostname "$0" && exec sh -c "$1"\' "$name" "$*"\n'
        )
        script.chmod(0o755)
        return script

    def pids(self, host: Host) -> list[int]:
        """Every process now running on ``host``."""
        listed = subprocess.run(
            ["ip", "netns", "pids", host.namespace], capture_output=True, text=True
        )
        return [int(pid) for pid in listed.stdout.split()]

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process of ``host``, as if it lost power."""
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def cut_link(self, host: Host) -> None:
        """Take ``host``'s interface down: its processes live on, unreachable."""
        _ip("-n", host.namespace, "link", "set", host.interface, "down")

    def close(self) -> None:
        for host in self.hosts:
            self.kill_host(host)
        for process in self._processes:
            try:
                process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
        deadline = time.monotonic() + 10
        for namespace in [host.namespace for host in self.hosts] + [self._switch]:
            while time.monotonic() < deadline:
                done = subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
                if done.returncode == 0 or b"No such file" in done.stderr:
                    break
                time.sleep(0.2)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
