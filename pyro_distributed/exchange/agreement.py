"""Which parameters a step touches, agreed by every worker.

SVI hands the optimizer a ``set`` of unconstrained tensors, whose iteration
order differs between processes, and each worker builds its own list. Before
any gradient travels, the workers must agree on one sorted list, or their
fused buffers would not line up and a collective would hang or mix values.

Tensors are known by names that every worker shares (the front end chooses
them: param-store names for Pyro's optimizers). The common case costs one tiny
collective per step: every worker hashes the sorted names it was given, plus
name, shape and dtype of the parameters it has never synchronised before, and
a max-reduction of ``(h, -h)`` tells every worker at once whether all hashes
are equal. With overlap the hash costs no collective of its own: it rides, as
:func:`digest_floats`, in the sum of the last gradient bucket
(:mod:`pyro_distributed.exchange.overlap`). Only when they differ do the
workers exchange their full lists (one object all-gather), and then all of
them reach the same verdict from the same data:

* a parameter passed by some workers and present in every worker's catalog
  (its param store) joins the step everywhere (workers that did not use it contribute a
  zero gradient);
* a parameter missing from some worker's store, one whose shape or dtype
  differs, or one that was re-created on only some workers, makes every worker
  raise :class:`~pyro_distributed.PyroDistributedError` naming it and the
  workers involved.

New parameters (first seen, or re-created with the same name) then take worker
0's values, so lazily initialised guides start identical everywhere.

A proposal is made once per set of tensors: the step's plan keeps it
(:class:`~.sync.ExchangePlan`, made again by the plan's owner only when the
tensors change), so the steady state costs no naming, sorting or hashing
here. The digest still travels at every step, so a worker whose tensors
changed is caught at the step it changed them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from ..consensus import describe_split, describe_workers
from ..digest import digest_int
from ..engines import Engine
from ..errors import PyroDistributedError
from .layout import plan_layouts

#: How many floats :func:`digest_floats` makes of a digest in 8-bit pieces.
DIGEST_FLOATS = 16
#: The most workers whose summed digest floats, in 8-bit pieces, stay exact in float32.
MAX_SUMMED_WORKERS = 2**24 // 255**2
#: The largest integer up to which every integer is exact, per floating-point type.
EXACT_INTEGERS = {
    torch.float64: 2**53,
    torch.float32: 2**24,
    torch.float16: 2**11,
    torch.bfloat16: 2**8,
}

Spec = tuple[tuple[int, ...], str]  # shape, dtype
#: Every tensor a worker could step, by name (see :meth:`ParameterAgreement.settle`).
Catalog = Callable[[], Mapping[str, Tensor]]


@dataclass(frozen=True)
class StepParams:
    """The agreed parameters of one step, sorted by param-store name."""

    names: tuple[str, ...]
    tensors: tuple[Tensor, ...]
    #: Names this worker was not given but steps because another worker was.
    borrowed: frozenset[str]


@dataclass(frozen=True)
class Proposal:
    """One worker's view of a step: what it was given, and what is new to it."""

    names: tuple[str, ...]
    given: dict[str, Tensor]
    new: tuple[str, ...]
    digest: int

    @cached_property
    def floats(self) -> list[float]:
        """The digest as :func:`digest_floats` (made once per proposal)."""
        return digest_floats(self.digest)

    def floats_in(self, bits: int) -> list[float]:
        """The digest as :func:`digest_floats` in pieces of ``bits`` bits."""
        return self.floats if bits == 8 else digest_floats(self.digest, bits)

    @cached_property
    def step(self) -> StepParams:
        """The step, should every worker propose the same (made once per proposal)."""
        tensors = tuple(self.given[name] for name in self.names)
        return StepParams(self.names, tensors, frozenset())


