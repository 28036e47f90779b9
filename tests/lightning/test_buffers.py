"""Module buffers under PyroDistributedStrategy, and Trainer(sync_batchnorm=True).

``scripts/fit_batchnorm.py`` trains a LightningModule with a real
``BatchNorm1d`` on Lightning's launcher (each worker its share of the data)
and saves what every worker ended with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ..support.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "fit_batchnorm.py"


def fit(tmp_path: Path, workers: int, *options: str) -> list[dict[str, Any]]:
    """Every worker's record, by rank."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["MASTER_PORT"] = str(free_port())
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--devices", str(workers)]
    done = subprocess.run(
        [*command, *options], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-6000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(workers)]


@pytest.mark.parametrize("workers", [2, 3])
def test_batchnorm_statistics_end_identical_under_the_strategy(
    tmp_path: Path, workers: int
) -> None:
    records = fit(tmp_path, workers)
    first = records[0]
    assert first["buffers"]["net.1.running_mean"].abs().sum() > 0, "the statistics moved"
    for record in records:
        for name, value in first["buffers"].items():
            assert torch.equal(record["buffers"][name], value), name
        for name, value in first["params"].items():
            assert torch.equal(record["params"][name], value), name


def test_sync_batchnorm_on_cpu_is_refused_by_name(tmp_path: Path) -> None:
    (record,) = fit(tmp_path, 1, "--sync-batchnorm")
    assert "sync_batchnorm" in record["error"] and "CUDA" in record["error"], record
