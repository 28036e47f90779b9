"""The strategy's reference run, shared by the tests of other launchers.

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

from .harness import run_script

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
