"""The options every front end takes (pyro_distributed.optim.options): their
defaults written once, each wrong one refused by name."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.optim.horovod import _FUSION_MB
from pyro_distributed.optim.options import (
    DEFAULTS,
    EngineBinding,
    OptimizerOptions,
    ReducerOptions,
    check_optimizer_options,
)

from ..support.harness import run_workers


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be positive"),
        ({"bucket_cap_mb": "1"}, TypeError, "bucket_cap_mb must be a number"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite must be 'skip' or 'raise'"),
        ({"check_every": 0}, ValueError, "check_every must be a positive int"),
        ({"check_every": 2.5}, TypeError, "check_every must be an int or None"),
        ({"overlap": 1}, TypeError, "overlap must be True or False"),
    ],
)
def test_each_bad_option_gets_its_own_error(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ReducerOptions.of(**options)
    with pytest.raises(error, match=message):
        check_optimizer_options(options, "here")


def test_every_front_end_takes_its_defaults_from_the_one_dataclass() -> None:
    fields = {field.name for field in dataclasses.fields(ReducerOptions)} - {"reduction"}
    for front_end in (pd.DistributedOptimizer, pd.DistributedTorchOptimizer):
        parameters = inspect.signature(front_end.__init__).parameters
        for name in fields:
            assert parameters[name].default == getattr(DEFAULTS, name), (front_end, name)
    assert set(OptimizerOptions.__annotations__) == fields | {"multi_tensor"}
    assert ReducerOptions.of() == DEFAULTS
    assert ReducerOptions.of(bucket_cap_mb=_FUSION_MB).bucket_cap_mb == _FUSION_MB


def test_an_engine_or_local_binds_at_once_and_a_bad_one_is_refused() -> None:
    pd.init("local")
    try:
        engine = pd.current_engine()
        given = EngineBinding(engine)
        assert given.bound and given.engine() is engine
        local = EngineBinding("local")
        assert local.bound and local.engine() is engine
        assert not EngineBinding("auto").bound  # chosen at the first step
        with pytest.raises(TypeError, match="engine must be a name or an Engine, got int"):
            EngineBinding(3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown engine 'gloo'"):
            EngineBinding("gloo")
    finally:
        pd.shutdown()


def sync_kind() -> tuple[bool, bool]:
    param = torch.nn.Parameter(torch.zeros(2))
    sync = pd.DistributedTorchOptimizer(torch.optim.SGD([param], lr=0.1), bucket_cap_mb=1.0).sync
    return sync is None, sync is not None and sync.overlaps


def test_one_worker_gets_no_exchange_and_two_get_one() -> None:
    assert run_workers(sync_kind, world_size=1) == [(True, False)]
    assert run_workers(sync_kind) == [(False, True), (False, True)]
