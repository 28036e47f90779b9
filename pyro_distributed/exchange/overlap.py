"""Averaging gradients while backward is still running.

Without overlap a step computes every gradient and only then sends them. Here
a hook on each parameter notices when its gradient is complete, and a bucket
of the step's plan (:class:`~pyro_distributed.exchange.bucket.Bucket`) is asked to
send itself as soon as all of its members are, while backward computes the rest.

What keeps this exact, and keeps workers' collectives paired:

* The buckets are the plan's, those the averager sends all at once: same
  members, same gradient bytes on the wire, so an overlapped step is bitwise
  equal to an unoverlapped one at two workers. The last bucket also carries
  the header (below), which makes it longer; from three workers on, a ring
  all-reduce (gloo's) that cuts a buffer into chunks by its length may then
  add some elements in another order, so the averages can differ from an
  unoverlapped step's in the last bits (identically on every worker: the
  workers stay bitwise in sync).
* Buckets start in one fixed order, the same on every worker (worker 0's
  observed order of readiness, agreed once): a bucket is sent only after the
  buckets before it. Every worker sends all of them each step, during
  backward or at the optimizer call, so every worker starts the same
  collectives in the same order.
* They travel on a channel of their own (:meth:`Engine.open_channel`), so a
  collective that other code issues meanwhile (another optimizer, a user's
  ``all_mean``) cannot pair with them.
* A bucket is sent once each member has received as many gradient
  accumulations as it did in the previous step, so ELBOs that run several
  backward passes per step (one per particle) are learned, not broken.
* If a gradient changes after its bucket was sent (one more backward pass,
  or code that edits ``.grad``), the bucket is stale. Stale flags ride in the
  agreement header, so every worker learns of every stale bucket and all of
  them send it again.
* The last bucket in the order waits for the optimizer call and carries the
  agreement header
  (:func:`~pyro_distributed.exchange.agreement.digest_floats`) and the stale
  flags in its sum, so a step costs no collective beyond its buckets. The
  header is left out of any scaling and cast with the bucket, in pieces small
  enough that its sum is exact in the wire's type
  (:meth:`~pyro_distributed.exchange.hooks.CommHook.tail_dtype` and
  :func:`~pyro_distributed.exchange.agreement.digest_bits`: 8-bit pieces in
  float32, 4-bit ones in float16 up to 9 workers); only where no piece is
  small enough (a wire type without exact integers, or too many workers for
  it) does the header travel on its own.
* If a step's parameters are not the planned ones (new parameters, or
  workers that used different ones), the early results are dropped and the
  step runs unoverlapped.

Life cycle: when the agreed parameters change, hooks are installed; the next
step runs unoverlapped while it records the order in which buckets became
ready; from the step after that on, buckets go out during backward. When the
plan has one bucket only and it carries the header (every parameter fits in
``bucket_cap_mb``), nothing can leave early: the hooks are removed once armed,
and backward runs without them, as it would without overlap.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from ..engines import Engine
from .agreement import digest_bits
from .averager import BucketPlan

Phase = Literal["idle", "observing", "armed"]


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class Channel:
    """The engine's channel for buckets sent from backward: opened at its first
    use (a collective, made by every worker at the same step) and kept by the
    optimizer for every overlap it makes, so that a new one opens nothing."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._opened: Engine | None = None

    def get(self) -> Engine:
        """The channel, opened now if it was not yet."""
        if self._opened is None:
            self._opened = self._engine.open_channel()
        return self._opened


