"""Shared fixtures: every test starts and ends without a running engine.

Tests marked ``cuda`` need a GPU. They are deselected (not skipped, so not
counted) unless pytest runs with ``--cuda`` or ``PYRO_DISTRIBUTED_TEST_CUDA=1``
(``scripts/gpu_check.sh`` does); asked for on a machine without CUDA, the run
stops with a usage error instead of failing each test, unless
``PYRO_DISTRIBUTED_TEST_DEVICE=cpu`` asks for them on the CPU (to check the
tests themselves).

Tests marked ``cluster`` run launchers on hosts made of network namespaces
(``tests/support/cluster.py``); where none can be made (not root, no ``ip netns``)
they are deselected with one printed line that says why. So are the tests
marked ``slurm`` where ``scripts/start_slurm.sh`` cannot start a one-node
Slurm (``tests/support/slurm.py``).

The tests start their own workers with their own launchers, so a launcher's
variables already in the environment (``MASTER_ADDR`` or ``WORLD_SIZE`` in a
shell, ``SLURM_*`` inside an allocation) are removed for the session, and
every process runs one thread (``OMP_NUM_THREADS=1``) as the timings assume.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

import pyro_distributed as pd

from .support import cluster, slurm
from .support.harness import is_launcher_variable

CUDA_VARIABLE = "PYRO_DISTRIBUTED_TEST_CUDA"
#: Where the cuda tests put their tensors (tests/test_cuda.py); "cpu" runs them here.
DEVICE_VARIABLE = "PYRO_DISTRIBUTED_TEST_DEVICE"


def pytest_configure(config: pytest.Config) -> None:
    for name in list(os.environ):
        if is_launcher_variable(name):
            del os.environ[name]
    os.environ["OMP_NUM_THREADS"] = "1"
    _refuse_loadgroup_that_does_not_group(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    # The one-node Slurm stops with the last process of the run that started it
    # (tests/support/slurm.py), unless PYRO_DISTRIBUTED_KEEP_SLURM=1.
    slurm.release_held()


def _refuse_loadgroup_that_does_not_group(config: pytest.Config) -> None:
    """From pytest 9.2, pytest-xdist 3.8's ``--dist loadgroup`` silently stops
    grouping (it renames tests to carry their group, and pytest 9.2 ignores
    the new name: pytest-dev/pytest-xdist#1386). The tests that share a launch
    (``one_pytest_worker``) or the one Slurm node would then each be run by
    both pytest workers. The dev extra pins a pytest that groups."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    import xdist

    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())

    if release(pytest.__version__) >= (9, 2) and release(xdist.__version__) <= (3, 8):
        raise pytest.UsageError(
            f"--dist loadgroup does not group tests with pytest {pytest.__version__} and "
            f"pytest-xdist {xdist.__version__} (pytest-dev/pytest-xdist#1386); install "
            f"the versions of the dev extra (pip install -e '.[dev]')"
        )


#: What ``--quick`` (``scripts/test.sh --quick``, the inner loop) leaves out,
#: besides the tests marked ``slow`` or for another launcher and every run at
#: W=3: the files whose tests start a launcher or run a script as users do.
QUICK_LEAVES_OUT = (
    "tests/lightning/",
    "tests/integrations/",
    "tests/engines/test_launchers.py",
    "tests/test_convert_page.py",
    "tests/test_docs.py",
    "tests/test_examples.py",
    "tests/test_faults.py",
    "tests/test_statistics.py",
    "tests/test_vae_example.py",
    "tests/test_gpu_check.py",
)
_QUICK_LEAVES_OUT_MARKED = ("horovod", "mpi", "cluster", "slurm", "integrations", "slow")
_WORLD_PARAMETERS = ("workers", "world_size", "hosts")


def _left_out_by_quick(item: pytest.Item) -> bool:
    path = item.nodeid.split("::")[0]
    if path.startswith(QUICK_LEAVES_OUT):
        return True
    if any(item.get_closest_marker(name) is not None for name in _QUICK_LEAVES_OUT_MARKED):
        return True
    if "three_workers" in item.name or "_w3_" in item.name:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(params.get(name, 0) > 2 for name in _WORLD_PARAMETERS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="the inner loop: in-process and two-worker torch-engine tests only",
    )
    parser.addoption(
        "--outside-quick",
        action="store_true",
        help="only what --quick leaves out (the test command's main lane; its newest lane "
        "runs --quick)",
    )
    parser.addoption(
        "--cuda",
        action="store_true",
        help=f"run the tests marked cuda (they need a GPU); or set {CUDA_VARIABLE}=1",
    )


def cuda_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("--cuda")) or os.environ.get(CUDA_VARIABLE) == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            # One Slurm node of two CPUs: its steps run one after another, on
            # one pytest worker (-n 2 --dist loadgroup), never two at once.
            item.add_marker(pytest.mark.xdist_group("slurm"))
    quick, outside_quick = config.getoption("--quick"), config.getoption("--outside-quick")
    if quick and outside_quick:
        raise pytest.UsageError("--quick and --outside-quick select no test together")
    if quick or outside_quick:
        kept: list[pytest.Item] = []
        left_out: list[pytest.Item] = []
        for item in items:
            (left_out if _left_out_by_quick(item) == bool(quick) else kept).append(item)
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
    _deselect_where_unavailable(
        config, items, "cluster", cluster.unavailable, "no namespace hosts here"
    )
    # slurm.unavailable() starts the one-node Slurm (scripts/start_slurm.sh).
    _deselect_where_unavailable(config, items, "slurm", slurm.unavailable, "no Slurm here")
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


def _deselect_where_unavailable(
    config: pytest.Config,
    items: list[pytest.Item],
    marker: str,
    unavailable: Callable[[], str | None],
    missing: str,
) -> None:
    """Deselect the tests marked ``marker`` with one printed line when
    ``unavailable()`` (called only if some are collected) gives a reason."""
    wanted = [item for item in items if item.get_closest_marker(marker) is not None]
    if not wanted:
        return
    reason = unavailable()
    if reason is None:
        return
    print(f"\n[tests] {len(wanted)} {marker} test(s) deselected: {missing} ({reason})")
    config.hook.pytest_deselected(items=wanted)
    items[:] = [item for item in items if item.get_closest_marker(marker) is None]


@pytest.fixture(autouse=True)
def _no_engine_left_running() -> Iterator[None]:
    # An engine a test started in this process (engine="local", say) would
    # otherwise decide what "auto" means, or refuse another engine, in the
    # tests after it.
    yield
    pd.shutdown()
