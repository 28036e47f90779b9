"""The torch.distributed engine: how it is found, started, and what it refuses."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.engines import detect_engine

from ..harness import run_workers


@pytest.fixture(autouse=True)
def _no_engine_running():
    """Each test starts from no engine (another module may have left a local one) and
    leaves none behind."""
    pd.shutdown()
    yield
    pd.shutdown()


def test_torch_engine_without_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert detect_engine() == "local"
    with pytest.raises(pd.PyroDistributedError, match="torchrun --nproc-per-node"):
        pd.init("torch")


def _reuse_user_group() -> tuple[str, int, bool]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    engine = pd.init("auto")
    mean = pd.all_mean(float(pd.rank()))
    pd.shutdown()
    still_there = dist.is_initialized()  # the user's group is the user's to destroy
    dist.destroy_process_group()
    return engine.name, int(mean * 2), still_there


def test_torch_engine_reuses_a_group_the_user_initialised() -> None:
    for name, doubled_mean, still_there in run_workers(_reuse_user_group, engine=""):
        assert (name, doubled_mean, still_there) == ("torch", 1, True)


def non_cpu_tensor_on_gloo() -> str:
    with pytest.raises(pd.PyroDistributedError) as info:
        pd.current_engine().allreduce_([torch.zeros(2, device="meta")])
    return str(info.value)


def test_non_cpu_tensors_on_a_gloo_only_group_are_refused() -> None:
    # No GPU here: a "meta" tensor takes the same path a CUDA tensor would.
    message = run_workers(non_cpu_tensor_on_gloo)[0]
    assert "a meta tensor cannot travel on this process group (backend 'gloo'" in message
