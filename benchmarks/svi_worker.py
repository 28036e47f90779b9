"""One benchmark process: time ``--steps`` training steps of one workload.

Runs unchanged as one process (``python benchmarks/svi_worker.py ...``), under
``torchrun --nproc-per-node 2`` or under ``horovodrun``. Every worker builds
the same model on its own batch of the same size (weak scaling), runs
``--warmup`` untimed steps, waits for the others, then times ``--steps`` steps.
Worker 0 prints one JSON line::

    {"workload": ..., "optim": ..., "world_size": ..., "ms_per_step": ..., "steps": ...,
     "param_tensors": ..., "params_in_sync": ...}

and, with ``--json-out PATH``, also writes it to ``PATH``. ``param_tensors``
counts the tensors the optimizer steps; ``params_in_sync`` says whether every
worker ended with bitwise identical parameters (checked after the clock stops).

Every ``--optim`` but ``ddp`` is an SVI step (``Trace_ELBO``, Adam with lr
1e-3) with a different optimizer. ``ddp`` trains the same model and guide the
way torch users train a module: ``pyro.settings.set(module_local_params=True)``
keeps the parameters inside the modules, ``Trace_ELBO()(model, guide)`` is an
``nn.Module`` whose forward returns the loss, and at W>1 it is wrapped in
``torch.nn.parallel.DistributedDataParallel`` and stepped by one
``torch.optim.Adam``; ``ddp-fp16`` adds DDP's ``fp16_compress_hook`` and
``ddp-powersgd`` its ``powerSGD_hook`` at ``--rank``, against ``ours-lowrank``
and ``torch-ours-lowrank`` (``LowRankHook`` at the same rank, in SVI and in
the module's loop; all compress from the first timed step).
See :func:`module_training` for what differs from SVI. With ``--heldout`` the
line also holds ``heldout_loss``, the ELBO loss of the trained model on data
no worker trained on.

Step policies, at ``--period H`` (``bench_policies.py``): ``ours-localsgd``
(``step_policy=LocalSGD(H)``) and ``ours-diloco`` (``DiLoCo(H)`` with its
defaults) in SVI, against ``ddp-postlocal``: torch's post-local SGD (DDP's
``post_localSGD_hook`` and ``PostLocalSGDOptimizer`` with a
``PeriodicModelAverager``). In all three the ``--warmup`` untimed steps
average gradients and the parameters are averaged after every H-th timed
step, so each timed step a multiple of H is a sync point.

``--curve E`` measures time to a loss rather than time per step: every E
timed steps the clock stops, worker 0's held-out loss is computed (as with
``--heldout``), and the clock starts again. The line then also holds
``curve``, ``[seconds of training so far, held-out loss]`` from before the
first timed step to after the last, ``curve_every``, ``curve_in_sync``
(whether every worker held the same parameters at every point) and
``bytes_per_step``, what worker 0's host sent per timed step by the
counters of its network interfaces (``/proc/net/dev``, loopback aside:
meaningful only where the workers have a host each, as in
``bench_policies.py``).

``--first-step`` also times the first step, construction included
(``bench_first_step.py``): once the workload is built, the workers meet at
a barrier, and each times from there to the return of its first training
step, which is the first of the ``--warmup`` steps (so it needs at least
one). In SVI (``ours`` and every ``--optim`` that is not a torch module)
the clock covers building the Pyro optimizer (``DistributedOptimizer``
around ``pyro.optim.Adam``) and the ``SVI`` object, then the first
``svi.step``: the first trace of guide and model (which creates the
parameters in the param store), backward, and the optimizer's call, which
for ``ours`` holds the library's first-step work (the plan, the agreement
across workers on which parameters the step takes, the broadcast of worker
0's values of the new ones, the buckets) before the gradient all-reduce
and Adam's step. For ``ddp`` (and the other module
configurations) it covers building the ELBO module, its first loss
evaluation (which :func:`module_training` makes before DDP is built, to
create lazy parameters; it is also the first trace of guide and model),
``torch.optim.Adam``, the ``DistributedDataParallel`` constructor (which
broadcasts worker 0's parameters and buckets the gradients) with any comm
hook, then the first step (zero_grad, forward, backward with its
all-reduce, Adam's step). Both include building torch's Adam (SVI builds
one per parameter inside its first step), whose first construction in a
process imports ``torch._dynamo``. The line then also holds
``first_step_s``, the largest such time over the workers;
``first_step_wrapper_s``, the largest time from just before the optimizer
is built (``DistributedOptimizer``; ``torch.optim.Adam`` and the
``DistributedDataParallel`` constructor) to the end of the first step,
which for ``ddp`` leaves out the first loss evaluation (equal to
``first_step_s`` in SVI, whose first trace is inside its first step); and
``first_step_phases``, the largest time of each phase over the workers
(``first_call``, module configurations only; ``construct``; ``step``).
``--profile-first-step PATH`` implies ``--first-step`` and runs worker 0's
measured span under ``cProfile``, writing the functions that took the most
cumulative time (and those of ``pyro_distributed`` apart) to ``PATH``;
the profiler slows worker 0, so that run's ``first_step_s`` (flagged by
``first_step_profiled``) is not comparable with unprofiled ones. Time a
worker spends waiting for the others inside a collective counts as time in
that collective.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import pstats
import re
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from memory import state_bytes
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule
from pyro.optim import PyroOptim
from spatial_workload import NAME as SPATIAL_NAME
from spatial_workload import spatial_mapping
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import pyro_distributed

SEED = 20240601
LEARNING_RATE = 1e-3
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# smallN: N/2 latent coefficient vectors, so AutoNormal makes N small parameters.
GROUP_DIM = 4
SMALL_BATCH = 256

# wide40: the same regression with 20 coefficient vectors of 10k floats each, so
# AutoNormal makes 40 parameters of 10k floats (1.6 MB of gradients).
WIDE_NAME, WIDE_TENSORS, WIDE_DIM = "wide40", 40, 10_000

# tiny: the same regression with 5 coefficient vectors of 100 floats each, so
# AutoNormal makes 10 parameters, 1,000 floats in all: a step so cheap that
# any per-step overhead of the library shows.
TINY_NAME, TINY_TENSORS, TINY_DIM = "tiny", 10, 100

# large1m: a one-hidden-layer regression whose 1000 x 1000 weight is ~1 M floats.
HIDDEN = 1000
LARGE_BATCH = 512

# localN: N data points with a local 8-dimensional latent each (AutoNormal with
# create_plates): 2N x 8 local variational parameters, a subsample per step.
LOCAL_DIM = 8
LOCAL_BATCH = 256

# vae: the example's networks, at its default sizes, on a fixed batch per worker.
VAE_HIDDEN = 128
VAE_LATENT = 4
VAE_BATCH = 256

# --heldout: particles of the held-out ELBO, drawn from one seed for every configuration.
HELDOUT_PARTICLES = 8

# --profile-first-step: functions listed per table of the profile, and the
# functions whose callees it lists: the SVI step, its loss and gradients (the
# traces of guide and model, backward), our optimizer's call and its reducer.
PROFILE_LINES = 25
PROFILE_PARTS = (
    r"pyro[/\\]infer[/\\]svi\.py:\d+\(step\)",
    r"trace_elbo\.py:\d+\(loss_and_grads\)",
    r"pyro_distributed[/\\]optim[/\\]distributed\.py:\d+\(__call__\)",
    r"pyro_distributed[/\\]optim[/\\]reducer\.py:\d+\(reduce\)",
)

OPTIMS = (
    "plain",
    "ours",
    "ours-nooverlap",
    "ours-fp16",
    # The low-rank hook (LowRankHook at --rank), and DDP's powerSGD_hook at the same rank.
    "ours-lowrank",
    "ours-pp",
    "ours-noise",
    "ours-owned",
    "ours-sparse",
    "pyro-horovod",
    "ddp",
    # DDP with its fp16 compression hook: the strongest peer on a slow link.
    "ddp-fp16",
    "ddp-powersgd",
    # Pyro's torch-native loop: the ELBO module and one torch Adam, plain
    # (W=1), through our DistributedOptimizer, and with owned local rows.
    "torch",
    "torch-ours",
    "torch-ours-owned",
    "torch-ours-sparse",
    "torch-ours-lowrank",
    # Step policies at --period: LocalSGD and DiLoCo in SVI, and torch's
    # post-local SGD (DDP's post_localSGD_hook and PostLocalSGDOptimizer).
    "ours-localsgd",
    "ours-diloco",
    "ddp-postlocal",
)
#: The configurations that train the ELBO module with a torch optimizer.
MODULE_OPTIMS = (
    "ddp",
    "ddp-fp16",
    "ddp-powersgd",
    "ddp-postlocal",
    "torch-ours-lowrank",
    "torch",
    "torch-ours",
    "torch-ours-owned",
    "torch-ours-sparse",
)
#: The configurations whose workers step alone between averages every --period steps.
PERIOD_OPTIMS = ("ours-localsgd", "ours-diloco", "ddp-postlocal")

Model = Callable[..., object]


@dataclass(frozen=True)
class Workload:
    """A model, its guide, and this worker's batch, as ``svi.step(*args)`` takes them."""

    model: Model
    guide: Model
    args: tuple[Any, ...]
    #: Whether our configurations shard its subsampled plates across workers.
    sharded_plates: bool = False


