"""The optimizers users hand to SVI, and what runs around their steps.

:class:`~pyro_distributed.optim.distributed.DistributedOptimizer` is the
coordinator: it splits off local parameters, hands the rest to the gradient
exchange (:mod:`pyro_distributed.exchange`), and lets the wrapped optimizer
step. Around it: the Horovod contract (:mod:`.horovod`), multi-tensor stepping
(:mod:`.multi_tensor`), schedulers (:mod:`.schedulers`), drift checks
(:mod:`.consistency`), and the gradient noise scale (:mod:`.noise_scale`),
which the scaling planner (:mod:`pyro_distributed.scaling`, not an optimizer)
builds its advice on.
"""
