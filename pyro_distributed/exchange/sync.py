"""GradientSync: one object that owns a step's gradient exchange.

A front end calls :meth:`GradientSync.exchange` once per optimizer step with
the tensors it is about to step, by name, and gets back the agreed tensors
with their ``.grad`` replaced by the average over workers. Inside, in the
same order on every worker:

1. the workers agree on the sorted list of tensors, and new ones take worker
   0's values (:mod:`.agreement`);
2. their gradients are averaged in fused buckets (:mod:`.averager`, each
   bucket owning its layout and trip in :mod:`.bucket`); with overlap, most
   buckets already left during backward (:mod:`.overlap`), and step 1
   confirms they held the right tensors.

With overlap, the agreement header travels as riders of the last bucket: the
digest floats of :func:`~.agreement.digest_floats` (in pieces the wire sums
exactly), one stale flag per bucket, then the flag that some gradient which
never travels (a local parameter's) is NaN or Inf on that worker; without
overlap that flag rides in the agreement's header. Either way a step with
local parameters costs no collective of its own. This module is the only one that knows that order.

The exchange knows nothing of Pyro: tensors come with names chosen by the
front end, and ``catalog`` says which tensors a worker could step, for the
rare step in which workers proposed different ones.

The steady state runs a fixed plan. :meth:`GradientSync.plan` makes an
:class:`ExchangePlan` for a set of tensors (this worker's proposal), and its
owner (the reducer's plan, :mod:`pyro_distributed.optim.reducer`) hands the same
one over at every step while its tensors stay the same: nothing is renamed,
sorted, hashed or planned again, the plan keeps its buckets and the overlap
its hooks; a bucket is packed by one flatten in C++. The digest still rides
in every header, so a worker whose tensors changed is caught at that very
step, and every worker re-plans together. Each
bucket keeps its buffer from step to step, with one view per member made
once (:class:`~.bucket.ResidentBuffer`, as DDP's ``gradient_as_bucket_view``): a step copies
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
from .averager import BucketPlan, GradientAverager, Reduction
from .overlap import BackwardOverlap, Channel


class ExchangePlan:
    """The exchange's part of a step's plan, for one set of tensors.

    Made by :meth:`GradientSync.plan`. Its owner keeps it while its tensors
    stay the same, hands it to every :meth:`GradientSync.exchange`, and
    drops it (making a new one) when they change; only the exchange changes
    what it holds:

    * ``proposal``: this worker's proposal, made again once its new tensors
      have been synchronised (then nothing is new: ``Settlement.proposal``);
    * ``step`` and ``buckets``: the step last agreed on and its buckets (with
      their resident buffers), planned again only when the agreed tensors
      differ from the last step's (workers that disagree, a borrowed tensor);
      a new plan of the tensors of the last step starts from its buckets.

    The owner may not change the mapping it planned, and drops the plan with
    the exchange that made it (:meth:`GradientSync.close`).
    """

    def __init__(self, proposal: Proposal) -> None:
        self.proposal = proposal
        self.step: StepParams | None = None
        self.buckets: BucketPlan | None = None


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
    :param channel: where the overlap's buckets travel; kept by the caller
        across the exchanges it makes (by default, one of this exchange's own).

    An exchange lives for one epoch of its owner's steady state: what it
    learned (which tensors were synchronised, the overlap's hooks and order,
    the last buckets) ends with it. :meth:`close` ends it; its owner then
    makes a new one (:class:`pyro_distributed.optim.reducer.Reducer`).
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
        channel: Channel | None = None,
    ) -> None:
        self._world_size = engine.world_size
        self._agreement = ParameterAgreement(engine, cap_bytes, catalog_name)
        self._averager = GradientAverager(engine, cap_bytes, reduction, measure_norms)
        self._overlap = BackwardOverlap(engine, channel) if overlap else None
        self._last_buckets: BucketPlan | None = None

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
        return 0 if self._last_buckets is None else len(self._last_buckets.buckets)

    def plan(self, given: Mapping[str, Tensor]) -> ExchangePlan:
        """The plan for exchanging ``given`` (the tensors this worker steps, by
        shared name), to hand to :meth:`exchange` at every step while they
        stay the same. No communication."""
        return ExchangePlan(self._agreement.propose(given))

    def exchange(
        self,
        plan: ExchangePlan,
        catalog: Catalog,
        *,
        nonfinite_here: bool = False,
        step: int = 0,
    ) -> Exchanged:
        """Average the gradients of ``plan``'s tensors (a collective: every worker calls it).

        :param plan: :meth:`plan` of the tensors this worker steps.
        :param catalog: every tensor this worker could step, by name (called
            only when workers proposed different tensors).
        :param nonfinite_here: whether a gradient that never travels (a local
            parameter's) is NaN or Inf on this worker. It rides in the header,
            so that every worker's ``finite`` says "no worker has one" without
            a collective of its own.
        :param step: the optimizer steps taken before this one (what hooks
            see as :attr:`~.hooks.GradBucket.step`).
        :raises PyroDistributedError: when the workers' tensors cannot be
            reconciled (missing somewhere, different shapes), naming them.
        """
        proposal = plan.proposal
        overlap = self._overlap
        flag = int(nonfinite_here)
        if overlap is None or not overlap.armed:
            settlement = self._agreement.settle(proposal, catalog, [flag])
            plan.proposal = settlement.proposal
            agreed, nonfinite_somewhere = settlement.step, settlement.riders[0] > 0
            buckets = self._buckets(plan, agreed)
            finite = self._averager.average_(buckets, step)
        else:
            overlap.step = step  # buckets that did not leave during backward
            agreed, buckets, finite, nonfinite_somewhere = self._exchange_overlapped(
                plan, catalog, overlap, flag, step
            )
        self._last_buckets = buckets
        kept = finite and not nonfinite_somewhere  # the same on every worker
        for bucket in buckets.buckets:
            bucket.settle(kept)  # a skipped step commits no hook state
        if overlap is not None:
            overlap.after_step(buckets)
            overlap.step = step + 1
        # The buckets' tuples, which are the same objects while the tensors are
        # (a proposal made again has tuples of its own): the front end's plan
        # recognises the step by them (optim.reducer.Plan.follow).
        return Exchanged(buckets.names, buckets.params, agreed.borrowed, kept)

    def _buckets(self, plan: ExchangePlan, step: StepParams) -> BucketPlan:
        """The buckets of ``step``: at once the plan's own when it is the plan's
        step; otherwise the last step's buckets if they hold the same tensors
        (so that every worker's overlap keeps its hooks alike, whichever
        worker made a new plan), else new ones."""
        if step is plan.step and plan.buckets is not None:
            return plan.buckets
        last = self._last_buckets
        if last is not None and _holds(last, step):
            plan.buckets = last
        else:
            plan.buckets = self._averager.plan(step.names, step.tensors)
        plan.step = step
        return plan.buckets

    def _exchange_overlapped(
        self,
        plan: ExchangePlan,
        catalog: Catalog,
        overlap: BackwardOverlap,
        flag: int,
        number: int,
    ) -> tuple[StepParams, BucketPlan, bool, bool]:
        """The step, its buckets, whether its averages are finite, and whether
        some worker's ``flag`` (a non-finite gradient that does not travel) was
        raised."""
        proposal = plan.proposal
        # Every bucket leaves before the header, on every worker alike; the
        # header then says whether they held the right tensors.
        overlap.send_remaining()
        stale = overlap.stale_flags()
        settlement = None
        if overlap.carrier is not None:
            digest = proposal.floats_in(overlap.digest_bits)
            summed = overlap.send_carrier([*digest, *stale, flag])
            agreed = digests_equal(summed[: len(digest)], self._world_size) and not proposal.new
            resend = [int(value > 0) for value in summed[len(digest) : -1]]
            raised = summed[-1] > 0
            if not agreed:
                overlap.discard()
                settlement = self._agreement.settle(proposal, catalog)
        else:
            settlement = self._agreement.settle(proposal, catalog, [*stale, flag])
            agreed, resend = settlement.unchanged, settlement.riders[:-1]
            raised = settlement.riders[-1] > 0
        if settlement is None:
            step = self._agreement.accept(proposal)
        else:
            plan.proposal, step = settlement.proposal, settlement.step
        buckets = self._buckets(plan, step)
        if agreed and overlap.sends(buckets):
            return step, buckets, overlap.finish(resend), raised
        overlap.discard()
        return step, buckets, self._averager.average_(buckets, number), raised

    def average_alone_(self, tensor: Tensor) -> Tensor:
        """``tensor``, in place, as the exchange would average it if every other
        worker sent zeros for it (a local parameter's gradient, which never
        travels); no communication. See ``GradientAverager.average_alone_``."""
        return self._averager.average_alone_(tensor)

    def squared_norms(self) -> tuple[float, float]:
        """``(mean_i |g_i|^2, |mean_i g_i|^2)`` of the last exchange (needs
        ``measure_norms``); a collective when a bucket could not carry its norm."""
        assert self._last_buckets is not None, "no exchange yet"
        return self._averager.squared_norms(self._last_buckets)

    def close(self) -> None:
        """End this exchange: drop what is on the wire and remove the overlap's
        hooks. Its plans are stale; a new exchange treats every tensor as new."""
        if self._overlap is not None:
            self._overlap.close()


def _holds(buckets: BucketPlan, step: StepParams) -> bool:
    """Whether ``buckets`` hold the very tensors of ``step``, under the same names."""
    return buckets.names == step.names and all(
        a is b for a, b in zip(buckets.params, step.tensors, strict=True)
    )
