"""The gradient's trip between workers, knowing nothing of Pyro.

A front end (:mod:`pyro_distributed.optim`) hands the exchange a list of
named tensors once per step; the exchange agrees with every other worker on
which tensors take part (:mod:`.agreement`), packs their gradients into a few
fused buckets (:mod:`.layout`), averages them (:mod:`.averager`, optionally
compressed, :mod:`.compression`), starts the buckets while backward is still
running (:mod:`.overlap`), and writes the averages back into ``.grad``.
:class:`~pyro_distributed.exchange.sync.GradientSync` owns all of it, so a
second front end calls one object instead of re-implementing the trip.
"""
