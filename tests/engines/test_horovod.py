"""The horovod engine under the real ``horovodrun --gloo``: what it reports, and the
library's other collectives (evaluation, prediction, flags, local parameters,
faults) on it, against the torch engine and one process.

All scenarios of one suite run in a single horovodrun launch (starting Horovod
costs seconds); each test then checks its own scenario's results. Horovod is
built by ``scripts/test.sh``; these tests fail, not skip, without it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pyro_distributed as pd

from ..support.collectives import flags
from ..support.faults import drift, nan_on_worker_one, uneven_epoch
from ..support.harness import HorovodSuites, one_pytest_worker, run_workers
from ..support.loss import losses
from ..support.ownership import gathered_and_local_rows
from ..support.ownership import train as train_locally
from ..support.predictive import by_data, by_samples

pytestmark = [pytest.mark.horovod, one_pytest_worker(__name__)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def engine_view() -> dict[str, Any]:
    engine = pd.current_engine()
    gathered = engine.allgather_object({"rank": pd.rank(), "payload": "x" * (10 * pd.rank())})
    pd.barrier()
    return {
        "engine": engine.name,
        "rank": pd.rank(),
        "world": pd.world_size(),
        "mean": pd.all_mean(float(pd.rank())),
        "gathered": gathered,
        "auto": pd.init("auto") is engine,
    }


SUITES = HorovodSuites(
    {
        "faults": [
            ("nan_skip", nan_on_worker_one, ("skip",)),
            ("drift", drift, ("param",)),
            ("uneven", uneven_epoch, ()),
        ],
        "evaluation": [
            ("engine", engine_view, ()),
            ("losses", losses, (2,)),
            ("by_samples", by_samples, (0, "main")),
            ("by_data", by_data, (1,)),
            ("flags", flags, ()),
            ("owned", train_locally, (True, "adam", "hand")),
            ("replicated", train_locally, (False, "adam", "hand")),
            ("gathered", gathered_and_local_rows, ()),
        ],
    }
)
outcome = SUITES.outcome


def test_engine_auto_picks_horovod_under_horovodrun() -> None:
    for rank, view in enumerate(outcome("engine", suite="evaluation")):
        assert (view["engine"], view["rank"], view["world"], view["auto"]) == (
            "horovod",
            rank,
            2,
            True,
        )
        assert view["mean"] == 0.5
        assert view["gathered"] == [{"rank": 0, "payload": ""}, {"rank": 1, "payload": "x" * 10}]


def test_local_parameters_on_horovod_are_the_replicated_numbers() -> None:
    owned = outcome("owned", suite="evaluation")
    replicated = outcome("replicated", suite="evaluation")
    for rank, (mine, reference) in enumerate(zip(owned, replicated, strict=True)):
        indices, _ = mine["local"]["z_loc"]
        assert torch.equal(mine["values"]["mu_loc"], reference["values"]["mu_loc"])
        assert torch.equal(mine["values"]["z_loc"], reference["values"]["z_loc"][indices]), rank
    gathered = outcome("gathered", suite="evaluation")
    assert torch.equal(gathered[0]["gathered"], replicated[0]["values"]["z_loc"])
    assert gathered[1]["gathered"] is None


def test_evaluation_prediction_and_flags_on_horovod_match_one_process() -> None:
    for result in outcome("losses", suite="evaluation"):
        for kind in ("global", "batch"):
            assert result[kind] == pytest.approx(result[f"{kind}_reference"], rel=1e-6)
    for scenario, args in (("by_samples", (0, "main")), ("by_data", (1,))):
        gathered, nothing = outcome(scenario, suite="evaluation")
        (alone,) = run_workers(SCENARIO_FUNCTIONS[scenario], *args, world_size=1)
        assert nothing is None
        assert gathered.keys() == alone.keys()
        for name, value in alone.items():
            assert gathered[name].shape == value.shape, name
        # Seeded sample chunks are the same draws at any W; split by data, the
        # deterministic site shows every point in its place.
        exact = alone.keys() if scenario == "by_samples" else ["mean"]
        assert all(torch.equal(gathered[name], alone[name]) for name in exact)
    assert (
        outcome("flags", suite="evaluation")
        == [{"any": True, "all": False, "all_true": True, "none": False}] * 2
    )


SCENARIO_FUNCTIONS = {"by_samples": by_samples, "by_data": by_data}


def test_nan_skip_drift_and_uneven_epochs_on_horovod() -> None:
    first, second = outcome("nan_skip", suite="faults")
    before, skipped, _ = first["values"]
    assert torch.equal(before["p"], skipped["p"]) and torch.equal(
        second["values"][1]["p"], skipped["p"]
    )
    drift_messages = outcome("drift", suite="faults")
    assert drift_messages[0] == drift_messages[1]
    assert "workers have drifted apart: parameter 'p' differs" in drift_messages[0]
    uneven = outcome("uneven", suite="faults")
    assert uneven[0]["used"] == uneven[1]["used"] == 6


def test_a_killed_horovod_worker_ends_the_job_quickly_and_is_named(tmp_path: Any) -> None:
    script = tmp_path / "die.py"
    script.write_text(
        "import os, signal, torch, pyro, pyro_distributed as pd\n"
        "pd.init()\n"
        "p = pyro.param('p', torch.ones(2)).unconstrained()\n"
        "optim = pd.DistributedOptimizer(pyro.optim.SGD({'lr': 0.1}))\n"
        "for step in range(100):\n"
        "    if step == 5 and pd.rank() == 1:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    p.sum().backward(); optim([p]); p.grad = None\n"
    )
    command = [
        str(BIN / "horovodrun"),
        "--gloo",
        "-np",
        "2",
        "-H",
        "localhost:2",
        sys.executable,
        str(script),
    ]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert "Process 1 exit with status code 137" in done.stdout + done.stderr
    assert time.monotonic() - start < 60
