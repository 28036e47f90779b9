"""What the launcher that started this process says about the job.

Every launcher tells its workers how many they are: ``torchrun`` in
``WORLD_SIZE``, ``horovodrun`` in ``HOROVOD_SIZE``, Open MPI in
``OMPI_COMM_WORLD_SIZE``, MPICH's Hydra and Slurm's PMI in ``PMI_SIZE``,
MVAPICH2 in ``MV2_COMM_WORLD_SIZE`` and ``srun`` in ``SLURM_STEP_NUM_TASKS``.
After an engine starts, :func:`check_world_size` compares the world it joined
with that number, because the two disagree in ways that otherwise pass in
silence: ``srun --mpi=none`` (Slurm's default) starts every task as an MPI
singleton of one worker, and so does an mpi4py built for another MPI than the
launcher's. Each singleton would train alone on all the data, call itself
worker 0 and write its outputs.

Only the innermost launcher counts: ``srun`` may start one ``torchrun`` per
node, each of which starts several workers, so ``WORLD_SIZE`` is asked before
Slurm's variables. A launcher is recognised by its whole set of variables, so
that a stray ``WORLD_SIZE`` left in a shell does not make a plain process
look launched.

A multi-task ``srun`` step without a PMI that MPI could use is joined through
torch.distributed instead, from Slurm's own variables
(:func:`torch_rendezvous_from_slurm`), so every ``srun`` line trains one model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import PyroDistributedError

#: The variables that MPI launchers give each process (rank and size), by launcher.
_MPI_LAUNCHERS = (
    ("Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2)", "PMI_RANK", "PMI_SIZE"),
    ("MVAPICH2's launcher", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
#: A PMIx launcher gives the rank but no size in the environment.
_PMIX_RANK = "PMIX_RANK"
#: What torchrun gives every worker (the torch engine joins from these).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Ports derived for a Slurm step lie below Linux's ephemeral range (32768 and up),
#: which outgoing connections draw from.
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class Declared:
    """A launcher's own count of the workers."""

    launcher: str
    variable: str
    world_size: int


def mpi_launcher_present() -> bool:
    """Whether an MPI launcher (or a PMI that MPI can use) started this process."""
    return _PMIX_RANK in os.environ or any(rank in os.environ for _, rank, _ in _MPI_LAUNCHERS)


def slurm_step() -> bool:
    """Whether this is one task of a multi-task ``srun`` step.

    ``SLURM_PROCID`` alone is also set inside a batch script, where a plain
    ``python train.py`` is one process and must stay one.
    """
    return "SLURM_PROCID" in os.environ and _int(os.environ.get("SLURM_STEP_NUM_TASKS"), 1) > 1


def declared_world_size() -> Declared | None:
    """The innermost launcher's count of the workers, or ``None`` if none says."""
    if all(name in os.environ for name in TORCHRUN_VARIABLES):
        return _declared("torchrun", "WORLD_SIZE")
    if "HOROVOD_RANK" in os.environ and "HOROVOD_SIZE" in os.environ:
        return _declared("horovodrun", "HOROVOD_SIZE")
    for launcher, rank, size in _MPI_LAUNCHERS:
        if rank in os.environ and size in os.environ:
            return _declared(launcher, size)
    if slurm_step():
        return _declared("srun", "SLURM_STEP_NUM_TASKS")
    return None


def check_world_size(engine_name: str, world_size: int) -> None:
    """Raise if the engine joined a different number of workers than its launcher started."""
    declared = declared_world_size()
    if declared is None or declared.world_size == world_size:
        return
    if declared.launcher == "srun" and engine_name == "mpi":
        cause = (
            "srun started the tasks without a PMI that this MPI can use (Slurm's default "
            "is --mpi=none), so each started MPI alone. Launch with `srun --mpi=pmi2` (or "
            "--mpi=pmix where Slurm has that plugin), or let engine='auto' join the tasks "
            "through torch.distributed from Slurm's variables."
        )
    elif engine_name == "mpi":
        cause = (
            "mpi4py was probably built against another MPI than the launcher's (an "
            "MPICH-built mpi4py under Open MPI's mpirun, say), so each process started "
            "MPI alone. Launch with the mpiexec of the MPI that mpi4py was built for "
            "(`python -c 'import mpi4py; print(mpi4py.get_config())'`), or rebuild mpi4py "
            "against the launcher's MPI."
        )
    elif engine_name == "local":
        cause = "the local engine never talks to other workers; use engine='auto' under a launcher."
    else:
        cause = "the launcher and the engine do not describe the same job."
    raise PyroDistributedError(
        f"the {engine_name} engine joined {world_size} worker(s), but {declared.launcher} "
        f"started {declared.world_size} ({declared.variable}={declared.world_size}). Every "
        f"worker would train on its own and none would see the others' gradients: {cause}"
    )


@dataclass(frozen=True)
class SlurmRendezvous:
    """Where and as whom a task of a ``srun`` step joins the others."""

    address: str
    port: int
    rank: int
    world_size: int
    local_rank: int

    @property
    def url(self) -> str:
        """torch.distributed's ``tcp://`` form of it."""
        return f"tcp://{self.address}:{self.port}?rank={self.rank}&world_size={self.world_size}"


def torch_rendezvous_from_slurm() -> SlurmRendezvous:
    """How this task of a ``srun`` step joins the step's other tasks.

    The first node of the step hosts the store; its port is derived from the
    job and step ids, so the tasks of one step agree on it without talking,
    and two steps of a job differ. ``MASTER_ADDR`` and ``MASTER_PORT``, where
    set, win.
    """
    rank = _int(os.environ.get("SLURM_PROCID"), 0)
    world_size = _int(os.environ.get("SLURM_STEP_NUM_TASKS"), 1)
    local_rank = _int(os.environ.get("SLURM_LOCALID"), 0)
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    address = os.environ.get("MASTER_ADDR") or first_host(nodes)
    if not address:
        raise PyroDistributedError(
            "srun started this task without SLURM_STEP_NODELIST, so the torch engine cannot "
            "tell which node hosts the rendezvous. Set MASTER_ADDR to the first node's name."
        )
    job, step = _int(os.environ.get("SLURM_JOB_ID"), 0), _int(os.environ.get("SLURM_STEP_ID"), 0)
    derived = _SLURM_PORT_BASE + (job * 97 + step) % _SLURM_PORT_SPAN
    port = _int(os.environ.get("MASTER_PORT"), derived)
    return SlurmRendezvous(address, port, rank, world_size, local_rank)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"gpu[07-09,12],cpu1"`` gives ``"gpu07"``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if match is None:
        return ""
    prefix, ranges, suffix = match.groups()
    if not ranges:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix


def _declared(launcher: str, variable: str) -> Declared | None:
    value = _int(os.environ.get(variable), 0)
    return Declared(launcher, variable, value) if value > 0 else None


def _int(raw: str | None, default: int) -> int:
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default
