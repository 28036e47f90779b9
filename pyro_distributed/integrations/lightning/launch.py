"""One launch convention for the strategy, whoever starts the workers.

Whatever starts the workers, ``devices`` counts the workers on each machine
and ``devices`` x ``num_nodes`` is how many there are:

* Lightning's own launcher starts ``devices`` processes per machine;
* ``torchrun --nproc-per-node N`` and ``mpiexec -n N``/``mpirun`` (with the
  torch engine that Lightning's ``MPIEnvironment`` sets up, or ``engine="mpi"``)
  started them already: ``devices`` x ``num_nodes`` must be N;
* so must it under ``horovodrun -np N``, where ``engine="auto"`` means
  ``engine="horovod"`` (:func:`resolve_engine`): Lightning sees no launcher
  it knows there and would otherwise start ``devices`` processes of its own
  in each of Horovod's, which then never meet.

A mismatch raises :class:`~pyro_distributed.PyroDistributedError` naming both
counts (:func:`check_devices`) before any worker waits for another. Under
``horovodrun`` and ``mpiexec`` with their own engines there is no torch
process group, and Lightning's cluster environment cannot say which worker
a process is; :class:`LauncherEnvironment` takes ranks from the engine, so
that each worker takes its own device (``parallel_devices[local_rank]``).
"""

from __future__ import annotations

from lightning.fabric.plugins import ClusterEnvironment

from ...engines import Engine, engine_class
from ...engines.network import choose_gloo_interface
from ...engines.rendezvous_store import check_addresses_before_a_group
from ...errors import PyroDistributedError


def resolve_engine(engine: str) -> str:
    """The engine the strategy runs on: ``"auto"`` is ``"horovod"`` under ``horovodrun``."""
    if engine == "auto" and engine_class("horovod").detected():
        return "horovod"
    return engine


def check_devices(num_nodes: int, devices: int, workers: int, launcher: str) -> None:
    """Refuse Trainer arguments that count other workers than ``launcher`` started."""
    if num_nodes * devices != workers:
        raise PyroDistributedError(
            f"PyroDistributedStrategy: {launcher} started {workers} worker(s) but the "
            f"Trainer counts devices={devices} x num_nodes={num_nodes}; give it devices= "
            f"(workers per machine) and num_nodes= whose product is {workers}, as under "
            f"every launcher"
        )


def check_world_size(engine: Engine, counted: int) -> None:
    """Refuse a Trainer that counts other workers than the engine has."""
    if engine.world_size != counted:
        raise PyroDistributedError(
            f"PyroDistributedStrategy: Lightning counts {counted} worker(s) (devices x "
            f"num_nodes) but the {engine.name!r} engine has {engine.world_size}; give the "
            f"Trainer devices= and num_nodes= that match the launcher"
        )


class LauncherEnvironment(ClusterEnvironment):
    """The workers ``horovodrun`` or ``mpiexec`` started, as the engine counts them.

    :param engine: the running engine (its ranks are this environment's).
    :param devices: workers per machine (the Trainer's ``devices``).
    """

    def __init__(self, engine: Engine, devices: int) -> None:
        self._engine = engine
        self._devices = devices

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # unused: the engine's transport connects the workers

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False  # made by the strategy, never chosen by Lightning

    def world_size(self) -> int:
        return self._engine.world_size

    def set_world_size(self, size: int) -> None:
        """Fixed by the launcher: a different size is a mismatch, which the strategy refuses."""

    def global_rank(self) -> int:
        return self._engine.rank

    def set_global_rank(self, rank: int) -> None:
        """Fixed by the launcher."""

    def local_rank(self) -> int:
        return self._engine.local_rank

    def node_rank(self) -> int:
        return self._engine.rank // self._devices


def reach_other_hosts(environment: ClusterEnvironment | None, num_nodes: int) -> None:
    """Before Lightning makes its process group across hosts, tell gloo the
    interface that reaches ``MASTER_ADDR``, as the torch engine does for its own.

    Where this host's name resolves to loopback (stock Debian and Ubuntu
    nodes), gloo would otherwise advertise loopback: the other host's worker
    fails with "connection refused" and this one waits for Lightning's
    process-group time-out (30 minutes by default). Decided by ``num_nodes``,
    not ``environment.world_size()``: Lightning's own environment learns the
    world size only in DDP's set-up, after the interface must be chosen.

    Under torchrun, every worker then checks the others' addresses through
    torchrun's store, as the torch engine does before its own group: a
    worker that would still advertise loopback (``GLOO_SOCKET_IFNAME=lo`` set
    by hand) stops every host within the engine's time-out, naming it.
    """
    if environment is not None and num_nodes > 1:
        choose_gloo_interface(environment.main_address, environment.main_port)
        check_addresses_before_a_group()
