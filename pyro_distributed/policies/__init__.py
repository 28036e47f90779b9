"""Step policies: when workers exchange, and what.

A front end's ``step_policy=`` decides, step by step, whether the workers
average their gradients before the optimizer steps, and what runs after it:

- ``None`` (the default): every step averages every shared gradient; the
  workers never differ.
- :class:`LocalSGD`: each worker steps on its own gradients, and the shared
  parameters are averaged every ``period`` steps.
- :class:`DiLoCo`: each worker takes ``period`` steps of the wrapped
  optimizer; then the average of the workers' moves drives an outer
  optimizer (SGD with Nesterov momentum) from where the period started.

Between two sync points the workers differ by design; at each sync point
their shared parameters are bitwise identical. A new policy subclasses
:class:`StepPolicy` (``docs/guide/policies.md``).

Example::

    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}), step_policy=pd.LocalSGD(16))
"""

from .base import StepContext, average_parameters
from .base import StepPolicy as StepPolicy
from .diloco import DiLoCo as DiLoCo
from .local_sgd import LocalSGD as LocalSGD

# What writing a policy needs beyond pd.StepPolicy (the policies themselves
# are pd.LocalSGD and pd.DiLoCo).
__all__ = ["StepContext", "average_parameters"]
