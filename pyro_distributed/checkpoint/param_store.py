"""Checkpoints of SVI runs with a Pyro optimizer: the param store and the optimizer.

A checkpoint holds the param store (values and constraints), the optimizer's
state (schedulers included), every worker's RNG state, the shared generator
behind sharded subsamples, and the step count. Local parameters
(:mod:`pyro_distributed.local`) are the exception: each worker writes and
reads its own blocks of them, beside worker 0's file, and they are
re-partitioned when the number of workers changed
(:mod:`pyro_distributed.local.blocks`). Writing and reading are
:mod:`.files`'.
"""

from __future__ import annotations

import os
from typing import Any

import pyro
import pyro.util
import torch
from pyro.optim import SGD  # type: ignore[attr-defined]

from ..engines import Engine
from ..engines.local import LocalEngine
from ..local import registry, sparse
from ..local.blocks import load_blocks
from ..optim.distributed import DistributedOptimizer
from ..pyro_internals import replace_unconstrained
from . import contents, extensions, files
from .optim_state import check_pyro_optim


def save(path: str | os.PathLike[str], optim: DistributedOptimizer) -> None:
    """:func:`~pyro_distributed.save_checkpoint` of a run with a Pyro optimizer."""
    engine = optim.engine
    rng_states = files.gather_rng(engine)
    store = pyro.get_param_store()
    local = {name: p for name, p in registry.local_params().items() if name in store}
    optim_state = optim.get_state()
    extension_states = extensions.gather(engine, optim)

    def state(local_meta: dict[str, Any] | None) -> dict[str, Any]:
        saved_store = store.get_state()
        return {
            **files.header(engine, optim.num_steps, "param_store"),
            "param_store": {
                "params": _without(saved_store["params"], local),
                "constraints": saved_store["constraints"],
            },
            "optim": _without(optim_state, local),
            "rng": rng_states,
            "local": local_meta,
            extensions.KEY: extension_states,
        }

    values = dict(store.named_parameters()) if local else {}
    files.commit(path, engine, state, local, values, optim_state)


def load(
    path: str | os.PathLike[str],
    optim: DistributedOptimizer,
    missing_ok: bool,
    *,
    trusted: bool = False,
    strict: bool = True,
    with_local: bool = True,
    with_optim: bool = True,
) -> int:
    """:func:`~pyro_distributed.load_checkpoint` of a run with a Pyro optimizer
    (``with_local=False``: leaving local parameters' blocks on disk;
    ``with_optim=False``: the parameters alone, not the optimizer's state)."""
    engine = optim.engine
    found = files.read(path, engine, missing_ok, trusted=trusted)
    if found is None:
        return 0
    state, where = found
    if not with_local:
        state = {**state, "local": None}
    local: dict[str, registry.LocalParam] = {}

    def check() -> None:  # everything the load reads, before it changes anything
        contents.check(state, repr(os.fspath(path)))
        if state.get("kind", "param_store") != "param_store":
            raise ValueError(
                f"the checkpoint {os.fspath(path)!r} is of a module trained with a torch "
                f"optimizer; load it with load_checkpoint(path, optimizer, module=...)"
            )
        local.update(files.local_params_of(state))
        _check_compatible(os.fspath(path), state, local, strict)
        if with_optim:
            saved = state["param_store"]["params"]
            check_pyro_optim(optim.wrapped, state["optim"], saved, repr(os.fspath(path)))
            extensions.check(state, optim, engine, repr(os.fspath(path)))

    files.agree(engine, check)

    values: dict[str, torch.Tensor] = {}
    local_state: dict[str, Any] = {}
    if state.get("local") is not None:
        # Each worker reads the blocks it needs, from where worker 0 found the
        # checkpoint, before anything changes: a block that cannot be read
        # leaves the run as it was.
        values, local_state = load_blocks(where, state["local"], local, engine, trusted=trusted)
    _restore_param_store(state["param_store"], local)
    if values:
        _restore_local(values, local, state["param_store"]["constraints"])
    optim.forget()
    sparse.drop_reads()  # rows read before the load are of the replaced tensors
    if strict:
        # Names not created yet (a guide's, before its first call) are checked
        # at the first step, against what it steps.
        optim.expect_parameters(set(state["param_store"]["params"]) | set(local), os.fspath(path))
    if with_optim:
        optim.set_state({**state["optim"], **local_state})
        # Last: under a policy that lets workers step alone, each worker's own
        # optimizer state (and parameters, between sync points) replace worker 0's.
        extensions.restore(state, optim, engine, repr(os.fspath(path)))
    optim.num_steps = state["num_steps"]
    files.restore_rng(state, engine)
    return int(state["num_steps"])


