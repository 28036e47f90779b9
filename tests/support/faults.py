"""Worker functions that go wrong on purpose: a worker killed, raising or hanging
at a known step, a NaN on one worker, an uneven last batch, workers that
drift apart. Shared by the tests of each engine (``tests/test_faults.py``,
``tests/optim/test_consistency.py``, and the same faults on Horovod and MPI)."""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import pyro
import torch

import pyro_distributed as pd

from .models import param_values, train_steps


def die_at_step_five(how: str, checkpoint: str) -> dict[str, Any]:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    train_steps(optim, 3)
    pd.save_checkpoint(checkpoint, optim)

    def fault(step: int) -> None:
        if pd.rank() == 1 and step == 5:
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "raise":
                raise RuntimeError("worker 1 failed on purpose")
            time.sleep(10)  # "hang": alive, but not taking part for longer than the time-out

    start = time.monotonic()
    try:
        train_steps(optim, 10, fault)
    except pd.PyroDistributedError as err:
        return {"message": str(err), "elapsed": time.monotonic() - start}
    return {"message": "no error", "elapsed": time.monotonic() - start}


def nan_on_worker_one(policy: str) -> dict[str, Any]:
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.1}), nonfinite=policy)  # type: ignore[arg-type]
    p = pyro.param("p", torch.ones(2)).unconstrained()
    q = pyro.param("q", torch.ones(2)).unconstrained()
    values = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            scale = float("nan") if (step == 1 and pd.rank() == 1) else 1.0
            ((p * scale).sum() + q.sum()).backward()
            try:
                optim([p, q])
            except pd.PyroDistributedError as err:
                return {"raised": str(err)}
            p.grad = q.grad = None
            values.append(param_values())
    return {"values": values, "warnings": [str(w.message) for w in caught]}


def uneven_epoch() -> dict[str, Any]:
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.1}))
    p = pyro.param("p", torch.zeros(2)).unconstrained()
    my_batches = [torch.ones(2) * (i + 1) for i in range(3 if pd.rank() == 0 else 5)]
    used = 0
    for _ in range(2):  # epochs
        for batch in pd.even_batches(my_batches):
            (p * batch).sum().backward()
            optim([p])
            p.grad = None
            used += 1
    return {"used": used, "params": param_values()}


def drift(what: str) -> str:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), check_every=3)
    train_steps(optim, 2)
    pd.assert_in_sync(optim)  # in sync so far
    p = pyro.param("p").unconstrained()
    if pd.rank() == 1:
        with torch.no_grad():
            if what == "param":
                p.add_(1e-6)
            else:
                next(iter(optim.optim_objs.values())).state[p]["exp_avg"].add_(1.0)
    try:
        train_steps(optim, 1)  # the third step runs the periodic check
    except pd.PyroDistributedError as err:
        return str(err)
    return "no error"