# ---------------------------------------------------------------------------
# smallN: many tiny parameters, so per-parameter overhead dominates the step.


def grouped_regression(groups: int, dim: int = GROUP_DIM) -> Model:
    """A regression with one small latent coefficient vector per group.

    ``x`` holds the group index in column 0 and the features after it. The
    model has no parameters of its own; AutoNormal gives each of the
    ``groups`` sites a location and a scale, so ``2 * groups`` tensors.
    """

    def model(x: Tensor, y: Tensor) -> None:
        coefs = torch.stack(
            [
                pyro.sample(f"coef_{g}", dist.Normal(torch.zeros(dim), 1.0).to_event(1))
                for g in range(groups)
            ]
        )
        group, features = x[:, 0].long(), x[:, 1:]
        mean = (features * coefs[group]).sum(-1)
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)

    return model


def small(tensors: int, generator: torch.Generator, dim: int = GROUP_DIM) -> Workload:
    """The grouped regression with ``tensors // 2`` groups of ``dim`` coefficients,
    fitted with AutoNormal.

    AutoNormal is a PyroModule, so the same pair serves SVI and DDP.
    """
    groups = tensors // 2
    group = torch.randint(groups, (SMALL_BATCH, 1), generator=generator)
    features = torch.randn(SMALL_BATCH, dim, generator=generator)
    y = features.sum(-1) + 0.5 * torch.randn(SMALL_BATCH, generator=generator)
    x = torch.cat([group.float(), features], dim=1)
    model = grouped_regression(groups, dim)
    return Workload(model, AutoNormal(model), (x, y))


# ---------------------------------------------------------------------------
# large1m: a few parameters, ~1 M floats in all, so gradient volume dominates.


def mlp_likelihood(x: Tensor, y: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> None:
    """The observation model of large1m, shared by its SVI and its module form."""
    mean = torch.tanh(x @ w1 + b1) @ w2 + b2
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)


