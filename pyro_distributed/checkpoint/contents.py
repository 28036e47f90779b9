"""What a checkpoint must hold: every entry a load reads, checked before it reads any.

A file whose header and checksum are sound can still hold the wrong data:
written by other code with the library's own writer, edited, or cut short
of an entry. Loading reads many entries at different moments, and a load
that met a missing one half-way would raise a bare ``KeyError`` with the run
half restored. So :func:`check` walks every entry the load will read, with
the type it must have, and names the first one that is missing or wrong,
and the file, in a ``ValueError``; every worker decodes the same bytes and
so refuses them alike. What the entries must agree with (the model's
parameters, the optimizer) is checked by the loaders and
:mod:`.optim_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributions.constraints import Constraint

__all__ = ["check"]


class _Entries:
    """Reads entries of one file, naming any that is missing or of the wrong type."""

    def __init__(self, shown: str) -> None:
        self.shown = shown

    def refuse(self, where: str, problem: str) -> ValueError:
        return ValueError(
            f"the checkpoint {self.shown} is damaged or was not written by "
            f"save_checkpoint: {where} {problem}"
        )

    def get(self, holder: Mapping[Any, Any], key: Any, kind: Any, where: str) -> Any:
        """``holder[key]``, which must be a ``kind`` (a type or a tuple of them)."""
        if key not in holder:
            raise self.refuse(where, "is missing")
        return self.typed(holder[key], kind, where)

    def typed(self, value: Any, kind: Any, where: str) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            wanted = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise self.refuse(where, f"must be {wanted}, got {_shown(value)}")
        return value

    def count(self, holder: Mapping[str, Any], key: str, minimum: int, where: str) -> int:
        value: int = self.get(holder, key, int, where)
        if value < minimum:
            raise self.refuse(where, f"must be at least {minimum}, got {value}")
        return value

    def tensors(self, holder: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
        """A dict of tensors by name."""
        found: dict[str, Any] = self.get(holder, key, dict, where)
        for name, value in found.items():
            self.typed(name, str, f"a name in {where}")
            self.typed(value, torch.Tensor, f"{where}[{name!r}]")
        return found

    def bytes_state(self, value: Any, where: str) -> None:
        """A generator's state: a tensor of bytes."""
        self.typed(value, torch.Tensor, where)
        if value.dtype != torch.uint8:
            raise self.refuse(where, f"must be a tensor of uint8, got one of {value.dtype}")


def check(state: dict[str, Any], shown: str) -> None:
    """Refuse ``state``, the file ``shown``, unless it holds every entry a load
    of its kind (``"param_store"``, the default, or ``"module"``) reads.

    :raises ValueError: naming the file and the entry.
    """
    entries = _Entries(shown)
    kind = state.get("kind", "param_store")  # absent in files of 0.x
    if kind not in ("param_store", "module"):
        raise entries.refuse("'kind'", f"must be 'param_store' or 'module', got {_shown(kind)}")
    world_size = entries.count(state, "world_size", 1, "'world_size'")
    entries.count(state, "num_steps", 0, "'num_steps'")
    entries.bytes_state(
        entries.get(state, "shared_rng", torch.Tensor, "'shared_rng'"), "'shared_rng'"
    )
    _check_rng(entries, entries.get(state, "rng", (list, tuple), "'rng'"), world_size)
    if "extensions" in state:  # absent in files of format version 4 and older
        _check_extensions(entries, state["extensions"], world_size)
    # Files of 0.x name no kind and hold no blocks; every later one says both.
    if "kind" in state:
        local = entries.get(state, "local", (dict, type(None)), "'local'")
    else:
        local = entries.typed(state.get("local"), (dict, type(None)), "'local'")
    local_names = _check_local(entries, local) if local is not None else set()
    if kind == "module":
        _check_module(entries, state, local_names)
    else:
        _check_param_store(entries, state, local_names)


