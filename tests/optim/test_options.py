"""The options both front ends take (pyro_distributed.optim.options)."""

from __future__ import annotations

import pytest

import pyro_distributed as pd
from pyro_distributed.exchange import Reduction
from pyro_distributed.optim.options import EngineBinding, check_options, make_sync

from ..support.harness import run_workers


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ((0, "skip", None, True), ValueError, "bucket_cap_mb must be positive"),
        (("1", "skip", None, True), TypeError, "bucket_cap_mb must be a number"),
        ((1.0, "ignore", None, True), ValueError, "nonfinite must be 'skip' or 'raise'"),
        ((1.0, "skip", 0, True), ValueError, "check_every must be a positive int"),
        ((1.0, "skip", 2.5, True), TypeError, "check_every must be an int or None"),
        ((1.0, "skip", None, 1), TypeError, "overlap must be True or False"),
    ],
)
def test_each_bad_option_gets_its_own_error(
    options: tuple[object, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        check_options(*options)


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
    sync = make_sync(pd.current_engine(), 1.0, Reduction(), True, None, "optimizer")
    return sync is None, sync is not None and sync.overlaps


def test_one_worker_gets_no_exchange_and_two_get_one() -> None:
    assert run_workers(sync_kind, world_size=1) == [(True, False)]
    assert run_workers(sync_kind) == [(False, True), (False, True)]
