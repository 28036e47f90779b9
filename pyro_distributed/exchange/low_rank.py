"""A low-rank communication hook with error feedback.

Each large gradient matrix M (a member of two or more dimensions, seen as
``shape[0]`` rows) is sent as two thin factors instead of itself: with Q the
factor kept from the last step, every worker sends P = M Q (summed), makes
the summed P orthonormal, sends Q = M^T P (summed), and takes P Q^T / W as
the average. That is the projection of the average of the workers' M onto
the columns of P, a rank-``rank`` approximation that costs ``rank * (n + m)``
values on the wire instead of ``n * m``. Keeping Q from step to step (a warm
start) makes one round of this power iteration track the gradient's leading
subspace, and what a step leaves out of a worker's M (its error) is added to
that worker's next gradient, so no direction is lost, only delayed (the idea
of PowerSGD, Vogels et al., 2019).

Members that would not shrink by at least ``min_compression``, vectors, and
the bucket's tail travel exactly, in the first of the two sums. Every worker
computes the same factors from the same sums, so parameters stay identical
on every worker; only the error, which stays on its worker, differs.

The hook keeps, per bucket (by its name) and compressed member, Q and this
worker's error; :meth:`LowRankHook.state_dict` returns them as plain data,
which checkpoints save for every worker, so a resumed run continues bitwise.
The warm-up counts the optimizer's steps (:attr:`GradBucket.step`), which a
checkpoint restores and a bucket sent again does not advance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..checks import check_bool, check_int, check_number
from ..engines import Engine, Pending
from .hooks import CommHook, GradBucket, Reducing

__all__ = ["LowRankHook"]


class LowRankHook(CommHook):
    """Sends each large gradient matrix as two rank-``rank`` factors (module docstring).

    :param rank: the rank of the approximation.
    :param warmup_steps: the optimizer steps in which every bucket is averaged
        exactly before compression starts (the early gradients change fastest).
    :param min_compression: compress an ``n x m`` matrix only where it holds at
        least this many times the values of its factors:
        ``n * m >= min_compression * rank * (n + m)``.
    :param error_feedback: add what a step left out to the next gradient.
    :param seed: seeds the first Q, identically on every worker.

    Example::

        optim = pd.DistributedOptimizer(
            pyro.optim.Adam({"lr": 1e-3}), comm_hook=pd.LowRankHook(rank=4)
        )

    .. warning::
        The average is approximate: the trained parameters differ from
        uncompressed training (identically on every worker). Check the
        held-out loss against a run without it before relying on it.
    """

    in_place = True

    def __init__(
        self,
        rank: int = 4,
        *,
        warmup_steps: int = 10,
        min_compression: float = 2.0,
        error_feedback: bool = True,
        seed: int = 0,
    ) -> None:
        check_int("LowRankHook: rank", rank, minimum=1)
        check_int("LowRankHook: warmup_steps", warmup_steps, minimum=0)
        check_number("LowRankHook: min_compression", min_compression)
        if not min_compression >= 1:
            raise ValueError(
                f"LowRankHook: min_compression must be at least 1, got {min_compression!r}"
            )
        check_bool("LowRankHook: error_feedback", error_feedback)
        # Seeds torch.Generator.manual_seed, which takes no negatives.
        check_int("LowRankHook: seed", seed, minimum=0)
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.min_compression = float(min_compression)
        self.error_feedback = error_feedback
        self.seed = seed
        # By the bucket's name, which every worker and every process of the
        # run share; a bucket of other shapes under a known name starts afresh.
        self._buckets: dict[str, _BucketState] = {}

    def __call__(self, bucket: GradBucket, engine: Engine) -> Reducing:
        state = self._state(bucket)
        if bucket.step < self.warmup_steps or not state.matrices:
            pending = engine.allreduce_async_(bucket.buffer, "sum", bucket.name)
            return _Exact(pending, bucket)
        return _LowRank(self, state, bucket, engine)

    def _state(self, bucket: GradBucket) -> _BucketState:
        state = self._buckets.get(bucket.name)
        if state is None or state.shapes != bucket.shapes:
            state = _BucketState(bucket.shapes, self._matrices(bucket.shapes))
            self._buckets[bucket.name] = state
        elif state.q and not _alike(state.q[0], bucket.buffer):
            # Loaded from a file of another type or device (a run resumed with
            # other compression, or elsewhere): carried over into the bucket's.
            state.q = [q.to(bucket.buffer) for q in state.q]
            state.error = [e.to(bucket.buffer) for e in state.error]
        return state

    def state_dict(self) -> dict[str, Any]:
        """Per bucket, by name: its members' shapes, and for each compressed
        member the warm-start Q and this worker's error (plain data; the
        tensors are the hook's own, not copies)."""
        return {
            name: {
                "shapes": [list(shape) for shape in state.shapes],
                "matrices": list(state.matrices),
                "q": list(state.q),
                "error": list(state.error),
            }
            for name, state in self._buckets.items()
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`, this worker's); ``{}``
        starts afresh.

        :raises ValueError: naming the bucket, for state of another shape.
        """
        buckets = {}
        for name, saved in state.items():
            try:
                shapes = tuple(torch.Size(shape) for shape in saved["shapes"])
                matrices = [int(index) for index in saved["matrices"]]
                q, error = list(saved["q"]), list(saved["error"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(
                    f"LowRankHook: the state of bucket {name!r} is not a LowRankHook's "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            if matrices != self._matrices(shapes):
                raise ValueError(
                    f"LowRankHook: the state of bucket {name!r} compresses members {matrices}, "
                    f"where this hook (rank={self.rank}, min_compression="
                    f"{self.min_compression}) compresses {self._matrices(shapes)}: it was "
                    f"saved with other settings"
                )
            self._check_factors(name, [shapes[index] for index in matrices], q, error)
            buckets[name] = _BucketState(shapes, matrices, q, error)
        self._buckets = buckets

    def _check_factors(
        self, name: str, shapes: list[torch.Size], q: list[Any], error: list[Any]
    ) -> None:
        """Refuse factors and errors that do not fit the compressed members' ``shapes``."""
        if len(q) not in (0, len(shapes)) or len(error) not in (0, len(q)):
            raise ValueError(
                f"LowRankHook: the state of bucket {name!r} holds {len(q)} factors and "
                f"{len(error)} errors for {len(shapes)} compressed members"
            )
        for held, shape in zip(q, shapes, strict=False):
            rows, columns = shape[0], shape.numel() // shape[0]
            wanted = (columns, min(self.rank, rows, columns))
            if not isinstance(held, Tensor) or tuple(held.shape) != wanted:
                found = list(held.shape) if isinstance(held, Tensor) else type(held).__name__
                raise ValueError(
                    f"LowRankHook: the state of bucket {name!r} holds a factor of shape "
                    f"{found} for a {rows} x {columns} member, where rank={self.rank} "
                    f"needs {list(wanted)}: it was saved with another rank"
                )
        for held, shape in zip(error, shapes, strict=False):
            rows, columns = shape[0], shape.numel() // shape[0]
            if not isinstance(held, Tensor) or tuple(held.shape) != (rows, columns):
                raise ValueError(
                    f"LowRankHook: the state of bucket {name!r} holds an error that is not "
                    f"a {rows} x {columns} tensor"
                )

    def _matrices(self, shapes: tuple[torch.Size, ...]) -> list[int]:
        """The members worth compressing, by index."""
        chosen = []
        for index, shape in enumerate(shapes):
            if len(shape) < 2:
                continue
            rows, columns = shape[0], shape.numel() // shape[0]
            rank = min(self.rank, rows, columns)
            if rows * columns >= self.min_compression * rank * (rows + columns):
                chosen.append(index)
        return chosen

    def __repr__(self) -> str:
        return f"LowRankHook(rank={self.rank}, warmup_steps={self.warmup_steps})"


@dataclass(eq=False)
class _BucketState:
    """What the hook keeps for one bucket between steps."""

    shapes: tuple[torch.Size, ...]
    #: The members compressed, by index.
    matrices: list[int]
    #: Per compressed member: the warm-start Q (m x r) and this worker's error (n x m).
    q: list[Tensor] = field(default_factory=list)
    error: list[Tensor] = field(default_factory=list)


class _Exact(Reducing):
    """The exact average of a bucket summed in place."""

    def __init__(self, pending: Pending, bucket: GradBucket) -> None:
        self._pending, self._bucket = pending, bucket

    def wait(self) -> Tensor:
        self._pending.wait()
        self._bucket.gradients().div_(self._bucket.world_size)
        return self._bucket.buffer

    def drop(self) -> None:
        self._pending.wait()


class _LowRank(Reducing):
    """One bucket's two sums: P with everything sent exactly, then Q."""

    def __init__(
        self, hook: LowRankHook, state: _BucketState, bucket: GradBucket, engine: Engine
    ) -> None:
        self._state, self._bucket, self._engine = state, bucket, engine
        pieces = bucket.pieces()
        chosen = set(state.matrices)
        self._exact = [piece for index, piece in enumerate(pieces) if index not in chosen]
        self._matrices = [
            pieces[index].reshape(pieces[index].shape[0], -1) for index in state.matrices
        ]
        self._q = state.q or _first_q(self._matrices, hook.rank, hook.seed, bucket.buffer.dtype)
        self._feedback = hook.error_feedback
        # M plus last step's error: new tensors, so the bucket's buffer is free for the result.
        self._m = (
            [m + e for m, e in zip(self._matrices, state.error, strict=True)]
            if state.error
            else [m.clone() for m in self._matrices]
        )
        #: What commit() keeps: the new Q and errors (``None``: start afresh).
        self._kept: tuple[list[Tensor], list[Tensor]] | None = None
        ps = [m @ q for m, q in zip(self._m, self._q, strict=True)]
        self._first = torch.cat(
            [
                *(piece.reshape(-1) for piece in self._exact),
                bucket.tail(),
                *(p.reshape(-1) for p in ps),
            ]
        )
        self._p_shapes = [p.shape for p in ps]
        self._pending: Pending | None = engine.allreduce_async_(
            self._first, "sum", f"{bucket.name}.p"
        )

    def wait(self) -> Tensor:
        bucket = self._bucket
        assert self._pending is not None
        self._pending.wait()
        self._pending = None
        world = bucket.world_size
        exact_size = sum(piece.numel() for piece in self._exact)
        tail = bucket.tail()
        exact, summed_tail, p_flat = torch.split(
            self._first, [exact_size, tail.numel(), self._first.numel() - exact_size - tail.numel()]
        )
        ps = [
            p.view(shape)
            for p, shape in zip(
                torch.split(p_flat, [s.numel() for s in self._p_shapes]),
                self._p_shapes,
                strict=True,
            )
        ]
        for p in ps:
            _orthonormalize_(p)
        qs = [m.T @ p for m, p in zip(self._m, ps, strict=True)]
        second = torch.cat([q.reshape(-1) for q in qs])
        self._engine.allreduce_async_(second, "sum", f"{bucket.name}.q").wait()
        second.div_(world)
        qs = [
            q.view_as(old)
            for q, old in zip(torch.split(second, [q.numel() for q in qs]), qs, strict=True)
        ]
        finite = bool(torch.isfinite(second).all()) and bool(torch.isfinite(p_flat).all())
        # Write the result into the bucket: exact members averaged, the tail summed,
        # each matrix its approximation P Q^T.
        exact.div_(world)
        offset = 0
        for piece in self._exact:
            piece.copy_(exact[offset : offset + piece.numel()].view_as(piece))
            offset += piece.numel()
        tail.copy_(summed_tail)
        errors = []
        for index, (matrix, p, q) in enumerate(zip(self._matrices, ps, qs, strict=True)):
            torch.mm(p, q.T, out=matrix)  # a view of the bucket's buffer
            if self._feedback and finite:
                errors.append(self._m[index].sub_(matrix))  # M is not needed after this
        # A NaN or Inf gradient (the step is skipped) must not poison later steps.
        self._kept = (qs, errors) if finite else ([], [])
        return bucket.buffer

    def commit(self) -> None:
        assert self._kept is not None, "commit() follows wait()"
        self._state.q, self._state.error = self._kept

    def drop(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def _alike(held: Tensor, like: Tensor) -> bool:
    """Whether ``held`` has ``like``'s type and device."""
    return held.dtype == like.dtype and held.device == like.device


def _first_q(matrices: list[Tensor], rank: int, seed: int, dtype: torch.dtype) -> list[Tensor]:
    """Random starting factors, the same on every worker."""
    generator = torch.Generator().manual_seed(seed)
    # device='cpu': drawn from a seeded host generator, so the same numbers on
    # every worker and every device, then moved where the matrix lives.
    return [
        torch.randn(
            m.shape[1], min(rank, *m.shape), generator=generator, dtype=dtype, device="cpu"
        ).to(m.device)
        for m in matrices
    ]


def _orthonormalize_(p: Tensor, eps: float = 1e-8) -> None:
    """Make the columns of ``p`` orthonormal in place (modified Gram-Schmidt)."""
    for column in range(p.shape[1]):
        vector = p[:, column : column + 1]
        vector.div_(vector.norm().clamp_min(eps))
        if column + 1 < p.shape[1]:
            rest = p[:, column + 1 :]
            rest.sub_(vector @ (vector.T @ rest))