@dataclass(frozen=True)
class Settlement:
    """The outcome of agreeing on a step."""

    step: StepParams
    #: Every worker proposed the same parameters and none was new: the step
    #: is exactly the one each worker proposed.
    unchanged: bool
    #: The riders, max-reduced across workers.
    riders: list[int]
    #: What to propose from now on: the proposal settled, or, once its new
    #: tensors were synchronised, the same tensors with nothing new.
    proposal: Proposal


def _spec(tensor: Tensor) -> Spec:
    return tuple(tensor.shape), str(tensor.dtype)


def digest_floats(digest: int, bits: int = 8) -> list[float]:
    """A digest as floats that can travel in a *sum* and still show disagreement.

    Its 64 bits are cut into pieces of ``bits`` bits (8, 4, 2 or 1), and each
    piece b goes with b**2. Summed over W workers, every piece satisfies
    W * sum(b**2) == sum(b)**2 exactly when all workers sent the same piece
    (equality in Cauchy-Schwarz), and every worker computes the same verdict
    from the same sums, as long as the sums are exact integers in the type
    they travel in: smaller pieces for narrower types and more workers
    (:func:`digest_bits`). In 8-bit pieces, float32 sums stay exact for up to
    :data:`MAX_SUMMED_WORKERS` workers.
    """
    mask = (1 << bits) - 1
    pieces = [(digest >> (bits * i)) & mask for i in range(64 // bits)]
    return [float(c) for c in pieces] + [float(c * c) for c in pieces]


def digest_bits(dtype: torch.dtype, world_size: int) -> int | None:
    """The widest pieces (8, 4, 2 or 1 bits) whose :func:`digest_floats`, and
    flags of 0 or 1, sum exactly over ``world_size`` workers in ``dtype``;
    ``None`` for a type without exact small integers, or too many workers."""
    exact = EXACT_INTEGERS.get(dtype)
    if exact is None:
        return None
    for bits in (8, 4, 2, 1):
        if ((1 << bits) - 1) ** 2 * world_size <= exact:
            return bits
    return None


def digests_equal(sums: Sequence[float], world_size: int) -> bool:
    """Whether every worker's :func:`digest_floats` were equal, from their sums
    (all of them, in any piece width: the values, then their squares)."""
    half = len(sums) // 2
    totals = [round(value) for value in sums]
    return all(
        world_size * square == total * total
        for total, square in zip(totals[:half], totals[half:], strict=True)
    )


class ParameterAgreement:
    """Tracks which parameters have been synchronised, and agrees on each step's list."""

    def __init__(self, engine: Engine, cap_bytes: int, catalog_name: str = "param store") -> None:
        self._engine = engine
        self._cap_bytes = cap_bytes
        # What the catalog is called in messages ("param store", "optimizer").
        self._catalog_name = catalog_name
        # name -> the unconstrained tensor that was synchronised under that name
        self._synced: dict[str, Tensor] = {}

    def propose(self, given: Mapping[str, Tensor]) -> Proposal:
        """This worker's view of the step, before any communication.

        :param given: the tensors this worker steps, by the names that every
            worker knows them by (param-store names, module paths, ...).

        A proposal with new tensors is out of date once :meth:`settle` has
        synchronised them: :attr:`Settlement.proposal` is the one to make then.
        """
        names = sorted(given)
        new = [name for name in names if self._synced.get(name) is not given[name]]
        digest = digest_int((names, [(name, _spec(given[name])) for name in new]))
        return Proposal(tuple(names), dict(given), tuple(new), digest)

    def accept(self, proposal: Proposal) -> StepParams:
        """The step, when every worker is known to have proposed it and nothing is new."""
        assert not proposal.new, "new parameters must be synchronised through settle()"
        return proposal.step

    def settle(
        self, proposal: Proposal, catalog: Catalog, riders: Sequence[int] = ()
    ) -> Settlement:
        """Agree on ``proposal`` with every worker; max-reduce ``riders`` on the way.

        ``catalog`` returns every tensor this worker could step, by name: when
        the workers proposed different tensors, one used only elsewhere joins
        the step here from it. ``riders`` (non-negative ints) travel in the
        same collective as the digest, which saves the caller a round trip.
        """
        # cpu: Python ints read back at once; every engine carries CPU tensors.
        header = torch.tensor(
            [proposal.digest, -proposal.digest, *riders], dtype=torch.int64, device="cpu"
        )
        self._engine.allreduce_([header], op="max")
        top, bottom, *summed = header.tolist()
        unanimous = top == -bottom
        if unanimous and not proposal.new:
            return Settlement(proposal.step, True, summed, proposal)
        names, given, new = list(proposal.names), proposal.given, list(proposal.new)
        borrowed: frozenset[str] = frozenset()
        if not unanimous:
            mine = frozenset(given)
            names, given, new = self._reconcile(given, catalog())
            borrowed = frozenset(given) - mine
        if new:
            broadcast_values_(self._engine, [given[name] for name in new], self._cap_bytes)
            self._synced.update((name, given[name]) for name in new)
        step = StepParams(tuple(names), tuple(given[name] for name in names), borrowed)
        settled = self.propose(proposal.given) if proposal.new else proposal
        return Settlement(step, unanimous and not new, summed, settled)

    def _reconcile(
        self, given: Mapping[str, Tensor], in_store: Mapping[str, Tensor]
    ) -> tuple[list[str], dict[str, Tensor], list[str]]:
        """The slow path: gather every worker's view and decide identically everywhere."""
        mine = {
            "given": sorted(given),
            "store": {name: _spec(tensor) for name, tensor in in_store.items()},
            "synced": sorted(n for n, t in self._synced.items() if in_store.get(n) is t),
        }
        views = self._engine.allgather_object(mine)
        union = sorted(set().union(*(view["given"] for view in views)))
        _raise_on_disagreement(union, views, self._catalog_name)
        my_given = {name: in_store[name] for name in union}
        new = [name for name in union if name not in mine["synced"]]
        return union, my_given, new


def _raise_on_disagreement(
    union: list[str], views: list[dict[str, Any]], catalog_name: str
) -> None:
    ranks = range(len(views))
    problems = []
    for name in union:
        givers = [r for r in ranks if name in views[r]["given"]]
        lacking = [r for r in ranks if name not in views[r]["store"]]
        if lacking:
            problems.append(
                f"parameter {name!r} is used on {describe_workers(givers)} but does not "
                f"exist in the {catalog_name} of {describe_workers(lacking)}"
            )
            continue
        specs = {r: views[r]["store"][name] for r in ranks}
        if len(set(specs.values())) > 1:
            shown = describe_split(
                list(specs.values()), lambda spec: f"shape {list(spec[0])}, {spec[1]}"
            )
            problems.append(f"parameter {name!r} differs in shape or dtype ({shown})")
            continue
        fresh = [r for r in ranks if name not in views[r]["synced"]]
        if fresh and len(fresh) < len(views):
            problems.append(
                f"parameter {name!r} was re-created on {describe_workers(fresh)} only (for "
                f"example by pyro.clear_param_store()); it is still the synchronised one on "
                f"{describe_workers(set(ranks) - set(fresh))}"
            )
    if problems:
        raise PyroDistributedError(
            "workers disagree on the parameters of this step: "
            + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more problems" if len(problems) > 5 else "")
            + ". Every worker must create the same parameters, with the same shapes and dtypes."
        )


def broadcast_values_(engine: Engine, tensors: Sequence[Tensor], cap_bytes: int) -> None:
    """Overwrite each tensor's values, in place, with worker 0's (in fused buffers)."""
    layouts = plan_layouts(tensors, cap_bytes)
    with torch.no_grad():
        flats = [torch.cat([tensors[i].detach().reshape(-1) for i in b.members]) for b in layouts]
        engine.broadcast_(flats, src=0)
        for layout, flat in zip(layouts, flats, strict=True):
            for index, chunk in zip(layout.members, layout.split_gradients(flat), strict=True):
                tensors[index].copy_(chunk.view_as(tensors[index]))