# Initial values of large1m's parameters, drawn from the global RNG when called.
MLP_INIT: dict[str, Callable[[], Tensor]] = {
    "w1": lambda: torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5,
    "b1": lambda: torch.zeros(HIDDEN),
    "w2": lambda: torch.randn(HIDDEN) / HIDDEN**0.5,
    # One element, not a scalar: DDP's powerSGD_hook fails on a 0-dim parameter
    # (it views every gradient as shape[0] rows).
    "b2": lambda: torch.zeros(1),
}


def mlp_regression(x: Tensor, y: Tensor) -> None:
    """A point-estimate regression through one hidden layer of ``HIDDEN`` units.

    The parameters live in Pyro's param store, as in a typical Pyro model;
    ``pyro.param`` draws their initial values on the first step only.
    """
    mlp_likelihood(x, y, **{name: pyro.param(name, init) for name, init in MLP_INIT.items()})


class MLPRegression(PyroModule):
    """large1m as a PyroModule, for DDP: the same parameters, names and computation.

    The four tensors are ``nn.Parameter`` attributes instead of param-store
    entries, and are drawn when the module is built, not on the first step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(MLP_INIT["w1"]())
        self.b1 = nn.Parameter(MLP_INIT["b1"]())
        self.w2 = nn.Parameter(MLP_INIT["w2"]())
        self.b2 = nn.Parameter(MLP_INIT["b2"]())

    def forward(self, x: Tensor, y: Tensor) -> None:
        mlp_likelihood(x, y, self.w1, self.b1, self.w2, self.b2)


def no_guide(*args: object) -> None:
    """The guide of a model without latent variables."""


def large1m(generator: torch.Generator, as_modules: bool) -> Workload:
    """The hidden-layer regression on this worker's ``LARGE_BATCH`` rows."""
    x = torch.randn(LARGE_BATCH, HIDDEN, generator=generator)
    y = torch.tanh(x[:, :10].sum(-1)) + 0.5 * torch.randn(LARGE_BATCH, generator=generator)
    model: Model = MLPRegression() if as_modules else mlp_regression
    return Workload(model, no_guide, (x, y))


# ---------------------------------------------------------------------------
# vae: the VAE example (examples/vae_digits.py), on a fixed batch of digits.


class VAEModel(PyroModule):
    """The example's ``VAE.model`` as a module that owns the decoder, for DDP.

    The body is ``VAE.model``'s without its ``pyro.module("decoder", ...)``
    line: with module-local parameters the decoder is a child module, and its
    parameters reach the optimizer through ``parameters()``, not the store.
    """

    def __init__(self, decoder: nn.Module, latent: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.latent = latent

    def forward(self, x: Tensor, indices: Tensor, size: int) -> None:
        prior = dist.Normal(x.new_zeros(self.latent), 1.0).to_event(1)
        with pyro.plate("data", size, subsample=indices):
            z = pyro.sample("z", prior)
            likelihood = dist.ContinuousBernoulli(logits=self.decoder(z)).to_event(1)
            pyro.sample("x", likelihood, obs=x)


class VAEGuide(PyroModule):
    """The example's ``VAE.guide`` as a module that owns the encoder, for DDP.

    Like :class:`VAEModel`: the same body without the ``pyro.module`` line.
    """

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: Tensor, indices: Tensor, size: int) -> None:
        with pyro.plate("data", size, subsample=indices):
            loc, scale = self.encoder(x)
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))


def vae(generator: torch.Generator, as_modules: bool) -> Workload:
    """The example's VAE on ``VAE_BATCH`` training images drawn once per worker.

    The example is imported, not copied, so SVI times the code users run. Its
    module needs scikit-learn and matplotlib, so only this workload imports it.
    """
    sys.path.insert(0, str(EXAMPLES))
    from vae_digits import VAE, load_images  # the example, not a package

    train, _ = load_images()
    indices = torch.randperm(len(train), generator=generator)[:VAE_BATCH]
    network = VAE(train.shape[1], VAE_HIDDEN, VAE_LATENT)
    args = (train[indices], indices, len(train))
    if as_modules:
        return Workload(VAEModel(network.decoder, network.latent), VAEGuide(network.encoder), args)
    return Workload(network.model, network.guide, args)


# ---------------------------------------------------------------------------
# localN: per-data-point variational parameters, the case for ownership.


def local_latents(points: int, generator: torch.Generator) -> Workload:
    """A global mean and one latent vector per data point, each point observed once.

    AutoNormal with ``create_plates`` gives every point a location and a scale
    of LOCAL_DIM floats (event_dim 1 inside the "data" plate): the local
    parameters that ``shard_subsamples(own_local_params=True)`` splits.
    """
    data = torch.randn(points, LOCAL_DIM, generator=generator) + 1.0

    def model(x: Tensor) -> None:
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0).expand([LOCAL_DIM]).to_event(1))
        with pyro.plate("data", len(x), subsample_size=LOCAL_BATCH) as idx:
            z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=x[idx])

    def plates(x: Tensor) -> pyro.plate:
        return pyro.plate("data", len(x), subsample_size=LOCAL_BATCH)

    return Workload(model, AutoNormal(model, create_plates=plates), (data,), sharded_plates=True)


SMALL_NAME = re.compile(r"small(\d+)")
LOCAL_NAME = re.compile(r"local(\d+)")


def build_workload(name: str, generator: torch.Generator, as_modules: bool) -> Workload:
    """The workload called ``name``: ``smallN`` (N even), ``tiny``, ``wide40``, ``large1m``
    or ``vae``.

    ``as_modules`` asks for model and guide as PyroModules that own their
    parameters, as DDP needs them; smallN's pair already is.
    """
    if name == "large1m":
        return large1m(generator, as_modules)
    if name == "vae":
        return vae(generator, as_modules)
    if name == WIDE_NAME:
        return small(WIDE_TENSORS, generator, WIDE_DIM)
    if name == TINY_NAME:
        return small(TINY_TENSORS, generator, TINY_DIM)
    local = LOCAL_NAME.fullmatch(name)
    if local is not None:
        # The same data on every worker, as a data set they share.
        return local_latents(int(local[1]), torch.Generator().manual_seed(SEED))
    return small(small_tensors(name), generator)


