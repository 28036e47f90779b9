"""Shared fixtures: every test starts and ends without a running engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import pyro_distributed as pd


@pytest.fixture(autouse=True)
def _no_engine_left_running() -> Iterator[None]:
    # An engine a test started in this process (engine="local", say) would
    # otherwise decide what "auto" means, or refuse another engine, in the
    # tests after it.
    yield
    pd.shutdown()
