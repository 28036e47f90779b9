"""pd.launch against what a user's function and environment can do: each case ends
within its bound with the right result or a named error, and leaves no process
and no launch folder behind.

Each worker (and each process a worker starts) records its pid, and after each
case every one of them must be gone within seconds, with no child of this
process left and no launch folder of this process in the temporary directory.
Signals to the launching process itself, which would end pytest, are in
tests/spawn/test_orphans.py.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.engines.base import process_is_alive
from pyro_distributed.spawn import folders

from .scripts import accidents as a


def _ok(check: Callable[[Any], bool]) -> tuple[str, Callable[[Any], bool]]:
    return ("ok", check)


def _error(kind: type[BaseException], pattern: str) -> tuple[type[BaseException], str]:
    return (kind, pattern)


@dataclass
class Case:
    """``fn(where, *args)`` launched with ``options``: it must return a value that
    passes the check, or raise ``kind`` matching the pattern, within ``bound`` s."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    expect: tuple[Any, Any]
    options: dict[str, Any] = field(default_factory=dict)
    bound: float = 30.0
    #: Run in a thread of this process once the workers have recorded their pids.
    meanwhile: Callable[[list[int]], None] | None = None
    environment: dict[str, str | None] = field(default_factory=dict)
    #: Run in this process before the launch, undone after it (returns the undo).
    setup: Callable[[], Callable[[], None]] | None = None


def _closure_over(tensor: torch.Tensor) -> Callable[[str], torch.Tensor]:
    """A function no worker can import: it travels by value, with what it holds."""

    def doubled(where: str) -> torch.Tensor:
        a.record(where)
        return tensor * 2

    return doubled


def _set_the_interpreter() -> Callable[[], None]:
    """Set here what a kernel may set at its top."""
    dtype = torch.get_default_dtype()
    settings = pyro.settings.get()
    torch.set_default_dtype(torch.float64)
    pyro.settings.set(module_local_params=True, validate_infer=False)
    torch.manual_seed(123)

    def undo() -> None:
        torch.set_default_dtype(dtype)
        pyro.settings.set(**settings)

    return undo


def _interpreter_here() -> dict[str, Any]:
    torch.manual_seed(123)
    return {
        "dtype": torch.float64,
        "draw": float(torch.rand((), dtype=torch.float64)),
        "module_local_params": True,
        "validation": False,
    }


def _signal_one_worker(signum: int) -> Callable[[list[int]], None]:
    def send(pids: list[int]) -> None:
        os.kill(max(pids), signum)  # one of the two workers

    return send


def _interrupt_this_process(pids: list[int]) -> None:
    os.kill(os.getpid(), signal.SIGINT)  # a notebook's stop button


