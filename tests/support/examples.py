"""The examples as users run them: the command that starts a script, and
what its output must say. Shared by the tests of each launcher
(``tests/test_examples.py``, ``tests/test_vae_example.py``, and the tests
under ``mpiexec``, Slurm and in notebooks)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from pyro_distributed.checkpoint.files import load_file

from .harness import free_port

ROOT = Path(__file__).resolve().parents[2]
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


QUICKSTART = ROOT / "examples" / "quickstart.py"


def python_or_torchrun(workers: int) -> list[str]:
    """The command that starts a script as one process, or as ``workers`` under torchrun."""
    if workers == 1:
        return [sys.executable]
    return [
        str(BIN / "torchrun"),
        f"--nproc-per-node={workers}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
    ]


#: sigma / sqrt(N): the posterior width of each weight with 10,000 rows. A
#: plate sized by one of two shards would give sqrt(2) times this.
QUICKSTART_WIDTH = 0.3 / 10_000**0.5


def quickstart_posterior(output: str) -> tuple[list[float], list[float]]:
    # No "$": another worker's line may follow on the same line (see tests/engines/test_slurm.py).
    match = re.search(r"^w: mean \[([^]]*)\] sd \[([^]]*)\]", output, re.MULTILINE)
    assert match, output
    return [float(v) for v in match.group(1).split(",")], [
        float(v) for v in match.group(2).split(",")
    ]


VAE_EXAMPLE = ROOT / "examples" / "vae_digits.py"
#: The steps of each run of the VAE example.
VAE_STEPS = 6
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_example(launcher: list[str], tmp_path: Path) -> tuple[str, str]:
    """Run the example for a few steps in ``tmp_path``; its stdout and stderr.

    The output is decoded by hand: text mode would turn the carriage returns
    with which tqdm redraws its bar into newlines.
    """
    command = [
        *launcher,
        str(VAE_EXAMPLE),
        f"--max-steps={VAE_STEPS}",
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
    assert stdout.count(f"trained {VAE_STEPS} steps") == 1, stdout

    # tqdm redraws its bar with carriage returns and ends it with one newline:
    # one bar line in all, and it reached the last step.
    bars = [line for line in stderr.split("\n") if "training:" in line]
    assert len(bars) == 1, f"expected worker 0's progress bar only:\n{stderr}"
    assert f"{VAE_STEPS}/{VAE_STEPS}" in bars[0].split("\r")[-1], bars[0]

    # With two workers the noise scale is measured, and its reading printed once.
    readings = stdout.count(f"gradient noise scale over {VAE_STEPS} steps")
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
    assert checkpoint["num_steps"] == VAE_STEPS
    names = set(checkpoint["param_store"]["params"])
    assert {"encoder$$$hidden.weight", "decoder$$$logits.bias"} <= names, sorted(names)

    assert sorted(path.name for path in tmp_path.iterdir()) == ["vae.png", "vae.pt"]


#: Runs the script named first as ``__main__``, then reports what this task joined.
REPORT = """
import hashlib, runpy, sys
import pyro
import pyro_distributed as pd
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
engine = pd.current_engine()
digest = hashlib.sha256()
store = pyro.get_param_store()
for name in sorted(store.keys()):
    digest.update(name.encode())
    digest.update(store[name].detach().cpu().contiguous().numpy().tobytes())
sys.stdout.write(f"task {engine.rank} local {engine.local_rank} engine {engine.name} "
                 f"world {engine.world_size} params {digest.hexdigest()}\\n")
sys.stdout.flush()
"""


# Not anchored to a line: an unbuffered print() writes its text and its newline
# in two writes, and the launcher may put another task's line between them.
_TASK = re.compile(r"task (\d+) local (\d+) engine (\S+) world (\d+) params ([0-9a-f]{64})")


def tasks(output: str) -> dict[int, dict[str, Any]]:
    """What each task reported, by rank (each rank once)."""
    found = [match.groups() for match in _TASK.finditer(output)]
    reports = {
        int(rank): {"local": int(local), "engine": engine, "world": int(world), "params": params}
        for rank, local, engine, world, params in found
    }
    assert len(reports) == len(found), output
    return reports


def assert_one_model(
    output: str, engine: str, world_size: int, per_node: int | None = None
) -> dict[int, dict[str, Any]]:
    """Every task joined ``engine`` in one world of ``world_size`` (``per_node``
    tasks on each node, all on one by default) and ends with the same
    parameters; worker 0 alone printed the posterior of all the data."""
    reports = tasks(output)
    assert sorted(reports) == list(range(world_size)), output
    for rank, report in reports.items():
        assert (report["engine"], report["world"]) == (engine, world_size), output
        assert report["local"] == rank % (per_node or world_size), output
    assert len({report["params"] for report in reports.values()}) == 1, "workers diverged"
    # tests/test_examples.py's check of the example, on every launcher.
    assert output.count("predictions: (1000, 1001)") == 1, "gathered on worker 0 only"
    assert output.count("step 0: loss") == 1, "only worker 0 prints"
    means, widths = quickstart_posterior(output)
    for mean, true in zip(means, [2.0, -1.0, 0.5], strict=True):
        assert abs(mean - true) < 0.02, means
    for width in widths:
        assert abs(width / QUICKSTART_WIDTH - 1) < 0.2, widths
    return reports
