"""A launcher's variables, read and checked: whole numbers, ports, hosts and node lists.

A launcher writes each of its variables in one form (``WORLD_SIZE=4``,
``MASTER_PORT=29500``, ``SLURM_STEP_NODELIST=gpu[07-09]``). A value in any
other form was set by hand, and guessing what it meant would start a job
other than the one the launcher started: W replicas that each train alone,
or a worker that waits for a peer that is not coming. So each reader here
raises a ``ValueError`` that names the variable, its value and what it must
be. Which launcher started the process, and where its workers meet, is
:mod:`.launchers`' question.
"""

from __future__ import annotations

import os
import re

#: What each count is, for the messages of :func:`env_int`.
WORKERS = "the number of workers"
TASKS = "the number of the step's tasks"
RANK = "this worker's rank"
LOCAL_RANK = "this worker's rank on its host"
RESTARTS = "the number of restarts"


def env_int(
    variable: str,
    *,
    minimum: int,
    what: str,
    default: int | None = None,
    below: tuple[str, int] | None = None,
) -> int:
    """The whole number a launcher put in ``variable``, at least ``minimum`` and
    less than ``below``'s value where given; ``default`` where it is unset.

    :raises ValueError: naming the variable, its value and what it must be: a
        launcher never writes anything else, so the value was set by hand,
        and guessing would start a job other than the one the launcher started.
    """
    raw = os.environ.get(variable)
    if raw is None and default is not None:
        return default
    value = int(raw) if raw is not None and raw.strip().isdecimal() else -1
    low, high = minimum, None if below is None else below[1] - 1
    if value < low or (high is not None and value > high):
        bound = (
            f"from {low} to {high} (one less than {below[0]}={below[1]})"
            if below
            else (f"of at least {low}")
        )
        given = "unset" if raw is None else f"{raw!r}"
        raise ValueError(
            f"{variable}={given} is not {what}: it must be a whole number {bound}, as the "
            f"launcher that started the workers sets it"
        )
    return value


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


def first_reserved_port(reserved: str) -> int:
    """The first port of ``SLURM_STEP_RESV_PORTS`` (``"12000-12003"``, ``"12011"``)."""
    match = re.fullmatch(r"(\d+)(?:-\d+)?(?:,\d+(?:-\d+)?)*", reserved.strip())
    port = int(match.group(1)) if match else 0
    if not 1 <= port <= 65535:
        raise ValueError(
            f"SLURM_STEP_RESV_PORTS={reserved!r} is not a list of ports: it must be "
            f"ports from 1 to 65535, as a range or a list, as srun --resv-ports gives them, "
            f"e.g. '12000-12003'"
        )
    return port


#: One host of a Slurm node list: name parts and bracketed ranges of numbers.
_HOST_PATTERN = re.compile(r"(?:[A-Za-z0-9._-]+|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])+")


def first_host(nodelist: str, variable: str = "SLURM_STEP_NODELIST") -> str:
    """The first host of a Slurm node list: ``"gpu[07-09,12],cpu1"`` gives
    ``"gpu07"`` (``""`` for an empty list).

    :raises ValueError: naming ``variable`` and its value, where the list is
        not one Slurm writes (``"node[1-"``, say): a host made of the pieces
        would be a name no worker can reach.
    """
    # Commas inside brackets separate numbers; outside, hosts.
    hosts = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if not nodelist.strip():
        return ""
    if ",".join(hosts) != nodelist.strip() or not all(map(_HOST_PATTERN.fullmatch, hosts)):
        raise ValueError(
            f"{variable}={nodelist!r} is not a Slurm node list: it must be host names "
            f"separated by commas, each with optional bracketed numbers or ranges, e.g. "
            f"'gpu[07-09,12],cpu1'"
        )
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", hosts[0])


def host_variable(variable: str) -> str:
    """The host name or address in ``variable``, checked."""
    raw = os.environ.get(variable, "")
    if not re.fullmatch(r"[A-Za-z0-9._:%-]+", raw.strip()):  # % : an IPv6 zone
        raise ValueError(
            f"{variable}={raw!r} is not a host: it must be the name or IP address of the "
            f"host of worker 0, the same on every worker, e.g. {variable}=127.0.0.1"
        )
    return raw.strip()
