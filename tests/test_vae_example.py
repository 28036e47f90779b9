"""The VAE example, run as users run it: under the real torchrun on two workers, and alone.

A few steps only: the point is that every piece runs end to end (sharded
loading, distributed SVI, the held-out ELBO, the figure and the checkpoint),
and that only worker 0 speaks.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .support.examples import check_outputs, run_example
from .support.harness import free_port

BIN = Path(sys.executable).parent


def test_vae_example_runs_under_torchrun_on_two_workers(tmp_path: Path) -> None:
    launcher = [
        str(BIN / "torchrun"),
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
    ]
    check_outputs(run_example(launcher, tmp_path), tmp_path, workers=2)


def test_vae_example_runs_as_one_plain_process(tmp_path: Path) -> None:
    check_outputs(run_example([sys.executable], tmp_path), tmp_path, workers=1)
