"""What the launcher that started this process says about the job.

Every launcher names its world size in a variable of its own (``WORLD_SIZE``,
``HOROVOD_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``,
``MV2_COMM_WORLD_SIZE``, ``SLURM_STEP_NUM_TASKS``). :func:`check_world_size`
compares it with the world the engine joined, because ``srun --mpi=none``
and an mpi4py built for another MPI both start every task as a singleton
that would train alone on all the data and write as worker 0. Rules:

* only the innermost launcher counts (``srun`` may start one ``torchrun`` a
  node), so ``WORLD_SIZE`` is asked before Slurm's variables;
* a launcher is recognised by its whole set of variables, so a stray
  ``WORLD_SIZE`` in a shell does not make a plain process look launched;
* a multi-task ``srun`` step without a PMI that MPI could use joins through
  torch.distributed (:func:`torch_rendezvous_from_slurm`);
* a script run from the shell of an interactive ``srun -n 4 --pty bash``
  would wait for tasks that are shells, so it runs alone, with an
  :class:`InteractiveStepWarning` (:func:`started_from_an_interactive_step`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import PyroDistributedError
from .variables import (
    LOCAL_RANK,
    RANK,
    RESTARTS,
    TASKS,
    WORKERS,
    env_int,
    first_host,
    first_reserved_port,
    host_variable,
    master_port,
    parse_master_port,
)

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
#: What ``horovodrun`` gives every worker.
HOROVODRUN_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE")
#: Ports derived for a Slurm step lie below Linux's ephemeral range (32768 and up),
#: which outgoing connections draw from, and above 12000-12999, the range Slurm's
#: documentation suggests for the ports it reserves (``MpiParams=ports=``).
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 32768 - 20000


@dataclass(frozen=True)
class Declared:
    """A launcher's own count of the workers."""

    launcher: str
    variable: str
    world_size: int


def horovodrun_present() -> bool:
    """Whether ``horovodrun`` started this process (all of its variables are set)."""
    return all(name in os.environ for name in HOROVODRUN_VARIABLES)


def mpi_launcher_present() -> bool:
    """Whether an MPI launcher (or a PMI that MPI can use) started this process."""
    return _PMIX_RANK in os.environ or any(rank in os.environ for _, rank, _ in _MPI_LAUNCHERS)


class InteractiveStepWarning(UserWarning):
    """A script started from the shell of an interactive ``srun --pty`` step
    runs alone: the step's other tasks will never join it."""


#: What a shell is called (a login shell's ``argv[0]`` begins with ``-``).
_SHELLS = frozenset({"bash", "sh", "dash", "zsh", "ksh", "mksh", "fish", "tcsh", "csh"})


def slurm_step() -> bool:
    """Whether this is one task of a multi-task ``srun`` step.

    ``SLURM_PROCID`` alone is also set inside a batch script, where a plain
    ``python train.py`` is one process and must stay one; and so is it in a
    script started from an interactive step's shell
    (:func:`started_from_an_interactive_step`), which is no task either.
    """
    return _multi_task_step() and not started_from_an_interactive_step()


def _multi_task_step() -> bool:
    if "SLURM_PROCID" not in os.environ:
        return False
    return env_int("SLURM_STEP_NUM_TASKS", minimum=1, default=1, what=TASKS) > 1


def started_from_an_interactive_step() -> bool:
    """Whether this process was started from the shell that is a ``srun
    --pty`` step's task, rather than being the step's task itself.

    Slurm sets ``SLURM_PTY_PORT`` in a ``--pty`` step, and ``SLURM_TASK_PID``
    to the task's process. Neither alone decides: a step started from such a
    shell inherits ``SLURM_PTY_PORT``, and a task that is ``bash -c 'cd dir &&
    python train.py'`` forks the script, in every task alike. So this asks
    what the task's process is: a shell given neither a command (``-c``) nor
    a script, which reads its commands from the terminal. Where that cannot
    be read (no ``/proc``), the process counts as a task, as it always did.
    """
    if "SLURM_PTY_PORT" not in os.environ:
        return False
    task = env_int("SLURM_TASK_PID", minimum=1, default=0, what="the process id of the step's task")
    if task == 0 or task == os.getpid():
        return False
    try:
        command = Path(f"/proc/{task}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return False
    return _is_interactive_shell([part.decode(errors="replace") for part in command])


def _is_interactive_shell(command: list[str]) -> bool:
    if not command or os.path.basename(command[0]).lstrip("-") not in _SHELLS:
        return False
    options = command[1:]
    if any(not option.startswith("-") or option == "--" for option in options):
        return False  # a script, or arguments for one
    # -c, alone or among other short options (-lc), runs the command it is given.
    return not any("c" in option[1:] for option in options if not option.startswith("--"))


def warn_if_started_from_an_interactive_step() -> None:
    """Say, once per call site, why a script in an interactive step's shell runs alone."""
    if not (_multi_task_step() and started_from_an_interactive_step()):
        return
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "?")
    step = f"{os.environ.get('SLURM_JOB_ID', '?')}.{os.environ.get('SLURM_STEP_ID', '?')}"
    warnings.warn(
        f"this process was started from the shell of the interactive srun step {step} "
        f"(SLURM_PTY_PORT is set, and SLURM_TASK_PID={os.environ.get('SLURM_TASK_PID')} "
        f"is that shell, not this process), whose {tasks} tasks are shells: the others "
        f"have ended and will never join, so this process trains alone (world size 1). "
        f"To train on {tasks} workers, launch the script itself as the step's tasks: "
        f"`srun -n {tasks} python train.py` (from this shell: `srun --overlap -n {tasks} "
        f"python train.py`).",
        InteractiveStepWarning,
        stacklevel=4,
    )


