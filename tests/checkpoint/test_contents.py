"""Checkpoints whose checksum holds but whose data does not: an entry missing or of
the wrong type, optimizer state of another optimizer or shape, an impossible
header. Each is refused at load, by name, on every worker, changing nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch
from torch.distributions import constraints

import pyro_distributed as pd
from pyro_distributed import safe_files
from pyro_distributed.checkpoint import files

from ..support.harness import run_workers

Edit = Callable[[dict[str, Any]], None]


def _without(key: str, *inside: str) -> Edit:
    def edit(state: dict[str, Any]) -> None:
        holder = state
        for step in inside:
            holder = holder[step]
        del holder[key]

    return edit


def _setting(value: Any, *where: str) -> Edit:
    def edit(state: dict[str, Any]) -> None:
        holder = state
        for step in where[:-1]:
            holder = holder[step]
        holder[where[-1]] = value

    return edit


def _wrong_moment(state: dict[str, Any]) -> None:
    state["optim"]["w"]["state"][0]["exp_avg"] = torch.zeros(5)


#: Files made from a good checkpoint by the library's own writer (so their
#: checksums hold), and what the refusal says.
EDITS: dict[str, tuple[Edit, str]] = {
    "no param store": (_without("param_store"), r"'param_store' is missing"),
    "no optimizer state": (_without("optim"), r"'optim' is missing"),
    "no step count": (_without("num_steps"), r"'num_steps' is missing"),
    "no RNG states": (_without("rng"), r"'rng' is missing"),
    "no values": (_without("params", "param_store"), r"'param_store'\['params'\] is missing"),
    "no constraint": (
        _without("w", "param_store", "constraints"),
        r"'param_store'\['constraints'\]\['w'\] is missing",
    ),
    "a step count of text": (_setting("abc", "num_steps"), r"'num_steps' must be int, got str"),
    "a negative step count": (_setting(-3, "num_steps"), r"'num_steps' must be at least 0"),
    "a step count of True": (_setting(True, "num_steps"), r"'num_steps' must be int, got bool"),
    "a value of a list": (
        _setting([1.0, 2.0, 3.0], "param_store", "params", "w"),
        r"'param_store'\['params'\]\['w'\] must be Tensor, got list",
    ),
    "another world's RNG states": (
        _setting([], "rng"),
        r"'rng' holds 0 workers' states for \d workers",
    ),
    "an unknown kind": (_setting("notes", "kind"), r"'kind' must be 'param_store' or 'module'"),
    "a moment of the wrong shape": (
        _wrong_moment,
        r"optimizer state 'exp_avg' of shape \[5\] for parameter 'w', which needs \[3\]",
    ),
}
#: Headers that claim more, or less, than a file can hold.
CLAIMS = {
    "a payload of 2 GiB": (2**31, r"is truncated: its header promises 2147483648 bytes"),
    "a payload of 10^12 bytes": (10**12, r"is truncated: its header promises 1000000000000"),
    "a negative payload": (-5, r"has a damaged header \(a payload of -5 bytes\)"),
}


def _run(optimizer: str = "adam") -> pd.DistributedOptimizer:
    pyro.clear_param_store()
    if optimizer == "adam":
        optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    else:
        optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.1, "momentum": 0.9}))
    params = [
        pyro.param("w", torch.ones(3)).unconstrained(),
        pyro.param("scale", torch.ones(2), constraint=constraints.positive).unconstrained(),
    ]
    sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
    optim(params)
    return optim


def _values() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}


def _make_bad_files(directory: Path, good: Path) -> dict[str, str]:
    """Every bad file beside ``good``, by name; what each refusal must say."""
    expected = {}
    for name, (edit, message) in EDITS.items():
        state = files.load_file(good)
        edit(state)
        files.write_checkpoint(directory / f"{name}.pt", state)
        expected[name] = message
    start, end = len(safe_files.MAGIC), len(safe_files.MAGIC) + safe_files.HEADER_BYTES
    data = good.read_bytes()
    for name, (claim, message) in CLAIMS.items():
        fields = json.loads(data[start:end])
        fields["payload_bytes"] = claim
        header = json.dumps(fields).encode().ljust(safe_files.HEADER_BYTES)
        (directory / f"{name}.pt").write_bytes(data[:start] + header + data[end:])
        expected[name] = message
    return expected


def refuse_everywhere(root: str) -> dict[str, Any]:
    """On every worker: save a good checkpoint, then load each bad file made
    from it (worker 0 makes them), and an SGD run's into Adam and back."""
    directory = Path(root)
    optim = _run()
    good = directory / "good.pt"
    pd.save_checkpoint(good, optim)
    sgd = _run("sgd")
    pd.save_checkpoint(directory / "sgd.pt", sgd)
    expected = _make_bad_files(directory, good) if pd.rank() == 0 else None
    expected = pd.current_engine().allgather_object(expected)[0]
    outcomes = {}
    into = _run()
    for name in [*expected, "sgd"]:
        outcomes[name] = _load(directory / f"{name}.pt", into)
    outcomes["good"] = _load(good, _run("sgd"))
    return {"expected": expected, "outcomes": outcomes}


