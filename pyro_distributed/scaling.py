"""How many workers to use: time to a target loss, projected from measurements.

Steps times seconds per step, for W = 1, 2, 4, ..., 512, in the spirit of
Pollux's goodput (Qiao et al., OSDI 2021). Steps: S(W) = S_min (1 + B_noise /
W) (McCandlish et al., 2018), with B_noise the simple noise scale that
:meth:`DistributedOptimizer.noise_scale` measures. Seconds: each worker's
compute plus an all-reduce modelled as latency + bytes / bandwidth, fitted to
all-reduces the engine times here, extrapolated beyond this W as a ring with
the fitted or the given network's figures. :meth:`CollectiveCost.in_step`
re-fits the latency to a measured step, for what a collective costs inside
one. The user's guide is ``docs/guide/noise-scale.md``.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TextIO

import pyro
import torch

from . import runtime
from .checks import check_int, check_number
from .engines import Engine
from .optim.noise_scale import NoiseScale

if TYPE_CHECKING:
    from .optim.distributed import DistributedOptimizer

__all__ = [
    "CollectiveCost",
    "ScalingProjection",
    "measure_collective",
    "project_scaling",
    "scaling_advice",
]

#: All-reduce sizes timed by default, in bytes: 4 KiB to 4 MiB.
DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 4 * 2**20)
#: Worker counts the projection covers by default.
DEFAULT_WORKERS = tuple(2**k for k in range(10))


def measure_collective(
    engine: Engine | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 10,
    device: torch.device | str = "cpu",
) -> list[tuple[int, float]]:
    """Time float32 all-reduces of ``sizes`` bytes; ``(bytes, median seconds)`` each.

    ``device``: where the timed buffers live, that of the gradients they stand
    for (``"cuda"`` times NCCL, or whatever carries CUDA tensors).

    A collective: every worker calls it. The workers' medians are averaged,
    so every worker returns the same timings.

    Example::

        for nbytes, seconds in pd.scaling.measure_collective():
            print(f"{nbytes} bytes: {1e6 * seconds:.0f} us")
    """
    check_int("measure_collective: repeats", repeats, minimum=1)
    engine = engine or runtime.current_engine()
    medians = []
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), device=device)
        engine.allreduce_([buffer])  # the first of a size sets up buffers: untimed
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            engine.allreduce_([buffer])
            seconds.append(time.perf_counter() - started)
        medians.append(statistics.median(seconds))
    # cpu: timings, a host-side control
    shared = torch.tensor(medians, dtype=torch.float64, device="cpu")
    engine.allreduce_([shared], op="mean")
    return list(zip(sizes, shared.tolist(), strict=True))


@dataclass(frozen=True)
class CollectiveCost:
    """An all-reduce of n bytes at ``world_size`` workers takes latency_s + n / bandwidth.

    Example::

        cost = pd.scaling.CollectiveCost.fit(pd.scaling.measure_collective(), pd.world_size())
        print(cost.seconds(4e6))  # a 4 MB gradient
    """

    latency_s: float
    bandwidth: float  # bytes per second
    world_size: int

    def __post_init__(self) -> None:
        check_number("CollectiveCost: latency_s", self.latency_s)
        if self.latency_s < 0:
            raise ValueError(f"CollectiveCost: latency_s must be >= 0, got {self.latency_s!r}")
        check_number("CollectiveCost: bandwidth", self.bandwidth, positive=True, finite=False)
        check_int("CollectiveCost: world_size", self.world_size, minimum=1)

    @classmethod
    def fit(cls, timings: Sequence[tuple[int, float]], world_size: int) -> CollectiveCost:
        """Least squares on relative error, so small sizes count as much as large ones."""
        if len({size for size, _ in timings}) < 2:
            raise ValueError("fitting latency and bandwidth needs timings of two or more sizes")
        # Minimise sum ((a + n c - t) / t)^2 over a (latency) and c (1 / bandwidth).
        rows = [(1.0 / t, n / t) for n, t in timings]
        saa = sum(a * a for a, _ in rows)
        sac = sum(a * c for a, c in rows)
        scc = sum(c * c for _, c in rows)
        sa, sc = sum(a for a, _ in rows), sum(c for _, c in rows)
        det = saa * scc - sac * sac
        latency = (sa * scc - sc * sac) / det
        per_byte = (saa * sc - sac * sa) / det
        # A noisy fit can give a slope of zero or below: then no size effect was seen.
        per_byte = max(per_byte, 1e-15)
        return cls(max(latency, 0.0), 1.0 / per_byte, world_size)

    def seconds(self, nbytes: float) -> float:
        """The time of one all-reduce of ``nbytes`` at this cost's world size."""
        return self.latency_s + nbytes / self.bandwidth

    def in_step(self, step_s: float, compute_s: float, gradient_bytes: float) -> CollectiveCost:
        """This cost with the latency re-fitted so that compute + all-reduce = the step.

        ``step_s`` is a measured step at this world size, ``compute_s`` one
        without communication (one worker); the bandwidth stays as fitted.
        """
        latency = step_s - compute_s - gradient_bytes / self.bandwidth
        return replace(self, latency_s=max(latency, 0.0))

    @property
    def hop_s(self) -> float:
        """The latency of one ring hop that makes up the fitted latency."""
        return self.latency_s / (2 * (self.world_size - 1))

    @property
    def link_bandwidth(self) -> float:
        """The bandwidth of one ring link that makes up the fitted bandwidth."""
        return self.bandwidth * 2 * (self.world_size - 1) / self.world_size

    def at(self, world_size: int, nbytes: float) -> float:
        """An all-reduce of ``nbytes`` at ``world_size``, extrapolated as a ring all-reduce."""
        return _ring_seconds(world_size, nbytes, self.hop_s, self.link_bandwidth)