def save_store(path: str | os.PathLike[str], engine: Engine) -> None:
    """The param store alone (and every worker's owned rows), through a stand-in
    optimizer that never steps: for carrying what workers trained elsewhere (a
    collective)."""
    save(path, DistributedOptimizer(SGD({}), engine=engine))


def load_store_here(path: str | os.PathLike[str], *, with_local: bool = True) -> None:
    """Load a checkpoint's param store into this process alone, at one worker:
    values written into the tensors that exist here, owned rows joined in order
    (``with_local=False``: left on disk); names only one side has are left alone.
    The optimizer's state stays in the file, for a launch's ``resume=``."""
    stand_in = DistributedOptimizer(SGD({}), engine=LocalEngine())
    load(path, stand_in, False, strict=False, with_local=with_local, with_optim=False)


def _restore_param_store(saved: dict[str, Any], local: dict[str, Any]) -> None:
    """Put the saved values into the param store.

    Parameters that already exist are overwritten in place, not replaced:
    ``PyroModule`` and ``pyro.module`` networks hold their own tensors, and
    would silently keep training their old values if the store swapped them.
    """
    store = pyro.get_param_store()
    current = dict(store.named_parameters())
    with torch.no_grad():
        for name, value in saved["params"].items():
            if name in current:
                current[name].copy_(value)
    fresh = {name: value for name, value in saved["params"].items() if name not in current}
    constraints = {name: c for name, c in saved["constraints"].items() if name not in local}
    store.set_state({"params": fresh, "constraints": constraints})


def _restore_local(
    values: dict[str, torch.Tensor],
    local: dict[str, registry.LocalParam],
    constraints: dict[str, Any],
) -> None:
    """Install this worker's rows of each local parameter, bit for bit."""
    store = pyro.get_param_store()
    current = dict(store.named_parameters())
    registry.unregister(local)
    for name, value in values.items():
        if name in current and current[name].shape == value.shape:
            with torch.no_grad():
                current[name].copy_(value)
        elif name in current:
            replace_unconstrained(name, value)  # it still held all N rows
        else:
            fresh = value.clone().requires_grad_(True)
            store.set_state({"params": {name: fresh}, "constraints": {name: constraints[name]}})
        registry.register(local[name])


def _without(entries: dict[str, Any], names: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in entries.items() if name not in names}


def _check_compatible(
    path: str, state: dict[str, Any], local: dict[str, Any], strict: bool
) -> None:
    """Refuse a checkpoint whose parameters contradict the ones already created:
    names (unless not ``strict``), shapes, dtypes and constraints."""
    saved = state["param_store"]["params"]
    store = pyro.get_param_store()
    current = dict(store.named_parameters())
    unknown, reshaped = files.mismatches(current, saved, local)
    if not strict:
        unknown = []
        current = {name: value for name, value in current.items() if name in saved or name in local}
    constraints = store.get_state()["constraints"]
    saved_constraints = state["param_store"]["constraints"]
    constrained = sorted(
        f"{name!r}: {saved_constraints[name]} saved, {constraints[name]} now"
        for name in set(current) & set(saved_constraints)
        if name in constraints and not same_constraint(constraints[name], saved_constraints[name])
    )
    if unknown or reshaped or constrained:
        details = []
        if constrained:
            details.append(f"parameters differ in constraint ({', '.join(constrained)})")
        if unknown:
            details.append(f"parameters {unknown} exist now but not in the checkpoint")
        if reshaped:
            shown = ", ".join(
                f"{name!r}: "
                + (
                    f"{list(saved[name].shape)} {saved[name].dtype} saved"
                    if name in saved
                    else f"{local[name].size} rows along plate {local[name].plate!r} saved"
                )
                + f", {list(current[name].shape)} {current[name].dtype} now"
                for name in reshaped
            )
            details.append(f"parameters differ in shape or dtype ({shown})")
        raise ValueError(f"the checkpoint {path!r} is of a different model: {'; '.join(details)}")


def same_constraint(first: Any, second: Any) -> bool:
    """Whether two constraints are the same: of one class, with equal attributes
    (bounds, a base constraint and its event dimensions, ...)."""
    if type(first) is not type(second):
        return False
    if isinstance(first, torch.Tensor):
        return bool(first.shape == second.shape and torch.equal(first, second))
    if isinstance(first, torch.distributions.constraints.Constraint):
        mine, theirs = vars(first), vars(second)
        return mine.keys() == theirs.keys() and all(
            same_constraint(mine[key], theirs[key]) for key in mine
        )
    return bool(first == second)
