"""The old import paths of the integrations (pyro_distributed/lightning.py) still work.

Each warns with a ``DeprecationWarning`` that names the new path, and gives
the moved module itself, not a copy: the strategy's class is the same object
and is registered with Lightning once.
"""

from __future__ import annotations

import importlib
import sys

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import pyro_distributed.integrations.lightning as new_package
from pyro_distributed.integrations.lightning.strategy import PyroDistributedStrategy

MOVED = {
    "pyro_distributed.lightning.strategy": "pyro_distributed.integrations.lightning.strategy",
    "pyro_distributed.lightning.kernel": "pyro_distributed.integrations.lightning.kernel",
    "pyro_distributed.lightning.data": "pyro_distributed.integrations.lightning.data",
    "pyro_distributed.lightning.anndata": "pyro_distributed.integrations.scvi.anndata",
    "pyro_distributed.lightning.rows_on_disk": "pyro_distributed.integrations.scvi.rows_on_disk",
    "pyro_distributed.lightning.obsm_writer": "pyro_distributed.integrations.scvi.obsm_writer",
    "pyro_distributed.lightning.posterior": "pyro_distributed.integrations.scvi.posterior",
}


@pytest.fixture
def fresh_old_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the old paths for the test (restored after), so that importing them warns."""
    for name in [n for n in sys.modules if n.startswith("pyro_distributed.lightning")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.usefixtures("fresh_old_paths")
def test_the_old_package_warns_and_gives_the_new_names() -> None:
    with pytest.warns(
        DeprecationWarning, match=r"import pyro_distributed\.integrations\.lightning$"
    ):
        old = importlib.import_module("pyro_distributed.lightning")
    for name in new_package.__all__:
        assert getattr(old, name) is getattr(new_package, name)
    assert old.__all__ == new_package.__all__


@pytest.mark.usefixtures("fresh_old_paths")
@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_module_warns_naming_its_new_path_and_is_the_moved_module(
    old: str, new: str
) -> None:
    with pytest.warns(DeprecationWarning) as caught:
        module = importlib.import_module(old)
    assert f"{old} is deprecated; import {new}" in [str(w.message) for w in caught]
    assert module is importlib.import_module(new)
    assert module.__spec__ is not None and module.__spec__.name == new  # left as it was


@pytest.mark.usefixtures("fresh_old_paths")
def test_from_the_old_package_import_a_module() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        from pyro_distributed.lightning import posterior
    assert any(
        "import pyro_distributed.integrations.scvi.posterior" in str(w.message) for w in caught
    )
    assert posterior is importlib.import_module("pyro_distributed.integrations.scvi.posterior")


@pytest.mark.usefixtures("fresh_old_paths")
def test_the_strategy_is_registered_once_under_its_name() -> None:
    with pytest.warns(DeprecationWarning):
        importlib.import_module("pyro_distributed.lightning.strategy")
    assert StrategyRegistry[PyroDistributedStrategy.strategy_name]["strategy"] is (
        PyroDistributedStrategy
    )


@pytest.mark.usefixtures("fresh_old_paths")
def test_a_name_that_never_was_there_is_not_found() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ModuleNotFoundError):
        importlib.import_module("pyro_distributed.lightning.no_such_module")
