"""Which address gloo gives its peers, chosen so that other hosts can reach it.

Without ``GLOO_SOCKET_IFNAME``, gloo advertises the address the host's name
resolves to, which on many cluster nodes (Debian's default ``/etc/hosts``)
is loopback: a peer on another host dials its own loopback, and the worker it
meant to reach waits in gloo's connect with no bound of ours. So
:func:`choose_gloo_interface` tells gloo to use the interface the kernel
routes to ``MASTER_ADDR`` (when the variable is unset, the name resolves to
loopback and ``MASTER_ADDR`` is another host), and
:func:`check_peer_addresses` has every worker publish its advertised address
in the rendezvous store before any gloo connection and raise alike, naming
the hosts and the variable to set, when one on another host is loopback.
NCCL never picks a loopback interface while another exists, so nothing here
touches NCCL.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import PyroDistributedError

GLOO_VARIABLE = "GLOO_SOCKET_IFNAME"
#: Linux's ioctl that reads an interface's IPv4 address.
_SIOCGIFADDR = 0x8915


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address, not a name) is a loopback address."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def source_address_towards(host: str, port: int) -> str | None:
    """The local address the kernel would send from to reach ``host``.

    A UDP socket's ``connect`` sends nothing: it only asks the routing table.
    """
    address = _resolve(host)
    if address is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, port))
        except OSError:
            return None
        source: str = probe.getsockname()[0]
        return source


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name``, or ``None``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", name.encode()[:15])
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def own_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces, loopback left out."""
    found = (interface_address(name) for _, name in socket.if_nameindex())
    return [address for address in found if address is not None and not is_loopback(address)]


def interface_with_address(address: str) -> str | None:
    """The name of the interface that holds ``address``, or ``None``."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def choose_gloo_interface(master_addr: str, master_port: int) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` where gloo's own choice would be loopback
    but the job spans hosts; return the interface chosen, or ``None``.

    A variable the user set is always kept, and so is gloo's choice whenever
    this host's name resolves to an address other hosts may reach.
    """
    if os.environ.get(GLOO_VARIABLE):
        return None
    own = _resolve(socket.gethostname())
    if own is not None and not is_loopback(own):
        return None
    source = source_address_towards(master_addr, master_port)
    if source is None or is_loopback(source):
        return None  # MASTER_ADDR is this host: one host, where loopback serves
    interface = interface_with_address(source)
    if interface is not None:
        os.environ[GLOO_VARIABLE] = interface
    return interface


@dataclass(frozen=True)
class Advertised:
    """Where one worker's gloo will listen, as that worker sees it."""

    host: str
    interface: str | None
    address: str | None

    def describe(self) -> str:
        via = f"interface {self.interface}" if self.interface else "its host name"
        return f"{self.address or 'an unresolvable address'} ({via}) on host {self.host}"


def advertised_address() -> Advertised:
    """The address this worker's gloo will give its peers."""
    interface = os.environ.get(GLOO_VARIABLE) or None
    if interface is not None:
        # gloo takes the first of a comma-separated list for the default device.
        first = interface.split(",")[0]
        return Advertised(socket.gethostname(), first, interface_address(first))
    return Advertised(socket.gethostname(), None, _resolve(socket.gethostname()))


def check_peer_addresses(store: Any, rank: int, world_size: int) -> None:
    """Raise on every worker if a worker's gloo would be unreachable from another host.

    Each worker writes what :func:`advertised_address` says under its rank and
    reads every other worker's (the store's own time-out bounds the reads).
    The verdict is computed from the same list on every worker, so all of
    them raise together, before any of them waits in gloo's connect.
    """
    mine = advertised_address()
    store.set(f"pyro_distributed/gloo_address/{rank}", _encode(mine))
    everyone = [
        _decode(store.get(f"pyro_distributed/gloo_address/{peer}")) for peer in range(world_size)
    ]
    hosts = {entry.host for entry in everyone}
    if len(hosts) < 2:
        return  # one host: loopback reaches everyone
    unreachable = [
        (peer, entry)
        for peer, entry in enumerate(everyone)
        if entry.address is None or is_loopback(entry.address)
    ]
    if not unreachable:
        return
    listed = "; ".join(f"worker {peer}: {entry.describe()}" for peer, entry in unreachable)
    raise PyroDistributedError(
        f"the workers span {len(hosts)} hosts ({', '.join(sorted(hosts))}), but gloo on "
        f"{listed} would listen on an address that other hosts cannot reach, and they "
        f"would wait for it until the time-out. Set {GLOO_VARIABLE} on every host to the "
        f"network interface that reaches the other hosts (see `ip -brief addr`), e.g. "
        f"{GLOO_VARIABLE}=eth0, or make each host's name resolve to that interface's "
        f"address in /etc/hosts. (Found while joining, on worker {rank}; nothing was "
        f"trained.)"
    )


def _encode(entry: Advertised) -> str:
    return "\t".join((entry.host, entry.interface or "", entry.address or ""))


def _decode(raw: bytes) -> Advertised:
    host, interface, address = raw.decode().split("\t")
    return Advertised(host, interface or None, address or None)
