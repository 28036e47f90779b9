"""GradientSync: one object that owns a step's gradient exchange.

A front end calls :meth:`GradientSync.exchange` once per optimizer step with
the tensors it is about to step, by name, and gets back the agreed tensors
with their ``.grad`` replaced by the average over workers. Inside, in the
same order on every worker:

1. the workers agree on the sorted list of tensors, and new ones take worker
   0's values (:mod:`.agreement`);
2. their gradients are averaged in fused buckets (:mod:`.averager`,
   :mod:`.layout`); with overlap, most buckets already left during backward
   (:mod:`.overlap`), and step 1 confirms they held the right tensors.

With overlap, the agreement header travels as riders of the last bucket: the
digest floats of :func:`~.agreement.digest_floats` (in pieces the wire sums
exactly), one stale flag per bucket, then the flag that some gradient which
never travels (a local parameter's) is NaN or Inf on that worker; without
overlap that flag rides in the agreement's header. Either way a step with
local parameters costs no collective of its own. This module is the only one that knows that order.

The exchange knows nothing of Pyro: tensors come with names chosen by the
front end, and ``catalog`` says which tensors a worker could step, for the
rare step in which workers proposed different ones.

The steady state runs a fixed plan. Once a step gives the same tensors under
the same names as the last one (one pass builds the key, names and object
ids, and one comparison checks it), the agreement hands back the same
proposal and the same step tuples, the averager and the overlap see those
tuples by identity and keep their buckets and hooks, and nothing is renamed,
sorted, hashed or planned again; a bucket is packed by one flatten in C++.
The digest still rides in every header, so a worker whose tensors changed
is caught at that very step, and every worker re-plans together. Each
bucket keeps its buffer from step to step, with one view per member made
once (:mod:`.resident`, as DDP's ``gradient_as_bucket_view``): a step copies
the gradients in with one call, and points each ``.grad`` at the view it had
last step. Pyro replaces every ``.grad`` with fresh zeros after a step and
torch's ``zero_grad`` sets it to ``None``, so the one copy into the bucket
is the floor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from ..engines import Engine
from .agreement import (
    Catalog,
    ParameterAgreement,
    Proposal,
    StepParams,
    digests_equal,
)
from .averager import GradientAverager, Reduction
from .overlap import BackwardOverlap


@dataclass(frozen=True)
class Exchanged:
    """The outcome of one exchange."""

    #: The agreed tensors, sorted by name; each ``.grad`` is now the average.
    names: tuple[str, ...]
    tensors: tuple[Tensor, ...]
    #: Names this worker was not given but steps because another worker was;
    #: their ``.grad`` should be dropped after the step.
    borrowed: frozenset[str]
    #: Whether every averaged gradient is finite (the same on every worker).
    finite: bool

    def release_borrowed(self) -> None:
        """Drop the gradients of borrowed tensors, after the step: this worker's
        own loop will not zero them, and a stale average must not count as
        this worker's gradient next step."""
        if not self.borrowed:
            return
        for name, tensor in zip(self.names, self.tensors, strict=True):
            if name in self.borrowed:
                tensor.grad = None


