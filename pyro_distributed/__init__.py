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

Every public name is re-exported here, so users never need the subpackages;
the scaling planner's names stay together in one namespace, ``pd.scaling``.
The subpackages are layers that import only downwards (``docs/development.md``;
import-linter checks them).
"""

from . import policies, scaling
from .checkpoint import load_checkpoint, save_checkpoint
from .data.plates import data_plate
from .data.shards import ShardSampler, even_batches, shard, shard_indices
from .data.subsample import shard_subsamples
from .engines import Engine
from .errors import PyroDistributedError
from .evaluation.loss import evaluate_loss
from .evaluation.predictive import Predictive
from .exchange import CommHook, GradBucket, LowRankHook, Reducing
from .local.rows import gather_param, local_rows
from .optim.consistency import assert_in_sync
from .optim.distributed import DistributedOptimizer
from .optim.horovod import HorovodOptimizer
from .optim.noise_scale import NoiseScale
from .optim.torch_optimizer import DistributedTorchOptimizer
from .partition import block_range
from .policies import DiLoCo, LocalSGD, StepPolicy
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
from .seeding import set_rng_seed
from .spawn import Launched, launch, progress

__version__ = "0.1.0"

__all__ = [
    "CommHook",
    "DiLoCo",
    "DistributedOptimizer",
    "DistributedTorchOptimizer",
    "Engine",
    "GradBucket",
    "HorovodOptimizer",
    "Launched",
    "LocalSGD",
    "LowRankHook",
    "NoiseScale",
    "Predictive",
    "PyroDistributedError",
    "Reducing",
    "ShardSampler",
    "StepPolicy",
    "all_mean",
    "all_workers",
    "any_worker",
    "assert_in_sync",
    "barrier",
    "block_range",
    "current_engine",
    "data_plate",
    "evaluate_loss",
    "even_batches",
    "gather_param",
    "init",
    "is_main",
    "launch",
    "load_checkpoint",
    "local_rank",
    "local_rows",
    "policies",
    "progress",
    "rank",
    "save_checkpoint",
    "scaling",
    "set_rng_seed",
    "shard",
    "shard_indices",
    "shard_subsamples",
    "shutdown",
    "world_size",
]
