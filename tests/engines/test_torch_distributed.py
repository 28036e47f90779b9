"""The torch.distributed engine: how it is found, started, and what it refuses."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.engines import detect_engine

from ..support.harness import run_workers


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


def _threads_after_shutdown() -> tuple[list[str], list[str]]:
    """Train a few overlapped steps (the overlap opens a channel, a second gloo
    group), shut down, and list this process's gloo threads."""
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    def model(data: torch.Tensor) -> None:
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)

    data = torch.randn(8)
    # The optimizer made after the group: torch.optim imports torch's
    # functional collectives (through torch._dynamo) then, which once kept the
    # default group alive in their defaults.
    optimizer = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), overlap=True)
    svi = SVI(model, AutoNormal(model), optimizer, Trace_ELBO())
    for _ in range(3):
        svi.step(data)
    engine = pd.current_engine()
    pd.shutdown()
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    refusals = []
    for collective in (
        lambda: engine.allreduce_([torch.zeros(1)]),
        lambda: engine.allgather_object(1),
        engine.barrier,
    ):
        with pytest.raises(pd.PyroDistributedError) as refused:
            collective()
        refusals.append(str(refused.value))
    return [name for name in names if "gloo" in name], refusals


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
def test_shutdown_joins_every_gloo_thread_before_the_interpreter_finalises() -> None:
    # A group left alive at exit can abort the process after training: one of
    # its threads, releasing a finished collective's tensors, takes the GIL
    # while the interpreter finalises ("terminate called without an active
    # exception", seen after torchrun restarts). After shutdown no group's
    # thread is left, the overlap's channel included.
    for threads, refusals in run_workers(_threads_after_shutdown):
        assert threads == []
        assert all("this engine was shut down" in refused for refused in refusals), refusals


_AGAIN_AFTER_A_FAILURE = """
import os, socket
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
from pyro_distributed.engines import create_engine
import pyro_distributed as pd
first = create_engine("torch")
try:
    raise RuntimeError("a step failed")
except RuntimeError:
    first.shutdown()  # leaves its group, and the store on the port, behind
second = create_engine("torch")
print("second engine", second.world_size)
second.shutdown()
"""


def test_a_second_engine_after_a_failed_one_joins_at_the_same_port() -> None:
    """After a failure the first engine's store stays on the port, served by this
    process: the second engine under the same variables must not call it taken."""
    import subprocess
    import sys

    from ..support.notebooks import ROOT

    done = subprocess.run(
        [sys.executable, "-c", _AGAIN_AFTER_A_FAILURE],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
        env={k: v for k, v in __import__("os").environ.items() if k != "MASTER_PORT"},
    )  # fmt: skip
    assert "second engine 1" in done.stdout, done.stdout + done.stderr
