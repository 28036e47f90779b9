"""Posterior predictive sampling spread over the workers, gathered in order.

:class:`Predictive` (its docstring has the arguments) splits the draws or the
data. ``split="samples"``: workers take contiguous shares of the draws; with
a ``seed`` the draws come in fixed-size chunks, each from a generator seeded
by ``(seed, chunk)``, and workers take whole chunks, which is what makes the
result bitwise the same at every world size. ``split="data"``: each worker
runs every draw on its block of the data, and the blocks are joined along
each site's data-plate axis, found by watching the plates the model enters;
sites outside that plate are checked to be identical on every worker.
Results are assembled by :func:`~pyro_distributed.gather.gather_pieces`,
which streams, so the receiving worker holds the result and one piece.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import pyro
import pyro.infer
import pyro.util
import torch
from pyro.poutine.messenger import Messenger
from torch import Tensor

from .. import runtime
from ..checks import check_choice, check_int
from ..data.shards import block_batches, data_columns
from ..gather import Destination, gather_pieces
from ..partition import block_range
from ..pyro_internals import Subsample
from ..seeding import derived_seed

Split = Literal["samples", "data"]
#: With a seed and no chunk_size, the draws are cut into this many chunks,
#: enough to spread them evenly over this many workers.
DEFAULT_CHUNKS = 64


class Predictive:
    """``pyro.infer.Predictive``, with the draws (or the data) split across workers.

    The first six arguments are ``pyro.infer.Predictive``'s, with its meaning.
    Calling it, on every worker, returns the same dictionary of samples that
    one process would return, each of shape ``(num_samples, ...)``, on worker 0
    (other workers get ``None``), or on every worker with ``gather="all"``.

    :param split: ``"samples"`` (default): each worker draws its share of the
        samples. ``"data"``: each worker handles its block of the data points,
        the positional arguments of the call, which must all be tensors of the
        same length.
    :param gather: ``"main"`` (default) or ``"all"``: who receives the result.
    :param seed: with ``split="samples"``, draw the samples in chunks seeded
        by ``(seed, chunk)``: the result is then identical at any world size.
        With ``split="data"``, seed each worker's draws by ``(seed, rank)``.
        ``None`` (default): a seed drawn from this worker's torch generator,
        mixed with its rank, so that workers never repeat each other's draws.
    :param chunk_size: how many samples one underlying ``pyro.infer.Predictive``
        call draws (default: a worker's whole share, or with a ``seed``
        ``ceil(num_samples / 64)``). Smaller chunks hold less memory at once.

    Example::

        predictive = pd.Predictive(model, guide=guide, num_samples=1000, seed=0)
        samples = predictive(x_test)  # every worker calls it
        if pd.is_main():
            print(samples["obs"].shape)  # (1000, len(x_test)), as in one process

    .. warning::
        A collective: call it on every worker with the same arguments. With
        ``split="data"``, sample sites outside the data plate must be
        identical on every worker; pass them as ``posterior_samples``, or use
        ``split="samples"`` for guides with global latent variables.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        posterior_samples: Mapping[str, Tensor] | None = None,
        guide: Callable[..., Any] | None = None,
        num_samples: int | None = None,
        return_sites: Sequence[str] | None = (),
        parallel: bool = False,
        *,
        split: Split = "samples",
        gather: Destination = "main",
        seed: int | None = None,
        chunk_size: int | None = None,
    ) -> None:
        if not callable(model):
            raise TypeError(f"Predictive: model must be callable, got {model!r:.60}")
        check_choice("Predictive: split", split, ("samples", "data"))
        check_choice("Predictive: gather", gather, ("main", "all"))
        check_int("Predictive: seed", seed, minimum=0, optional=True)
        check_int("Predictive: chunk_size", chunk_size, minimum=1, optional=True)
        posterior = _checked_posterior(posterior_samples)
        if not posterior and num_samples is not None:
            # With posterior samples Pyro takes the count from them instead.
            num_samples = _sample_count(num_samples)
        if return_sites is not None and not isinstance(return_sites, (list, tuple, set)):
            # Pyro's own check is a bare assert.
            raise TypeError(
                "Predictive: return_sites must be a list, tuple or set of site names, "
                f"or None, got {return_sites!r}"
            )
        # Pyro's own class checks the rest and works out num_samples.
        checked = pyro.infer.Predictive(  # type: ignore[no-untyped-call]
            model, posterior or None, guide, num_samples, return_sites, parallel
        )
        if checked.num_samples == 0:
            raise ValueError(
                "Predictive: posterior_samples hold no samples (their first dimension "
                "has length 0); pass at least one"
            )
        self.model, self.guide = model, guide
        self.posterior_samples: dict[str, Tensor] = dict(checked.posterior_samples)
        self.num_samples: int = checked.num_samples
        self.return_sites, self.parallel = return_sites, parallel
        self.split, self.gather, self.seed, self.chunk_size = split, gather, seed, chunk_size

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Tensor] | None:
        """Draw, on every worker, and gather; ``args`` and ``kwargs`` go to the model."""
        engine = runtime.current_engine()
        if self.split == "data":
            pieces, axes = self._by_data(args, kwargs)
        else:
            pieces = self._by_samples(args, kwargs)
            axes = dict.fromkeys(pieces, 0)
        return gather_pieces(engine, pieces, axes, self.gather)

    def _draw(
        self,
        rows: range,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        seed: int,
    ) -> dict[str, Tensor]:
        """Samples ``rows`` of the whole draw, from one ``pyro.infer.Predictive``
        call, from generators seeded by ``seed``."""
        posterior = {
            name: value[rows.start : rows.stop] for name, value in self.posterior_samples.items()
        }
        predictive = pyro.infer.Predictive(  # type: ignore[no-untyped-call]
            self.model,
            posterior or None,
            self.guide,
            None if posterior else len(rows),
            self.return_sites,
            self.parallel,
        )
        with torch.no_grad(), _seeded(seed):
            return {name: value.detach() for name, value in predictive(*args, **kwargs).items()}

    def _by_samples(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Tensor]:
        drawn = [self._draw(rows, args, kwargs, seed) for rows, seed in self._my_chunks()]
        if not drawn:
            # More workers than chunks: draw one sample to learn the sites'
            # shapes, and contribute none of it.
            shapes = self._draw(range(1), args, kwargs, seed=0)
            return {name: value[:0] for name, value in shapes.items()}
        return {name: torch.cat([piece[name] for piece in drawn]) for name in drawn[0]}

    def _my_chunks(self) -> Iterator[tuple[range, int]]:
        """This worker's chunks of ``range(num_samples)``, with each chunk's seed."""
        total = self.num_samples
        if self.seed is None:
            mine, base = block_range(total), _unseeded_base()
            size = self.chunk_size or max(len(mine), 1)
            for number, start in enumerate(range(mine.start, mine.stop, size)):
                yield range(start, min(start + size, mine.stop)), base + number
            return
        size = self.chunk_size or max(1, -(-total // DEFAULT_CHUNKS))
        for chunk in block_range(-(-total // size)):
            yield (
                range(chunk * size, min((chunk + 1) * size, total)),
                derived_seed(self.seed, chunk),
            )

    def _by_data(
        self, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, int | None]]:
        columns = data_columns(tuple(args), "Predictive(split='data')")
        size, workers = len(columns[0]), runtime.world_size()
        if size < workers:
            raise ValueError(
                f"Predictive(split='data'): {size} data points cannot be split across "
                f"{workers} workers; use split='samples'"
            )
        batch, rows = next(block_batches(columns, None))
        probe = _DataAxes(len(rows), size)
        everything = range(self.num_samples)
        seed = derived_seed(_unseeded_base() if self.seed is None else self.seed, runtime.rank())
        with probe:
            pieces = self._draw(everything, batch, kwargs, seed)
        return pieces, {name: probe.axes.get(name) for name in pieces}


def _sample_count(value: Any) -> int:
    """``num_samples`` as an int, refused by name unless it is a positive integer.

    Pyro takes any integer here, NumPy's and one-element integer tensors
    included, so those pass; a bool is a mistake, not a count.
    """
    is_bool = isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool)
    try:
        count = None if is_bool else operator.index(value)
    except TypeError:
        count = None
    if count is None:
        raise TypeError(f"Predictive: num_samples must be an int or None, got {value!r}")
    if count < 1:
        raise ValueError(f"Predictive: num_samples must be a positive int, got {value!r}")
    return count


def _checked_posterior(samples: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
    """``posterior_samples`` as a dict, each value checked to have a row per sample."""
    posterior = dict(samples or {})
    for name, value in posterior.items():
        shape = getattr(value, "shape", None)
        if shape is None:
            raise TypeError(
                f"Predictive: posterior_samples[{name!r}] must be a tensor, "
                f"got {type(value).__name__}"
            )
        if len(shape) == 0:
            raise ValueError(
                f"Predictive: posterior_samples[{name!r}] must have a first dimension, "
                f"one row per sample, got a value of shape {tuple(shape)}"
            )
    return posterior


def _unseeded_base() -> int:
    """A seed from this worker's torch generator, mixed with its rank: workers
    whose generators were seeded alike still draw independent samples."""
    # cpu: a seed, from torch's CPU RNG
    drawn = int(torch.randint(0, 2**31 - 1, (), device="cpu").item())
    return derived_seed(drawn, runtime.rank())


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Draw from generators seeded by ``seed``, then put the caller's states back."""
    state = pyro.util.get_rng_state()
    pyro.set_rng_seed(seed)
    try:
        yield
    finally:
        pyro.util.set_rng_state(state)


class _DataAxes(Messenger):
    """Finds, for each sample site, the axis of the plate over a block of ``block``
    rows out of ``size``: the axis along which workers' values are joined."""

    def __init__(self, block: int, size: int) -> None:
        super().__init__()
        self.block, self.size = block, size
        self.axes: dict[str, int] = {}

    def _pyro_post_sample(self, msg: Any) -> None:
        if isinstance(msg["fn"], Subsample) or msg["name"] in self.axes:
            return
        shape = getattr(msg["value"], "shape", ())
        for frame in msg["cond_indep_stack"]:
            if frame.size != self.block or frame.full_size not in (self.block, self.size):
                continue
            if frame.dim is None:
                return
            # A plate's dim counts from the right of the batch shape; a site
            # that declares its whole value an event (pyro.deterministic does
            # by default) still carries the plate's axis at that dim itself.
            event_dim = getattr(msg["fn"], "event_dim", 0)
            for axis in (frame.dim - event_dim, frame.dim):
                if -len(shape) <= axis and shape[axis] == self.block:
                    self.axes[msg["name"]] = axis
                    return
            return