def _load(path: Path, into: pd.DistributedOptimizer) -> tuple[str | None, str, bool]:
    """What loading ``path`` raised, and whether it left values and state alone."""
    before, state_before = _values(), repr(into.get_state())
    try:
        pd.load_checkpoint(path, into)
    except Exception as error:
        unchanged = all(torch.equal(v, _values()[k]) for k, v in before.items())
        return (
            type(error).__name__,
            str(error),
            unchanged and repr(into.get_state()) == state_before,
        )
    return None, "", True


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_contents_are_refused_by_name_on_every_worker(tmp_path: Path, world_size: int) -> None:
    if world_size == 1:
        pd.init("local")
        pyro.clear_param_store()
        workers = [refuse_everywhere(str(tmp_path))]
    else:
        workers = run_workers(refuse_everywhere, str(tmp_path), world_size=2)
    expected = workers[0]["expected"]
    assert set(expected) == set(EDITS) | set(CLAIMS)
    messages = {
        **expected,
        "sgd": r"holds optimizer state \['momentum_buffer'\] for parameter '\w+', where "
        r"this run's Adam keeps \['exp_avg', 'exp_avg_sq', 'step'\]",
        "good": r"holds optimizer state \['exp_avg', 'exp_avg_sq', 'step'\] for parameter "
        r"'\w+', where this run's SGD keeps \['momentum_buffer'\]",
    }
    for name, message in messages.items():
        outcomes = [worker["outcomes"][name] for worker in workers]
        for kind, said, unchanged in outcomes:
            assert kind == "ValueError", (name, outcomes)
            assert f"{name}.pt" in said, (name, said)
            assert re.search(message, said), (name, said)
            assert unchanged, name
        assert len({said for _, said, _ in outcomes}) == 1, outcomes


def test_a_missing_key_of_a_module_checkpoint_is_named(tmp_path: Path) -> None:
    pd.init("local")
    net = torch.nn.Linear(3, 2)
    optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(net.parameters(), lr=0.1))
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = tmp_path / "net.pt"
    pd.save_checkpoint(path, optimizer, module=net)
    for key in ("optimizer", "module", "schedulers", "local_names"):
        state = files.load_file(path)
        del state[key]
        files.write_checkpoint(tmp_path / "bad.pt", state)
        with pytest.raises(ValueError, match=rf"bad\.pt' is damaged .*: '{key}' is missing"):
            pd.load_checkpoint(tmp_path / "bad.pt", optimizer, module=net)


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        (123, TypeError, r"path must be a path \(a str or os.PathLike\), got 123"),
        (b"run.pt", TypeError, r"path must be a path .*got b'run.pt'"),
        (None, TypeError, r"path must be a path .*got None"),
        ("", ValueError, r"path must be a path, got an empty one"),
    ],
)
def test_the_path_argument_is_checked(path: Any, error: type, message: str) -> None:
    pd.init("local")
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    with pytest.raises(error, match=message):
        pd.save_checkpoint(path, optim)
    with pytest.raises(error, match=message):
        pd.load_checkpoint(path, optim)
