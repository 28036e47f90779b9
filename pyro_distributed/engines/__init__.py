"""Engine registry: names to modules, and how ``engine="auto"`` chooses.

Engine modules are imported only when chosen, so that a missing optional
transport (Horovod, mpi4py) costs nothing unless it is asked for. Adding an engine
means adding a module with an :class:`~pyro_distributed.engines.base.Engine`
subclass and one line in ``_ENGINES``.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

from .base import DEFAULT_TIMEOUT, Engine, Pending

__all__ = [
    "DEFAULT_TIMEOUT",
    "ENGINE_NAMES",
    "Engine",
    "Pending",
    "create_engine",
    "detect_engine",
]

# name -> (module, class). Order matters for "auto": the first launcher found wins.
_ENGINES: dict[str, tuple[str, str]] = {
    "horovod": ("pyro_distributed.engines.horovod", "HorovodEngine"),
    "torch": ("pyro_distributed.engines.torch_distributed", "TorchEngine"),
    "mpi": ("pyro_distributed.engines.mpi", "MPIEngine"),
    "local": ("pyro_distributed.engines.local", "LocalEngine"),
}

ENGINE_NAMES: tuple[str, ...] = tuple(_ENGINES)


def _engine_class(name: str) -> type[Engine]:
    if name not in _ENGINES:
        raise ValueError(
            f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)} or 'auto'"
        )
    module_name, class_name = _ENGINES[name]
    engine_class: type[Engine] = getattr(importlib.import_module(module_name), class_name)
    return engine_class


def detect_engine() -> str:
    """The engine ``"auto"`` stands for in this process.

    ``horovod`` when launched by ``horovodrun``; ``torch`` when launched by
    ``torchrun`` or when a torch.distributed process group already exists;
    ``mpi`` when launched by ``mpirun``, ``mpiexec`` or a multi-task ``srun``;
    ``local`` otherwise. Detection reads the environment only: it imports no
    optional transport (not even mpi4py).
    """
    from . import horovod, mpi, torch_distributed

    if horovod.HorovodEngine.detected():
        return "horovod"
    if torch_distributed.TorchEngine.detected():
        return "torch"
    if mpi.MPIEngine.detected():
        return "mpi"
    return "local"


def create_engine(name: str, timeout: timedelta = DEFAULT_TIMEOUT) -> Engine:
    """Start the engine called ``name`` (not ``"auto"``)."""
    return _engine_class(name)(timeout)
