"""Every worker's state of the step's extensions, in a checkpoint and back.

A communication hook may keep state across steps that differs from worker to
worker (:class:`~pyro_distributed.LowRankHook`'s error feedback is each
worker's own; its warm-start factors are the same everywhere). A checkpoint
holds it for every worker, by rank, under ``"extensions"``: :func:`gather`
collects each worker's
:meth:`~pyro_distributed.optim.front_end.FrontEnd.extension_state` at a
save, and :func:`restore` hands each worker its own at a load, after the
optimizer forgot its tensors, so that a resumed run, or one rolled back in
the same process, continues exactly.

Loaded at another number of workers, per-worker state cannot be split or
joined without changing what it means: the extensions start afresh, with a
:class:`RuntimeWarning` on every worker. A file written before checkpoints
held extension state (format version 4) has none to give: a hook that keeps
state starts afresh, with the same warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ..engines import Engine
from ..optim.front_end import FrontEnd

#: Where the extensions' states live in a checkpoint (and under Lightning's key).
KEY = "extensions"


def gather(engine: Engine, optim: FrontEnd) -> list[dict[str, Any]]:
    """Every worker's extension state, by rank (a collective)."""
    states: list[dict[str, Any]] = engine.allgather_object(optim.extension_state())
    return states


def check(saved: Mapping[str, Any], optim: FrontEnd, engine: Engine, shown: str) -> None:
    """Refuse, before anything changes, a file (``saved``, the file ``shown``)
    whose hook state for this worker the optimizer's hook cannot take: state
    for an optimizer without a hook that keeps state, or state of another
    hook or configuration (tried on a copy of the hook). At another number of
    workers the state is not loaded, and not checked."""
    states = saved.get(KEY)
    if not states or saved.get("world_size") != engine.world_size:
        return
    mine = states[engine.rank]
    if not any(mine.get(key) for key in ("comm_hook", "step_policy", "parameters", "optimizer")):
        return
    if not optim.keeps_extension_state():
        if not mine.get("comm_hook"):
            raise ValueError(
                f"the checkpoint {shown} holds the state of a step policy that keeps state, "
                f"and this optimizer has none: pass the step_policy it was saved with"
            )
        raise ValueError(
            f"the checkpoint {shown} holds the state of a communication hook that keeps "
            f"state (LowRankHook's, say), and this optimizer has none: pass the comm_hook "
            f"it was saved with"
        )
    try:
        optim.try_extension_state(mine)
    except (ValueError, TypeError, KeyError) as exc:
        if str(exc).startswith("step policy"):
            raise ValueError(
                f"the checkpoint {shown} holds step policy state that this optimizer's "
                f"step policy cannot take ({exc}): pass the step_policy it was saved with"
            ) from exc
        raise ValueError(
            f"the checkpoint {shown} holds communication hook state that this "
            f"optimizer's hook cannot take ({exc}): pass the comm_hook it was saved with"
        ) from exc


def restore(saved: Mapping[str, Any], optim: FrontEnd, engine: Engine, shown: str) -> None:
    """Hand this worker's saved extension state (from ``saved``, a checkpoint's
    entries, the file ``shown``) to ``optim``; start afresh, with a warning
    where the file holds none for this number of workers."""
    states = saved.get(KEY)
    world_size = saved.get("world_size")
    keeps_state = optim.keeps_extension_state()
    if states is None:
        if keeps_state:
            _warn(f"the checkpoint {shown} holds no state of the communication hook or step policy")
        optim.load_extension_state({})
        return
    if world_size != engine.world_size:
        kept = ("comm_hook", "step_policy", "parameters", "optimizer")
        if keeps_state or any(state.get(key) for state in states for key in kept):
            policy = any(state.get("step_policy") for state in states)
            what = "the communication hook's"
            if policy:
                what = "the step policy's and each worker's own"
            _warn(
                f"the checkpoint {shown} holds {what} state of {world_size} workers, which "
                f"cannot be split among {engine.world_size}"
            )
        optim.load_extension_state({})
        return
    optim.load_extension_state(states[engine.rank])


def _warn(why: str) -> None:
    warnings.warn(
        f"{why}: it starts afresh (the parameters and the optimizer's state are restored; "
        f"the first steps differ from the uninterrupted run's)",
        RuntimeWarning,
        stacklevel=4,
    )
