"""pd.launch in a real Jupyter kernel (ipykernel, driven by nbclient), against torchrun.

Each test executes a notebook, as a user's notebook server would, and
compares what the kernel holds afterwards with what the same code gives under
the real torchrun, bitwise.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

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
        timeout=300,  # the cells may take their time on a machine whose every core is busy
        kernel_name="python3",
        allow_errors=True,
        interrupt_on_timeout=True,
        resources={"metadata": {"path": str(ROOT)}},
    )
    errors: list[BaseException] = []

    def execute() -> None:
        try:  # an event loop of this thread's own, closed at the end
            asyncio.run(client.async_execute())
        except BaseException as error:  # raised below, in the test's own thread
            errors.append(error)

    running = threading.Thread(target=execute)
    running.start()
    # The notebook's stop button, pressed once both workers of the launch that
    # runs forever have started: what Jupyter's interrupt sends the kernel.
    deadline = time.monotonic() + 240
    while len(list(pids.iterdir())) < 2 and running.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list(pids.iterdir())) == 2 and running.is_alive(), errors
    provisioner: Any = client.km.provisioner  # jupyter_client's LocalProvisioner
    if provisioner.pgid:
        os.killpg(provisioner.pgid, signal.SIGINT)
    else:
        provisioner.process.send_signal(signal.SIGINT)
    running.join(timeout=600)
    assert not running.is_alive() and not errors, errors
    failed, interrupted, after = (output_of(cell) for cell in notebook.cells)
    assert "PyroDistributedError" in failed and "worker 1 of 2 raised" in failed, failed
    assert "ValueError: bad data on worker 1" in failed, failed
    assert "KeyboardInterrupt" in interrupted, interrupted
    assert "the kernel goes on" in after
    started = [int(path.name) for path in pids.iterdir()]
    assert len(started) == 2
    left = [pid for pid in started if process_is_alive(pid)]
    assert left == [], subprocess.run(["ps", "-fp", *map(str, left)], capture_output=True).stdout


def _docs_pattern(rows: int, steps: int) -> str:
    """The notebooks page's pattern, at ``rows`` rows and ``steps`` steps a launch."""
    return (
        "import pyro\nimport pyro.distributions as dist\nimport torch\n"
        "from pyro.infer import SVI, Trace_ELBO\nfrom pyro.infer.autoguide import AutoNormal\n"
        "import pyro_distributed as pd\n"
        f"x = torch.randn({rows}, 3, generator=torch.Generator().manual_seed(0))\n"
        "y = x @ torch.tensor([2.0, -1.0, 0.5])\n"
        "def model(x, y=None):\n"
        "    w = pyro.sample('w', dist.Normal(0.0, 10.0).expand([3]).to_event(1))\n"
        "    with pd.data_plate('data', x):\n"
        "        pyro.sample('y', dist.Normal(x @ w, 0.3), obs=y)\n"
        "guide = AutoNormal(model)\n"
        "def train(num_steps, seed=None):\n"
        "    if seed is not None:\n"
        "        pd.set_rng_seed(seed)\n"
        "    optim = pd.DistributedOptimizer(pyro.optim.Adam({'lr': 0.02}))\n"
        "    svi = SVI(model, guide, optim, Trace_ELBO())\n"
        "    for step in pd.progress(range(num_steps), desc='svi'):\n"
        "        loss = svi.step(pd.shard(x), pd.shard(y))\n"
        "    return loss, torch.get_num_threads()\n"
        f"launched = pd.launch(train, {steps}, 0, workers=2, time_limit=120)\n"
        "guide(x, y)\n"
        "print('first', launched.value)\n"
    )


@pytest.mark.slow
def test_a_kernel_that_has_computed_launches_twice_with_its_default_threads() -> None:
    """GNU OpenMP's pool does not survive fork: a kernel that ran one parallel op
    used to leave forked workers waiting forever in their first one."""
    notebook = execute(
        notebook_of(
            "import os\nos.environ.pop('OMP_NUM_THREADS', None)  # the machine's default\n"
            "import torch\ntorch.ones(2**22).mul_(2)\n"
            "print('kernel threads', torch.get_num_threads())",
            _docs_pattern(100_000, 20),
            "second = pd.launch(train, 20, workers=2, resume=launched, time_limit=120)\n"
            "print('second', second.value, guide.median()['w'].tolist())",
            "def alone():\n"
            "    torch.ones(2**22).mul_(2)\n"
            "    return torch.get_num_threads()\n"
            "print('alone', pd.launch(alone, workers=1, time_limit=120).value)",
        ),
        timeout=180,
    )
    kernel, first, second, alone = (output_of(cell) for cell in notebook.cells)
    cores = len(os.sched_getaffinity(0))
    assert f"kernel threads {cores}" in kernel, kernel
    assert re.search(rf"first \(-?[\d.]+, {max(1, cores // 2)}\)", first), first
    assert re.search(r"second \(-?[\d.]+, \d+\) \[", second), second
    assert f"alone {cores}" in alone, alone  # one worker: every core


@pytest.mark.slow
def test_progress_in_a_kernel_is_one_widget_bar_that_the_workers_fill() -> None:
    notebook = execute(notebook_of(_docs_pattern(1_000, 30)), timeout=180)
    (cell,) = notebook.cells
    assert "first (" in output_of(cell), output_of(cell)
    views = [
        output
        for output in cell.outputs
        if "application/vnd.jupyter.widget-view+json" in output.get("data", {})
    ]
    assert len(views) == 1, cell.outputs
    state = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [
        model["state"] for model in state.values() if model["model_name"] == "FloatProgressModel"
    ]
    assert [(bar["value"], bar["max"]) for bar in bars] == [(30, 30)]
