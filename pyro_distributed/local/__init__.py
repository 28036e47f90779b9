"""Local variational parameters, each row held by the worker that owns its data.

A guide with one set of variational parameters per data point (per-cell
abundances, per-document topic weights, per-group effects) declares them as
``pyro.param(name, init, event_dim=k)`` inside a subsampled plate, or gets them
from an AutoGuide built with ``create_plates``. Replicated, every worker holds
all N rows and their optimizer state, and averages an N-row gradient every
step, although only the worker whose data a row belongs to ever touches it.

Under ``pd.shard_subsamples(own_local_params=True)`` a plate of size N is cut
into W contiguous blocks (:func:`~pyro_distributed.partition.block_range`), worker
r draws its subsamples from block r only, and the rows of every local
parameter outside block r never exist on worker r:

* the param store, and so the optimizer, hold the block's rows only;
* a local parameter's gradient never travels. Replicated, its rows would be
  averaged with W-1 zero contributions, which is the owner's gradient times
  1/W; :func:`scale_local_grads` multiplies by exactly that factor, so the
  rows come out bitwise as the replicated path computes them;
* :func:`gather_param` and :func:`local_rows` read the result, and the
  checkpoints (:mod:`pyro_distributed.checkpoint`) save each block where its
  worker writes it and re-partition blocks for another number of workers.

The record of which parameters are local lives in :mod:`.registry`, the
param-store surgery that keeps a block of rows in :mod:`.store`, what the
optimizer does with their gradients in :mod:`.gradients`, the public read-back
API in :mod:`.rows` and their block files in :mod:`.blocks`. The effect handler
that applies it all to Pyro's ``param`` and plate messages is
:class:`~pyro_distributed.shard_subsamples`.
"""
