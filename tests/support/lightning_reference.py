"""The strategy's reference run, shared by the tests of other launchers, and
how the tests start ``tests/lightning/scripts/fit_regression.py`` and read
what every worker recorded.

``tests/lightning/scripts/fit_regression.py --plan auto`` for :data:`FIT_EPOCHS`
epochs on Lightning's own launcher (``devices=2`` on this host), run once per
test process: what ``srun`` (``tests/engines/test_slurm.py``) and torchrun on
two hosts (``tests/engines/test_multihost.py``) must train, bitwise.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..lightning.scripts.fit_regression import N
from .harness import free_port, run_script

ROOT = Path(__file__).resolve().parents[2]
FIT_REGRESSION = "tests/lightning/scripts/fit_regression.py"
FIT_EPOCHS = 4


def fit_regression_options(out: Path, devices: int = 2) -> list[str]:
    """The script and its arguments, writing every worker's record to ``out``."""
    return [
        FIT_REGRESSION, "--out", str(out), "--devices", str(devices), "--plan", "auto",
        "--epochs", str(FIT_EPOCHS),
    ]  # fmt: skip


@functools.cache
def fit_on_lightnings_own_launcher() -> list[dict[str, Any]]:
    """Each worker's record, by rank, from Lightning's own launcher with ``devices=2``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        command = [sys.executable, *fit_regression_options(out)]
        code, output = run_script(command, ROOT, timeout=180)
        assert code == 0, f"Lightning's own launcher: exit {code}\n{output}"
        return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


SCRIPT = ROOT / FIT_REGRESSION
BIN = Path(sys.executable).parent


def launch(
    tmp_path: Path,
    *options: str,
    workers: int = 2,
    torchrun: bool = False,
    horovodrun: bool = False,
    mpiexec: bool = False,
    timeout: float = 300,
) -> tuple[int, str]:
    """Run the script on ``workers`` workers; its exit code and the end of its output.

    Lightning's own launcher by default (``--devices workers``), else the
    outside launcher named, which starts every worker itself.
    """
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--devices", str(workers), *options]
    if horovodrun:
        command = [
            str(BIN / "horovodrun"), "--gloo", "-np", str(workers), "-H", f"localhost:{workers}",
            *command,
        ]  # fmt: skip
    if torchrun:
        command = [
            str(BIN / "torchrun"), f"--nproc-per-node={workers}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *command[1:],
        ]  # fmt: skip
    if mpiexec:
        command = [str(BIN / "mpiexec"), "-n", str(workers), *command]
    return run_script(command, ROOT, timeout)


def fit(tmp_path: Path, *options: str, workers: int = 2, **launcher: Any) -> list[Any]:
    """Run the script (see :func:`launch`); every worker's record, by rank."""
    code, output = launch(tmp_path, *options, workers=workers, **launcher)
    assert code == 0, f"exit {code}\n{output}"
    return [torch.load(tmp_path / "out" / f"rank{rank}.pt") for rank in range(workers)]


def assert_in_sync(records: list[Any]) -> None:
    first, second = (record["posterior"] for record in records)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def assert_each_epoch_shares_the_rows(records: list[Any], epochs: int) -> None:
    per_epoch = N // 2 // 100 * 100  # drop="uneven": equal shards of whole batches
    for epoch in range(epochs):
        shards = [set(r["seen"][epoch * per_epoch : (epoch + 1) * per_epoch]) for r in records]
        assert not shards[0] & shards[1], f"epoch {epoch}: a row on both workers"
        assert len(shards[0] | shards[1]) == 2 * per_epoch