class GradientSync:
    """Agrees on a step's tensors and averages their gradients across workers.

    :param engine: the engine to average over (more than one worker).
    :param cap_bytes: the largest fused bucket, in bytes.
    :param reduction: how gradients are combined and compressed.
    :param overlap: start buckets during backward.
    :param measure_norms: measure squared norms for :meth:`squared_norms`.
    :param catalog_name: what the catalog is called in error messages.
    """

    def __init__(
        self,
        engine: Engine,
        cap_bytes: int,
        reduction: Reduction,
        *,
        overlap: bool = True,
        measure_norms: bool = False,
        catalog_name: str = "param store",
    ) -> None:
        self._world_size = engine.world_size
        self._agreement = ParameterAgreement(engine, cap_bytes, catalog_name)
        self._averager = GradientAverager(engine, cap_bytes, reduction, measure_norms)
        self._overlap = BackwardOverlap(engine, self._averager) if overlap else None

    @property
    def overlaps(self) -> bool:
        """Whether buckets may leave during backward (``overlap=True``)."""
        return self._overlap is not None

    @property
    def overlap_armed(self) -> bool:
        """Whether buckets are leaving during backward now (from the third step on)."""
        return self._overlap is not None and self._overlap.armed

    @property
    def bucket_count(self) -> int:
        """How many buckets the last exchange used."""
        return len(self._averager.buckets)

    def exchange(
        self, given: Mapping[str, Tensor], catalog: Catalog, *, nonfinite_here: bool = False
    ) -> Exchanged:
        """Average the gradients of ``given`` (a collective: every worker calls it).

        :param given: the tensors this worker steps, by shared name.
        :param catalog: every tensor this worker could step, by name (called
            only when workers proposed different tensors).
        :param nonfinite_here: whether a gradient that never travels (a local
            parameter's) is NaN or Inf on this worker. It rides in the header,
            so that every worker's ``finite`` says "no worker has one" without
            a collective of its own.
        :raises PyroDistributedError: when the workers' tensors cannot be
            reconciled (missing somewhere, different shapes), naming them.
        """
        proposal = self._agreement.propose(given)
        overlap = self._overlap
        flag = int(nonfinite_here)
        if overlap is None or not overlap.armed:
            settlement = self._agreement.settle(proposal, catalog, [flag])
            step, nonfinite_somewhere = settlement.step, settlement.riders[0] > 0
            finite = self._averager.average_(step.names, step.tensors)
        else:
            step, finite, nonfinite_somewhere = self._exchange_overlapped(
                proposal, catalog, overlap, flag
            )
        if overlap is not None:
            overlap.after_step(step.names, step.tensors)
        return Exchanged(
            step.names, step.tensors, step.borrowed, finite and not nonfinite_somewhere
        )

    def _exchange_overlapped(
        self, proposal: Proposal, catalog: Catalog, overlap: BackwardOverlap, flag: int
    ) -> tuple[StepParams, bool, bool]:
        """The step, whether its averages are finite, and whether some worker's
        ``flag`` (a non-finite gradient that does not travel) was raised."""
        # Every bucket leaves before the header, on every worker alike; the
        # header then says whether they held the right tensors.
        overlap.send_remaining()
        stale = overlap.stale_flags()
        if overlap.carrier is not None:
            digest = proposal.floats_in(overlap.digest_bits)
            summed = overlap.send_carrier([*digest, *stale, flag])
            unanimous = digests_equal(summed[: len(digest)], self._world_size)
            resend = [int(value > 0) for value in summed[len(digest) : -1]]
            raised = summed[-1] > 0
            if unanimous and not proposal.new and _same(proposal.names, overlap.names):
                return self._agreement.accept(proposal), overlap.finish(resend), raised
            overlap.discard()
            step = self._agreement.settle(proposal, catalog).step
        else:
            settlement = self._agreement.settle(proposal, catalog, [*stale, flag])
            step, raised = settlement.step, settlement.riders[-1] > 0
            if settlement.unchanged and _same(step.names, overlap.names):
                return step, overlap.finish(resend=settlement.riders[:-1]), raised
            overlap.discard()
        return step, self._averager.average_(step.names, step.tensors), raised

    def average_alone_(self, tensor: Tensor) -> Tensor:
        """``tensor``, in place, as the exchange would average it if every other
        worker sent zeros for it (a local parameter's gradient, which never
        travels); no communication. See ``GradientAverager.average_alone_``."""
        return self._averager.average_alone_(tensor)

    def squared_norms(self) -> tuple[float, float]:
        """``(mean_i |g_i|^2, |mean_i g_i|^2)`` of the last exchange (needs
        ``measure_norms``); a collective when a bucket could not carry its norm."""
        return self._averager.squared_norms()

    def forget(self) -> None:
        """Treat every tensor as new again and drop the overlap's plan (after the
        tensors were replaced, for example by loading a checkpoint)."""
        self._agreement.forget()
        if self._overlap is not None:
            self._overlap.reset()


def _same(names: tuple[str, ...], planned: tuple[str, ...]) -> bool:
    """Whether two lists of names are equal; at once when they are the same tuple,
    as they are in the steady state."""
    return names is planned or names == planned