def _ring_seconds(world_size: int, nbytes: float, hop_s: float, link_bandwidth: float) -> float:
    # A ring all-reduce: 2 (W - 1) messages, each worker sending 2 (W - 1) / W of the bytes.
    if world_size <= 1:
        return 0.0
    hops = 2 * (world_size - 1)
    return hops * hop_s + hops / world_size * nbytes / link_bandwidth


@dataclass(frozen=True)
class ScalingRow:
    """One worker count of a projection."""

    workers: int
    steps: float  # to the target, or relative to this run's (= 1 at its W)
    step_s: float
    time: float  # steps * step_s: seconds, or relative to this run's
    worker_time: float  # workers * time: what it costs


@dataclass(frozen=True)
class ScalingProjection:
    """Time to a target loss by number of workers, and the recommended one.

    :func:`project_scaling` and :func:`scaling_advice` return it. Example::

        projection = pd.scaling.scaling_advice(optim, lambda: svi.step(x, y))
        print(projection.table())
        print(projection.recommended)
    """

    rows: tuple[ScalingRow, ...]
    recommended: int
    assumptions: tuple[str, ...]
    relative: bool  # whether steps and times are relative to this run's
    tolerance: float  # the recommendation: the fewest workers within this of the fastest

    def table(self) -> str:
        """The projection as text: assumptions, one row per worker count, the advice."""
        unit = "x this run" if self.relative else "s"
        lines = [*(f"assumed: {line}" for line in self.assumptions)]
        lines.append(
            f"{'workers':>7}  {'steps':>10}  {'ms/step':>8}  {'time (' + unit + ')':>14}  "
            f"{'worker-time':>11}"
        )
        for row in self.rows:
            mark = "  <- recommended" if row.workers == self.recommended else ""
            lines.append(
                f"{row.workers:>7}  {row.steps:>10.4g}  {1000 * row.step_s:>8.3g}  "
                f"{row.time:>14.4g}  {row.worker_time:>11.4g}{mark}"
            )
        lines.append(
            f"recommended: {self.recommended} workers (the fewest within "
            f"{100 * self.tolerance:.3g} % of the fastest time to the target)"
        )
        return "\n".join(lines)


