"""What every engine inherits: the one default of allreduce_, the liveness of peers, and
what an engine class says about itself (detection order, who starts the workers)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pyro_distributed.engines import ENGINE_NAMES, Engine, engine_class
from pyro_distributed.engines.local import LocalEngine
from pyro_distributed.engines.probes import UNREACHABLE, Peer, ProbeListener, _probe, remote_losses


def test_an_engine_with_neither_allreduce_is_refused_when_the_class_is_made() -> None:
    with pytest.raises(TypeError, match="Silent must override allreduce_ or allreduce_async_"):

        class Silent(Engine):  # each default is written with the other: it would recurse
            name = "silent"
            rank = local_rank = 0  # type: ignore[assignment]
            world_size = 1  # type: ignore[assignment]

            def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None: ...

            def allgather_object(self, obj: Any) -> list[Any]:
                return [obj]

            def barrier(self) -> None: ...

            def shutdown(self) -> None: ...


def test_every_engine_class_says_how_it_is_detected_and_who_starts_its_workers() -> None:
    classes = {name: engine_class(name) for name in ENGINE_NAMES}
    assert {name: cls.name for name, cls in classes.items()} == {name: name for name in classes}
    # The launcher whose environment can sit inside another's is asked first.
    order = sorted(classes, key=lambda name: -classes[name].detection_priority)
    assert order == ["horovod", "torch", "mpi", "local"]
    assert [n for n, c in classes.items() if c.launches_own_workers] == ["horovod", "mpi"]
    launchers = {name: cls.launcher for name, cls in classes.items()}
    assert launchers == {
        "horovod": "horovodrun", "mpi": "mpiexec", "torch": "the launcher", "local": "the launcher"
    }  # fmt: skip


def exited_pid() -> int:
    """The pid of a child process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_lost_workers_names_a_peer_on_this_machine_whose_process_exited() -> None:
    engine = LocalEngine()
    here = socket.gethostname()
    pid = exited_pid()
    engine._peers = [Peer(here, os.getpid()), Peer(here, pid), Peer("elsewhere", pid)]
    assert engine.lost_workers() == [f"worker 1 (pid {pid})"]  # not the one on another machine


def _silent_listener(address: str, port: int) -> list[socket.socket]:
    """A listener on ``address:port`` that never answers a new connection: its
    accept queue is full, so the kernel drops further SYNs (a host cut off)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address, port))
    listener.listen(0)
    held = [listener]
    for _ in range(3):
        filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect((address, port))
        held.append(filler)
    time.sleep(0.2)
    return held


def test_a_peer_with_several_addresses_is_judged_by_all_that_are_not_this_hosts() -> None:
    """How the mpi engine's peers are probed: every address a peer published,
    except those this host holds too (a bridge every host has), all at once.
    Three loopback addresses stand for a live, a silent and a refusing one."""
    alive = ProbeListener(["127.0.0.1"])
    port = alive.port
    silent = _silent_listener("127.0.0.2", port)
    peers = {
        1: Peer("hostA", 11, ("127.0.0.2", "127.0.0.1"), port),  # one address accepts
        2: Peer("hostB", 12, ("127.0.0.1",), port),
        3: Peer("hostC", 13, ("127.0.0.2",), port),  # nothing answers
        4: Peer("hostD", 14, ("127.0.0.2", "127.0.0.3"), port),  # one address refuses
    }
    try:
        assert remote_losses(peers, own=frozenset()) == [
            f"worker 3 on host hostC (127.0.0.2) {UNREACHABLE}",
            "worker 4 on host hostD (pid 14)",
        ]
        # This host's own addresses are left out: peer 2 is not judged at all,
        # and peer 1 only by the address that never answers.
        assert remote_losses(peers, own=frozenset({"127.0.0.1"})) == [
            f"worker 1 on host hostA (127.0.0.2) {UNREACHABLE}",
            f"worker 3 on host hostC (127.0.0.2) {UNREACHABLE}",
            "worker 4 on host hostD (pid 14)",
        ]
    finally:
        for held in [alive, *silent]:
            held.close()


def test_a_flood_of_connections_does_not_make_a_live_worker_look_cut_off() -> None:
    # A port scan, or many survivors probing one peer: connections nobody
    # accepted would fill the queue, and the next probe would go unanswered.
    listener = ProbeListener(["127.0.0.1"])
    held = []
    try:
        for made in range(200):
            client = socket.create_connection(("127.0.0.1", listener.port), timeout=10.0)
            if made % 2:
                client.close()  # a closed client's connection also waits to be accepted
            else:
                held.append(client)
        assert _probe("127.0.0.1", listener.port) == "alive"
    finally:
        for client in held:
            client.close()
        listener.close()


def test_a_probe_listener_listens_on_each_address_it_was_given_and_on_no_other() -> None:
    listener = ProbeListener(["127.0.0.2", "127.0.0.3", "127.0.0.2"])
    port = listener.port
    try:
        assert listener.addresses == ("127.0.0.2", "127.0.0.3")
        assert listener.bound() == [("127.0.0.2", port), ("127.0.0.3", port)]
        assert [_probe(a, port) for a in ("127.0.0.2", "127.0.0.3")] == ["alive", "alive"]
        assert _probe("127.0.0.1", port) == "exited"  # not the wildcard address
    finally:
        listener.close()
    # Closed: probes are refused, and the accepting thread has ended.
    assert _probe("127.0.0.2", port) == "exited"
    assert not listener._thread.is_alive()
    listener.close()  # twice: nothing more to do


def test_a_probe_listener_never_keeps_its_process_alive() -> None:
    code = (
        "from pyro_distributed.engines.probes import ProbeListener\n"
        "listener = ProbeListener(['127.0.0.1'])\n"
        "print(listener.port, flush=True)\n"
    )  # and it exits without closing the listener
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 30
    assert _probe("127.0.0.1", int(done.stdout)) == "exited"


def test_lost_workers_looks_once_without_grace_and_not_at_all_without_peers_here() -> None:
    engine = LocalEngine()
    start = time.monotonic()
    assert engine.lost_workers(grace=30.0) == []  # never learnt where its peers are
    engine._peers = [Peer("elsewhere", 1)]
    assert engine.lost_workers(grace=30.0) == []  # none on this machine to look at
    engine._learn_peers()  # itself, alive
    assert engine.lost_workers() == []  # one look, no wait
    assert time.monotonic() - start < 5
    start = time.monotonic()
    assert engine.lost_workers(grace=0.3) == []
    assert time.monotonic() - start >= 0.3  # kept looking for the grace it was given
