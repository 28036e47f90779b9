"""Worker functions that read the runtime's agreed flags (``pd.any_worker``,
``pd.all_workers``), shared by ``tests/test_runtime.py`` and the Horovod tests."""

from __future__ import annotations

import torch

import pyro_distributed as pd


def flags() -> dict[str, bool]:
    mine = pd.rank() == 1
    return {
        "any": pd.any_worker(mine),
        "all": pd.all_workers(mine),
        "all_true": pd.all_workers(True),
        "none": pd.any_worker(torch.tensor(False)),
    }
