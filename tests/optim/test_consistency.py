"""assert_in_sync and the periodic drift check: any difference is named, on every worker."""

from __future__ import annotations

import pyro
import pytest
import torch

import pyro_distributed as pd

from ..support.faults import drift
from ..support.harness import run_workers, with_engines


@pytest.mark.parametrize(
    ("engine", "what", "expected"),
    with_engines(
        [("param", "parameter 'p'"), ("state", "optimizer state of 'p'")],
        on_mpi=[("param", "parameter 'p'")],
    ),
)
def test_drift_is_caught_by_check_every_and_names_param_and_workers(
    engine: str, what: str, expected: str
) -> None:
    messages = run_workers(drift, what, engine=engine)
    assert messages[0] == messages[1]
    assert f"workers have drifted apart: {expected} differs" in messages[0]
    assert "worker 0: version" in messages[0] and "worker 1: version" in messages[0]


def store_only_check(extra_on: int | None) -> str:
    """assert_in_sync without an optimizer: the param store alone, on the current engine."""
    pyro.param("shared", torch.arange(3.0))
    if pd.rank() == extra_on:
        pyro.param("extra", torch.zeros(2))
    try:
        pd.assert_in_sync()
    except pd.PyroDistributedError as err:
        return str(err)
    return "in sync"


def test_identical_param_stores_are_in_sync_on_every_worker() -> None:
    assert run_workers(store_only_check, None, world_size=3) == ["in sync"] * 3


def test_a_parameter_only_some_workers_hold_is_named_with_its_holders() -> None:
    messages = run_workers(store_only_check, 2, world_size=3)
    assert messages[0] == messages[1] == messages[2]
    assert "workers have drifted apart: parameter 'extra' differs" in messages[0]
    assert "workers 0, 1: none" in messages[0]
    assert "worker 2: version" in messages[0]
