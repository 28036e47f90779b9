"""Data-parallel stochastic variational inference for Pyro.

Every worker runs the same model and guide on its own data; the optimizer
averages gradients across workers at every step, so all workers keep
identical parameters. The same script runs as one plain process, under
``torchrun`` (torch.distributed: gloo on CPU, NCCL on GPU), under
``horovodrun``, or under ``mpirun``/``mpiexec``/``srun`` (MPI, through mpi4py).

Example::

    import pyro
    import pyro_distributed as pd

    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}))
    svi = pyro.infer.SVI(model, guide, optim, pyro.infer.Trace_ELBO())
    loss = pd.all_mean(svi.step(my_shard))
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .consistency import assert_in_sync
from .data import ShardSampler, even_batches, shard, shard_indices
from .errors import PyroDistributedError
from .evaluate import evaluate_loss
from .horovod_optim import HorovodOptimizer
from .noise_scale import NoiseScale
from .optim import DistributedOptimizer
from .ownership import gather_param, local_rows
from .plates import data_plate
from .predictive import Predictive
from .runtime import (
    all_mean,
    all_workers,
    any_worker,
    barrier,
    current_engine,
    init,
    is_main,
    local_rank,
    rank,
    shutdown,
    world_size,
)
from .scaling import (
    CollectiveCost,
    ScalingProjection,
    measure_collective,
    project_scaling,
    scaling_advice,
)
from .seeding import set_rng_seed
from .subsample import shard_subsamples

__version__ = "0.1.0"

__all__ = [
    "CollectiveCost",
    "DistributedOptimizer",
    "HorovodOptimizer",
    "NoiseScale",
    "Predictive",
    "PyroDistributedError",
    "ScalingProjection",
    "ShardSampler",
    "all_mean",
    "all_workers",
    "any_worker",
    "assert_in_sync",
    "barrier",
    "current_engine",
    "data_plate",
    "evaluate_loss",
    "even_batches",
    "gather_param",
    "init",
    "is_main",
    "load_checkpoint",
    "local_rank",
    "local_rows",
    "measure_collective",
    "project_scaling",
    "rank",
    "save_checkpoint",
    "scaling_advice",
    "set_rng_seed",
    "shard",
    "shard_indices",
    "shard_subsamples",
    "shutdown",
    "world_size",
]