DIED = r"worker \d of 2 died without a word"
#: The machine's default threads (tests/conftest.py sets one for the session),
#: and each of two workers' share of the cores.
DEFAULT_THREADS: dict[str, str | None] = {"OMP_NUM_THREADS": None}
SHARE = max(1, len(os.sched_getaffinity(0)) // 2)
RAISED = r"worker \d of 2 raised; every worker was stopped"
CASES: dict[str, Case] = {
    # What comes back.
    "returns None": Case(a.returns, (None,), _ok(lambda v: v is None)),
    "returns a tensor": Case(
        a.returns, (torch.ones(3),), _ok(lambda v: torch.equal(v, torch.ones(3)))
    ),
    "returns a nested container": Case(
        a.returns, ({"a": [1, (2, 3)]},), _ok(lambda v: v == {"a": [1, (2, 3)]})
    ),
    "returns 200 MB": Case(
        a.returns_a_big_tensor,
        (50_000_000,),
        _ok(lambda v: v.numel() == 50_000_000 and v[-1] == 49_999_999),
    ),
    "returns an unpicklable value": Case(
        a.returns_unpicklable,
        (None,),
        _error(pd.PyroDistributedError, r"worker 0 of 2 raised.*return value cannot be sent back"),
    ),
    "worker 1's value is never sent": Case(a.returns_unpicklable, (1,), _ok(lambda v: v == 0)),
    "returns a generator": Case(
        a.returns_a_generator,
        (),
        _error(pd.PyroDistributedError, r"return value cannot be sent back"),
    ),
    # Exceptions.
    "every worker raises": Case(
        a.raises,
        (None, ValueError("bad input")),
        _error(pd.PyroDistributedError, RAISED + r".*ValueError: bad input"),
    ),
    "worker 1 raises": Case(
        a.raises,
        (1, ValueError("bad row")),
        _error(pd.PyroDistributedError, r"worker 1 of 2 raised.*ValueError: bad row"),
    ),
    "worker 0 raises": Case(
        a.raises,
        (0, KeyError("w")),
        _error(pd.PyroDistributedError, r"worker 0 of 2 raised.*KeyError: 'w'"),
    ),
    "worker 1 raises KeyboardInterrupt": Case(
        a.raises,
        (1, KeyboardInterrupt()),
        _error(pd.PyroDistributedError, r"worker 1 of 2 raised.*KeyboardInterrupt"),
    ),
    "worker 1 raises SystemExit": Case(
        a.raises,
        (1, SystemExit(3)),
        _error(pd.PyroDistributedError, r"worker 1 of 2 raised.*SystemExit: 3"),
    ),
    "worker 1 raises MemoryError": Case(
        a.raises,
        (1, MemoryError()),
        _error(pd.PyroDistributedError, r"worker 1 of 2 raised.*MemoryError"),
    ),
    "stderr and a raise on both": Case(
        a.writes_to_stderr_and_raises,
        (),
        _error(pd.PyroDistributedError, RAISED + r".*RuntimeError: broken on worker"),
    ),
    # Exits.
    "worker 1 calls sys.exit(0)": Case(
        a.exits,
        (1, "sys.exit", 0),
        _error(pd.PyroDistributedError, r"worker 1 of 2 raised.*SystemExit: 0"),
    ),
    "worker 1 calls os._exit(0)": Case(
        a.exits, (1, "os._exit", 0), _error(pd.PyroDistributedError, DIED)
    ),
    "worker 0 calls os._exit(7)": Case(
        a.exits, (0, "os._exit", 7), _error(pd.PyroDistributedError, DIED)
    ),
    "worker 1 aborts": Case(a.exits, (1, "abort", 0), _error(pd.PyroDistributedError, DIED)),
    "worker 1 SIGKILLs itself": Case(
        a.exits, (1, "SIGKILL", 0), _error(pd.PyroDistributedError, DIED)
    ),
    "worker 1 SIGTERMs itself": Case(
        a.exits, (1, "SIGTERM", 0), _error(pd.PyroDistributedError, DIED)
    ),
    "worker 0 SIGSEGVs itself": Case(
        a.exits, (0, "SIGSEGV", 0), _error(pd.PyroDistributedError, DIED)
    ),
    "both exit at once": Case(a.all_exit_at_once, (), _error(pd.PyroDistributedError, DIED)),
    # Hangs.
    "every worker spins, time_limit": Case(
        a.hangs,
        (None, False),
        _error(pd.PyroDistributedError, r"ran past its time_limit of 3 s.*workers \[0, 1\] of 2"),
        {"time_limit": 3},
        bound=15,
    ),
    "worker 1 spins, the other times out": Case(
        a.hangs,
        (1, True),
        _error(pd.PyroDistributedError, r"worker 0 of 2 raised.*time-out 3 s"),
        {"timeout": 3},
        bound=25,
    ),
    "worker 1 spins, time_limit first": Case(
        a.hangs,
        (1, True),
        _error(pd.PyroDistributedError, r"time_limit of 2 s"),
        {"timeout": 60, "time_limit": 2},
        bound=15,
    ),
    "a time_limit as a timedelta": Case(
        a.hangs,
        (None, False),
        _error(pd.PyroDistributedError, r"time_limit of 1.5 s"),
        {"time_limit": __import__("datetime").timedelta(seconds=1.5)},
        bound=15,
    ),
    "worker 0 prints past the time_limit": Case(
        a.prints_for,
        (30,),
        _error(pd.PyroDistributedError, r"time_limit of 2 s"),
        {"time_limit": 2},
        bound=10,
    ),
    "a time_limit that is not reached": Case(
        a.sleeps, (0.5,), _ok(lambda v: v == 0), {"time_limit": 60}
    ),
    # Signals from outside.
    "SIGKILL to one worker": Case(
        a.sleeps,
        (1000,),
        _error(pd.PyroDistributedError, DIED),
        meanwhile=_signal_one_worker(signal.SIGKILL),
    ),
    "SIGTERM to one worker": Case(
        a.sleeps,
        (1000,),
        _error(pd.PyroDistributedError, DIED),
        meanwhile=_signal_one_worker(signal.SIGTERM),
    ),
    "SIGINT to one worker": Case(
        a.sleeps,
        (1000,),
        _error(pd.PyroDistributedError, r"raised.*KeyboardInterrupt"),
        meanwhile=_signal_one_worker(signal.SIGINT),
    ),
    # Both workers sleep past the time_limit, one of them stopped: long enough
    # for both to start and be signalled on a loaded machine.
    "SIGSTOP to one worker, time_limit": Case(
        a.sleeps,
        (1000,),
        _error(pd.PyroDistributedError, r"time_limit of 10 s"),
        {"time_limit": 10},
        bound=30,
        meanwhile=_signal_one_worker(signal.SIGSTOP),
    ),
    "SIGINT to this process": Case(
        a.sleeps, (1000,), _error(KeyboardInterrupt, r""), meanwhile=_interrupt_this_process
    ),
    # What workers start.
    "a worker's subprocess": Case(a.starts_a_subprocess, (False,), _ok(lambda v: v > 0)),
    "a worker's subprocess in its own session": Case(
        a.starts_a_subprocess, (True,), _ok(lambda v: v > 0)
    ),
    "a worker forks": Case(a.forks, (), _ok(lambda v: v > 0)),
    "a worker's multiprocessing child": Case(
        a.starts_a_multiprocessing_child, (), _ok(lambda v: v > 0)
    ),
    "a worker's endless thread": Case(a.leaves_a_thread_running, (False,), _ok(lambda v: v == 1)),
    "a worker's endless daemon thread": Case(
        a.leaves_a_thread_running, (True,), _ok(lambda v: v == 1)
    ),
    "a launch inside a worker": Case(
        a.launches_inside,
        (),
        _error(pd.PyroDistributedError, RAISED + r".*pd.launch was called in worker \d of 2"),
    ),
    "the function shuts the engine down": Case(
        a.shuts_the_engine_down, (), _error(pd.PyroDistributedError, RAISED + r".*shut down the")
    ),
    # Output.
    "worker 0 prints 20,000 lines": Case(a.prints_a_lot, (20_000,), _ok(lambda v: v == 20_000)),
    # Start methods and threads.
    "the interpreter's settings travel": Case(
        a.reads_the_interpreter,
        (),
        _ok(lambda v: v == _interpreter_here()),
        setup=_set_the_interpreter,
    ),
    "a closure over a tensor travels by value": Case(
        _closure_over(torch.arange(4.0)), (), _ok(lambda v: torch.equal(v, torch.arange(4.0) * 2))
    ),
    "after a parallel op here, forkserver": Case(
        a.returns_rank_and_threads,
        (),
        _ok(lambda v: v == (0, 2, SHARE)),
        environment=DEFAULT_THREADS,
    ),
    "after a parallel op here, fork": Case(
        a.returns_rank_and_threads, (), _ok(lambda v: v == (0, 2, 1)), {"start_method": "fork"}
    ),
    "after a parallel op here, spawn": Case(
        a.returns_rank_and_threads,
        (),
        _ok(lambda v: v == (0, 2, SHARE)),
        {"start_method": "spawn"},
        environment=DEFAULT_THREADS,
    ),
    "one worker gets every core": Case(
        a.returns_rank_and_threads,
        (),
        _ok(lambda v: v == (0, 1, len(os.sched_getaffinity(0)))),
        {"workers": 1},
        environment={"OMP_NUM_THREADS": None},
    ),
    "three workers": Case(
        a.returns_rank_and_threads, (), _ok(lambda v: v[:2] == (0, 3)), {"workers": 3}
    ),
    "OMP_NUM_THREADS is kept": Case(
        a.returns_rank_and_threads,
        (),
        _ok(lambda v: v[2] == 2),
        environment={"OMP_NUM_THREADS": "2"},
    ),
    # The environment.
    "MASTER_ADDR and MASTER_PORT already set": Case(
        a.reads_the_environment,
        (["RANK", "WORLD_SIZE", "MASTER_ADDR"],),
        _ok(lambda v: v == {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}),
        environment={"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "1"},
    ),
    "a worker of torchrun launches": Case(
        a.returns,
        (1,),
        _error(pd.PyroDistributedError, r"pd.launch was called in one of 9 workers of torchrun"),
        environment={
            "RANK": "5",
            "LOCAL_RANK": "5",
            "WORLD_SIZE": "9",
            "LOCAL_WORLD_SIZE": "9",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        },
    ),
    "a variable set after the first launch": Case(
        a.reads_the_environment,
        (["PD_FUZZ_LATE"],),
        _ok(lambda v: v == {"PD_FUZZ_LATE": "late"}),
        environment={"PD_FUZZ_LATE": "late"},
    ),
    "a worker's DataLoader with its own workers": Case(
        a.iterates_a_dataloader, (), _ok(lambda v: v == 45)
    ),
    "the param store travels": Case(
        a.reads_the_store, ("fuzz_w",), _ok(lambda v: torch.equal(v, torch.full((2,), 7.0)))
    ),
    "a training loop with progress": Case(a.trains, (5,), _ok(lambda v: isinstance(v, float))),
    # Arguments, refused before any worker starts.
    "fn is not callable": Case(
        lambda where: None, (), _error(TypeError, r"fn must be a function"), {"fn": 5}
    ),
    "an argument does not pickle": Case(
        a.returns, (threading.Lock(),), _error(TypeError, r"do not pickle")
    ),
    "workers=0": Case(
        a.returns,
        (1,),
        _error(ValueError, r"workers must be an int of at least 1, got 0"),
        {"workers": 0},
    ),
    "workers='2'": Case(
        a.returns,
        (1,),
        _error(ValueError, r"workers must be an int of at least 1, got '2'"),
        {"workers": "2"},
    ),
    "time_limit=-1": Case(
        a.returns,
        (1,),
        _error(ValueError, r"time_limit must be a positive, finite duration, got -1"),
        {"time_limit": -1},
    ),
    "time_limit='1h'": Case(
        a.returns,
        (1,),
        _error(TypeError, r"time_limit must be seconds \(a number\) or a timedelta, got '1h'"),
        {"time_limit": "1h"},
    ),
    "an unknown keyword": Case(
        a.returns, (1,), _error(TypeError, r"unexpected keyword argument 'nprocs'"), {"nprocs": 2}
    ),
}


def _mine() -> set[Path]:
    mine = f"{os.getpid()} "
    return {
        folder
        for folder in Path(os.environ.get("TMPDIR", "/tmp")).glob(f"{folders.PREFIX}*")
        if (folder / folders.OWNER).is_file()
        and (folder / folders.OWNER).read_text().startswith(mine)
    }


@pytest.fixture(scope="module", autouse=True)
def _parallel_op_and_a_thread_here() -> Any:
    """This process has computed with threads, as a kernel has, and runs a thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(2**22).mul_(2)
    stop = threading.Event()
    waiting = threading.Thread(target=stop.wait, daemon=True)
    waiting.start()
    yield
    stop.set()
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_launch_ends_in_bound_with_its_answer_and_leaves_nothing(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    for variable, value in case.environment.items():
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    pyro.clear_param_store()
    pyro.param("fuzz_w", torch.full((2,), 7.0))
    before = _mine()
    options = dict(case.options)
    fn = options.pop("fn", case.fn)
    options.setdefault("workers", 2)
    workers = options["workers"] if isinstance(options["workers"], int) else 0
    undo = case.setup() if case.setup is not None else None
    watcher = None
    unheard: list[str] = []  # why the case's action did not happen
    if case.meanwhile is not None:
        watcher = threading.Thread(
            target=_when_recorded, args=(tmp_path, workers, case.meanwhile, unheard)
        )
        watcher.start()
    began = time.monotonic()
    outcome: Any
    try:
        outcome = ("ok", pd.launch(fn, str(tmp_path), *case.args, **options).value)
    except BaseException as exc:  # KeyboardInterrupt included: it is one of the answers
        outcome = (type(exc), str(exc))
    took = time.monotonic() - began
    if undo is not None:
        undo()
    if watcher is not None:
        watcher.join()
    assert not unheard, f"the case's action had no one to act on: {unheard}"
    gc.collect()
    kind, check = case.expect
    if kind == "ok":
        assert outcome[0] == "ok", outcome
        assert check(outcome[1]), outcome
    else:
        assert outcome[0] is kind, outcome
        assert re.search(check, outcome[1], re.S), outcome
    assert took < case.bound, took
    _assert_nothing_left(tmp_path)
    assert _mine() <= before


#: How long the workers of a case may take to start and record themselves: on a
#: machine whose cores every lane of the test command keeps busy, a launch's
#: workers have taken over a minute.
RECORD_WITHIN = 300


def _when_recorded(
    where: Path, workers: int, action: Callable[[list[int]], None], failures: list[str]
) -> None:
    deadline = time.monotonic() + RECORD_WITHIN
    while len(list(where.iterdir())) < workers and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    pids = [int(path.name) for path in where.iterdir()]
    if not pids:  # said by the test, which a watcher thread's own exception is not
        failures.append(f"no worker recorded itself within {RECORD_WITHIN} s")
        return
    action(pids)


def _assert_nothing_left(where: Path) -> None:
    pids = [int(path.name) for path in where.iterdir()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(process_is_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert [pid for pid in pids if process_is_alive(pid)] == []
    assert multiprocessing.active_children() == []


def test_the_cases_number_at_least_fifty() -> None:
    assert len(CASES) >= 50
