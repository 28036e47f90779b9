"""Deprecated: the Lightning integration is :mod:`pyro_distributed.integrations.lightning`.

Importing this module, or any module the package of this name used to hold, warns with a
``DeprecationWarning`` that names the new path and gives the new module's
objects themselves, so the strategy is registered once whichever path
imports it. The old modules are no files of their own: a finder maps
``pyro_distributed.lightning.<module>`` to the module's new home, in
:mod:`pyro_distributed.integrations.lightning` or, for the scvi-tools code,
:mod:`pyro_distributed.integrations.scvi`. This is one file, not a package,
so that tools that walk the package (``pkgutil.walk_packages``) do not
import it; its empty ``__path__`` lets the import system look for
submodules, which the finder alone answers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

from .integrations.lightning import IndexedDataset, OptimizerOptions, PyroDistributedStrategy

__all__ = ["IndexedDataset", "OptimizerOptions", "PyroDistributedStrategy"]
__path__: list[str] = []

NEW_PATHS = {
    **{
        name: f"pyro_distributed.integrations.lightning.{name}"
        for name in (
            "checkpoints",
            "collectives",
            "data",
            "internals",
            "kernel",
            "launch",
            "layer_sync",
            "plans",
            "pyro_state",
            "strategy",
        )
    },
    **{
        name: f"pyro_distributed.integrations.scvi.{name}"
        for name in ("anndata", "obsm_writer", "posterior", "rows_on_disk")
    },
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; import {new}", DeprecationWarning, stacklevel=3)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``pyro_distributed.lightning.<module>`` and loads the moved module itself."""

    package = __name__

    def __init__(self) -> None:
        self.specs: dict[str, ModuleSpec | None] = {}  # by new path: the moved modules' own

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in NEW_PATHS:
            return None
        return ModuleSpec(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        new = NEW_PATHS[spec.name.rpartition(".")[2]]
        _warn(spec.name, new)
        module = importlib.import_module(new)
        self.specs[new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Nothing to run, the module was imported at its new path; only its
        # __spec__, which the import system has just set to the old path's,
        # is given back.
        module.__spec__ = self.specs[module.__name__]


if not any(getattr(finder, "package", None) == __name__ for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
_warn(__name__, "pyro_distributed.integrations.lightning")
