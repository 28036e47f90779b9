"""What the step's extensions keep across steps, in and out of checkpoints.

Two extensions of a step keep state: a communication hook
(:class:`~pyro_distributed.LowRankHook`'s error feedback and warm-start
factors) and a step policy (:class:`~pyro_distributed.DiLoCo`'s period
start and outer momentum). Under a policy that lets workers step alone, a
worker also keeps its own between two sync points: its shared parameters and
its modules' buffers. :class:`ExtensionState` turns all of it into plain data
(:meth:`ExtensionState.saved`), and back (:meth:`ExtensionState.load`), for
the reducer, which knows when the workers are in sync; checkpoints save it
for every worker (:mod:`pyro_distributed.checkpoint.extensions`).

An extension that keeps state keeps it by bucket or parameter name, and two
optimizers' names can be the same (``param_groups[0][0]``): one instance
serves one optimizer (:func:`claim`).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..exchange import CommHook, NarrowedHook
from ..policies import StepPolicy
from .module_buffers import named_buffers, trained_modules
from .options import ReducerOptions


class ExtensionState:
    """The state of one optimizer's hook and step policy, and a worker's own.

    :param options: the optimizer's options (its hook and policy).
    :param catalog: every tensor the optimizer could step, by shared name, read
        live: where a worker's own parameters are put back.
    :param catalog_name: what the catalog is called in errors ("param store").
    :param owner: the object the extensions serve (:func:`claim`).
    """

    def __init__(
        self,
        options: ReducerOptions,
        catalog: Mapping[str, Tensor],
        catalog_name: str,
        owner: object,
    ) -> None:
        self.hook = options.reduction.hook
        self.policy = options.step_policy
        self._catalog = catalog
        self._catalog_name = catalog_name
        claim(self.stateful_hook(), owner, "comm_hook")
        policy = self.policy
        if policy is not None and (policy.steps_alone or _keeps_state(policy, StepPolicy)):
            claim(policy, owner, "step_policy")

    def saved(self, own: Mapping[str, Tensor] | None) -> dict[str, Any]:
        """``{"comm_hook": ..., "step_policy": ...}``: the hook's and the
        policy's ``state_dict()`` (``{}`` for the defaults); with ``own`` (this
        worker's shared parameters, between two sync points), also those
        (``"parameters"``) and the trained modules' buffers (``"buffers"``)."""
        hook, policy = self.hook, self.policy
        state: dict[str, Any] = {
            "comm_hook": {} if hook is None else hook.state_dict(),
            "step_policy": {} if policy is None else policy.state_dict(),
        }
        if own is not None:
            state["parameters"] = {name: tensor.detach().clone() for name, tensor in own.items()}
            # BatchNorm's running statistics are each worker's too.
            state["buffers"] = {name: b.clone() for name, b in self._trained_buffers()}
        return state

    def load(self, state: Mapping[str, Any]) -> dict[str, Tensor]:
        """Continue the hook and the policy from ``state`` (a :meth:`saved`;
        ``{}``: afresh) and put back this worker's own parameters and buffers;
        return those parameters (``{}`` at a sync point).

        :raises ValueError: for state the extensions do not keep, or own
            parameters or buffers that are not here.
        """
        _load_into(state, self.hook, self.policy)
        own: dict[str, Tensor] = dict(state.get("parameters") or {})
        buffers = state.get("buffers") or {}
        held_buffers = dict(self._trained_buffers()) if buffers else {}
        with torch.no_grad():
            for name, value in own.items():
                held = self._catalog.get(name)
                if held is None or held.shape != value.shape:
                    raise ValueError(
                        f"step policy: this worker's saved parameter {name!r} is not in the "
                        f"{self._catalog_name}, or not in that shape"
                    )
                held.copy_(value)
            for name, value in buffers.items():
                buffer = held_buffers.get(name)
                if buffer is None or buffer.shape != value.shape:
                    raise ValueError(
                        f"step policy: this worker's saved buffer {name!r} is not among the "
                        f"trained modules' buffers, or not in that shape"
                    )
                buffer.copy_(value)
        return own

    def try_load(self, state: Mapping[str, Any]) -> None:
        """:meth:`load` into copies of the hook and the policy, changing nothing.
        The parameters are checked against the file's own, which a load
        restores first; here, that they are tensors by name."""
        _load_into(state, copy.deepcopy(self.hook), copy.deepcopy(self.policy))
        for key in ("parameters", "buffers"):
            own = state.get(key) or {}
            if not isinstance(own, Mapping) or not all(isinstance(t, Tensor) for t in own.values()):
                raise ValueError(f"step policy: this worker's {key} are not tensors by name")

    def keeps_state(self) -> bool:
        """Whether an extension may keep state across steps (its class says so,
        or the policy lets workers step alone)."""
        policy = self.policy
        return self.stateful_hook() is not None or (
            policy is not None and (policy.steps_alone or _keeps_state(policy, StepPolicy))
        )

    def stateful_hook(self) -> CommHook | None:
        """The user's hook (under a narrowing), if its class keeps state."""
        hook = self.hook
        while isinstance(hook, NarrowedHook):
            hook = hook.hook
        if hook is None or not _keeps_state(hook, CommHook):
            return None
        return hook

    def _trained_buffers(self) -> list[tuple[str, Tensor]]:
        """The buffers of the modules whose parameters the optimizer steps, by
        the names :func:`~.module_buffers.named_buffers` gives them (found from
        the catalog, so also before the first step after a load)."""
        return named_buffers(trained_modules(list(self._catalog.values())))


def _load_into(state: Mapping[str, Any], hook: CommHook | None, policy: StepPolicy | None) -> None:
    if hook is not None:
        hook.load_state_dict(state.get("comm_hook") or {})
    elif state.get("comm_hook"):
        raise ValueError(
            "the checkpoint holds a communication hook's state, and this optimizer "
            "has none: pass the comm_hook it was saved with"
        )
    if policy is not None:
        try:
            policy.load_state_dict(state.get("step_policy") or {})
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"step policy: {exc}") from exc
    elif state.get("step_policy") or state.get("parameters") or state.get("optimizer"):
        raise ValueError(
            "the checkpoint holds a step policy's state, and this optimizer has none: "
            "pass the step_policy it was saved with"
        )


def _keeps_state(extension: Any, base: type) -> bool:
    """Whether ``extension``'s class overrides ``state_dict`` of ``base``."""
    return type(extension).state_dict is not base.state_dict  # type: ignore[attr-defined]


#: The extensions that keep state, by id: each with the object it serves (both weakly).
_SERVING: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}


def claim(extension: Any, owner: object, option: str) -> None:
    """Let ``extension`` (a hook, a step policy: the ``option``) serve
    ``owner`` alone; ``ValueError`` if it serves another already."""
    if extension is None:
        return
    for key, (held, served) in list(_SERVING.items()):
        if held() is None or served() is None:
            del _SERVING[key]
    serving = _SERVING.get(id(extension))
    if serving is not None and serving[0]() is extension and serving[1]() is not owner:
        raise ValueError(
            f"{option}: this {type(extension).__name__} already serves another optimizer; "
            f"one that keeps state keeps it for one optimizer's tensors: give each optimizer "
            f"its own (copy.deepcopy, or a new one)"
        )
    _SERVING[id(extension)] = (weakref.ref(extension), weakref.ref(owner))
