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
import re
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

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
    return "SLURM_PROCID" in os.environ and _int(os.environ.get("SLURM_STEP_NUM_TASKS"), 1) > 1


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
    task = _int(os.environ.get("SLURM_TASK_PID"), 0)
    if task <= 0 or task == os.getpid():
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
    """The innermost launcher's count of the workers, or ``None`` if none says."""
    if all(name in os.environ for name in TORCHRUN_VARIABLES):
        return _declared("torchrun", "WORLD_SIZE")
    if horovodrun_present():
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
    #: Where the port came from, for messages (``"MASTER_PORT=29500"``, say).
    port_source: str = ""
    #: The job and step, ``"4242.0"``: the store's keys live under it.
    step: str = ""

    @property
    def url(self) -> str:
        """torch.distributed's ``tcp://`` form of it."""
        return f"tcp://{self.address}:{self.port}?rank={self.rank}&world_size={self.world_size}"

    def check_port_is_free(self) -> None:
        """On the task that hosts the store (worker 0), raise if another
        process already listens on the port.

        A taken port cannot be traded for another: the other tasks could
        learn the new one only from a store. They would wait at this one
        until the time-out (or meet another step's store there), so worker 0
        stops at once, with what to launch instead.
        """
        if self.rank != 0 or not _port_in_use(self.port):
            return
        raise PyroDistributedError(
            f"port {self.port} ({self.port_source}), where worker 0 of this srun step "
            f"(job.step {self.step}) would host the torch.distributed rendezvous on "
            f"{socket.gethostname()}, is already in use; the other tasks cannot learn "
            f"another port, and would wait for it until the time-out. Launch with `srun "
            f"--resv-ports=1 ...`, so that Slurm reserves a port for the step "
            f"(SLURM_STEP_RESV_PORTS; Slurm needs MpiParams=ports=... in slurm.conf), or "
            f"set MASTER_PORT to a free port for every task (`MASTER_PORT=29517 srun ...`)."
        )


def torch_rendezvous_from_slurm() -> SlurmRendezvous:
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
    store (:meth:`SlurmRendezvous.check_port_is_free`), and raises, naming
    the port and both fixes, rather than leaving the others to wait.
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
    job, step = os.environ.get("SLURM_JOB_ID", "0"), os.environ.get("SLURM_STEP_ID", "0")
    port, source = master_port(), "MASTER_PORT"
    reserved = os.environ.get("SLURM_STEP_RESV_PORTS", "")
    first_reserved = re.match(r"\s*(\d+)", reserved)
    if port is None and first_reserved:
        port, source = int(first_reserved.group(1)), "SLURM_STEP_RESV_PORTS"
    if port is None:
        port = slurm_step_port(job, step)
        source = f"derived from SLURM_JOB_ID={job} and SLURM_STEP_ID={step}"
    else:
        source = f"{source}={os.environ[source]}"
    return SlurmRendezvous(address, port, rank, world_size, local_rank, source, f"{job}.{step}")


def slurm_step_port(job: str, step: str) -> int:
    """The port derived for step ``step`` of job ``job``, the same on every task."""
    digest = hashlib.sha256(f"slurm job {job} step {step}".encode()).digest()
    return _SLURM_PORT_BASE + int.from_bytes(digest[:8], "big") % _SLURM_PORT_SPAN


def master_port() -> int | None:
    """``MASTER_PORT`` as a port, or ``None`` where it is unset
    (:func:`parse_master_port` where it is set)."""
    raw = os.environ.get("MASTER_PORT")
    return None if raw is None else parse_master_port(raw)


def parse_master_port(raw: str) -> int:
    """The port that ``MASTER_PORT=raw`` names.

    :raises ValueError: naming the variable and its value, where it is not a
        whole number from 1 to 65535.
    """
    port = int(raw) if raw.strip().isdecimal() else 0
    if not 1 <= port <= 65535:
        raise ValueError(
            f"MASTER_PORT={raw!r} is not a port: it must be a whole number from 1 to 65535, "
            f"the same on every worker (the port of the rendezvous store on MASTER_ADDR's "
            f"host), e.g. MASTER_PORT=29500"
        )
    return port


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
