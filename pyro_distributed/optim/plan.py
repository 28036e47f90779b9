"""StepPlan: what a step works out from its tensors, worked out once.

A step in the steady state steps the same tensors as the last one, and
everything that follows from them is the same too: their names, which of
them are local, this worker's proposal to the others, the buckets their
gradients travel in (with the buffers those keep from step to step), the
multi-tensor groups that step them and the module buffers averaged after
them. A :class:`StepPlan` holds all of it, for one set of tensors, and a
step of the same tensors reuses it whole. DDP's reducer does the same with
its buckets: it builds them once and again only when the parameters change.

**When a plan is made.** :meth:`DataParallelStep.plan
<pyro_distributed.optim.step.DataParallelStep.plan>` compares the key its
front end gives (the ids of the tensors it is about to step: one pass, in
C) and the local registry's generation with the last plan's. A new plan is
made when

* the front end's tensors changed (another set, another order where order
  names them, a parameter re-created);
* a tensor became local or stopped being local (the registry's generation);
* :meth:`~pyro_distributed.optim.step.DataParallelStep.forget` dropped the
  last one (a checkpoint replaced the tensors).

Forgetting is dropping the plan. A plan holds its tensors, so their ids
cannot be taken by other tensors while it lives.

**How it fills in.** Each part is made the first time a step needs it:
the names, the split and the :class:`~pyro_distributed.exchange.ExchangePlan`
at the first exchange (none with one worker); the multi-tensor groups at
the first grouped step; the module-buffer groups at the first finish. The
exchange keeps its part up to date itself (a proposal made again once its
new tensors are synchronised; buckets planned again when the workers agree
on other tensors). What the optimizer steps follows the tensors the workers
agreed on (:meth:`StepPlan.follow`): in the steady state the very tuple of
the last step, so nothing is made again; when they agreed on other tensors
(a tensor borrowed from another worker), the stepped tensors, the groups
and the buffer groups are made again for them.

**What a caller may not change.** Nothing a plan holds: not its tuples, not
its dicts (``replicated``, ``local``), which are handed on to the
exchange and the optimizer as they are. A front end whose tensors change
gives a new key.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from torch import Tensor

from ..exchange import ExchangePlan
from .module_buffers import BufferGroups
from .multi_tensor import GroupedSteps


@dataclass(eq=False)
class StepPlan:
    """The plan of a step for one set of tensors (see the module docstring)."""

    #: The front end's key for its tensors, and the tensors (held).
    key: Hashable
    tensors: tuple[Tensor, ...]
    #: The local registry's generation when the plan was made.
    generation: int
    #: The tensors by the names every worker shares, split (at the first exchange).
    replicated: dict[str, Tensor] = field(default_factory=dict)
    local: dict[str, Tensor] = field(default_factory=dict)
    #: The exchange's part (at the first exchange; ``None`` with one worker).
    exchange: ExchangePlan | None = None
    #: The dense tensors the optimizer steps: the agreed ones, then the local ones.
    stepped: tuple[Tensor, ...] = ()
    #: The front end's multi-tensor groups for :attr:`stepped` (made by the front end).
    groups: GroupedSteps | None = None
    #: The module buffers to average, and the sparse local parameters they were found with.
    buffers: BufferGroups | None = None
    buffers_with: tuple[str, ...] = ()
    _agreed: tuple[Tensor, ...] | None = None

    def follow(self, agreed: tuple[Tensor, ...]) -> None:
        """Step ``agreed`` (the tensors every worker agreed on, then the local
        ones): at once when they are the last step's tuple; otherwise the
        parts made for the last ones are made again when needed."""
        if agreed is self._agreed:
            return
        self._agreed = agreed
        self.stepped = (*agreed, *self.local.values()) if self.local else agreed
        self.groups, self.buffers = None, None
