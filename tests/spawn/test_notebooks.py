"""pd.launch in a real Jupyter kernel (ipykernel, driven by nbclient), against torchrun.

Each test executes a notebook, as a user's notebook server would, and
compares what the kernel holds afterwards with what the same code gives under
the real torchrun, bitwise.
"""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from pyro_distributed.engines.base import process_is_alive

from ..support.examples import python_or_torchrun
from ..support.harness import run_script
from ..support.notebooks import ROOT, execute, notebook_of, output_of
from .scripts import owned_rows

QUICKSTART_NOTEBOOK = ROOT / "examples" / "quickstart_notebook.ipynb"


def _result_lines(output: str) -> list[str]:
    return re.findall(r"^(?:step \d+: loss .*|w: mean .*|held-out ELBO .*)$", output, re.M)


def test_the_quickstart_notebook_trains_as_the_script_does_under_torchrun() -> None:
    notebook = execute(nbformat.read(QUICKSTART_NOTEBOOK, as_version=4))
    kernel = "".join(output_of(cell, ("stdout",)) for cell in notebook.cells)
    assert "Error" not in kernel, kernel[-3000:]
    code, script = run_script(
        [*python_or_torchrun(2), str(ROOT / "examples" / "quickstart.py")], ROOT, 300
    )
    assert code == 0, script
    # Every printed number, the posterior's mean and width to the last bit included.
    assert _result_lines(kernel) == _result_lines(script) != [], (kernel, script)
    # And the guide made in the kernel holds the trained weights.
    medians = re.search(r"\{'w': \[([^]]*)\]", kernel)
    assert medians is not None, kernel[-2000:]
    weights = [float(value) for value in medians.group(1).split(",")]
    assert weights == pytest.approx([2.0, -1.0, 0.5], abs=0.02)


STEPS = 6


@pytest.mark.slow
def test_owned_rows_and_a_resumed_launch_in_a_kernel_equal_torchrun_bitwise(
    tmp_path: Path,
) -> None:
    save = "torch.save({{name: pyro.param(name).detach() for name in NAMES}}, {!r})"
    notebook = execute(
        notebook_of(
            "import pyro, torch\n"
            "from pyro.infer import SVI, Trace_ELBO\n"
            "import pyro_distributed as pd\n"
            "from tests.local.test_ownership import data, guide, model\n"
            f"NAMES = {owned_rows.NAMES!r}",
            inspect.getsource(owned_rows.train),  # defined in the notebook itself
            f"launched = pd.launch(train, {STEPS}, 0, workers=2)\n"
            + save.format(str(tmp_path / "once.pt")),
            f"pyro.clear_param_store()\npd.launch(train, {2 * STEPS}, 0, workers=2)\n"
            + save.format(str(tmp_path / "straight.pt")),
            f"pyro.clear_param_store()\nfirst = pd.launch(train, {STEPS}, 0, workers=2)\n"
            f"second = pd.launch(train, {STEPS}, workers=2, resume=first)\n"
            "print('steps', second.value)\n" + save.format(str(tmp_path / "resumed.pt")),
        )
    )
    kernel = "".join(output_of(cell) for cell in notebook.cells)
    assert "Error" not in kernel and f"steps {2 * STEPS}" in kernel, kernel[-3000:]
    code, output = run_script(
        [
            *python_or_torchrun(2),
            str(ROOT / "tests" / "spawn" / "scripts" / "owned_rows.py"),
            str(STEPS),
            str(tmp_path / "torchrun.pt"),
        ],
        ROOT,
        300,
    )
    assert code == 0, output
    by_torchrun = torch.load(tmp_path / "torchrun.pt")
    once, straight, resumed = (
        torch.load(tmp_path / f"{name}.pt") for name in ("once", "straight", "resumed")
    )
    for name in owned_rows.NAMES:
        assert torch.equal(once[name], by_torchrun[name]), name
        assert torch.equal(resumed[name], straight[name]), name


@pytest.mark.slow
def test_a_workers_exception_and_an_interrupt_stop_every_worker(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    notebook = notebook_of(
        "import os, time\nimport pyro_distributed as pd\n"
        "def fails():\n"
        "    pd.barrier()\n"
        "    if pd.rank() == 1:\n"
        "        raise ValueError('bad data on worker 1')\n"
        "    pd.barrier()\n"
        "pd.launch(fails, workers=2)",
        "def forever(where):\n"
        "    open(os.path.join(where, str(os.getpid())), 'w').close()\n"
        "    while True:\n"
        "        pd.barrier()\n"
        "        time.sleep(0.05)\n"
        f"pd.launch(forever, {str(pids)!r}, workers=2)",
        "print('the kernel goes on')",
    )
    client = NotebookClient(
        notebook,
        timeout=20,  # then nbclient interrupts the kernel: the notebook's stop button
        kernel_name="python3",
        allow_errors=True,
        interrupt_on_timeout=True,
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()
    failed, interrupted, after = (output_of(cell) for cell in notebook.cells)
    assert "PyroDistributedError" in failed and "worker 1 of 2 raised" in failed, failed
    assert "ValueError: bad data on worker 1" in failed, failed
    assert "KeyboardInterrupt" in interrupted, interrupted
    assert "the kernel goes on" in after
    started = [int(path.name) for path in pids.iterdir()]
    assert len(started) == 2
    left = [pid for pid in started if process_is_alive(pid)]
    assert left == [], subprocess.run(["ps", "-fp", *map(str, left)], capture_output=True).stdout
