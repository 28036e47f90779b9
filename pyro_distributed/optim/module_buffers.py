"""Module buffers made identical on every worker at the end of every step.

Parameters stay identical because their gradients are averaged. A module's
floating-point buffers (BatchNorm's ``running_mean`` and ``running_var``,
anything registered with ``register_buffer``) change in the forward pass,
on each worker from its own batch, and nothing else brings them together:
without this, every worker would predict, evaluate and checkpoint with its
own statistics.

**Averaged, not worker 0's.** DDP's ``broadcast_buffers`` copies worker 0's
buffers at each forward, so its replicas differ by the last step's update
and the statistics come from worker 0's data alone. Here the buffers are
averaged after the step, so every worker ends every step with the same
values, and they summarise every worker's batch: a BatchNorm's running mean
moves by ``momentum`` times the mean of the workers' batch means, as it
would with their combined batch. Each worker sends its change since the
last step's agreed values and adds the mean change to them, so a buffer
that no worker changed (a module in ``eval()`` mode, a frozen network)
keeps its bits at any W (averaging W equal values could move its last bit
at W=3).

**Finding the modules.** An optimizer is handed tensors, not modules. When
a step hands over a parameter by a name not seen before (the first step, a
parameter added), the live modules holding them are found once, by a scan
of Python's objects (``gc``); kept are the topmost modules every one of
whose parameters this optimizer steps, and the buffers of all their
submodules are synced. That covers ``pyro.module`` networks and
``PyroModule``s (their parameters are the param store's tensors), the ELBO
module of the torch-native loop and a LightningModule. A module none of
whose parameters this optimizer steps (a BatchNorm without ``affine``
outside any trained module, a frozen network beside the trained one) is not
covered: nothing tells the optimizer that it belongs to the run. The
buffers are listed again only when the step's parameter names change, so
a buffer registered after training started (rare: lazy modules register
theirs at the first forward) joins when the parameters next change.

Integer buffers (``num_batches_tracked``) are not averaged: every worker
counts the same batches. :func:`~pyro_distributed.assert_in_sync` compares
them with the floating-point ones.

The cost: one all-reduce per step of the buffers' bytes (one per dtype),
started before the wrapped optimizer steps and awaited after it, and
nothing at all when the trained modules have no floating-point buffer.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Collection, Iterable, Mapping

import torch
from torch import Tensor

from ..consensus import ABSENT, require_agreement
from ..engines import Engine


def trained_modules(params: Collection[Tensor]) -> list[torch.nn.Module]:
    """The topmost live modules every one of whose parameters is in ``params``
    (and which hold at least one), in a fixed order: that of ``params``.

    A scan of every object Python tracks: call it when ``params`` change, not
    at every step.
    """
    wanted = {id(param): index for index, param in enumerate(params)}
    # type(), not isinstance: isinstance reads __class__, which some objects
    # (torch.distributed's deprecated reduce_op) answer with a warning.
    module_type = torch.nn.Module
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), module_type)]
    parents: dict[int, list[torch.nn.Module]] = {}
    for module in modules:
        for child in module._modules.values():
            if child is not None:
                parents.setdefault(id(child), []).append(module)

    known: dict[int, bool] = {}

    def trained(module: torch.nn.Module) -> bool:
        if id(module) not in known:
            ids = [id(param) for param in module.parameters()]
            known[id(module)] = bool(ids) and all(i in wanted for i in ids)
        return known[id(module)]

    roots: dict[int, tuple[int, torch.nn.Module]] = {}
    for module in modules:
        if not any(id(p) in wanted for p in module._parameters.values() if p is not None):
            continue
        top = module
        while True:
            above = [parent for parent in parents.get(id(top), ()) if trained(parent)]
            if not above:
                break
            top = above[0]
        if trained(top):
            first = min(wanted[id(p)] for p in top.parameters())
            roots[id(top)] = (first, top)
    return [module for _, module in sorted(roots.values(), key=lambda pair: pair[0])]


def named_buffers(
    roots: Iterable[torch.nn.Module], floating_only: bool = False
) -> list[tuple[str, Tensor]]:
    """The buffers of ``roots`` and their submodules, each once, named by the
    root's place and the buffer's path (the same names on every worker)."""
    seen: set[int] = set()
    found = []
    for number, root in enumerate(roots):
        for name, buffer in root.named_buffers():
            if (buffer.is_floating_point() or not floating_only) and id(buffer) not in seen:
                seen.add(id(buffer))
                found.append((f"module {number}: {name}", buffer))
    return found


#: The buffers to average, by dtype (:meth:`ModuleBuffers.groups`).
BufferGroups = dict[torch.dtype, list[Tensor]]


class ModuleBuffers:
    """Averages the floating-point buffers of the modules being trained (see the module docstring).

    :param engine: the engine to average over (more than one worker).
    """

    def __init__(self, engine: Engine, agreed: Mapping[torch.dtype, Tensor] | None = None) -> None:
        self._engine = engine
        self._seen: dict[str, Tensor] = {}
        self._roots: list[torch.nn.Module] = []
        self._checked = False
        # The values every worker agreed on at the end of the last step, per
        # dtype (``agreed``: a checkpoint's, so that a resumed run averages
        # from where the saved one would have, to the bit).
        self._agreed: dict[torch.dtype, Tensor] = dict(agreed or {})
        self._keep_agreed = bool(agreed)

    def found(self, named: Mapping[str, Tensor]) -> list[torch.nn.Module]:
        """The modules being trained, found again when a name in ``named`` is new.

        Names are kept across steps, so that a parameter used in some steps
        only does not make every other step scan for modules again.
        """
        if any(name not in self._seen for name in named):
            self._seen.update(named)
            self._roots = trained_modules(list(self._seen.values()))
            if not self._keep_agreed:  # (the first modules found after a load: the file's)
                self._agreed = {}
            self._keep_agreed = False
            self._checked = False
        return self._roots

    @property
    def agreed(self) -> dict[torch.dtype, Tensor]:
        """The buffers' values every worker agreed on at the last average, per dtype."""
        return dict(self._agreed)

    @property
    def roots(self) -> list[torch.nn.Module]:
        """The modules found at the last step."""
        return self._roots

    def groups(self, named: Mapping[str, Tensor]) -> BufferGroups:
        """The floating-point buffers of the modules holding ``named`` (a step's
        parameters, by names every worker shares), by dtype. The first call is
        a collective (every worker must have found the same buffers). The
        step's plan keeps them while its parameters stay the same."""
        buffers = named_buffers(self.found(named), floating_only=True)
        if not self._checked:
            self._check(buffers)
        groups: BufferGroups = {}
        for _, buffer in buffers:
            groups.setdefault(buffer.dtype, []).append(buffer)
        return groups

    def start(self, groups: BufferGroups) -> Callable[[], None]:
        """Start averaging ``groups`` (:meth:`groups`); the returned function
        finishes it. A collective when there are buffers, on every worker
        alike; it travels while the optimizer steps (which reads no buffer),
        so it costs little more than its bytes."""
        if not groups:
            return _nothing
        sent = []
        for dtype, group in groups.items():
            flat = torch.cat([buffer.detach().reshape(-1) for buffer in group])
            agreed = self._agreed.get(dtype)
            if agreed is None or agreed.shape != flat.shape:
                agreed = torch.zeros_like(flat)
            delta = flat.sub_(agreed)  # this worker's change since the last step
            name = f"pyro_distributed.buffers.{dtype}"
            pending = self._engine.allreduce_async_(delta, op="sum", name=name)
            sent.append((pending, dtype, group, agreed, delta))

        def finish() -> None:
            inverse = 1.0 / self._engine.world_size
            for pending, dtype, group, agreed, delta in sent:
                pending.wait()
                with torch.no_grad():
                    new = agreed.add_(delta.mul_(inverse))
                    self._agreed[dtype] = new
                    chunks = torch.split(new, [buffer.numel() for buffer in group])
                    for buffer, chunk in zip(group, chunks, strict=True):
                        buffer.copy_(chunk.view_as(buffer))

        return finish

    def _check(self, buffers: list[tuple[str, Tensor]]) -> None:
        """Check that every worker found the same buffers (a collective, once)."""
        self._checked = True
        require_agreement(
            self._engine,
            {name: (str(b.dtype), tuple(b.shape)) for name, b in buffers},
            message=lambda name, split: (
                f"workers disagree on the module buffer {name!r} ({split}); every worker "
                f"must train the same modules"
            ),
            describe=lambda value: "absent" if value is ABSENT else f"{value[0]} {list(value[1])}",
        )


def _nothing() -> None:
    """The finish of a step with no buffers to average."""
