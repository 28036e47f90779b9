"""The VAE example, run as users run it: under the real torchrun on two workers, and alone.

A few steps only: the point is that every piece runs end to end (sharded
loading, distributed SVI, the held-out ELBO, the figure and the checkpoint),
and that only worker 0 speaks.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from pyro_distributed.checkpoint.files import load_file

from .support.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vae_digits.py"
BIN = Path(sys.executable).parent
STEPS = 6
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_example(launcher: list[str], tmp_path: Path) -> tuple[str, str]:
    """Run the example for a few steps in ``tmp_path``; its stdout and stderr.

    The output is decoded by hand: text mode would turn the carriage returns
    with which tqdm redraws its bar into newlines.
    """
    command = [
        *launcher,
        str(EXAMPLE),
        f"--max-steps={STEPS}",
        f"--figure={tmp_path / 'vae.png'}",
        f"--checkpoint={tmp_path / 'vae.pt'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        command, capture_output=True, timeout=120, env=env, cwd=tmp_path, check=False
    )
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, f"exit {done.returncode}\n{stdout}\n{stderr}"
    return stdout, stderr


def check_outputs(output: tuple[str, str], tmp_path: Path, workers: int) -> None:
    stdout, stderr = output
    assert stdout.count(f"training on {workers} worker(s)") == 1, stdout
    assert stdout.count("training on") == 1, "only worker 0 prints"
    assert stdout.count(f"trained {STEPS} steps") == 1, stdout

    # tqdm redraws its bar with carriage returns and ends it with one newline:
    # one bar line in all, and it reached the last step.
    bars = [line for line in stderr.split("\n") if "training:" in line]
    assert len(bars) == 1, f"expected worker 0's progress bar only:\n{stderr}"
    assert f"{STEPS}/{STEPS}" in bars[0].split("\r")[-1], bars[0]

    # With two workers the noise scale is measured, and its reading printed once.
    readings = stdout.count(f"gradient noise scale over {STEPS} steps")
    assert readings == (1 if workers > 1 else 0), stdout

    elbos = re.findall(r"^held-out ELBO per image: (\S+) nats$", stdout, re.MULTILINE)
    assert len(elbos) == 1, stdout
    assert math.isfinite(float(elbos[0])), elbos
    # The held-out set is split across the workers, not repeated on each.
    assert stdout.count(f"evaluated 297 held-out images on {workers} worker(s)") == 1, stdout

    figure = tmp_path / "vae.png"
    assert figure.read_bytes()[:8] == PNG_MAGIC
    from matplotlib.image import imread

    pixels = imread(figure)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100, pixels.shape

    checkpoint = load_file(tmp_path / "vae.pt")
    assert checkpoint["format"] == "pyro_distributed.checkpoint"
    assert checkpoint["world_size"] == workers
    assert checkpoint["num_steps"] == STEPS
    names = set(checkpoint["param_store"]["params"])
    assert {"encoder$$$hidden.weight", "decoder$$$logits.bias"} <= names, sorted(names)

    assert sorted(path.name for path in tmp_path.iterdir()) == ["vae.png", "vae.pt"]


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