def declared_world_size() -> Declared | None:
    """The innermost launcher's count of the workers, or ``None`` if none says.

    :raises ValueError: naming the variable and its value, where the launcher's
        count or this worker's rank among them is not a whole number in range:
        a worker that misread either would train on its own, or wait for a
        peer that is not coming.
    """
    if all(name in os.environ for name in TORCHRUN_VARIABLES):
        return _declared("torchrun", "RANK", "WORLD_SIZE")
    if horovodrun_present():
        return _declared("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE")
    for launcher, rank, size in _MPI_LAUNCHERS:
        if rank in os.environ and size in os.environ:
            return _declared(launcher, rank, size)
    if _PMIX_RANK in os.environ:
        env_int(_PMIX_RANK, minimum=0, what="this worker's rank")
    if slurm_step():
        return _declared("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
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
class Rendezvous:
    """Where and as whom this worker joins the others through a torch.distributed store."""

    address: str
    port: int
    rank: int
    world_size: int
    #: ``None`` where the launcher does not say (this worker's rank stands in).
    local_rank: int | None
    #: Where the address and the port came from, for messages (``"MASTER_PORT=29500"``).
    address_source: str
    port_source: str
    #: Who started the workers, for messages (``"torchrun"``, ``"srun step 4242.0"``).
    launcher: str
    #: What to do where worker 0 finds the port taken.
    port_fix: str
    #: Every key of this job lives under it: a Slurm step's tasks that meet
    #: another step's store on a shared port never read or write its keys.
    prefix: str = "pyro_distributed"
    #: Whether worker 0 serves the store; torchrun's agent serves it where
    #: ``TORCHELASTIC_USE_AGENT_STORE=True``, and every worker is a client.
    worker_0_hosts: bool = True

    @property
    def where(self) -> str:
        """The store's address and port, and where each came from, for messages."""
        return f"{self.address}:{self.port} ({self.address_source}, {self.port_source})"

    @property
    def hosts_the_store(self) -> bool:
        """Whether this worker serves the store the others connect to."""
        return self.worker_0_hosts and self.rank == 0

    def check_port_is_free(self) -> None:
        """On the worker that hosts the store (worker 0), raise if another
        process already listens on the port.

        A taken port cannot be traded for another: the other workers could
        learn the new one only from a store. They would wait at this one
        until the time-out (or meet another job's store there), so worker 0
        stops at once, with what to launch instead.
        """
        if not self.hosts_the_store or not _port_in_use(self.port):
            return
        raise PyroDistributedError(port_taken_message(self))


def port_taken_message(rendezvous: Rendezvous) -> str:
    """What worker 0 says when another process listens on the store's port."""
    return (
        f"port {rendezvous.port} ({rendezvous.port_source}), where worker 0 of "
        f"{rendezvous.launcher} would host the torch.distributed rendezvous on "
        f"{socket.gethostname()}, is already in use; the other workers cannot learn "
        f"another port, and wait for this one until the time-out. {rendezvous.port_fix}"
    )


def torch_rendezvous_from_torchrun() -> Rendezvous:
    """How this worker joins the others from torchrun's variables (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and ``LOCAL_RANK`` where set).

    :raises ValueError: naming the variable and its value, where one is not
        what torchrun would give (a rank outside ``0..WORLD_SIZE-1``, say).
    """
    world_size = env_int("WORLD_SIZE", minimum=1, what=WORKERS)
    rank = env_int("RANK", minimum=0, below=("WORLD_SIZE", world_size), what=RANK)
    local_rank = env_int("LOCAL_RANK", minimum=0, default=-1, what=LOCAL_RANK)
    port = parse_master_port(os.environ["MASTER_PORT"])
    address = host_variable("MASTER_ADDR")
    attempt = "0"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent_store:
        # A restart runs on the agent's store, which still holds the last
        # attempt's keys (see TorchEngine._join_group).
        attempt = str(env_int("TORCHELASTIC_RESTART_COUNT", minimum=0, default=0, what=RESTARTS))
    return Rendezvous(
        address=address,
        port=port,
        rank=rank,
        world_size=world_size,
        local_rank=None if local_rank < 0 else local_rank,
        address_source=f"MASTER_ADDR={address}",
        port_source=f"MASTER_PORT={port}",
        launcher="this torchrun job",
        port_fix="Set MASTER_PORT to a free port, the same on every worker.",
        prefix=f"pyro_distributed/attempt{attempt}",
        worker_0_hosts=not agent_store,
    )


def torch_rendezvous_from_slurm() -> Rendezvous:
    """How this task of a ``srun`` step joins the step's other tasks.

    The first node of the step hosts the store, on a port that every task
    finds without talking to the others, the first of these that is set:

    * ``MASTER_PORT`` (and ``MASTER_ADDR`` for the host);
    * the first port of ``SLURM_STEP_RESV_PORTS``, which ``srun --resv-ports``
      reserves for this step alone on each of its nodes (where Slurm is
      configured with ``MpiParams=ports=...``; a step that reserves none,
      started from a step that did, inherits that step's);
    * a port derived from the job and step ids: a hash of both into
      20000-32767, so that the steps of a job, and of jobs that share a node,
      meet on one port only by chance (about 1 in 12768 for two steps),
      never by a pattern of their ids.

    A derived port cannot be retried: the other tasks could not learn the
    second choice. So worker 0 checks that it is free before it hosts the
    store (:meth:`Rendezvous.check_port_is_free`), and raises, naming
    the port and both fixes, rather than leaving the others to wait.

    :raises ValueError: naming the variable and its value, where one of
        Slurm's variables is not what Slurm would give.
    """
    world_size = env_int("SLURM_STEP_NUM_TASKS", minimum=1, default=1, what=TASKS)
    rank = env_int("SLURM_PROCID", minimum=0, below=("SLURM_STEP_NUM_TASKS", world_size), what=RANK)
    local_rank = env_int("SLURM_LOCALID", minimum=0, default=0, what=LOCAL_RANK)
    job = env_int("SLURM_JOB_ID", minimum=0, default=0, what="the job's id")
    step = env_int("SLURM_STEP_ID", minimum=0, default=0, what="the step's id")
    if os.environ.get("MASTER_ADDR"):
        address = host_variable("MASTER_ADDR")
        address_source = f"MASTER_ADDR={address}"
    else:
        variable = (
            "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in os.environ else "SLURM_JOB_NODELIST"
        )
        address = first_host(os.environ.get(variable, ""), variable)
        address_source = f"the first node of {variable}={os.environ.get(variable, '')}"
    if not address:
        raise PyroDistributedError(
            "srun started this task without SLURM_STEP_NODELIST, so the torch engine cannot "
            "tell which node hosts the rendezvous. Set MASTER_ADDR to the first node's name."
        )
    port, port_source = master_port(), f"MASTER_PORT={os.environ.get('MASTER_PORT')}"
    if port is None and os.environ.get("SLURM_STEP_RESV_PORTS"):
        reserved = os.environ["SLURM_STEP_RESV_PORTS"]
        port, port_source = first_reserved_port(reserved), f"SLURM_STEP_RESV_PORTS={reserved}"
    if port is None:
        port = slurm_step_port(str(job), str(step))
        port_source = f"derived from SLURM_JOB_ID={job} and SLURM_STEP_ID={step}"
    return Rendezvous(
        address=address,
        port=port,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        address_source=address_source,
        port_source=port_source,
        launcher=f"this srun step (job.step {job}.{step})",
        port_fix=(
            "Launch with `srun --resv-ports=1 ...`, so that Slurm reserves a port for the "
            "step (SLURM_STEP_RESV_PORTS; Slurm needs MpiParams=ports=... in slurm.conf), or "
            "set MASTER_PORT to a free port for every task (`MASTER_PORT=29517 srun ...`)."
        ),
        prefix=f"pyro_distributed/slurm/{job}.{step}",
    )


def slurm_step_port(job: str, step: str) -> int:
    """The port derived for step ``step`` of job ``job``, the same on every task."""
    digest = hashlib.sha256(f"slurm job {job} step {step}".encode()).digest()
    return _SLURM_PORT_BASE + int.from_bytes(digest[:8], "big") % _SLURM_PORT_SPAN


def _port_in_use(port: int) -> bool:
    """Whether a socket already listens on ``port`` on this host, on any
    address: a bind as the store's own (address reuse on, so that a port a
    finished store left in TIME_WAIT counts as free, as it does for the store)."""
    dual_stack = socket.has_dualstack_ipv6()
    family = socket.AF_INET6 if dual_stack else socket.AF_INET
    try:
        with socket.create_server(("", port), family=family, dualstack_ipv6=dual_stack):
            return False
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE


def _declared(launcher: str, rank_variable: str, size_variable: str) -> Declared:
    size = env_int(size_variable, minimum=1, what=WORKERS)
    env_int(rank_variable, minimum=0, below=(size_variable, size), what=RANK)
    return Declared(launcher, size_variable, size)
