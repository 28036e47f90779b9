"""The examples, run as users run them: a plain process, and the real torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .harness import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "bayesian_regression.py"
BIN = Path(sys.executable).parent


def run(command: list[str], timeout: float = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def fitted_weights(output: str) -> list[float]:
    match = re.search(r"^weights: \[(.*)\]$", output, re.MULTILINE)
    assert match, output
    return [float(w) for w in match.group(1).split(",")]


def test_regression_example_runs_as_one_plain_process() -> None:
    output = run([sys.executable, str(EXAMPLE), "--steps", "1000"])
    assert "training on 1 worker(s)" in output
    for fitted, true in zip(fitted_weights(output), [2.0, -1.0, 0.5], strict=True):
        assert abs(fitted - true) < 0.1


def test_regression_example_runs_under_torchrun_on_two_workers() -> None:
    command = [
        str(BIN / "torchrun"),
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(EXAMPLE),
        "--steps=1000",
    ]
    output = run(command)
    assert output.count("training on 2 worker(s)") == 1, "only worker 0 prints"
    assert output.count("weights:") == 1
    for fitted, true in zip(fitted_weights(output), [2.0, -1.0, 0.5], strict=True):
        assert abs(fitted - true) < 0.1