def project_scaling(
    noise: NoiseScale,
    compute_s: float,
    gradient_bytes: float,
    cost: CollectiveCost,
    *,
    network_latency_s: float | None = None,
    network_bandwidth: float | None = None,
    workers: Sequence[int] = DEFAULT_WORKERS,
    steps_to_target: float | None = None,
    tolerance: float = 0.10,
) -> ScalingProjection:
    """Project time to a target loss for each worker count (no communication).

    :param noise: the measured noise scale (B_simple in worker batches).
    :param compute_s: seconds of compute per step and worker.
    :param gradient_bytes: bytes each step averages.
    :param cost: the fitted all-reduce cost at this run's world size.
    :param network_latency_s: the latency of one ring hop beyond the workers
        measured here (default: the fitted one).
    :param network_bandwidth: bytes per second of one link beyond them
        (default: the fitted one).
    :param steps_to_target: steps this run (at ``noise.world_size`` workers)
        takes to reach the target loss; without it, steps and times are
        relative to this run's.
    :param tolerance: recommend the fewest workers within this fraction of
        the fastest time.

    Example (after training with ``noise_scale=True`` on two or more workers)::

        cost = pd.scaling.CollectiveCost.fit(pd.scaling.measure_collective(), pd.world_size())
        projection = pd.project_scaling(
            optim.noise_scale(), compute_s=0.004, gradient_bytes=72e3, cost=cost
        )
        print(projection.table())
    """
    if not isinstance(noise, NoiseScale):
        raise TypeError(f"project_scaling: noise must be a NoiseScale, got {noise!r:.60}")
    if not isinstance(cost, CollectiveCost):
        raise TypeError(f"project_scaling: cost must be a CollectiveCost, got {cost!r:.60}")
    check_number("project_scaling: compute_s", compute_s, positive=True)
    check_number("project_scaling: gradient_bytes", gradient_bytes)
    if gradient_bytes < 0:
        raise ValueError(f"project_scaling: gradient_bytes must be >= 0, got {gradient_bytes!r}")
    b_noise = noise.b_simple
    if not (math.isfinite(b_noise) and b_noise >= 0):
        raise ValueError(
            f"the noise scale is not usable yet ({noise.advice()}); train longer with "
            f"noise_scale=True first"
        )
    here = noise.world_size
    hop = cost.hop_s if network_latency_s is None else network_latency_s
    link = cost.link_bandwidth if network_bandwidth is None else network_bandwidth
    relative = steps_to_target is None
    now_steps = 1.0 if steps_to_target is None else steps_to_target
    min_steps = now_steps / (1.0 + b_noise / here)
    rows = []
    for count in workers:
        if count <= here:
            step_s = compute_s + cost.at(count, gradient_bytes)
        else:
            step_s = compute_s + _ring_seconds(count, gradient_bytes, hop, link)
        steps = min_steps * (1.0 + b_noise / count)
        rows.append(ScalingRow(count, steps, step_s, steps * step_s, count * steps * step_s))
    if relative:
        now = min_steps * (1.0 + b_noise / here) * (compute_s + cost.at(here, gradient_bytes))
        rows = [replace(r, time=r.time / now, worker_time=r.worker_time / now) for r in rows]
    fastest = min(row.time for row in rows)
    recommended = min(row.workers for row in rows if row.time <= (1 + tolerance) * fastest)
    assumptions = (
        f"B_simple = {b_noise:.3g} worker batches (measured over {noise.steps} steps at "
        f"W={here}); steps to the target S(W) = S_min (1 + B_simple / W)",
        f"compute {1000 * compute_s:.3g} ms per step and worker, the same at every W",
        f"all-reduce of {gradient_bytes:.4g} bytes: {1e6 * cost.latency_s:.3g} us + bytes / "
        f"{cost.bandwidth / 1e9:.3g} GB/s at W={cost.world_size} (fitted here); a ring beyond",
        f"beyond W={here}: {1e6 * hop:.3g} us per hop, {link / 1e9:.3g} GB/s per link"
        + ("" if network_latency_s is not None else " (latency as fitted here)")
        + ("" if network_bandwidth is not None else " (bandwidth as fitted here)"),
    )
    return ScalingProjection(tuple(rows), recommended, assumptions, relative, tolerance)


