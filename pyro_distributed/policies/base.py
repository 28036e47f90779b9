"""What a step policy is, and the one collective the policies share.

The reducer asks its policy two things each step (:class:`StepPolicy`):
before the exchange, whether this step averages gradients; after the wrapped
optimizer stepped, what to do now (:meth:`StepPolicy.after_step`), which
returns whether the workers' shared parameters are identical again. That
answer is what the drift check and checkpoints read.

:func:`average_parameters` is the sync point's collective: one header that
proves every worker is at the same step with the same parameters (names,
shapes, dtypes), then the parameters themselves, summed and divided on every
worker alike, so the result is bitwise the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..consensus import require_agreement
from ..digest import digest_int
from ..engines import Engine
from ..errors import PyroDistributedError

#: Parameters averaged in one collective at most (in elements): bounds the
#: extra memory of a sync point.
_BUCKET_ELEMENTS = 8 * 2**20


@dataclass(frozen=True)
class StepContext:
    """What a policy sees after the wrapped optimizer stepped.

    :param engine: the engine every worker runs on (one worker included).
    :param step: how many steps the optimizer took before this one.
    :param averaged: whether this step averaged the gradients of parameters
        identical on every worker: then they are identical now. (The first step
        with new parameters averages between two sync points too; there the
        others still differ, and it counts as a step alone.)
    :param shared: the parameters every worker holds a copy of, by the names
        every worker shares; owned local parameters are never among them.

    Example::

        def after_step(self, context):
            if context.step % 8 == 7:  # average every 8 steps
                pd.policies.average_parameters(context.engine, context.shared, context.step)
                return True
            return context.averaged
    """

    engine: Engine
    step: int
    averaged: bool
    shared: Mapping[str, Tensor]


class StepPolicy:
    """When workers exchange, and what: subclass it for a policy of your own.

    The default methods are those of averaging every step. A policy that lets
    workers step alone overrides :meth:`averages_gradients` and
    :meth:`after_step`, and keeps its state where :meth:`state_dict` returns it.

    Example::

        class AverageEvery(pd.StepPolicy):  # local SGD in a few lines
            def __init__(self, period):
                self.period = period

            def averages_gradients(self, step):
                return False

            def after_step(self, context):
                if (context.step + 1) % self.period:
                    return False
                pd.policies.average_parameters(context.engine, context.shared, context.step)
                return True

    .. warning::
        A policy's answers must be the same on every worker at every step:
        they decide which collectives run. Decide from the step count and
        from state every worker shares, never from a worker's own data.
    """

    #: Whether workers may step alone between sync points (their parameters
    #: and the wrapped optimizer's state then differ from worker to worker).
    steps_alone: bool = False

    def averages_gradients(self, step: int) -> bool:
        """Whether step ``step`` (the steps taken before it) averages the
        gradients before the wrapped optimizer steps. A plan's first step
        averages whatever this says, so that every worker starts from worker
        0's parameters."""
        return True

    def after_step(self, context: StepContext) -> bool:
        """Run after the wrapped optimizer stepped (or skipped a non-finite
        step), on every worker; return whether the shared parameters are now
        identical on every worker (a sync point)."""
        return context.averaged

    def state_dict(self) -> dict[str, Any]:
        """What this worker's policy keeps across steps, as plain data."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`; ``{}``: afresh)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state; got {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def average_parameters(engine: Engine, shared: Mapping[str, Tensor], step: int) -> None:
    """Replace each of ``shared`` by its average over workers, in place, bitwise
    the same on every worker (a collective; with one worker, nothing to do).

    :raises PyroDistributedError: on every worker, if the workers are at other
        steps or hold other parameters (names, shapes, dtypes).

    Example::

        pd.policies.average_parameters(context.engine, context.shared, context.step)
    """
    world_size = engine.world_size
    if world_size == 1:
        return
    # By name: the order in which a front end lists its tensors is its own
    # (SVI hands over a set, whose order differs from process to process).
    layout = [(name, tuple(shared[name].shape), str(shared[name].dtype)) for name in sorted(shared)]
    mine = digest_int((step, layout)) % 2**62
    # Where the parameters live: a GPU engine's collectives take device tensors.
    device = next(iter(shared.values())).device if shared else torch.device("cpu")
    header = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    engine.allreduce_([header], "max", ["pyro_distributed.policy.header"])
    if int(header[0]) != mine or -int(header[1]) != mine:
        require_agreement(
            engine,
            {"step": step, "parameters": digest_int(layout)},
            message=lambda item, split: (
                f"the workers reached a sync point of their step policy with other {item} "
                f"({split}): every worker must step the same parameters, step for step"
            ),
        )
        raise PyroDistributedError(  # the gathered views agreed: the header itself did not
            "the workers reached a sync point of their step policy in disagreement"
        )
    with torch.no_grad():
        for index, group in enumerate(_buckets(shared)):
            flat = torch.cat([tensor.reshape(-1) for tensor in group])
            engine.allreduce_([flat], "sum", [f"pyro_distributed.policy.{index}"])
            flat.div_(world_size)
            offset = 0
            for tensor in group:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def _buckets(shared: Mapping[str, Tensor]) -> list[list[Tensor]]:
    """The tensors in sorted-name order, in groups of one dtype and device,
    each of at most :data:`_BUCKET_ELEMENTS` elements (or one tensor)."""
    groups: list[list[Tensor]] = []
    size = 0
    for name in sorted(shared):
        tensor = shared[name]
        last = groups[-1] if groups else None
        fits = (
            last is not None
            and last[0].dtype == tensor.dtype
            and last[0].device == tensor.device
            and size + tensor.numel() <= _BUCKET_ELEMENTS
        )
        if fits:
            assert last is not None
            last.append(tensor)
            size += tensor.numel()
        else:
            groups.append([tensor])
            size = tensor.numel()
    return groups
