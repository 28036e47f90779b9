"""Engine registry: names to classes, and how ``engine="auto"`` chooses.

An engine module imports its optional transport (Horovod, mpi4py) only when
the engine starts, so a missing one costs nothing unless it is asked for.
Adding an engine means adding a module with an
:class:`~pyro_distributed.engines.base.Engine` subclass, which says itself
how it is detected and in which order (:meth:`~Engine.detected`,
:attr:`~Engine.detection_priority`) and whether its launcher starts the
workers (:attr:`~Engine.launches_own_workers`), and its line in ``_ENGINES``.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

from ..errors import PyroDistributedError
from .base import DEFAULT_TIMEOUT, Engine, Pending
from .launchers import (
    check_world_size,
    declared_world_size,
    warn_if_started_from_an_interactive_step,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "ENGINE_NAMES",
    "Engine",
    "Pending",
    "check_engine_name",
    "create_engine",
    "detect_engine",
    "engine_class",
]

# name -> (module, class), in the order messages list them.
_ENGINES: dict[str, tuple[str, str]] = {
    "horovod": ("pyro_distributed.engines.horovod", "HorovodEngine"),
    "torch": ("pyro_distributed.engines.torch_distributed", "TorchEngine"),
    "mpi": ("pyro_distributed.engines.mpi", "MPIEngine"),
    "local": ("pyro_distributed.engines.local", "LocalEngine"),
}

ENGINE_NAMES: tuple[str, ...] = tuple(_ENGINES)


def check_engine_name(name: str, where: str, *, local: bool = True) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``name`` is ``"auto"`` or an
    engine's name (``"local"`` only if ``local``): the one check every entry
    point that takes ``engine=`` makes, so all of them accept and name the same."""
    allowed = ["auto", *(n for n in ENGINE_NAMES if local or n != "local")]
    if not isinstance(name, str):
        raise TypeError(
            f"{where}: engine must be a name, one of {', '.join(map(repr, allowed))}, got {name!r}"
        )
    if name not in allowed:
        raise ValueError(
            f"{where}: unknown engine {name!r}; choose one of {', '.join(map(repr, allowed))}"
        )


def engine_class(name: str) -> type[Engine]:
    """The engine class called ``name`` (its module imported, its transport not)."""
    if name not in _ENGINES:
        raise ValueError(
            f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)} or 'auto'"
        )
    module_name, class_name = _ENGINES[name]
    found: type[Engine] = getattr(importlib.import_module(module_name), class_name)
    return found


def detect_engine() -> str:
    """The engine ``"auto"`` stands for in this process.

    ``horovod`` when launched by ``horovodrun``; ``torch`` when launched by
    ``torchrun``, when a torch.distributed process group already exists, or
    by a multi-task ``srun`` without a PMI; ``mpi`` when launched by
    ``mpirun``, ``mpiexec`` or ``srun`` with a PMI;
    ``local`` otherwise, with an
    :class:`~pyro_distributed.engines.launchers.InteractiveStepWarning` where
    this process was started from an interactive ``srun --pty`` step's shell.
    Each engine class is asked, highest :attr:`~Engine.detection_priority`
    first. Detection reads the environment (and, in a ``srun --pty`` step,
    what the step's task is) only: it imports no optional transport (not
    even mpi4py).
    """
    classes = sorted(map(engine_class, ENGINE_NAMES), key=lambda c: -c.detection_priority)
    name = next(c.name for c in classes if c.detected())
    if name == "local":  # where no other launcher (torchrun from that shell, say) says more
        warn_if_started_from_an_interactive_step()
    return name


def create_engine(name: str, timeout: timedelta = DEFAULT_TIMEOUT) -> Engine:
    """Start the engine called ``name`` (not ``"auto"``), and check that it
    joined as many workers as its launcher started
    (:func:`~pyro_distributed.engines.launchers.check_world_size`).

    The launcher's variables are read before the engine starts, so that one a
    launcher could not have written (``WORLD_SIZE=abc``, a rank past the world
    size) raises a ``ValueError`` naming it before any transport reads it.
    """
    declared_world_size()
    engine = engine_class(name)(timeout)
    try:
        check_world_size(engine.name, engine.world_size)
    except PyroDistributedError as error:
        mismatch = error
    else:
        return engine
    # A clean shutdown, outside the handler: an engine that sees an exception
    # in flight ends as after a failure (the MPI engine would abort the process).
    engine.shutdown()
    raise mismatch
