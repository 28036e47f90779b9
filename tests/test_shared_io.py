"""File work outside the engine's time-out, with every worker's failure seen by all."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pyro_distributed as pd
from pyro_distributed import shared_io

from .support.harness import run_workers


def _slow_on_one_worker(seconds: float) -> dict[str, Any]:
    pd.init("torch", timeout=seconds / 3)

    def work() -> tuple[int, str]:
        if pd.rank() == 1:
            time.sleep(seconds)
            raise OSError("disk full (injected)")
        return pd.rank() * 10, f"ok from {pd.rank()}"

    began = time.monotonic()
    outcome = shared_io.on_each_worker(pd.current_engine(), work)
    failed = shared_io.failures(outcome.reports)
    return {
        "value": outcome.value,
        "reports": outcome.reports,
        "failed": {rank: (f.kind, f.message) for rank, f in failed.items()},
        "took": time.monotonic() - began,
    }


def test_every_worker_waits_past_the_time_out_and_sees_the_failure() -> None:
    workers = run_workers(_slow_on_one_worker, 3.0, engine="")
    assert [worker["value"] for worker in workers] == [0, None]
    for worker in workers:
        # Worker 1 slept three times the engine's time-out; worker 0 waited for
        # it past that time-out (it may have started up to a second later).
        assert worker["took"] > 2.0
        assert worker["reports"][0] == "ok from 0"
        assert worker["failed"] == {1: ("error", "OSError: disk full (injected)")}


def test_work_that_outlasts_its_own_time_out_fails() -> None:
    pd.init("local")
    outcome = shared_io.on_each_worker(
        pd.current_engine(), lambda: (time.sleep(2), None), timeout=timedelta(seconds=0.2)
    )
    failed = shared_io.failures(outcome.reports)
    assert failed[0].kind == "timeout" and "still busy after 0.2 s" in failed[0].message


def test_failures_are_classified_as_the_caller_says() -> None:
    pd.init("local")

    def missing() -> tuple[None, None]:
        raise FileNotFoundError("nothing there")

    outcome = shared_io.on_each_worker(
        pd.current_engine(), missing, classify=lambda exc: type(exc).__name__
    )
    assert shared_io.describe(shared_io.failures(outcome.reports)) == (
        "worker 0: FileNotFoundError: nothing there"
    )
    assert shared_io.failures(outcome.reports)[0].kind == "FileNotFoundError"
