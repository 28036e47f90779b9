"""Posterior summaries of owned observations, computed where each observation lives.

After training with ``PyroDistributedStrategy(own_local_params=True)`` worker
r holds the variational parameters of its block of observations only
(:mod:`pyro_distributed.local`), so scvi-tools' ``sample_posterior`` and
cell2location's ``posterior_quantile`` cannot run on one worker over every
observation. :func:`owned_posterior` makes them work unchanged: inside it,
each of these methods of the model runs on every worker over that worker's
block (its data and its parameters), turns its samples into summaries there
(means, standard deviations, quantiles), and only the summaries travel,
joined along the observation plate in the AnnData's order. Global sites'
summaries are worker 0's. No worker ever holds another worker's samples,
nor every observation's. With ``to="owners"`` the summaries are not joined
either: each worker keeps its block's, and
:func:`~pyro_distributed.integrations.scvi.obsm_writer.write_owned_obsm` writes
them into an ``.h5ad`` file block by block, so that no worker ever holds
every spot's summaries (at Visium HD sizes they are hundreds of MB each).

Example::

    model.train(..., strategy=PyroDistributedStrategy(own_local_params=True))
    with owned_posterior(model):                 # on every worker
        adata = model.export_posterior(adata, sample_kwargs={"num_samples": 100})
    # every worker's adata.obsm["means_cell_abundance_w_sf"] has every spot

.. warning::
    A collective: call the model's methods inside it on every worker, in the
    same order and with the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, get_args

import numpy as np
import torch

from ... import runtime
from ...checks import check_choice, check_int
from ...data.subsample import shard_subsamples
from ...gather import gather_pieces
from ...partition import block_range
from . import internals

__all__ = ["owned_posterior"]

Summaries = dict[str, Any]
#: Spots of a worker's block whose quantiles one batch computes, where the
#: caller gives no ``batch_size``: scvi-tools' loader hands the guide each
#: batch's counts as one dense tensor, about 280 MB at 8,588 genes, where
#: the whole block would be 10.9 GiB a worker at 678,771 spots and W=2.
QUANTILE_ROWS = 8192
#: Where the plate's summaries go: joined on every worker, joined on worker 0,
#: or left with their owners (each worker its block's, in the AnnData's order).
SummariesTo = Literal["all", "main", "owners"]


@contextmanager
def owned_posterior(model: Any, *, to: SummariesTo = "all") -> Iterator[Any]:
    """Make ``model.sample_posterior`` and (where the model has it)
    ``model.posterior_quantile`` summarise each worker's block where it lives.

    ``sample_posterior`` takes the block in one batch unless given
    ``batch_size``; ``posterior_quantile`` loads ``batch_size`` spots of
    counts at a time (:data:`QUANTILE_ROWS` by default), once for an
    ``AutoNormal`` guide, whose quantiles are its parameters'.

    :param model: a trained scvi-tools model with a Pyro module
        (``PyroSampleMixin``), such as cell2location's ``Cell2location``.
    :param to: ``"all"`` (default): every worker gets every observation's
        summaries, so the model's own exports (``export_posterior``) work on
        every worker; ``"main"``: worker 0 only, and other workers get ``None``
        from the methods (call exports on worker 0 alone then); ``"owners"``:
        each worker keeps its block's summaries, in the AnnData's order (write
        them with :func:`~pyro_distributed.integrations.scvi.write_owned_obsm`).

    Example::

        with owned_posterior(model):             # on every worker
            summaries = model.sample_posterior(num_samples=100)
        summaries["means"]["w_sf"].shape         # (every spot, cell types)
    """
    check_choice("to", to, get_args(SummariesTo))
    engine = runtime.current_engine()
    n_obs = int(model.adata.n_obs)
    block = np.arange(block_range(n_obs).start, block_range(n_obs).stop)
    saved = {name: model.__dict__.get(name) for name in ("sample_posterior", "posterior_quantile")}
    own_sample = model.sample_posterior

    def sample_posterior(**kwargs: Any) -> Summaries | None:
        kwargs.setdefault("batch_size", len(block))
        with shard_subsamples(own_local_params=True):
            summaries = own_sample(indices=block, **kwargs)
        sites = _plate_sites(model, block)
        joined = {
            summary: _join(engine, values, sites, to) for summary, values in summaries.items()
        }
        return None if to == "main" and engine.rank != 0 else joined

    model.sample_posterior = sample_posterior
    if internals.has_posterior_quantile(model):
        model.posterior_quantile = _quantiles(model, block, engine, to)
    try:
        yield model
    finally:
        for name, value in saved.items():
            if value is None:
                model.__dict__.pop(name, None)
            else:
                model.__dict__[name] = value


def _quantiles(
    model: Any, block: np.ndarray, engine: Any, to: SummariesTo
) -> Callable[..., Summaries | None]:
    """cell2location's ``posterior_quantile`` over this worker's block, its
    counts loaded ``batch_size`` spots at a time (:data:`QUANTILE_ROWS` by
    default). cell2location's own method loads every spot's counts in one
    dense batch, which at Visium HD sizes does not fit.

    Guides differ in what one batch gives: an ``AutoNormal``'s quantiles
    are its parameters', every spot of the block whatever the batch (the
    counts are loaded only because the method asks for a batch), so the
    first batch gives them all, bitwise the one-batch values; a messenger
    guide's are the batch's spots, so the batches' are joined along the
    plate. Each plate site is taken one way or the other by its size in
    the first batch."""

    def posterior_quantile(**kwargs: Any) -> Summaries | None:
        rows = kwargs.pop("batch_size", None)
        check_int("batch_size", rows, minimum=1, optional=True)
        rows = rows or QUANTILE_ROWS
        exclude = kwargs.pop("exclude_vars", None) or []
        sites = _plate_sites(model, block)
        pieces: list[Summaries] = []
        with shard_subsamples(own_local_params=True):
            for start in range(0, max(len(block), 1), rows):
                spots = block[start : start + rows]
                piece = internals.posterior_quantile(model, spots, exclude_vars=exclude, **kwargs)
                pieces.append(piece)
                if len(spots) < len(block) and _whole_block(piece, sites, len(block)):
                    break  # the guide gave every spot's from one batch
        values = {
            name: np.concatenate(
                [np.asarray(piece[name]) for piece in pieces],
                axis=_axis(sites[name], np.ndim(value)),
            )
            if name in sites and len(pieces) > 1 and _plate_size(value, sites[name]) != len(block)
            else value
            for name, value in pieces[0].items()
        }
        joined = _join(engine, values, sites, to)
        return None if to == "main" and engine.rank != 0 else joined

    return posterior_quantile


def _whole_block(piece: Summaries, sites: dict[str, int], spots: int) -> bool:
    """Whether every plate site of ``piece`` (if any) has all ``spots`` of the block."""
    return all(_plate_size(piece[name], sites[name]) == spots for name in piece if name in sites)


def _plate_size(value: Any, dim: int) -> int:
    """The length of ``value`` along the plate's axis ``dim``."""
    return int(np.shape(value)[_axis(dim, np.ndim(value))])


