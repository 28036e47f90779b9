"""The examples, run as users run them: a plain process, and the real torchrun."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .support.examples import (
    BIN,
    EXAMPLE,
    QUICKSTART,
    QUICKSTART_WIDTH,
    ROOT,
    fitted_weights,
    python_or_torchrun,
    quickstart_posterior,
    run,
)
from .support.harness import free_port


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


def horovodrun(*script_and_args: str) -> str:
    """Run under the real horovodrun; return the output without its "[rank]<stdout>:" tags."""
    command = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2"]
    output = run([*command, sys.executable, *script_and_args])
    return re.sub(r"^\[\d+\]<stdout>:", "", output, flags=re.MULTILINE)


@pytest.mark.horovod
def test_regression_example_runs_under_horovodrun_on_two_workers() -> None:
    output = horovodrun(str(EXAMPLE), "--steps=600")
    assert output.count("training on 2 worker(s)") == 1, "only worker 0 prints"
    for fitted, true in zip(fitted_weights(output), [2.0, -1.0, 0.5], strict=True):
        assert abs(fitted - true) < 0.1


def final_params(output: str) -> dict[int, dict[str, Any]]:
    lines = [json.loads(line) for line in output.splitlines() if line.startswith('{"rank"')]
    return {line["rank"]: line for line in lines}


@pytest.mark.horovod
def test_script_written_for_pyros_class_runs_unchanged_with_ours(tmp_path: Path) -> None:
    original = ROOT / "tests" / "scripts" / "pyro_horovod_script.py"
    source = original.read_text()
    assert source.count("from pyro.optim import HorovodOptimizer") == 1
    ours = tmp_path / "ours.py"
    ours.write_text(
        source.replace(
            "from pyro.optim import HorovodOptimizer",
            "from pyro_distributed import HorovodOptimizer",
        )
    )
    with_pyros = final_params(horovodrun(str(original)))
    with_ours = final_params(horovodrun(str(ours)))
    assert with_ours.keys() == {0, 1}
    assert with_ours[0]["params"] == with_ours[1]["params"], "workers diverged"
    # Same algorithm: Adam on the averaged gradient. Only summation order may differ.
    for name, values in with_pyros[0]["params"].items():
        ours_values = torch.tensor(with_ours[0]["params"][name])
        assert torch.allclose(ours_values, torch.tensor(values), atol=1e-3), name


@pytest.mark.parametrize("workers", [1, 2])
def test_quickstart_gives_the_posterior_of_all_the_data(workers: int) -> None:
    launcher = python_or_torchrun(workers)
    output = run([*launcher, str(QUICKSTART)])
    means, widths = quickstart_posterior(output)
    for mean, true in zip(means, [2.0, -1.0, 0.5], strict=True):
        assert abs(mean - true) < 0.02
    for width in widths:
        assert abs(width / QUICKSTART_WIDTH - 1) < 0.2, widths
    assert output.count("predictions: (1000, 1001)") == 1, "gathered on worker 0 only"


RANDOM_EFFECTS = ROOT / "examples" / "random_effects.py"


@pytest.mark.parametrize(("workers", "local_updates"), [(1, "dense"), (2, "dense"), (2, "sparse")])
def test_random_effects_example_recovers_the_effects(workers: int, local_updates: str) -> None:
    launcher = python_or_torchrun(workers)
    flags = ["--groups=2000", "--batch=200", "--steps=1500", f"--local-updates={local_updates}"]
    output = run([*launcher, str(RANDOM_EFFECTS), *flags])
    assert output.count(f"worker 0 holds {2000 // workers} of 2000 groups' parameters") == 1
    match = re.search(r"correlation with the truth (\S+) \(at best (\S+)\)", output)
    assert match, output
    assert float(match.group(1)) > float(match.group(2)) - 0.03, output
    mu = re.search(r"^mu (\S+),", output, re.MULTILINE)
    assert mu and abs(float(mu.group(1)) - 3.0) < 0.15, output


SVI_TORCH = ROOT / "examples" / "svi_torch.py"


def svi_torch_posterior(output: str) -> dict[str, float]:
    match = re.search(
        r"^posterior: slope (\S+) \+- (\S+), bias (\S+), scale (\S+)$", output, re.MULTILINE
    )
    assert match, output
    return dict(
        zip(["slope", "slope_sd", "bias", "scale"], map(float, match.groups()), strict=True)
    )


def test_svi_torch_example_gives_the_same_posterior_on_two_workers_as_on_one() -> None:
    one = svi_torch_posterior(run([sys.executable, str(SVI_TORCH)]))
    two_output = run([*python_or_torchrun(2), str(SVI_TORCH)])
    assert two_output.count("training on 2 worker(s)") == 1, "only worker 0 prints"
    two = svi_torch_posterior(two_output)
    for posterior in (one, two):  # the truth: slope 1.5, bias -0.5, scale 0.7
        assert abs(posterior["slope"] - 1.5) < 0.05, posterior
        assert abs(posterior["bias"] + 0.5) < 0.05, posterior
        assert abs(posterior["scale"] - 0.7) < 0.05, posterior
    for name in ("slope", "bias", "scale"):
        assert abs(one[name] - two[name]) < 0.01, (one, two)
    assert abs(two["slope_sd"] / one["slope_sd"] - 1) < 0.25, (one, two)


def test_the_topk_hook_example_resumes_bitwise_under_torchrun() -> None:
    # The example asserts the resumed run equals the straight one, bitwise.
    output = run([*python_or_torchrun(2), str(ROOT / "examples" / "topk_hook.py")])
    assert "trained on 2 worker(s), sending 10% of each bucket" in output
    assert "resumed run equals the straight run" in output
    error = float(re.search(r"largest weight error ([0-9.]+)", output).group(1))  # type: ignore[union-attr]
    assert error < 0.1
