"""Every scvi-tools private name that integrations/scvi/internals.py uses is still there.

A failure names the installed scvi-tools and cell2location: read internals.py
when upgrading. (Imported in the tests, not at the top: the main venv, which
deselects them, collects this file without either package.)
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from types import ModuleType, SimpleNamespace

import pytest

pytestmark = pytest.mark.integrations


def installed(name: str) -> ModuleType:
    with warnings.catch_warnings():  # their imports' own warnings (jax's, tensorflow's)
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def version() -> str:
    scvi, cell2location = installed("scvi"), installed("cell2location")
    return f"scvi-tools {scvi.__version__}, cell2location {cell2location.__version__}"


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_a_pyro_module_turns_a_batch_into_its_models_arguments() -> None:
    module_class = installed("scvi.module.base").PyroBaseModuleClass
    assert parameters(module_class._get_fn_args_from_batch) == ["tensor_dict"], version()


def test_a_pyro_model_finds_its_observation_plate_sites() -> None:
    names = parameters(installed("scvi.model.base").PyroSampleMixin._get_obs_plate_sites)
    assert names[:4] == ["self", "args", "kwargs", "return_observed"], version()


def test_a_model_makes_a_loader_over_chosen_observations() -> None:
    names = parameters(installed("scvi.model.base").BaseModelClass._make_data_loader)
    assert {"adata", "indices", "batch_size", "shuffle"} <= set(names), version()


def test_cell2location_computes_quantiles_on_chosen_observations() -> None:
    names = parameters(installed("cell2location.models").Cell2location._posterior_quantile)
    assert {"batch_size", "data_loader_indices", "exclude_vars"} <= set(names), version()


def test_a_splitter_keeps_its_loaders_distributed_sampler_where_it_can_be_dropped() -> None:
    from pyro_distributed.integrations.scvi import internals

    dataloaders = installed("scvi.dataloaders")
    manager = SimpleNamespace(adata=SimpleNamespace(n_obs=10))  # all a splitter reads when made
    for splitter_class in (dataloaders.DataSplitter, dataloaders.DeviceBackedDataSplitter):
        splitter = splitter_class(manager, distributed_sampler=True)
        assert internals.takes_distributed_sampler(splitter), version()
        alone = internals.without_distributed_sampler(splitter)
        assert not internals.takes_distributed_sampler(alone), version()
        assert internals.takes_distributed_sampler(splitter), version()  # the copy changed