def _plate_sites(model: Any, block: np.ndarray) -> dict[str, int]:
    """Each site of the observation plate, with the plate's axis in its values,
    traced on a few observations of this worker's block (scvi-tools' own rule)."""
    loader = internals.data_loader(model, block[:16])
    args, kwargs = internals.batch_args(model.module, next(iter(loader)))
    with shard_subsamples(own_local_params=True), torch.no_grad():
        return internals.obs_plate_sites(model, args, kwargs)


def _join(engine: Any, values: Summaries, sites: dict[str, int], to: SummariesTo) -> Summaries:
    """Every worker's summaries of the plate's sites joined in rank order (the
    AnnData's order, as blocks are), or each worker's own with ``"owners"``;
    the other sites worker 0's."""
    shared = {name: v for name, v in values.items() if name not in sites}
    shared = engine.allgather_object(shared)[0] if to != "main" else shared
    if to == "owners":
        return {name: values[name] if name in sites else shared[name] for name in values}
    # cpu: the summaries arrive as NumPy arrays and travel from host memory.
    local = {
        name: torch.as_tensor(np.asarray(v), device="cpu")
        for name, v in values.items()
        if name in sites
    }
    axes: dict[str, int | None] = {name: _axis(sites[name], local[name].dim()) for name in local}
    joined = gather_pieces(engine, local, axes, to) or {}
    out = {**shared, **{name: value.numpy() for name, value in joined.items()}}
    return {name: out[name] for name in values if name in out}


def _axis(dim: int, ndim: int) -> int:
    """The plate's axis of a summary of ``ndim`` dimensions, from the right
    (scvi-tools gives it from the right)."""
    return dim if dim < 0 else dim - ndim
