"""Local variational parameters, each row held by the worker that owns its data.

Under ``pd.shard_subsamples(own_local_params=True)`` a plate of size N is cut
into W contiguous blocks (:func:`~pyro_distributed.partition.block_range`);
worker r draws its subsamples from block r only, and the rows of a local
parameter outside block r never exist on worker r, in the param store or in
the optimizer. A local gradient never travels; it is scaled as the exchange
scales an average (:mod:`.gradients`), so the rows come out bitwise as the
replicated path's.

The record of which parameters are local is :mod:`.registry`; the param-store
surgery that keeps a block, :mod:`.store`; their gradients, :mod:`.gradients`
(and :mod:`.sparse` for sparse steps); reading them back, :mod:`.rows`; their
checkpoint files, :mod:`.blocks`. The effect handler that applies it to
Pyro's messages is :class:`~pyro_distributed.shard_subsamples`; the user's
guide is ``docs/guide/local-parameters.md``.
"""
