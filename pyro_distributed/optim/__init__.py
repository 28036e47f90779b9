"""The optimizers users hand to SVI, and what runs around their steps.

:class:`~pyro_distributed.optim.distributed.DistributedOptimizer` (over a
Pyro optimizer) and :class:`~pyro_distributed.optim.torch_optimizer.DistributedTorchOptimizer`
(over a torch one) are the front ends: each steps its wrapped optimizer
between two calls of one :class:`~pyro_distributed.optim.reducer.Reducer`,
which owns everything around the gradient exchange
(:mod:`pyro_distributed.exchange`), with its options in :mod:`.options`.
Around them: the Horovod contract (:mod:`.horovod`), multi-tensor stepping
(:mod:`.multi_tensor`), schedulers (:mod:`.schedulers`), drift checks
(:mod:`.consistency`), and the gradient noise scale (:mod:`.noise_scale`),
which the scaling planner (:mod:`pyro_distributed.scaling`, not an optimizer)
builds its advice on.
"""
