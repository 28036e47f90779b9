"""Files of data, not programs: what is read before the payload, and what the payload may name."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tracemalloc
from importlib import metadata
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions.constraints as pyro_constraints
import pytest
import torch
from torch.distributions import constraints, transform_to
from torch.distributions.transforms import ExpTransform

import pyro_distributed as pd
from pyro_distributed import safe_files
from pyro_distributed.checkpoint.files import allowed_globals, load_file


class _Mkdir:
    """A pickle that makes a directory when it is loaded."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.where),))


class _OwnConstraint(constraints.Constraint):
    """A user's constraint class: not on the allow-list."""

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return value > 0


transform_to.register(_OwnConstraint)(lambda constraint: ExpTransform())


def _hostile_file(path: Path, payload: Any, kind: str = "checkpoint") -> None:
    """A file with a valid header, length and checksum, whose payload is
    ``payload`` as torch.save pickles it, ``__reduce__`` and all."""
    safe_files.write(path, kind, {"format": "pyro_distributed.checkpoint"}, payload)


def _checkpoint(tmp_path: Path) -> Path:
    pd.init("local")
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    pyro.param("scale", torch.ones(3), constraint=constraints.positive)
    pyro.param("soft", torch.ones(2), constraint=pyro_constraints.softplus_positive)
    pyro.param("box", torch.full((2, 2), 0.5), constraint=constraints.interval(0.0, 1.0))
    params = [pyro.param(name).unconstrained() for name in ("scale", "soft", "box")]
    sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
    optim(params)
    path = tmp_path / "run.pt"
    pd.save_checkpoint(path, optim)
    return path


def test_a_pickle_that_runs_code_is_refused_before_it_runs(tmp_path: Path) -> None:
    made = tmp_path / "made-by-the-file"
    hostile = tmp_path / "hostile.pt"
    _hostile_file(hostile, {"format": "pyro_distributed.checkpoint", "x": _Mkdir(made)})
    with pytest.raises(ValueError, match=r"needs posix\.mkdir|needs os\.mkdir"):
        load_file(hostile)
    assert not made.exists()
    # A plain torch.save file (the 0.x format) is not unpickled without trusted=True.
    legacy = tmp_path / "legacy.pt"
    torch.save({"format": "pyro_distributed.checkpoint", "x": _Mkdir(made)}, legacy)
    with pytest.raises(ValueError, match=r"is a plain torch.save file.*trusted=True"):
        load_file(legacy)
    assert not made.exists()
    load_file(legacy, trusted=True)  # asked for by name: the code runs
    assert made.is_dir()


def test_the_header_is_checked_before_the_payload(tmp_path: Path) -> None:
    made = tmp_path / "made-by-the-file"
    hostile = tmp_path / "block.pt"
    _hostile_file(hostile, _Mkdir(made), kind="block")
    with pytest.raises(ValueError, match="is a block file, not a checkpoint file"):
        load_file(hostile, trusted=True)
    assert not made.exists()
    newer = tmp_path / "newer.pt"
    data = bytearray(_checkpoint(tmp_path).read_bytes())
    start = len(safe_files.MAGIC)
    data[start : start + safe_files.HEADER_BYTES] = (
        data[start : start + safe_files.HEADER_BYTES]
        .replace(b'"format_version": 5', b'"format_version": 9')
    )  # fmt: skip
    newer.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"has format version 9 .* reads version 5 and older"):
        load_file(newer)


def test_files_record_the_versions_that_wrote_them(tmp_path: Path) -> None:
    with open(_checkpoint(tmp_path), "rb") as file:
        header = safe_files.read_header(file, "run.pt", "checkpoint")
    assert header.format_version == safe_files.FORMAT_VERSION
    assert set(header.versions) == {"pyro-distributed", "torch", "pyro-ppl"}
    assert header.versions["pyro-distributed"] == pd.__version__
    # What ran, build label included: torch.__version__ of a CUDA wheel from PyPI
    # is "2.15.0+cu132" where its distribution's metadata says "2.15.0".
    assert header.versions["torch"] == torch.__version__
    assert header.versions["pyro-ppl"] == metadata.version("pyro-ppl")


def test_a_checkpoint_needs_only_the_constraint_classes(tmp_path: Path) -> None:
    state = load_file(_checkpoint(tmp_path))
    saved = state["param_store"]["constraints"]
    assert type(saved["soft"]) is type(pyro_constraints.softplus_positive)
    assert saved["box"].upper_bound == 1.0
    allowed = {f"{cls.__module__}.{cls.__qualname__}" for cls in allowed_globals()}
    assert "pyro.distributions.constraints._SoftplusPositive" in allowed
    assert all(name.startswith(("torch.", "pyro.")) for name in allowed)