def scaling_advice(
    optim: DistributedOptimizer,
    step: Callable[[], Any],
    *,
    measure_steps: int = 20,
    compute_s: float | None = None,
    gradient_bytes: float | None = None,
    steps_to_target: float | None = None,
    network_latency_s: float | None = None,
    network_bandwidth: float | None = None,
    workers: Sequence[int] = DEFAULT_WORKERS,
    file: TextIO | None = sys.stdout,
) -> ScalingProjection:
    """Measure a step and the all-reduce here, project to W = 1 ... 512 and print a table.

    A collective: call it on every worker, after training with
    ``noise_scale=True`` long enough for the estimate to settle. It runs
    ``measure_steps`` more training steps through ``step`` (timed), times
    all-reduces of a few sizes, and prints the table on worker 0.

    :param step: one training step, such as ``lambda: svi.step(batch)``.
    :param compute_s: seconds a step takes without communication (timed with
        one worker); then the all-reduce's latency is fitted to the measured
        step (:meth:`CollectiveCost.in_step`). Without it the compute time is
        the measured step less the fitted all-reduce.
    :param gradient_bytes: bytes each step averages (default: every parameter
        in Pyro's param store).

    The other parameters are :func:`project_scaling`'s. Example::

        step = lambda: svi.step(x, y)  # noqa: E731
        projection = pd.scaling.scaling_advice(optim, step, network_bandwidth=1.25e9)
        print(projection.recommended)
    """
    if not callable(getattr(optim, "noise_scale", None)):
        raise TypeError(f"scaling_advice: optim must be a DistributedOptimizer, got {optim!r:.60}")
    if not callable(step):
        raise TypeError(f"scaling_advice: step must be callable, got {step!r:.60}")
    check_int("scaling_advice: measure_steps", measure_steps, minimum=1)
    engine = optim.engine
    if gradient_bytes is None:
        params = pyro.get_param_store().named_parameters()
        gradient_bytes = float(sum(p.numel() * p.element_size() for _, p in params))
    engine.barrier()
    seconds = []
    for _ in range(measure_steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    # cpu: a timing
    shared = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device="cpu")
    engine.allreduce_([shared], op="mean")
    step_s = float(shared[0])
    sizes = sorted({*DEFAULT_SIZES, int(gradient_bytes)})
    # Timed on the device the gradients live on: NCCL's cost, not gloo's, on a GPU.
    stored = pyro.get_param_store().named_parameters()
    device = next((p.device for _, p in stored), torch.device("cpu"))
    timings = measure_collective(engine, sizes, device=device)
    cost = CollectiveCost.fit(timings, engine.world_size)
    if compute_s is None:
        compute_s = max(step_s - cost.seconds(gradient_bytes), 0.0)
    else:
        cost = cost.in_step(step_s, compute_s, gradient_bytes)
    noise = optim.noise_scale()
    projection = project_scaling(
        noise,
        compute_s,
        gradient_bytes,
        cost,
        network_latency_s=network_latency_s,
        network_bandwidth=network_bandwidth,
        workers=workers,
        steps_to_target=steps_to_target,
    )
    if file is not None and engine.rank == 0:
        print(f"{noise}\nmeasured step at W={engine.world_size}: {1000 * step_s:.3g} ms", file=file)
        print(projection.table(), file=file)
    return projection