class BackwardOverlap:
    """Sends a plan's buckets from backward hooks; see the module docstring.

    :param engine: the engine whose workers send.
    :param channel: where the buckets travel, opened when the overlap arms
        (by default, a channel of its own).
    """

    def __init__(self, engine: Engine, channel: Channel | None = None) -> None:
        self._engine = engine
        self._channel = Channel(engine) if channel is None else channel
        #: The optimizer steps taken before the step whose buckets go out now.
        self.step = 0
        self._phase: Phase = "idle"
        # The buckets the hooks send (the step plan's; see after_step).
        self._plan = _NO_PLAN
        self._hooks: list[RemovableHandle] = []
        # Hooks outlive this object on the parameters; remove them with it.
        weakref.finalize(self, _remove, self._hooks)
        self._bucket_of: list[int] = []  # parameter index -> bucket index
        self._order: list[int] = []  # the agreed order in which buckets are sent
        self._carrier: int | None = None  # the bucket that carries the header, if any
        self._digest_bits = 8  # the pieces of the carrier's digest floats
        self._expected: list[int] = []  # accumulations per parameter per step
        self._fires: list[int] = []  # accumulations per parameter so far this step
        self._waiting: list[int] = []  # per bucket: members still short of their expectation
        self._sizes: list[int] = []  # per bucket: how many members it has
        self._observed: list[int] = []  # buckets in the order they became ready
        self._next = 0  # position in _order of the next bucket to send

    @property
    def armed(self) -> bool:
        """Whether buckets go out during backward (the same on every worker)."""
        return self._phase == "armed"

    @property
    def digest_bits(self) -> int:
        """The pieces the carrier's digest floats are cut in (see :meth:`_arm`)."""
        return self._digest_bits

    @property
    def carrier(self) -> int | None:
        """The bucket that carries the agreement header, or ``None`` if it travels alone."""
        return self._carrier

    def sends(self, plan: BucketPlan) -> bool:
        """Whether the hooks send the buckets of ``plan`` (and no other)."""
        return plan is self._plan

    def close(self) -> None:
        """Drop what is on the wire and remove the hooks: this overlap sends no more."""
        self._drain()
        _remove(self._hooks)
        self._phase, self._plan = "idle", _NO_PLAN

    def after_step(self, plan: BucketPlan) -> None:
        """Prepare the next step; called on every worker after every step, with
        the buckets it used. The steady state hands over the same plan, and the
        hooks stay; any other plan gets hooks of its own."""
        if plan is not self._plan:
            self._install(plan)
        elif self._phase == "observing":
            self._arm()
        self._new_step()

    def send_remaining(self) -> None:
        """Send every bucket that backward did not, in the agreed order, but the carrier."""
        while self._next < self._early:
            self._send(self._order[self._next])
            self._next += 1

    def stale_flags(self) -> list[int]:
        """Per bucket, 1 if a member's gradient changed after the bucket was sent
        (never the carrier: packed at the call, after every backward pass)."""
        carrier = self._carrier
        return [
            int(index != carrier and bucket.stale())
            for index, bucket in enumerate(self._plan.buckets)
        ]

    def send_carrier(self, header: Sequence[float]) -> list[float]:
        """Send the carrier with ``header`` riding along; return the header summed
        over workers (a collective, once per step, after :meth:`send_remaining`)."""
        assert self._carrier is not None
        self._send(self._carrier, header)
        # The tail is summed exactly (see _arm and CommHook.tail_dtype).
        return self._plan.buckets[self._carrier].summed_riders()

    def finish(self, resend: Sequence[int]) -> bool:
        """Wait for every bucket, send again those flagged in ``resend`` (by any worker),
        and write the averages into ``.grad``; return whether all are finite."""
        buckets = self._plan.buckets
        for index in self._order:
            if resend[index]:
                buckets[index].discard()  # a stateful hook commits nothing of it
                self._send(index)
        finite = True
        for bucket in buckets:
            finite &= bucket.receive()
        return finite

    def discard(self) -> None:
        """Drop this step's early results (the step runs unoverlapped instead)."""
        self._drain()

    def _drain(self) -> None:
        for bucket in self._plan.buckets:
            bucket.discard()

    def _install(self, plan: BucketPlan) -> None:
        _remove(self._hooks)
        buckets, params = plan.buckets, plan.params
        self._plan = plan
        self._sizes = [len(bucket.members) for bucket in buckets]
        self._bucket_of = [0] * len(params)
        for index, bucket in enumerate(buckets):
            for member in bucket.layout.members:
                self._bucket_of[member] = index
        self._expected = [1] * len(params)
        self._fires = [0] * len(params)
        self._order, self._carrier = [], None
        ref = weakref.ref(self)
        self._hooks.extend(
            param.register_post_accumulate_grad_hook(_hook(ref, index))  # type: ignore[no-untyped-call]
            for index, param in enumerate(params)
        )
        # Nothing to send (every parameter local to its worker): nothing to arm.
        self._phase = "observing" if buckets else "idle"

    def _arm(self) -> None:
        """Adopt worker 0's order of readiness; a collective, made by every worker at once."""
        count = len(self._plan.buckets)
        unseen = [index for index in range(count) if index not in self._observed]
        # cpu: read back
        order = torch.tensor(self._observed + unseen, dtype=torch.int64, device="cpu")
        self._engine.broadcast_([order], src=0)
        self._order = order.tolist()
        last = self._order[-1]
        dtype = self._plan.buckets[last].riders_dtype()
        bits = None if dtype is None else digest_bits(dtype, self._engine.world_size)
        self._carrier = None if bits is None else last
        self._digest_bits = bits or 8
        self._channel.get()  # opened now, at the same step on every worker
        self._phase = "armed"
        if not self._early:
            # One bucket, the carrier, which leaves at the call: the hooks have
            # nothing to send early, so backward should not pay for calling them.
            _remove(self._hooks)

    def _new_step(self) -> None:
        self._next = 0
        if not self._hooks:
            return  # nothing counts accumulations (removed once armed, see _arm)
        if self._fires != self._expected:
            # A parameter that got no gradient this step keeps its old expectation.
            self._expected = [f or e for f, e in zip(self._fires, self._expected, strict=True)]
        self._fires = [0] * len(self._plan.params)
        self._waiting = self._sizes.copy()
        self._observed = []

    def accumulated(self, index: int) -> None:
        """Parameter ``index`` received a gradient (called from its hook)."""
        self._fires[index] += 1
        if self._fires[index] != self._expected[index]:
            return
        bucket = self._bucket_of[index]
        self._waiting[bucket] -= 1
        if self._waiting[bucket]:
            return
        if self._phase == "observing":
            self._observed.append(bucket)
            return
        order = self._order
        while self._next < self._early and not self._waiting[order[self._next]]:
            self._send(order[self._next])
            self._next += 1

    @property
    def _early(self) -> int:
        """How many buckets, from the start of the order, may leave before the call."""
        return len(self._order) - (self._carrier is not None)

    def _send(self, index: int, riders: Sequence[float] = ()) -> None:
        # The carrier is packed at the call, after every backward pass: it
        # cannot go stale, and its members' gradients need no watching.
        self._plan.buckets[index].send(
            self._channel.get(),
            riders,
            watch=index != self._carrier,
            step=self.step,
            is_last=not self._order or index == self._order[-1],
        )


#: The plan of an overlap that watches nothing (before the first step, after a reset).
_NO_PLAN = BucketPlan((), (), [])


def _hook(owner: weakref.ref[BackwardOverlap], index: int) -> Callable[[Tensor], None]:
    def on_accumulated(_: Tensor) -> None:
        overlap = owner()
        if overlap is not None:
            overlap.accumulated(index)

    return on_accumulated
