"""Whether a worker on another host still lives, asked without its cooperation.

A collective that fails across hosts says little: a dropped connection names
an address, a time-out names nothing, and the peer that dropped may itself be
a survivor that gave up first. So each worker of an engine that supports it
keeps a listening socket open for as long as its process lives (the kernel
completes a probe's connection without the process doing anything, so a busy
or hung worker still answers). On the failure path, a survivor probes every
peer on another host, all at once, for at most :data:`PROBE_TIMEOUT_S`:

* the connection is accepted: the worker's process lives;
* it is refused: the host is up but the worker's process is gone;
* no answer: the host is down or cut off from this one.

A worker may publish several addresses (an engine that does not know which of
its interfaces the others reach, the mpi engine). A survivor leaves out those
it holds itself (a bridge address every host has, say) and probes the rest
together: one that accepts means the worker lives, else one that refuses means
its process is gone, else its host cannot be reached.
"""

from __future__ import annotations

import errno
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: How long a probe waits for a peer's host to answer.
PROBE_TIMEOUT_S = 1.0
#: How an unreachable peer's description ends (``describe_lost`` words the rest).
UNREACHABLE = "cannot be reached"


@dataclass(frozen=True)
class Peer:
    """Where one worker lives: its host, pid, and where it can be probed."""

    host: str
    pid: int
    addresses: tuple[str, ...] = ()
    port: int | None = None


def open_probe_socket(address: str) -> socket.socket:
    """A socket that accepts probes on ``address`` (``"0.0.0.0"``: on every
    interface) while this process lives."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(64)
    return listener


def _probe(address: str, port: int) -> str:
    """``"alive"``, ``"exited"`` or ``"unreachable"``."""
    try:
        with socket.create_connection((address, port), timeout=PROBE_TIMEOUT_S):
            return "alive"
    except ConnectionRefusedError:
        return "exited"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return "exited"
        return "unreachable"


def remote_losses(peers: dict[int, Peer], own: frozenset[str] = frozenset()) -> list[str]:
    """The peers (by rank) that have exited or cannot be reached, described for a
    message; ``own``: this host's addresses, never probed as a peer's."""
    probed = [
        (rank, address, peer.port)
        for rank, peer in peers.items()
        if peer.port is not None
        for address in peer.addresses
        if address not in own
    ]
    if not probed:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(probed))) as pool:
        answers = list(pool.map(lambda at: _probe(at[1], at[2]), probed))
    verdicts: dict[int, set[str]] = {}
    for (rank, _, _), answer in zip(probed, answers, strict=True):
        verdicts.setdefault(rank, set()).add(answer)
    lost = []
    for rank, answers_of_rank in verdicts.items():
        peer = peers[rank]
        if "alive" in answers_of_rank:
            continue
        if "exited" in answers_of_rank:
            lost.append(f"worker {rank} on host {peer.host} (pid {peer.pid})")
        else:
            tried = ", ".join(address for address in peer.addresses if address not in own)
            lost.append(f"worker {rank} on host {peer.host} ({tried}) {UNREACHABLE}")
    return lost
