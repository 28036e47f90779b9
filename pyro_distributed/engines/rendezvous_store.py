"""The rendezvous store through which torch.distributed workers meet: served by
worker 0 (or torchrun's agent) and joined by the others, within the user's
time-out, with every failure named on every worker.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import PyroDistributedError
from ..torch_internals import PrefixStore
from .base import DEFAULT_TIMEOUT
from .launchers import (
    TORCHRUN_VARIABLES,
    Rendezvous,
    port_taken_message,
    torch_rendezvous_from_torchrun,
)
from .network import check_peer_addresses

#: How much longer than the time-out a worker waits for the store before it
#: gives up itself: worker 0's own wait for the others ends at the time-out,
#: and its message (how many joined) is the more useful one.
_STORE_GRACE_S = 5.0


def open_store(joining: Rendezvous, timeout: timedelta) -> Any:
    """The rendezvous store of ``joining`` (served by worker 0 unless torchrun's
    agent serves it), with keys under its prefix, within the time-out.

    A client that reaches a process other than a store on the port (one that
    holds the port worker 0 could not take) would wait for its answer with no
    bound of torch's, so the store is made on a thread of its own, and this
    worker gives up after the time-out. Every failure becomes a
    :class:`PyroDistributedError` that names the address, the port and where
    each came from: on every worker, each after at most the time-out.
    """
    outcome: list[Any] = []

    def connect() -> None:
        try:
            outcome.append(
                dist.TCPStore(  # type: ignore[attr-defined]  # public, missing from the stubs
                    host_name=joining.address,
                    port=joining.port,
                    world_size=joining.world_size,
                    is_master=joining.hosts_the_store,
                    timeout=timeout,
                    # Another engine of this process may serve this port already.
                    multi_tenant=joining.hosts_the_store,
                )
            )
        except Exception as error:  # handed to the waiting thread, which names it
            outcome.append(error)

    thread = threading.Thread(target=connect, name="pyro_distributed rendezvous", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + _STORE_GRACE_S)
    seconds = f"{timeout.total_seconds():g} s"
    if not outcome:
        raise PyroDistributedError(
            f"worker {joining.rank} of {joining.launcher} found no rendezvous store at "
            f"{joining.where} within the time-out ({seconds}): something answers on the "
            f"port, but it is not worker 0's store. Worker 0 may have failed to start it "
            f"(its own error says why: the port may be taken), or the address and port "
            f"differ between the workers."
        )
    store = outcome[0]
    if isinstance(store, Exception):
        raise PyroDistributedError(_store_failure(joining, store, seconds)) from store
    store.set_timeout(timeout)
    return PrefixStore(joining.prefix, store)


def _store_failure(joining: Rendezvous, error: Exception, seconds: str) -> str:
    """What a worker says when its store could not be made."""
    if joining.hosts_the_store and "EADDRINUSE" in str(error):
        return port_taken_message(joining)
    if joining.hosts_the_store:
        return (
            f"worker 0 of {joining.launcher} waited at {joining.where} for all "
            f"{joining.world_size} workers within the time-out ({seconds}), and not all "
            f"came ({error}). The others failed before they joined (their own errors say "
            f"why), or do not share this address, port and world size."
        )
    return (
        f"worker {joining.rank} of {joining.launcher} could not reach the rendezvous store "
        f"at {joining.where} within the time-out ({seconds}): {error}. Worker 0 hosts it: "
        f"it may have failed before it did (its own error says why), or the address is "
        f"not one this host reaches."
    )


def check_addresses_before_a_group(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Under torchrun, check every worker's gloo address through torchrun's own
    store before a host framework (Lightning) makes the process group itself.

    The engine checks before it joins a group of its own (:meth:`TorchEngine._join_group`);
    a group made elsewhere would otherwise wait in gloo's unbounded connect for
    a worker that advertised loopback. It runs only where the store is
    torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE=True``), which every
    worker reaches as a client: elsewhere worker 0 serves the store when the
    group is made, and a second server could not take the port.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if any(name not in os.environ for name in TORCHRUN_VARIABLES):
        return
    joining = torch_rendezvous_from_torchrun()
    store = open_store(joining, timeout)
    if joining.world_size > 1:
        check_peer_addresses(PrefixStore("host_framework", store), joining.rank, joining.world_size)
