"""scvi-tools models (cell2location's among them) with observations owned by their worker.

With ``PyroDistributedStrategy(own_local_params=True)`` each worker trains,
holds and summarises its block of observations only. What it takes for
scvi-tools' objects lives here: the loaders and data splitter cut to the
block (:mod:`~pyro_distributed.integrations.scvi.anndata`), the guide of a
Pyro plan set up on the block (:mod:`~pyro_distributed.integrations.scvi.guides`),
count matrices read from the ``.h5ad`` file by rows
(:func:`read_h5ad_by_rows`), posterior summaries computed where the
observations live (:func:`owned_posterior`) and written from there
(:func:`write_owned_obsm`). None of it imports scvi-tools or Lightning: it
works on the objects the user's model hands it, and every reach into
scvi-tools' private names is in
:mod:`~pyro_distributed.integrations.scvi.internals`.
"""

from __future__ import annotations

from .obsm_writer import write_owned_obsm
from .posterior import owned_posterior
from .rows_on_disk import RowsOnDisk, read_h5ad_by_rows

__all__ = ["RowsOnDisk", "owned_posterior", "read_h5ad_by_rows", "write_owned_obsm"]
