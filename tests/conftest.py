"""Shared fixtures: every test starts and ends without a running engine.

Tests marked ``cuda`` need a GPU. They are deselected (not skipped, so not
counted) unless pytest runs with ``--cuda`` or ``PYRO_DISTRIBUTED_TEST_CUDA=1``
(``scripts/gpu_check.sh`` does); asked for on a machine without CUDA, the run
stops with a usage error instead of failing each test, unless
``PYRO_DISTRIBUTED_TEST_DEVICE=cpu`` asks for them on the CPU (to check the
tests themselves).

Tests marked ``cluster`` run launchers on hosts made of network namespaces
(``tests/cluster.py``); where none can be made (not root, no ``ip netns``)
they are deselected with one printed line that says why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import pyro_distributed as pd

from . import cluster

CUDA_VARIABLE = "PYRO_DISTRIBUTED_TEST_CUDA"
#: Where the cuda tests put their tensors (tests/test_cuda.py); "cpu" runs them here.
DEVICE_VARIABLE = "PYRO_DISTRIBUTED_TEST_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cuda",
        action="store_true",
        help=f"run the tests marked cuda (they need a GPU); or set {CUDA_VARIABLE}=1",
    )


def cuda_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("--cuda")) or os.environ.get(CUDA_VARIABLE) == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_cluster_tests_where_no_cluster_can_be_made(config, items)
    if cuda_requested(config):
        on_cpu = os.environ.get(DEVICE_VARIABLE) == "cpu"  # checks the tests themselves
        if not (torch.cuda.is_available() or on_cpu):
            raise pytest.UsageError(
                "--cuda: no CUDA device here (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}); the tests marked cuda need a GPU"
            )
        return
    deselected = [item for item in items if item.get_closest_marker("cuda") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("cuda") is None]


def _deselect_cluster_tests_where_no_cluster_can_be_made(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    wanted = [item for item in items if item.get_closest_marker("cluster") is not None]
    if not wanted:
        return
    reason = cluster.unavailable()
    if reason is None:
        return
    print(f"\n[tests] {len(wanted)} cluster test(s) deselected: no namespace hosts here ({reason})")
    config.hook.pytest_deselected(items=wanted)
    items[:] = [item for item in items if item.get_closest_marker("cluster") is None]


@pytest.fixture(autouse=True)
def _no_engine_left_running() -> Iterator[None]:
    # An engine a test started in this process (engine="local", say) would
    # otherwise decide what "auto" means, or refuse another engine, in the
    # tests after it.
    yield
    pd.shutdown()
