"""What the performance suite runs, and the targets it is judged by.

Three tables of plain data, kept apart from the code that runs them
(``bench_svi.py``) and the code that reports on them (``report.py``), so that
adding a configuration, a workload or a target is one line here:

* ``CONFIGS``: how to run the worker (optimizer, launcher, number of workers)
  and which configuration each is compared with;
* ``PLANS``: the workloads, how many steps each times, and which
  configurations run on it: every one on the main workloads, only those the
  plot needs on the rest of the step-time sweep;
* ``TARGETS``: the goals the suite checks, each a throughput ratio of
  one configuration against another with a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CONFIGS",
    "LOCAL_CONFIGS",
    "LOCAL_PLANS",
    "PEERS",
    "PLANS",
    "SWEEP_CONFIGS",
    "TARGETS",
    "Config",
    "Plan",
    "Target",
]

Launcher = Literal["python", "torchrun", "horovodrun", "mpirun"]


@dataclass(frozen=True)
class Config:
    """One way of running the benchmark.

    :param optim: the worker's ``--optim``.
    :param launcher: ``"python"`` starts ``workers`` independent processes at
        the same time (no communication) and keeps the slowest; ``"torchrun"``,
        ``"horovodrun"`` and ``"mpirun"`` (MPICH's ``mpiexec``, the mpi engine)
        start one job of ``workers`` communicating workers.
    :param baseline: the configuration this one is compared with, if any:
        ``plain`` for one worker (the overhead), ``plain-x2`` for two (the
        weak-scaling efficiency).
    """

    name: str
    optim: str
    launcher: Launcher
    workers: int = 1
    baseline: str | None = None
    #: Runs only on plans that name it, not on those that take every configuration.
    named_only: bool = False
    #: Times this many times the plan's steps: for a configuration so much
    #: faster than the others that the plan's steps would time too little.
    steps_scale: int = 1

    @property
    def needs_horovod(self) -> bool:
        return self.launcher == "horovodrun" or self.optim == "pyro-horovod"

    @property
    def needs_mpi(self) -> bool:
        return self.launcher == "mpirun"


CONFIGS: tuple[Config, ...] = (
    Config("plain", "plain", "python"),
    Config("plain-x2", "plain", "python", workers=2),
    Config("ours-w1", "ours", "python", baseline="plain"),
    Config("ours-pp-w1", "ours-pp", "python", baseline="plain"),
    Config("ours-w2", "ours", "torchrun", workers=2, baseline="plain-x2"),
    Config("ours-nooverlap-w2", "ours-nooverlap", "torchrun", workers=2, baseline="plain-x2"),
    Config("ours-fp16-w2", "ours-fp16", "torchrun", workers=2, baseline="plain-x2"),
    Config("ours-noise-w2", "ours-noise", "torchrun", workers=2, baseline="plain-x2"),
    Config("ours-horovod-w2", "ours", "horovodrun", workers=2, baseline="plain-x2"),
    # The same library on the mpi engine: collectives through MPI's shared memory.
    Config("ours-mpi-w2", "ours", "mpirun", workers=2, baseline="plain-x2"),
    Config("pyro-horovod-w2", "pyro-horovod", "horovodrun", workers=2, baseline="plain-x2"),
    Config("ddp-w2", "ddp", "torchrun", workers=2, baseline="plain-x2"),
    # Pyro's torch-native loop (an ELBO module and a torch Adam): plain torch,
    # and ours around the same torch optimizer; ddp-w2 above is its DDP peer.
    Config("torch-w1", "torch", "python"),
    Config("torch-ours-w1", "torch-ours", "python", baseline="torch-w1"),
    Config("torch-ours-w2", "torch-ours", "torchrun", workers=2, baseline="plain-x2"),
    # Local parameters owned by their worker (run by bench_local.py only).
    Config(
        "ours-owned-w2", "ours-owned", "torchrun", workers=2, baseline="plain-x2", named_only=True
    ),
    Config(
        "torch-ours-owned-w2",
        "torch-ours-owned",
        "torchrun",
        workers=2,
        baseline="plain-x2",
        named_only=True,
    ),
    # Ownership with sparse local steps (local_updates="sparse"): O(batch) a step.
    Config(
        "ours-sparse-w2",
        "ours-sparse",
        "torchrun",
        workers=2,
        baseline="plain-x2",
        named_only=True,
        steps_scale=20,
    ),
    Config(
        "torch-ours-sparse-w2",
        "torch-ours-sparse",
        "torchrun",
        workers=2,
        baseline="plain-x2",
        named_only=True,
        steps_scale=20,
    ),
)

# The peers every two-worker configuration is compared with, by throughput.
PEERS: tuple[str, ...] = ("pyro-horovod-w2", "ddp-w2")

# What the step time against parameter tensors plot draws: the limits and
# the peers beside our default configuration.
SWEEP_CONFIGS: tuple[str, ...] = (
    "plain",
    "plain-x2",
    "ours-w1",
    "ours-w2",
    "ours-mpi-w2",
    "pyro-horovod-w2",
    "ddp-w2",
)


@dataclass(frozen=True)
class Plan:
    """A workload, how long each run times it, and which configurations run on it.

    Steps are per workload because step times differ by 40x between them: a
    run should time a second or more, and the process start-up (several
    seconds) already dominates. ``configs=None`` means every configuration;
    a main workload gets its own table and is judged by the targets.
    """

    workload: str
    steps: int
    warmup: int
    configs: tuple[str, ...] | None = None
    main: bool = True

    def runs(self, config: Config) -> bool:
        if self.configs is None:
            return not config.named_only
        return config.name in self.configs


PLANS: tuple[Plan, ...] = (
    # 10 tensors, 1,000 floats: a step of a few milliseconds, all overhead.
    Plan("tiny", steps=200, warmup=20),
    Plan("small400", steps=15, warmup=3),
    # 40 parameters of 10k floats: between small400's latency and large1m's volume.
    Plan("wide40", steps=50, warmup=5),
    Plan("large1m", steps=50, warmup=5),
    Plan("vae", steps=100, warmup=10),
    # The rest of the sweep; small400 above is its last point.
    Plan("small10", steps=100, warmup=10, configs=SWEEP_CONFIGS, main=False),
    Plan("small40", steps=60, warmup=10, configs=SWEEP_CONFIGS, main=False),
    Plan("small100", steps=30, warmup=5, configs=SWEEP_CONFIGS, main=False),
)


# Per-data-point variational parameters (benchmarks/bench_local.py): N local
# rows of 8 floats, a batch of 256 per worker. Its own command, not part of
# the main suite: the largest N takes minutes per configuration.
LOCAL_CONFIGS: tuple[str, ...] = (
    "plain",
    "ours-w2",
    "ours-owned-w2",
    "ours-sparse-w2",
    "pyro-horovod-w2",
    "ddp-w2",
    "torch-ours-w2",
    "torch-ours-owned-w2",
    "torch-ours-sparse-w2",
)
LOCAL_PLANS: tuple[Plan, ...] = (
    Plan("local10000", steps=40, warmup=5, configs=LOCAL_CONFIGS, main=False),
    Plan("local100000", steps=30, warmup=5, configs=LOCAL_CONFIGS, main=False),
    Plan("local1000000", steps=10, warmup=3, configs=LOCAL_CONFIGS, main=False),
    Plan("local4000000", steps=5, warmup=2, configs=LOCAL_CONFIGS, main=False),
    Plan("local10000000", steps=4, warmup=2, configs=LOCAL_CONFIGS, main=False),
)


@dataclass(frozen=True)
class Target:
    """A goal: ``config``'s throughput against ``reference``'s, with a threshold.

    Every kind is computed from one ratio, r = median(reference) /
    median(config), the throughput of ``config`` in units of the reference's:

    * ``"efficiency"``: r itself, against the two-process limit; at least
      ``threshold``;
    * ``"speedup"``: r against a peer; at least ``threshold``;
    * ``"overhead"``: 1/r - 1, the extra time per step; at most ``threshold``.
    """

    label: str
    config: str
    reference: str
    kind: Literal["efficiency", "speedup", "overhead"]
    threshold: float
    #: The main workloads it is judged on (default: all of them).
    workloads: tuple[str, ...] | None = None

    def value(self, throughput_ratio: float) -> float:
        return 1.0 / throughput_ratio - 1.0 if self.kind == "overhead" else throughput_ratio

    def passed(self, value: float) -> bool:
        return value <= self.threshold if self.kind == "overhead" else value >= self.threshold


TARGETS: tuple[Target, ...] = (
    Target("W=2 efficiency >= 90 %", "ours-w2", "plain-x2", "efficiency", 0.90),
    Target(">= 1.3x Pyro's HorovodOptimizer", "ours-w2", "pyro-horovod-w2", "speedup", 1.3),
    Target("no slower than DDP", "ours-w2", "ddp-w2", "speedup", 1.0),
    # Measuring the gradient noise scale should cost nothing measurable.
    Target("noise_scale=True overhead <= 5 %", "ours-noise-w2", "ours-w2", "overhead", 0.05),
    Target("W=1 overhead <= 2 %", "ours-w1", "plain", "overhead", 0.02),
    # The same, with one torch optimizer per parameter as plain Pyro has: the
    # cost of the wrapper alone, without the multi-tensor step's gain.
    Target("W=1 overhead <= 2 %, per-parameter step", "ours-pp-w1", "plain", "overhead", 0.02),
    # Pyro's torch-native loop, around a torch optimizer.
    Target("torch-native: no slower than DDP", "torch-ours-w2", "ddp-w2", "speedup", 1.0),
    Target("torch-native: W=1 overhead <= 3 %", "torch-ours-w1", "torch-w1", "overhead", 0.03),
    # The plain loop at W=1: the wrapper costs at most 1 % on every workload.
    Target("W=1 overhead <= 1 %", "ours-w1", "plain", "overhead", 0.01),
    Target("torch-native: W=1 overhead <= 1 %", "torch-ours-w1", "torch-w1", "overhead", 0.01),
    # The mpi engine.
    Target("MPI: W=2 efficiency >= 90 %", "ours-mpi-w2", "plain-x2", "efficiency", 0.90),
    Target("MPI: >= 1.3x DDP on gloo", "ours-mpi-w2", "ddp-w2", "speedup", 1.3, workloads=("vae",)),
)
