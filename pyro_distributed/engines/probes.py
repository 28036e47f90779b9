"""Whether a worker on another host still lives, asked without its cooperation.

A failed collective across hosts names little, so each worker keeps a
listening socket for as long as its process lives: the kernel completes a
probe's connection even while the worker is busy or hung. On the failure
path a survivor probes every peer on another host at once, for at most
:data:`PROBE_TIMEOUT_S`: accepted means the process lives, refused means the
host is up but the process is gone, no answer means the host is down or cut
off. Two rules keep the answers true:

* a thread (:class:`ProbeListener`) accepts and closes every connection, so
  a port scan or many survivors cannot fill the accept queue and make a
  live worker look cut off;
* a worker listens on each address it published, on one port, never on the
  wildcard address (which would answer on interfaces it never published);
  a survivor skips the addresses it holds itself and reads a peer's
  addresses together: any accepts, it lives; else any refuses, it is gone.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: How long a probe waits for a peer's host to answer.
PROBE_TIMEOUT_S = 1.0
#: How an unreachable peer's description ends (``describe_lost`` words the rest).
UNREACHABLE = "cannot be reached"
#: How many ports a listener tries before it gives up finding one that is free
#: on every address it was given.
_PORT_TRIES = 16


@dataclass(frozen=True)
class Peer:
    """Where one worker lives: its host, pid, and where it can be probed."""

    host: str
    pid: int
    addresses: tuple[str, ...] = ()
    port: int | None = None


class ProbeListener:
    """Sockets listening on ``addresses``, all on one port, that accept and
    close every connection until :meth:`close` (or the process's end).

    A daemon thread does the accepting, so it never keeps the process alive.
    Ports are the kernel's choice: the first address's is tried on the others,
    and where one of them has it taken, all are closed and another is drawn.

    :raises OSError: where an address cannot be bound, or no port is free on
        every address after a few tries.
    """

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("a probe listener needs at least one address to listen on")
        # An address held by two interfaces is listened on once.
        self.addresses = tuple(dict.fromkeys(addresses))
        self._sockets = self._bind_all(self.addresses)
        self.port: int = self._sockets[0].getsockname()[1]
        # Wakes the thread for close(): on Linux, closing a socket does not
        # wake a thread that waits on it.
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        for listener in (*self._sockets, self._wake_read):
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_until_closed, name="pyro_distributed probe listener", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _bind_all(addresses: tuple[str, ...]) -> list[socket.socket]:
        taken: OSError | None = None
        for _ in range(_PORT_TRIES):
            bound: list[socket.socket] = []
            try:
                for address in addresses:
                    port = bound[0].getsockname()[1] if bound else 0
                    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    bound.append(listener)
                    listener.bind((address, port))
                    listener.listen(64)
                return bound
            except OSError as exc:
                for listener in bound:
                    listener.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                taken = exc
        raise OSError(
            errno.EADDRINUSE,
            f"no port free on every one of {', '.join(addresses)} after {_PORT_TRIES} tries "
            f"(last: {taken})",
        )

    def bound(self) -> list[tuple[str, int]]:
        """Where each socket listens, ``(address, port)``, as the kernel says."""
        names = (listener.getsockname() for listener in self._sockets)
        return [(str(address), int(port)) for address, port in names]

    def _accept_until_closed(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_read:
                    return
                listener: socket.socket = key.fileobj  # type: ignore[assignment]
                # A connection reset before it was accepted, or another
                # thread's accept, leaves nothing to accept: not an error.
                with contextlib.suppress(OSError):
                    connection, _ = listener.accept()
                    connection.close()

    def close(self) -> None:
        """Stop accepting and close the sockets; probes are refused from then on."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        self._thread.join(timeout=5)
        self._selector.close()
        for listener in (*self._sockets, self._wake_read, self._wake_write):
            listener.close()


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