def test_a_valid_checkpoint_loads_where_torch_forces_weights_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _checkpoint(tmp_path)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    assert pd.load_checkpoint(path, optim) == 1


def test_a_class_the_file_may_not_load_is_named(tmp_path: Path) -> None:
    pd.init("local")
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    param = pyro.param("w", torch.ones(2), constraint=_OwnConstraint()).unconstrained()
    param.sum().backward()
    optim([param])
    path = tmp_path / "own.pt"
    pd.save_checkpoint(path, optim)
    with pytest.raises(ValueError, match=r"needs tests\.test_safe_files\._OwnConstraint.*trusted"):
        pd.load_checkpoint(path, optim)
    assert pd.load_checkpoint(path, optim, trusted=True) == 1
    # A class renamed since the file was written is named the same way.
    data = path.read_bytes().replace(b"_OwnConstraint", b"_OldConstraint")
    start = len(safe_files.MAGIC) + safe_files.HEADER_BYTES
    renamed = tmp_path / "renamed.pt"
    header = data[len(safe_files.MAGIC) : start].decode()
    old_sum = hashlib.sha256(path.read_bytes()[start:]).hexdigest()
    header = header.replace(old_sum, hashlib.sha256(data[start:]).hexdigest())
    renamed.write_bytes(safe_files.MAGIC + header.encode() + data[start:])
    with pytest.raises(ValueError, match=r"needs tests\.test_safe_files\._OldConstraint"):
        pd.load_checkpoint(renamed, optim)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_are_written_with_the_mode_the_umask_gives(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        safe_files.write(tmp_path / "data.pt", "block", {}, {"x": torch.ones(1)})
        torch.save({"x": 1}, tmp_path / "torch.pt")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "data.pt").stat().st_mode)
    assert mode == 0o666 & ~umask == stat.S_IMODE((tmp_path / "torch.pt").stat().st_mode)


def test_the_directory_is_fsynced_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(handle: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{handle}"))
        real_fsync(handle)

    monkeypatch.setattr(os, "fsync", fsync)
    safe_files.write(tmp_path / "data.pt", "block", {}, {"x": torch.ones(1)})
    assert synced[-1] == str(tmp_path), synced
    assert (tmp_path / "data.pt").exists()


def test_damage_is_named(tmp_path: Path) -> None:
    good = _checkpoint(tmp_path).read_bytes()
    cases = {
        "is truncated: it ends inside its header": good[:100],
        "is truncated: its header promises": good[:-10],
        "data follows the end its header gives": good + b"x",
        "does not match the header's checksum": good[:-100] + bytes([good[-100] ^ 1]) + good[-99:],
        "has a damaged header": good[:20] + b"\xff" + good[21:],
        "is not a pyro_distributed file": b"\x00" + good[1:],
    }
    for message, data in cases.items():
        damaged = tmp_path / "damaged.pt"
        damaged.write_bytes(data)
        with pytest.raises(ValueError, match=message):
            load_file(damaged)


def _claiming(good: bytes, payload_bytes: Any) -> bytes:
    """``good`` with a header whose payload length is ``payload_bytes``."""
    start = len(safe_files.MAGIC)
    fields = json.loads(good[start : start + safe_files.HEADER_BYTES])
    fields["payload_bytes"] = payload_bytes
    header = json.dumps(fields).encode().ljust(safe_files.HEADER_BYTES)
    return safe_files.MAGIC + header + good[start + safe_files.HEADER_BYTES :]


def test_a_payload_claim_is_compared_with_the_file_before_anything_is_allocated(
    tmp_path: Path,
) -> None:
    good = _checkpoint(tmp_path).read_bytes()
    claims = tmp_path / "claims.pt"
    claims.write_bytes(_claiming(good, 2**31))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"claims\.pt' is truncated: .* 2147483648 bytes"):
            load_file(claims)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated to refuse the file"


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        (10**12, r"is truncated: its header promises 1000000000000 bytes"),
        (-5, r"has a damaged header \(a payload of -5 bytes\)"),
        (True, r"has a damaged header \(header entry 'payload_bytes' is True, not of type int\)"),
    ],
)
def test_an_impossible_payload_claim_is_a_damaged_file(
    tmp_path: Path, claim: Any, message: str
) -> None:
    path = _checkpoint(tmp_path)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(_claiming(path.read_bytes(), claim))
    with pytest.raises(ValueError, match=rf"'.*bad\.pt' {message}"):
        load_file(bad)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    with pytest.raises(ValueError, match=message) as refused:
        pd.load_checkpoint(bad, optim)
    assert not isinstance(refused.value, pd.PyroDistributedError)
