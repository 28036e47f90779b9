"""A SIGINT sent to one launched worker stops the launch, however the
launching process was started.

A shell script's background job (``python train.py &``) starts with SIGINT
ignored, and the forkserver, and every worker it forks, inherited that: a
worker slept through the signal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..support.notebooks import ROOT

SCRIPT = ROOT / "tests" / "spawn" / "scripts" / "interrupts_a_worker.py"


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_an_interrupted_worker_stops_a_launch_started_as_a_background_job(
    method: str, tmp_path: Path
) -> None:
    # Without job control (bash -c), a background job's SIGINT is ignored.
    line = f'"{sys.executable}" "{SCRIPT}" "{tmp_path}" {method} & wait $!'
    done = subprocess.run(
        ["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert "SIGINT here: ignored" in done.stdout, done.stdout + done.stderr
    assert "launch raised: worker 1 of 2 raised" in done.stdout, done.stdout + done.stderr
    assert "KeyboardInterrupt" in done.stdout, done.stdout + done.stderr
