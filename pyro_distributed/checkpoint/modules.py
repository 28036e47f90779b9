"""Checkpoints of runs with a torch optimizer: the module, the optimizer, the schedulers.

Pyro's torch-native loop keeps its parameters on the module it trains (an
ELBO module, ``module_local_params``), not in the param store. Its checkpoint
holds the module's ``state_dict`` (parameters and buffers), the torch
optimizer's ``state_dict``, the schedulers' ``state_dict``\\s, every worker's
RNG state and the step count. Local parameters are written as blocks, one
file per worker, under their ``named_parameters()`` names, with their rows of
the optimizer's state, and re-partitioned for another number of workers
(:mod:`pyro_distributed.local.blocks`). Loading writes values into the
module's existing parameters (a local one's ``.data`` becomes this worker's
block), so the optimizer keeps stepping the same parameter objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..local import registry, sparse
from ..local.blocks import load_blocks
from ..optim.torch_optimizer import DistributedTorchOptimizer
from . import contents, extensions, files
from .optim_state import check_torch_optimizer


@dataclass(frozen=True)
class ModuleLocal:
    """A local parameter of a module: its record under its ``named_parameters()``
    name (which the block files use), the tensor, and its Pyro name and constraint."""

    record: registry.LocalParam
    param: Tensor
    pyro_name: str
    constraint: Any


def module_locals(module: torch.nn.Module) -> dict[str, ModuleLocal]:
    """The module's local parameters, by ``named_parameters()`` name."""
    found: dict[str, ModuleLocal] = {}
    for name, param in module.named_parameters():
        record = registry.local_of(param)
        if record is not None:
            as_module = registry.LocalParam(name, record.plate, record.size, record.axis)
            constraint = registry.module_constraint(record.name)
            found[name] = ModuleLocal(as_module, param, record.name, constraint)
    return found


def state_indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Each parameter's index in the optimizer's ``state_dict`` (by ``id``): torch
    numbers them in the order the groups list them."""
    indices: dict[int, int] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            indices.setdefault(id(param), len(indices))
    return indices


def without_state(saved: dict[str, Any], indices: set[int]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` without the state of the parameters at
    ``indices`` (local ones: their rows travel in the block files)."""
    kept = {index: value for index, value in saved["state"].items() if index not in indices}
    return {**saved, "state": kept}


def save(
    path: str | os.PathLike[str],
    optimizer: DistributedTorchOptimizer,
    module: torch.nn.Module,
    schedulers: list[Any],
) -> None:
    """:func:`~pyro_distributed.save_checkpoint` of a run with a torch optimizer."""
    engine = optimizer.engine
    rng_states = files.gather_rng(engine)
    local = module_locals(module)
    records = {name: held.record for name, held in local.items()}
    values = {name: held.param for name, held in local.items()}
    indices = state_indices(optimizer)
    local_indices = {indices[id(param)] for param in values.values() if id(param) in indices}
    state_of = optimizer.state
    optim_state = {name: dict(state_of[p]) for name, p in values.items() if p in state_of}
    extension_states = extensions.gather(engine, optimizer)

    def state(local_meta: dict[str, Any] | None) -> dict[str, Any]:
        saved_optimizer = without_state(optimizer.state_dict(), local_indices)
        return {
            **files.header(engine, optimizer.num_steps, "module"),
            "module": {k: v for k, v in module.state_dict().items() if k not in records},
            "optimizer": saved_optimizer,
            "schedulers": [scheduler.state_dict() for scheduler in schedulers],
            "rng": rng_states,
            "local": local_meta,
            "local_names": {
                name: (held.pyro_name, held.constraint) for name, held in local.items()
            },
            extensions.KEY: extension_states,
        }

    files.commit(path, engine, state, records, values, optim_state)


def load(
    path: str | os.PathLike[str],
    optimizer: DistributedTorchOptimizer,
    module: torch.nn.Module,
    schedulers: list[Any],
    missing_ok: bool,
    *,
    trusted: bool = False,
    strict: bool = True,
) -> int:
    """:func:`~pyro_distributed.load_checkpoint` of a run with a torch optimizer."""
    engine = optimizer.engine
    found = files.read(path, engine, missing_ok, trusted=trusted)
    if found is None:
        return 0
    state, where = found
    local: dict[str, registry.LocalParam] = {}

    def check() -> None:  # everything the load reads, before it changes anything
        contents.check(state, repr(os.fspath(path)))
        if state.get("kind") != "module":
            raise ValueError(
                f"the checkpoint {os.fspath(path)!r} is of a run with a Pyro optimizer (the "
                f"param store); load it with load_checkpoint(path, optim), without module="
            )
        local.update(files.local_params_of(state))
        _check_compatible(os.fspath(path), state, module, local, strict)
        if len(schedulers) != len(state["schedulers"]):
            raise ValueError(
                f"the checkpoint {os.fspath(path)!r} holds {len(state['schedulers'])} "
                f"scheduler(s); {len(schedulers)} were passed"
            )
        check_torch_optimizer(optimizer.wrapped, state["optimizer"], repr(os.fspath(path)))
        extensions.check(state, optimizer, engine, repr(os.fspath(path)))

    files.agree(engine, check)
    if local:  # read before anything changes, so that a bad block leaves the run as it was
        values, local_state = load_blocks(where, state["local"], local, engine, trusted=trusted)
    module.load_state_dict(state["module"], strict=False)
    saved_optimizer = state["optimizer"]
    if local:
        named = dict(module.named_parameters())
        indices = state_indices(optimizer)
        for name, value in values.items():
            param = named[name]
            with torch.no_grad():
                param.data = value.to(param.device).clone()  # this worker's block of rows
            pyro_name, constraint = state["local_names"][name]
            record = local[name]
            registry.unregister([pyro_name])
            sparse.drop_reads([pyro_name])  # rows read before the load are not this block's
            registry.register(
                registry.LocalParam(pyro_name, record.plate, record.size, record.axis),
                param,
                constraint,
            )
            if name in local_state and id(param) in indices:
                saved_optimizer["state"][indices[id(param)]] = local_state[name]
    optimizer.load_state_dict(saved_optimizer)
    for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    optimizer.forget()  # what the exchange and the hook knew is of the replaced state
    extensions.restore(state, optimizer, engine, repr(os.fspath(path)))
    optimizer.num_steps = state["num_steps"]
    files.restore_rng(state, engine)
    return int(state["num_steps"])


def _check_compatible(
    path: str, state: dict[str, Any], module: torch.nn.Module, local: dict[str, Any], strict: bool
) -> None:
    """Refuse a checkpoint of another module (names only if ``strict``)."""
    saved = state["module"]
    current = module.state_dict()
    missing, reshaped = files.mismatches(current, saved, local)
    extra = sorted((set(saved) | set(local)) - set(current))
    if not strict:
        missing, extra = [], []
    details = []
    if missing:
        details.append(f"{missing} exist now but not in the checkpoint")
    if extra:
        details.append(f"{extra} are in the checkpoint but not in the module")
    if reshaped:
        details.append(f"{reshaped} differ in shape or dtype")
    if details:
        raise ValueError(f"the checkpoint {path!r} is of a different module: {'; '.join(details)}")
