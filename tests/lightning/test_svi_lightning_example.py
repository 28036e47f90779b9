"""examples/svi_lightning.py, run as users run it: Lightning's launcher, 2 CPU workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..support.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "svi_lightning.py"


def run_example(*options: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["MASTER_PORT"] = str(free_port())
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--devices", "2", *options],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-6000:]}"
    return done.stdout


def weights(output: str) -> list[float]:
    # Wherever it sits: the other worker's line may be written into this one.
    match = re.search(r"weights: \[([^\]]*)\]", output)
    assert match, output
    return [float(w) for w in match.group(1).split(",")]


@pytest.mark.parametrize(
    "options",
    [[], ["--local"], ["--local", "--sparse"]],
    ids=["global", "local-latents", "local-latents-sparse-steps"],
)
def test_the_lightning_example_recovers_the_weights_on_two_workers(options: list[str]) -> None:
    local = "--local" in options
    output = run_example(*options)
    assert "trained on 2 worker(s)" in output
    for fitted, true in zip(weights(output), [2.0, -1.0, 0.5], strict=True):
        assert abs(fitted - true) < 0.1, output
    if local:  # each worker holds its own half of the per-row parameters
        for rank in (0, 1):
            assert f"worker {rank}: holds 1000 of 2000 rows" in output, output
        stepped = "only each batch's rows" if "--sparse" in options else "all its rows"
        assert output.count(f"stepped {stepped}") == 2, output
