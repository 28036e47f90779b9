"""Drift detection: are the workers' parameters and optimizer states still identical?

Averaging keeps workers bitwise identical only if everything else does too:
the same optimizer arguments, no per-worker edits to the param store, no
second-order optimizer working on a local Hessian. :func:`assert_in_sync`
checks, in one collective, a checksum of every parameter and every
per-parameter optimizer state, and names the first that differs. Local
parameters (:mod:`pyro_distributed.local.ownership`) are left out: each worker
holds its own rows of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyro
import torch

from .. import runtime
from ..engines import Engine
from ..errors import PyroDistributedError
from ..local.ownership import local_params

if TYPE_CHECKING:
    from .distributed import DistributedOptimizer

__all__ = ["assert_in_sync"]


def _feed(hasher: Any, value: Any) -> None:
    """Hash tensors by their bytes, containers in key order, anything else by repr."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous().reshape(-1)
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            hasher.update(repr(key).encode())
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(hasher, item)
    else:
        hasher.update(repr(value).encode())


def _checksum(value: Any) -> str:
    hasher = hashlib.blake2b(digest_size=8)
    _feed(hasher, value)
    return hasher.hexdigest()


def assert_in_sync(optim: DistributedOptimizer | None = None) -> None:
    """Raise on every worker if any parameter or optimizer state differs across workers.

    :param optim: also compare this optimizer's per-parameter state (and use
        its engine); without it, only the param store is compared.
    :raises PyroDistributedError: naming the first differing entry and which
        workers hold which version.

    Example::

        pyro_distributed.assert_in_sync(optim)   # e.g. after loading a checkpoint

    .. warning::
        A collective: call it on every worker at the same point.
    """
    engine: Engine = optim.engine if optim is not None else runtime.current_engine()
    # Local parameters differ across workers by design: each holds its own rows.
    local = local_params()
    entries = [
        (f"parameter {name!r}", _checksum(value))
        for name, value in sorted(pyro.get_param_store().named_parameters())
        if name not in local
    ]
    if optim is not None:
        state = optim.get_state()
        entries += [
            (f"optimizer state of {name!r}", _checksum(state[name]))
            for name in sorted(state, key=str)
            if name not in local
        ]
    views = engine.allgather_object(entries)
    if all(view == views[0] for view in views):
        return
    names = sorted({name for view in views for name, _ in view})
    for name in names:
        holders: dict[str | None, list[int]] = {}
        for rank, view in enumerate(views):
            holders.setdefault(dict(view).get(name), []).append(rank)
        if len(holders) > 1:
            groups = "; ".join(
                f"workers {ranks} hold " + ("none" if digest is None else f"version {digest}")
                for digest, ranks in holders.items()
            )
            raise PyroDistributedError(f"workers have drifted apart: {name} differs ({groups})")
