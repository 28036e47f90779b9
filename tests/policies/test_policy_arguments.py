"""Step policies refuse wrong arguments by name, and what they cannot keep."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd

from ..support.harness import run_workers
from ..support.policies import data, guide, model


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda: pd.LocalSGD(0), ValueError, "LocalSGD period"),
        (lambda: pd.LocalSGD(2.5), TypeError, "LocalSGD period"),
        (lambda: pd.LocalSGD(4, warmup_steps=-1), ValueError, "LocalSGD warmup_steps"),
        (lambda: pd.DiLoCo(0), ValueError, "DiLoCo period"),
        (lambda: pd.DiLoCo(8, outer_lr=0.0), ValueError, "DiLoCo outer_lr"),
        (lambda: pd.DiLoCo(8, momentum=1.0), ValueError, r"DiLoCo momentum must be in \[0, 1\)"),
        (lambda: pd.DiLoCo(8, nesterov="yes"), TypeError, "DiLoCo nesterov"),
        (lambda: pd.LocalSGD(4, period=2), TypeError, "period"),
    ],
)
def test_a_policy_with_a_wrong_argument_is_refused_by_name(
    make: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        make()


def test_an_optimizer_refuses_what_is_not_a_policy_and_the_noise_scale_beside_one() -> None:
    with pytest.raises(TypeError, match=r"step_policy must be a pyro_distributed\.StepPolicy"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), step_policy="local")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_scale needs every step's averaged gradient"):
        pd.DistributedOptimizer(
            pyro.optim.Adam({"lr": 0.1}), step_policy=pd.DiLoCo(4), noise_scale=True
        )


def test_a_policy_that_keeps_state_serves_one_optimizer() -> None:
    policy = pd.DiLoCo(4)
    first = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), step_policy=policy)
    with pytest.raises(ValueError, match="step_policy: this DiLoCo already serves another"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), step_policy=policy)
    pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), step_policy=copy.deepcopy(policy))
    del first


def test_a_state_of_another_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="LocalSGD"):
        pd.LocalSGD(4).load_state_dict({"since_sync": 7})
    with pytest.raises(ValueError, match="not a DiLoCo's"):
        pd.DiLoCo(4).load_state_dict({"since_sync": 1})
    saved = pd.DiLoCo(4).state_dict()
    pd.DiLoCo(4).load_state_dict(saved)


def _save_under_diloco(where: str) -> None:
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), step_policy=pd.DiLoCo(4))
    svi = SVI(model, guide, optim, Trace_ELBO())
    x, y = data()
    for _ in range(3):  # between two sync points
        svi.step(x, y)
    pd.save_checkpoint(Path(where) / "run.pt", optim)


def _load_without_a_policy(where: str) -> str:
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    try:
        pd.load_checkpoint(Path(where) / "run.pt", optim)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_a_policys_file_loaded_without_the_policy_is_refused_and_elsewhere_starts_afresh(
    tmp_path: Path,
) -> None:
    run_workers(_save_under_diloco, str(tmp_path))
    for answer in run_workers(_load_without_a_policy, str(tmp_path)):
        assert "holds the state of a step policy" in answer and "step_policy" in answer, answer
    # At one worker: worker 0's parameters and optimizer state, the policy afresh, said.
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(
        pyro.optim.Adam({"lr": 0.05}), step_policy=pd.DiLoCo(4), engine="local"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pd.load_checkpoint(tmp_path / "run.pt", optim) == 3
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(said) == 1 and "the step policy's and each worker's own state of 2" in said[0]
    assert optim.in_sync and optim.extension_state()["step_policy"]["since_sync"] == 0


def _nan_on_worker_1_alone() -> list[str]:
    pyro.enable_validation(False)  # a NaN datum reaches the gradient, as in a real bug
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), step_policy=pd.LocalSGD(4))
    svi = SVI(model, guide, optim, Trace_ELBO())
    x, y = data()
    caught = []
    for step in range(8):
        poisoned = x.clone()
        if step == 2 and pd.rank() == 1:
            poisoned[0, 0] = float("nan")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            svi.step(poisoned, y)
        caught += [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert all(torch.isfinite(pyro.param(n)).all() for n in ("weight", "bias"))
    return caught


def test_a_nonfinite_gradient_on_a_step_alone_skips_that_workers_step() -> None:
    quiet, warned = run_workers(_nan_on_worker_1_alone)
    assert quiet == []
    assert len(warned) == 1 and "this worker's own gradient of" in warned[0], warned
    assert "this worker skips this step" in warned[0]
