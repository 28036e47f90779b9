"""What a user's launched function can do besides training: each function here
is one accident (or an ordinary surprise), run by tests/spawn/test_launch_fuzz.py.

Every function takes ``where``, a folder in which each worker, and each process
it starts, records its pid (a file named by the pid), so that the test can
check afterwards that none of them is left running.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import pyro_distributed as pd


def record(where: str, pid: int | None = None) -> None:
    Path(where, str(pid or os.getpid())).touch()


def on_rank(rank: int) -> bool:
    return pd.rank() == rank


def returns(where: str, value: Any) -> Any:
    record(where)
    pd.barrier()
    return value


def returns_rank_and_threads(where: str) -> tuple[int, int, int]:
    record(where)
    torch.ones(2**20).mul_(2)  # a parallel op: it hangs in a worker forked after OpenMP
    return pd.rank(), pd.world_size(), torch.get_num_threads()


def returns_a_big_tensor(where: str, numel: int) -> torch.Tensor:
    record(where)
    return torch.arange(numel, dtype=torch.float32)


def returns_unpicklable(where: str, rank: int | None) -> Any:
    record(where)
    pd.barrier()
    if rank is None or on_rank(rank):
        return threading.Lock()
    return 0


def returns_a_generator(where: str) -> Any:
    record(where)
    return (step for step in range(3))


def raises(where: str, rank: int | None, exception: BaseException) -> None:
    record(where)
    pd.barrier()
    if rank is None or on_rank(rank):
        raise exception
    pd.barrier()


def exits(where: str, rank: int, how: str, code: int) -> None:
    record(where)
    pd.barrier()
    if on_rank(rank):
        if how == "sys.exit":
            sys.exit(code)
        if how == "os._exit":
            os._exit(code)
        if how == "abort":
            os.abort()
        os.kill(os.getpid(), getattr(signal, how))
    pd.barrier()


def all_exit_at_once(where: str) -> None:
    record(where)
    pd.barrier()
    os._exit(3)


def hangs(where: str, rank: int | None, in_barrier_after: bool) -> None:
    """``rank`` (every worker where ``None``) spins outside any collective."""
    record(where)
    if rank is None or on_rank(rank):
        while True:
            time.sleep(0.01)
    if in_barrier_after:
        pd.barrier()


def sleeps(where: str, seconds: float) -> int:
    record(where)
    time.sleep(seconds)
    pd.barrier()
    return pd.rank()


def starts_a_subprocess(where: str, new_session: bool) -> int:
    record(where)
    child = subprocess.Popen(["sleep", "1000"], start_new_session=new_session)
    record(where, child.pid)
    pd.barrier()
    return child.pid


def forks(where: str) -> int:
    record(where)
    pid = os.fork()
    if pid == 0:
        time.sleep(1000)
        os._exit(0)
    record(where, pid)
    pd.barrier()
    return pid


def _sleep_forever() -> None:
    time.sleep(1000)


def starts_a_multiprocessing_child(where: str) -> int:
    record(where)
    child = multiprocessing.get_context("fork").Process(target=_sleep_forever)
    child.start()
    assert child.pid is not None
    record(where, child.pid)
    pd.barrier()
    return child.pid


def leaves_a_thread_running(where: str, daemon: bool) -> int:
    record(where)
    threading.Thread(target=_sleep_forever, daemon=daemon).start()
    pd.barrier()
    return 1


def prints_a_lot(where: str, lines: int) -> int:
    record(where)
    for line in range(lines):
        print(f"line {line} " + "x" * 100)
    return lines


def writes_to_stderr_and_raises(where: str) -> None:
    record(where)
    print("the last words of worker", pd.rank(), file=sys.stderr)
    raise RuntimeError(f"broken on worker {pd.rank()}")


def reads_the_environment(where: str, names: list[str]) -> dict[str, str | None]:
    record(where)
    return {name: os.environ.get(name) for name in names}


def reads_the_folder(where: str) -> str:
    record(where)
    return os.getcwd()


def launches_inside(where: str) -> Any:
    record(where)
    pd.barrier()
    return pd.launch(returns_rank_and_threads, where, workers=2).value


def shuts_the_engine_down(where: str) -> None:
    record(where)
    pd.barrier()
    pd.shutdown()


def reads_the_store(where: str, name: str) -> torch.Tensor:
    record(where)
    import pyro

    return pyro.param(name).detach()


def trains(where: str, steps: int) -> float:
    record(where)
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    def model(x: torch.Tensor) -> None:
        loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
        with pd.data_plate("data", x):
            pyro.sample("x", dist.Normal(loc, 1.0), obs=x)

    pd.set_rng_seed(0)
    x = torch.arange(100.0) / 10
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    svi = SVI(model, AutoNormal(model), optim, Trace_ELBO())
    loss = 0.0
    for _ in pd.progress(range(steps)):
        loss = svi.step(pd.shard(x))
    return loss


def iterates_a_dataloader(where: str) -> int:
    record(where)
    loader = torch.utils.data.DataLoader(range(10), batch_size=2, num_workers=2)
    return int(sum(int(batch.sum()) for batch in loader))


def prints_for(where: str, seconds: float) -> int:
    """Worker 0 prints a line every 50 ms for ``seconds``, outside any collective."""
    record(where)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        print("still going", flush=True)
        time.sleep(0.05)
    return 0


def reads_the_interpreter(where: str) -> dict[str, Any]:
    """What a worker's interpreter is set to, where a kernel may have set it."""
    import pyro

    record(where)
    return {
        "dtype": torch.get_default_dtype(),
        "draw": float(torch.rand(())),
        "module_local_params": pyro.settings.get("module_local_params"),
        "validation": pyro.settings.get("validate_infer"),
    }


def holds_the_gil(where: str) -> None:
    """A C call that never lets go of the interpreter (a regular expression
    that backtracks for ages): no Python thread of this worker runs meanwhile."""
    import re

    record(where)
    re.match(r"(a+)+$", "a" * 60 + "b")