def small_tensors(name: str) -> int:
    """N of a ``smallN`` name; ``ValueError`` if it is not one or N is odd or zero."""
    match = SMALL_NAME.fullmatch(name)
    if match is None or int(match[1]) < 2 or int(match[1]) % 2:
        raise ValueError(f"unknown workload {name!r}: use small<N> (N even, >= 2), large1m or vae")
    return int(match[1])


def workload_name(name: str) -> str:
    """argparse type: a workload name that :func:`build_workload` accepts."""
    named = name in ("large1m", "vae", WIDE_NAME, TINY_NAME)
    if not (named or LOCAL_NAME.fullmatch(name) or SPATIAL_NAME.fullmatch(name)):
        try:
            small_tensors(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return name


# ---------------------------------------------------------------------------
# Training: one step function and the parameters it trains, for SVI or DDP.


def always_in_sync() -> bool:
    """A sync point after every step: where every step averages."""
    return True


@dataclass(frozen=True)
class Training:
    """One training step (returns the loss) and the parameters it updates, by name."""

    step: Callable[[], float]
    parameters: Callable[[], Sequence[tuple[str, Tensor]]]
    #: Bytes of this worker's parameters and optimizer state.
    state_bytes: Callable[[], int]
    #: The loss on other data (``heldout_args``), without a step.
    heldout: Callable[[tuple[Any, ...]], float]
    #: Whether the last step ended at a sync point by the optimizer's own
    #: account (always, where every step averages).
    at_sync: Callable[[], bool] = always_in_sync


def start_engine(optim: str) -> None:
    """Join the other workers before building anything: joining is a collective.

    ``pyro-horovod`` starts Horovod itself, as Pyro's users do; the library's
    engine then finds it running. Everything else lets the library choose.
    """
    if optim == "pyro-horovod":
        import horovod.torch as hvd  # only this configuration needs Horovod

        hvd.init()
    pyro_distributed.init()


def make_optimizer(name: str, options: dict[str, Any]) -> PyroOptim:
    """The Pyro optimizer for ``--optim`` (every name but ``ddp``).

    ``options`` go to every ``DistributedOptimizer`` (for tuning runs).
    """
    adam = pyro.optim.Adam({"lr": LEARNING_RATE})
    if name == "plain":
        return adam
    if name == "ours":
        return pyro_distributed.DistributedOptimizer(adam, **options)
    if name == "ours-nooverlap":
        return pyro_distributed.DistributedOptimizer(adam, overlap=False, **options)
    if name == "ours-fp16":
        return pyro_distributed.DistributedOptimizer(adam, compression="fp16", **options)
    if name == "ours-lowrank":
        hook = pyro_distributed.LowRankHook(options.pop("rank"), warmup_steps=options.pop("start"))
        return pyro_distributed.DistributedOptimizer(adam, comm_hook=hook, **options)
    if name == "ours-pp":
        return pyro_distributed.DistributedOptimizer(adam, multi_tensor=False, **options)
    if name == "ours-noise":
        return pyro_distributed.DistributedOptimizer(adam, noise_scale=True, **options)
    if name in ("ours-owned", "ours-sparse"):
        return pyro_distributed.DistributedOptimizer(adam, **options)
    if name in ("ours-localsgd", "ours-diloco"):
        period, warmup = options.pop("period"), options.pop("start")
        policy: pyro_distributed.StepPolicy = (
            pyro_distributed.LocalSGD(period, warmup_steps=warmup)
            if name == "ours-localsgd"
            # DiLoCo's defaults, spelled out: the paper's outer SGD.
            else pyro_distributed.DiLoCo(
                period, outer_lr=0.7, momentum=0.9, nesterov=True, warmup_steps=warmup
            )
        )
        return pyro_distributed.DistributedOptimizer(adam, step_policy=policy, **options)
    if name == "pyro-horovod":
        return pyro.optim.HorovodOptimizer(adam)
    raise ValueError(f"no Pyro optimizer for --optim {name!r}")


def store_parameters() -> list[tuple[str, Tensor]]:
    """Every parameter in Pyro's param store (unconstrained), sorted by name."""
    return sorted(pyro.get_param_store().named_parameters())


def broadcast_store_from_worker_0(workload: Workload) -> None:
    """Give every worker worker 0's initial parameters, as Pyro's Horovod example does.

    Pyro's ``HorovodOptimizer`` averages gradients but never copies values,
    so workers seeded differently would drift apart. Its example creates the
    parameters with one guide call and broadcasts them; here one loss
    evaluation creates those of model and guide alike.
    """
    import horovod.torch as hvd

    with torch.no_grad():
        Trace_ELBO().loss(workload.model, workload.guide, *workload.args)
    hvd.broadcast_parameters(
        {name: value.detach() for name, value in store_parameters()}, root_rank=0
    )


def svi_training(
    workload: Workload,
    optim_name: str,
    options: dict[str, Any],
    first_step: FirstStep | None = None,
) -> Training:
    """SVI with the optimizer that ``optim_name`` names.

    ``first_step``, if given, starts here: its ``construct`` phase is the
    optimizer and the ``SVI`` object, and its ``step`` the first ``svi.step``.
    """
    if first_step is not None:
        first_step.start()
    if optim_name == "pyro-horovod" and pyro_distributed.world_size() > 1:
        broadcast_store_from_worker_0(workload)
    hook_options = {"rank": options.pop("rank", 4), "start": options.pop("start", 10)}
    if optim_name == "ours-lowrank":
        options = {**options, **hook_options}
    elif optim_name in PERIOD_OPTIMS:
        options = {**options, "start": hook_options["start"]}
    optim = make_optimizer(optim_name, options)
    svi = SVI(workload.model, workload.guide, optim, Trace_ELBO())
    if first_step is not None:
        first_step.mark("construct")

    def step() -> float:
        # Our configurations shard the local workloads' subsamples across
        # workers; "ours-owned" also keeps each worker's block of local
        # parameters only, and "ours-sparse" steps only their selected rows.
        if not (optim_name.startswith("ours") and workload.sharded_plates):
            return svi.step(*workload.args)
        with pyro_distributed.shard_subsamples(
            own_local_params=optim_name in ("ours-owned", "ours-sparse"),
            local_updates="sparse" if optim_name == "ours-sparse" else "dense",
        ):
            return svi.step(*workload.args)

    def held_bytes() -> int:
        optimizers = getattr(optim, "optim_objs", {}).values()
        return state_bytes(dict(store_parameters()).values(), optimizers)

    def heldout(args: tuple[Any, ...]) -> float:
        pyro.set_rng_seed(SEED)
        with torch.no_grad():
            return float(Trace_ELBO(num_particles=HELDOUT_PARTICLES).loss(
                workload.model, workload.guide, *args
            ))  # fmt: skip

    return Training(
        step, store_parameters, held_bytes, heldout, lambda: getattr(optim, "in_sync", True)
    )


def module_training(
    workload: Workload,
    optim_name: str,
    options: dict[str, Any],
    first_step: FirstStep | None = None,
) -> Training:
    """The same model and guide as a torch module, trained with a torch Adam:
    under DDP at W>1 (``ddp``; ``ddp-fp16`` with its fp16 compression hook),
    plain (``torch``), or through our DistributedOptimizer (``torch-ours``,
    ``torch-ours-owned``, and ``torch-ours-sparse``: owned rows with sparse
    local steps).

    What DDP gets is the ELBO module's ``parameters()``: the guide's (and the
    model's, for large1m and the VAE), the same tensors SVI would find in the
    param store. What differs from an SVI step is the loop around them: no
    param-store lookups, no tracing to find the parameters, one Adam for all
    of them, and DDP's averaging that starts during ``backward()``. The first
    loss evaluation is untimed; it creates AutoNormal's lazy parameters,
    which DDP must see when it is built. DDP copies worker 0's values then.

    ``first_step``, if given, starts here: its ``first_call`` phase is the
    ELBO module and that first loss evaluation; ``construct`` torch's Adam
    and the wrapper (``DistributedDataParallel`` and its hook, or ours); and
    ``step`` the first step.
    """
    if first_step is not None:
        first_step.start()
    ours = optim_name.startswith("torch-ours")
    # As for SVI: ours shards the local workloads' subsamples; "owned" keeps
    # each worker's block of local rows only (cut by the first call).
    sharded = ours and workload.sharded_plates
    owned = optim_name in ("torch-ours-owned", "torch-ours-sparse")
    local_updates = "sparse" if optim_name == "torch-ours-sparse" else "dense"

    def plates() -> Any:
        if not sharded:
            return nullcontext()
        return pyro_distributed.shard_subsamples(
            own_local_params=owned, local_updates=local_updates
        )

    elbo = Trace_ELBO()(workload.model, workload.guide)
    with plates():
        elbo(*workload.args)
    if first_step is not None:
        first_step.mark("first_call")
    module: nn.Module = elbo
    optimizer: torch.optim.Optimizer = torch.optim.Adam(elbo.parameters(), lr=LEARNING_RATE)
    at_sync: Callable[[], bool] = always_in_sync
    if optim_name.startswith("ddp") and pyro_distributed.world_size() > 1:
        if pyro_distributed.current_engine().name != "torch":
            raise SystemExit("--optim ddp with several workers needs torchrun")
        ddp = nn.parallel.DistributedDataParallel(elbo)
        if optim_name == "ddp-fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if optim_name == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=options.get("rank", 4),
                start_powerSGD_iter=max(2, options.get("start", 10)),
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        if optim_name == "ddp-postlocal":
            optimizer, at_sync = post_local_sgd(ddp, optimizer, options["period"], options["start"])
        module = ddp
    elif ours:
        hook = {}
        if optim_name == "torch-ours-lowrank":
            rank, start = options.get("rank", 4), options.get("start", 10)
            hook["comm_hook"] = pyro_distributed.LowRankHook(rank, warmup_steps=start)
        optimizer = pyro_distributed.DistributedTorchOptimizer(optimizer, **hook)
    if first_step is not None:
        first_step.mark("construct")

    def step() -> float:
        optimizer.zero_grad()
        with plates():
            loss = module(*workload.args)
        loss.backward()
        optimizer.step()
        return float(loss.detach())  # svi.step returns the loss as a float too

    def heldout(args: tuple[Any, ...]) -> float:
        pyro.set_rng_seed(SEED)
        with torch.no_grad():
            loss = Trace_ELBO(num_particles=HELDOUT_PARTICLES)(workload.model, workload.guide)
            return float(loss(*args))

    return Training(
        step,
        lambda: sorted(elbo.named_parameters()),
        lambda: state_bytes(elbo.parameters(), [optimizer]),
        heldout,
        at_sync,
    )


def post_local_sgd(
    ddp: nn.parallel.DistributedDataParallel, adam: torch.optim.Optimizer, period: int, warmup: int
) -> tuple[torch.optim.Optimizer, Callable[[], bool]]:
    """Torch's post-local SGD on ``ddp``, on the schedule of our ``LocalSGD(period,
    warmup_steps=warmup)``; the optimizer, and whether its last step was a sync point.

    DDP's ``post_localSGD_hook`` all-reduces the gradients of the first
    ``warmup`` steps over every worker, and after them over its ``subgroup``:
    here each worker's own group of one, since with ``subgroup=None`` it
    makes one per machine from the CUDA devices, and there are none. Its
    ``PostLocalSGDOptimizer`` steps Adam, then lets a ``PeriodicModelAverager``
    average the parameters after step ``s`` (counted from 0) whenever ``s >=
    warmup_steps`` and ``(s - warmup_steps) % period == 0``: its first average
    comes right after its first step alone. Torch's examples give both the
    same warm-up; the averager's is one less here (so ``warmup`` must be at
    least 1), which puts its averages after the same steps as ours: ``warmup
    + period``, ``warmup + 2 * period``, ... Its one extra average, after the
    last warm-up step, is of parameters the warm-up kept identical.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    if warmup < 1:
        raise ValueError("ddp-postlocal needs at least one warm-up step")
    alone, _ = torch.distributed.new_subgroups(group_size=1)  # a collective: every worker
    state = post_localSGD_hook.PostLocalSGDState(
        process_group=None, subgroup=alone, start_localSGD_iter=warmup
    )
    ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup - 1)
    optimizer = PostLocalSGDOptimizer(optim=adam, averager=averager)

    def at_sync() -> bool:
        taken = averager.step  # one per optimizer step
        return taken < warmup or (taken - warmup) % period == 0

    return optimizer, at_sync


class FirstStep:
    """The clock of ``--first-step``: from before the training step is built to
    the return of its first step, in phases (see the module's docstring).

    :meth:`start` waits for every worker, then starts the clock (and, on
    worker 0 given ``profile``, a ``cProfile`` profiler); each :meth:`mark`
    ends a phase; :meth:`stop`, after the first step, ends the last one.
    """

    def __init__(self, profile: Path | None = None) -> None:
        self.profile = profile
        self.profiler: cProfile.Profile | None = None
        self.times: list[tuple[str, float]] = []

    def start(self) -> None:
        if pyro_distributed.world_size() > 1:
            pyro_distributed.barrier()
        synchronize()
        if self.profile is not None and pyro_distributed.is_main():
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        self.times = [("start", time.perf_counter())]

    def mark(self, phase: str) -> None:
        """End the phase called ``phase`` now."""
        synchronize()
        self.times.append((phase, time.perf_counter()))

    def stop(self) -> None:
        """End the first step (the last phase) and the profile."""
        self.mark("step")
        if self.profiler is not None:
            self.profiler.disable()

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, in order."""
        return {
            phase: end - begin
            for (_, begin), (phase, end) in zip(self.times, self.times[1:], strict=False)
        }

    def write_profile(self, title: str) -> None:
        """Write worker 0's profile to ``profile``: the top functions by
        cumulative time, then those of ``pyro_distributed`` (worker 0 only)."""
        if self.profiler is None or self.profile is None:
            return
        phases = ", ".join(f"{phase} {seconds:.4f} s" for phase, seconds in self.phases().items())
        out = io.StringIO()
        out.write(f"{title}\nphases on worker 0 (profiled, so slower): {phases}\n\n")
        out.write(f"== top {PROFILE_LINES} functions by cumulative time ==\n")
        stats = pstats.Stats(self.profiler, stream=out).sort_stats("cumulative")
        stats.print_stats(PROFILE_LINES)
        out.write(f"== pyro_distributed's top {PROFILE_LINES} by cumulative time ==\n")
        stats.print_stats(r"pyro_distributed[/\\]", PROFILE_LINES)
        out.write("== where the parts of an SVI step spent it (callees) ==\n")
        for part in PROFILE_PARTS:
            stats.print_callees(part)
        text = out.getvalue()
        # Paths relative to the repository and to site-packages, for width.
        for prefix in (Path(torch.__file__).parent.parent, Path(__file__).resolve().parent.parent):
            text = text.replace(f"{prefix}/", "")
        self.profile.write_text(text)


def time_steps(training: Training, steps: int, warmup: int) -> float:
    """Seconds taken by ``steps`` steps after ``warmup`` untimed ones."""
    for _ in range(warmup):
        training.step()
    if pyro_distributed.world_size() > 1:
        pyro_distributed.barrier()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        training.step()
    synchronize()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Curve:
    """What :func:`time_curve` measured."""

    seconds: float  #: of the timed steps, without the evaluations between them
    #: ``[seconds so far, held-out loss]``, before the first timed step and after every ``every``.
    points: list[list[float]]
    #: Whether every worker held the same shared parameters at every point.
    in_sync: bool
    #: What this host sent during the timed steps (``None``: no counters).
    sent_bytes: int | None


def time_curve(
    training: Training, steps: int, warmup: int, every: int, data: tuple[Any, ...]
) -> Curve:
    """:func:`time_steps` that stops the clock every ``every`` steps (and after
    the last) to take the held-out loss on ``data``.

    Every worker evaluates its own parameters, identical at a sync point, and
    waits for the others before the clock starts again: a worker that went
    on alone would train while the other's clock is stopped.
    """
    for _ in range(warmup):
        training.step()
    if pyro_distributed.world_size() > 1:
        pyro_distributed.barrier()
    loss, synced = curve_point(training, data)
    points, seconds, sent, done = [[0.0, loss]], 0.0, 0, 0
    while done < steps:
        chunk = min(every, steps - done)
        synchronize()
        before = sent_bytes()
        start = time.perf_counter()
        for _ in range(chunk):
            training.step()
        synchronize()
        seconds += time.perf_counter() - start
        after = sent_bytes()
        sent += 0 if before is None or after is None else after - before
        done += chunk
        loss, point_synced = curve_point(training, data)
        points.append([seconds, loss])
        synced = synced and point_synced
    return Curve(seconds, points, synced, None if sent_bytes() is None else sent)


def curve_point(training: Training, data: tuple[Any, ...]) -> tuple[float, bool]:
    """The held-out loss of this worker's parameters, and whether every worker
    holds the same shared ones at a sync point (a collective, so also a barrier).

    The held-out loss seeds Pyro's generators; their state is put back after
    it, so that the workers' training draws stay their own.
    """
    state = pyro.util.get_rng_state()
    try:
        loss = training.heldout(data)
    finally:
        pyro.util.set_rng_state(state)
    at_sync = training.at_sync()
    identical = in_sync(shared_parameters(training))  # every worker, whatever at_sync says
    return loss, at_sync and identical


def shared_parameters(training: Training) -> list[tuple[str, Tensor]]:
    """The trained parameters every worker holds a copy of (owned local ones
    differ across workers by design)."""
    local_of = pyro_distributed.local.registry.local_of
    return [(name, value) for name, value in training.parameters() if local_of(value) is None]


def sent_bytes() -> int | None:
    """Bytes this host's network interfaces, loopback aside, have sent
    (``/proc/net/dev`` of this process's network namespace); ``None`` if unreadable."""
    try:
        rows = Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return None
    total = 0
    for row in rows:
        interface, _, counters = row.partition(":")
        if interface.strip() != "lo":
            total += int(counters.split()[8])  # 8 receive columns, then bytes sent
    return total


def synchronize() -> None:
    """Wait for the GPU's queued work, so that the clock times it (a no-op without CUDA)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def on_device(workload: Workload, device: str) -> Workload:
    """``workload`` with its data and networks on ``device``; parameters that Pyro
    creates lazily follow through ``torch.set_default_device`` (see :func:`prepare`)."""
    for part in (workload.model, workload.guide):
        owner = getattr(part, "__self__", part)  # a network's bound model or guide method
        if isinstance(owner, nn.Module):
            owner.to(device)
    args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in workload.args)
    return replace(workload, args=args)


def in_sync(parameters: Sequence[tuple[str, Tensor]]) -> bool:
    """Whether every worker holds bitwise the same parameters (a collective).

    One digest per worker travels, not the parameters: the check must stay
    cheap for the 1 M-float workload.
    """
    digest = hashlib.sha256()
    for name, value in parameters:
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    digests = pyro_distributed.current_engine().allgather_object(digest.hexdigest())
    return len(set(digests)) == 1


def first_step_record(first_step: FirstStep) -> dict[str, Any]:
    """The fields ``--first-step`` adds to the line: the largest times over
    the workers (a collective)."""
    every: list[dict[str, float]] = pyro_distributed.current_engine().allgather_object(
        first_step.phases()
    )
    return {
        "first_step_s": max(sum(phases.values()) for phases in every),
        "first_step_wrapper_s": max(
            sum(seconds for phase, seconds in phases.items() if phase != "first_call")
            for phases in every
        ),
        "first_step_phases": {phase: max(phases[phase] for phases in every) for phase in every[0]},
        "first_step_profiled": first_step.profile is not None,
    }


def fitted_cost(parameters: Sequence[tuple[str, Tensor]]) -> dict[str, float]:
    """The all-reduce cost fitted at this W, and the bytes a step averages."""
    gradient_bytes = sum(p.numel() * p.element_size() for _, p in parameters)
    cost = {"gradient_bytes": float(gradient_bytes)}
    if pyro_distributed.world_size() > 1:
        sizes = sorted({*pyro_distributed.scaling.DEFAULT_SIZES, gradient_bytes})
        timings = pyro_distributed.scaling.measure_collective(sizes=sizes)
        fit = pyro_distributed.scaling.CollectiveCost.fit(timings, pyro_distributed.world_size())
        cost.update(latency_s=fit.latency_s, bandwidth=fit.bandwidth)
    return cost


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--workload",
        type=workload_name,
        required=True,
        help="small<N>, local<N>, spatial<N>x<G>, tiny, wide40, large1m or vae",
    )
    parser.add_argument("--optim", choices=OPTIMS, required=True)
    parser.add_argument("--steps", type=int, default=50, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--json-out", type=Path, help="also write the JSON line here")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where data, networks and parameters live: cpu or cuda (each worker its GPU)",
    )
    parser.add_argument(
        "--bucket-cap-mb", type=float, help="DistributedOptimizer's bucket_cap_mb (tuning runs)"
    )
    parser.add_argument(
        "--rank", type=int, default=4, help="the rank of ours-lowrank and ddp-powersgd"
    )
    parser.add_argument(
        "--heldout",
        action="store_true",
        help="after timing, the loss on data no worker trained on (large1m, vae)",
    )
    parser.add_argument(
        "--period",
        type=int,
        help="steps between two averages of ours-localsgd, ours-diloco and ddp-postlocal",
    )
    parser.add_argument(
        "--curve",
        type=int,
        metavar="E",
        help="stop the clock every E timed steps for the held-out loss (large1m, vae); "
        "a multiple of --period",
    )
    parser.add_argument(
        "--fit-cost",
        action="store_true",
        help="after timing, fit the all-reduce cost here (validate_cost_model.py)",
    )
    parser.add_argument(
        "--first-step",
        action="store_true",
        help="also time the first step, from before the optimizer or DDP is built "
        "(the first of the --warmup steps)",
    )
    parser.add_argument(
        "--profile-first-step",
        type=Path,
        metavar="PATH",
        help="profile worker 0's first step with cProfile into PATH (implies --first-step)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if (args.optim in PERIOD_OPTIMS) != (args.period is not None):
        parser.error(f"--period goes with --optim {', '.join(PERIOD_OPTIMS)}, and only with them")
    if args.period is not None and (args.period < 1 or args.warmup < 1):
        # One averaged step at least: torch's averager counts its warm-up from one less.
        parser.error("--period and --warmup must be at least 1 with a step policy")
    if args.curve is not None and (args.curve < 1 or args.curve % (args.period or 1)):
        parser.error("--curve must be a positive multiple of --period: a sync point")
    if args.profile_first_step is not None:
        args.first_step = True
    if args.first_step and args.warmup < 1:
        parser.error("--first-step times the first warm-up step: --warmup must be at least 1")
    return args


def prepare(
    workload_name: str,
    optim: str,
    options: dict[str, Any],
    device: str = "cpu",
    first_step: FirstStep | None = None,
) -> Training:
    """Join the workers and build this worker's workload and training step, seeded by rank.

    ``first_step``, if given, starts once the workload is built (a barrier),
    just before the training step is.

    The workload is drawn on the CPU (the same numbers on every device), then
    moved to ``device``; on a GPU, ``torch.set_default_device`` puts there the
    parameters Pyro creates on the first step, as a user's GPU script would.
    """
    torch.set_num_threads(1)
    ddp = optim in MODULE_OPTIMS
    if ddp:
        pyro.settings.set(module_local_params=True)
    start_engine(optim)
    rank = pyro_distributed.rank()
    pyro.clear_param_store()
    pyro.set_rng_seed(SEED + rank)
    spatial = SPATIAL_NAME.fullmatch(workload_name)
    if spatial is not None:
        # Made where it trains, and with an owner's configuration only its block.
        owned = optim in ("ours-owned", "ours-sparse") and pyro_distributed.world_size() > 1
        model, guide, args = spatial_mapping(int(spatial[1]), int(spatial[2]), device, owned, SEED)
        workload = Workload(model, guide, args, sharded_plates=True)
    else:
        workload = build_workload(workload_name, torch.Generator().manual_seed(SEED + rank), ddp)
    if device != "cpu":
        workload = on_device(workload, device)
        torch.set_default_device(device)
    if ddp:
        return module_training(workload, optim, options, first_step)
    return svi_training(workload, optim, options, first_step)


def heldout_args(workload_name: str, device: str) -> tuple[Any, ...]:
    """Data no worker trained on, for ``--heldout``: large1m's rows drawn from
    another seed, the VAE's test images."""
    generator = torch.Generator().manual_seed(SEED - 1)
    if workload_name == "large1m":
        args: tuple[Any, ...] = large1m(generator, as_modules=False).args
    elif workload_name == "vae":
        sys.path.insert(0, str(EXAMPLES))
        from vae_digits import load_images  # the example, not a package

        train, test = load_images()
        count = min(VAE_BATCH, len(test))
        args = (test[:count], torch.arange(count), len(train))
    else:
        raise SystemExit(f"--heldout is for large1m and vae, not {workload_name}")
    return tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)


def main() -> None:
    args = parse_args()
    options: dict[str, Any] = (
        {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    )
    if args.optim in ("ours-lowrank", "torch-ours-lowrank", "ddp-powersgd"):
        # Compression starts after the untimed steps, in both.
        options.update(rank=args.rank, start=args.warmup)
    if args.optim in PERIOD_OPTIMS:
        # The untimed steps average gradients; the workers step alone after them.
        options.update(period=args.period, start=args.warmup)
    first_step = FirstStep(args.profile_first_step) if args.first_step else None
    training = prepare(args.workload, args.optim, options, args.device, first_step)
    warmup = args.warmup
    if first_step is not None:
        # The first warm-up step, timed with the construction before it.
        training.step()
        first_step.stop()
        warmup -= 1
    curve: dict[str, Any] = {}
    if args.curve is None:
        seconds = time_steps(training, args.steps, warmup)
        heldout = (
            {"heldout_loss": training.heldout(heldout_args(args.workload, args.device))}
            if args.heldout
            else {}
        )
    else:
        data = heldout_args(args.workload, args.device)
        measured = time_curve(training, args.steps, warmup, args.curve, data)
        seconds = measured.seconds
        heldout = {"heldout_loss": measured.points[-1][1]}
        sent = measured.sent_bytes
        curve = {
            "curve": measured.points,
            "curve_every": args.curve,
            "curve_in_sync": measured.in_sync,
            "bytes_per_step": None if sent is None else sent / args.steps,
        }
    parameters = training.parameters()
    # Local parameters differ across workers by design: compare the rest.
    shared = shared_parameters(training)
    synced = in_sync(shared)
    cost = fitted_cost(shared) if args.fit_cost else {}
    first = {} if first_step is None else first_step_record(first_step)
    if pyro_distributed.is_main():
        line = json.dumps(
            {
                **cost,
                **heldout,
                **curve,
                "workload": args.workload,
                "optim": args.optim,
                **({} if args.period is None else {"period": args.period}),
                "world_size": pyro_distributed.world_size(),
                "ms_per_step": 1000.0 * seconds / args.steps,
                "steps": args.steps,
                "param_tensors": len(parameters),
                "params_in_sync": synced,
                "state_bytes": training.state_bytes(),
                "device": args.device,
                "cuda_peak_bytes": (
                    torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0
                ),
                **first,
            }
        )
        print(line, flush=True)
        if args.json_out is not None:
            args.json_out.write_text(line + "\n")
        if first_step is not None:
            world = pyro_distributed.world_size()
            first_step.write_profile(f"first step of {args.optim} on {args.workload}, W={world}")
    # DDP's reducer holds the process group, and drops it without letting go
    # of the GIL: dropped after the group is destroyed, it joins gloo's
    # threads while one of them waits for the GIL to free a finished
    # all-gather's tensors, and the worker never exits (in 3 of about 10 DDP
    # runs of bench_link.py beside idle-priority CPU spinners). Released
    # while the group is still registered, it drops a reference that is not
    # the last; the group's own destructor lets go of the GIL.
    del training
    gc.collect()
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main()