def _check_rng(entries: _Entries, rng: Any, world_size: int) -> None:
    if len(rng) != world_size:
        raise entries.refuse("'rng'", f"holds {len(rng)} workers' states for {world_size} workers")
    for rank, worker in enumerate(rng):
        where = f"'rng'[{rank}]"
        entries.typed(worker, (list, tuple), where)
        if len(worker) != 2:
            raise entries.refuse(where, f"must be a pair of states, got {len(worker)} entries")
        states, blocks = worker
        entries.typed(states, dict, where)
        entries.bytes_state(entries.get(states, "torch", torch.Tensor, f"{where}['torch']"), where)
        entries.get(states, "random", (list, tuple), f"{where}['random']")
        numpy = entries.get(states, "numpy", (list, tuple), f"{where}['numpy']")
        if len(numpy) != 5:
            raise entries.refuse(f"{where}['numpy']", f"must hold 5 entries, got {len(numpy)}")
        entries.bytes_state(blocks, f"{where}[1]")


def _check_extensions(entries: _Entries, states: Any, world_size: int) -> None:
    """Every worker's extension state: a dict of dicts by extension, per worker."""
    entries.typed(states, (list, tuple), "'extensions'")
    if len(states) != world_size:
        raise entries.refuse(
            "'extensions'", f"holds {len(states)} workers' states for {world_size} workers"
        )
    for rank, state in enumerate(states):
        where = f"'extensions'[{rank}]"
        entries.typed(state, dict, where)
        for name, value in state.items():
            entries.typed(name, str, f"a name in {where}")
            entries.typed(value, dict, f"{where}[{name!r}]")


def _check_local(entries: _Entries, local: dict[str, Any]) -> set[str]:
    """The names of the local parameters ``local`` (the blocks' description) lists."""
    entries.get(local, "token", str, "'local'['token']")
    entries.count(local, "world_size", 1, "'local'['world_size']")
    params = entries.get(local, "params", dict, "'local'['params']")
    for name, spec in params.items():
        where = f"'local'['params'][{name!r}]"
        entries.typed(name, str, "a name in 'local'['params']")
        entries.typed(spec, (list, tuple), where)
        if len(spec) != 3:
            raise entries.refuse(where, "must be (plate, size, axis)")
        entries.typed(spec[0], str, f"{where}'s plate")
        entries.typed(spec[1], int, f"{where}'s size")
        entries.typed(spec[2], int, f"{where}'s axis")
    return set(params)


def _check_param_store(entries: _Entries, state: dict[str, Any], local: set[str]) -> None:
    store = entries.get(state, "param_store", dict, "'param_store'")
    params = entries.tensors(store, "params", "'param_store'['params']")
    constraints = entries.get(store, "constraints", dict, "'param_store'['constraints']")
    for name in sorted(set(params) | local):
        where = f"'param_store'['constraints'][{name!r}]"
        entries.get(constraints, name, Constraint, where)
    for name, value in entries.get(state, "optim", dict, "'optim'").items():
        entries.typed(name, str, "a name in 'optim'")
        entries.typed(value, dict, f"'optim'[{name!r}]")


def _check_module(entries: _Entries, state: dict[str, Any], local: set[str]) -> None:
    entries.tensors(state, "module", "'module'")
    optimizer = entries.get(state, "optimizer", dict, "'optimizer'")
    entries.get(optimizer, "state", dict, "'optimizer'['state']")
    groups = entries.get(optimizer, "param_groups", list, "'optimizer'['param_groups']")
    for index, group in enumerate(groups):
        where = f"'optimizer'['param_groups'][{index}]"
        entries.typed(group, dict, where)
        for number in entries.get(group, "params", list, f"{where}['params']"):
            entries.typed(number, int, f"an index in {where}['params']")
    for index, saved in enumerate(entries.get(state, "schedulers", list, "'schedulers'")):
        entries.typed(saved, dict, f"'schedulers'[{index}]")
    names = entries.get(state, "local_names", dict, "'local_names'")
    for name in sorted(local):
        where = f"'local_names'[{name!r}]"
        held = entries.get(names, name, (list, tuple), where)
        if len(held) != 2 or not isinstance(held[0], str):
            raise entries.refuse(where, "must be (the Pyro name, its constraint)")


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
