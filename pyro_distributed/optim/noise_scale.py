"""The gradient noise scale: how many workers a batch size can put to use.

Past a critical batch size, a bigger batch buys almost no progress per step.
McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") show
that the *simple noise scale* B_simple = tr(Sigma) / |G|^2 predicts it, where
G is the true gradient and Sigma the covariance of the gradient estimate of a
batch of size 1. Data parallelism measures it almost for free: each worker's
gradient g_i is an estimate from a small batch (B_small = 1, in units of one
worker's batch) and their mean is one from a big batch (B_big = W). With

    small = mean_i |g_i|^2         (expected |G|^2 + tr(Sigma))
    big   = |mean_i g_i|^2         (expected |G|^2 + tr(Sigma) / W)

the unbiased two-batch estimators of the paper's appendix A.1 are

    |G|^2     ~ (W * big - small) / (W - 1)
    tr(Sigma) ~ (small - big) / (1 - 1 / W)

Each is noisy on its own step (and |G|^2 may come out negative), so each is
smoothed by an exponential moving average before their ratio is taken, as
the paper recommends. The averages are bias-corrected (divided by the total
weight so far, as Adam does), so the first steps are not pulled towards zero.

Where the numbers come from: :class:`~pyro_distributed.exchange.averager.GradientAverager`
lets each worker's squared norm ride in the gradient buckets' sums, so
``small`` costs no collective; ``big`` is read from the averaged gradient.
Both are taken before the wrapped optimizer steps, so clipping does not
distort them. Local parameters (:mod:`pyro_distributed.local`) never
travel and are not part of the measurement. Steps whose averaged gradient
is not finite are skipped by every worker and leave the averages alone.

Units: B_simple is in units of one worker's batch, so the critical number of
workers at this batch size is about B_simple itself. If each worker's
gradient comes from b data points drawn independently, Sigma of one worker is
the per-datum covariance over b, and B_simple in data points is b times as
large. With :func:`~pyro_distributed.shard_subsamples` the W batches are drawn
without replacement from N points; the estimate of |G|^2 is then low by
tr(Sigma_datum) / N, a relative error of about B_simple (in points) / N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_int

#: The weight of each new step in the moving averages when ``noise_scale=True``:
#: they remember about the last 2 / 0.02 = 100 steps.
DEFAULT_SMOOTHING = 0.02


@dataclass(frozen=True)
class NoiseScale:
    """The current estimates, as :meth:`DistributedOptimizer.noise_scale` returns them.

    :param gradient_sq: ``|G|^2``, the squared norm of the true gradient.
    :param trace_sigma: ``tr(Sigma)``, the total variance of one worker's gradient.
    :param b_simple: ``tr(Sigma) / |G|^2`` in units of one worker's batch;
        ``inf`` while the ``|G|^2`` estimate is not positive (the gradient is still
        buried in noise), ``nan`` before the first measurement.
    :param world_size: the number of workers that measured it.
    :param steps: how many steps the averages hold.
    :param batch_size: data points per worker per step, if given.

    Example::

        estimate = optim.noise_scale(batch_size=32)
        print(estimate)  # the figures and a one-line reading
        if estimate.critical_workers < pd.world_size():
            ...
    """

    gradient_sq: float
    trace_sigma: float
    b_simple: float
    world_size: int
    steps: int
    batch_size: int | None = None

    @property
    def critical_workers(self) -> float:
        """W*, the number of workers past which more mostly waste compute (about B_simple)."""
        return self.b_simple

    @property
    def b_simple_points(self) -> float | None:
        """B_simple in data points (``b_simple * batch_size``), if the batch size was given."""
        return None if self.batch_size is None else self.b_simple * self.batch_size

    def advice(self) -> str:
        """A one-line reading of the estimate."""
        if self.steps == 0:
            return "no noise-scale measurement yet: it is taken at every optimizer step"
        if not self.gradient_sq > 0:
            return (
                f"the gradient is still buried in noise (|G|^2 estimate {self.gradient_sq:.3g} "
                f"<= 0): the noise scale is too large to measure, so more workers or bigger "
                f"batches should still help"
            )
        critical = self.critical_workers
        points = self.b_simple_points
        size = "" if points is None else f", {points:.3g} data points"
        if critical < 1:
            return (
                f"even one worker's batch is past the critical batch size (B_simple ~ "
                f"{critical:.2g} worker batches{size}): more workers will mostly waste compute"
            )
        return (
            f"more than about {round(critical)} workers at this batch size will mostly "
            f"waste compute (B_simple ~ {critical:.3g} worker batches{size}; "
            f"this run has {self.world_size})"
        )

    def __str__(self) -> str:
        return (
            f"gradient noise scale over {self.steps} steps: |G|^2 = {self.gradient_sq:.4g}, "
            f"tr(Sigma) = {self.trace_sigma:.4g}, B_simple = {self.b_simple:.4g}. "
            f"{self.advice()}"
        )


class _MovingAverage:
    """An exponential moving average, divided by its total weight (bias-corrected)."""

    def __init__(self, smoothing: float) -> None:
        self._smoothing = smoothing
        self._sum = 0.0
        self._weight = 0.0

    def add(self, value: float) -> None:
        keep = 1.0 - self._smoothing
        self._sum = keep * self._sum + self._smoothing * value
        self._weight = keep * self._weight + self._smoothing

    @property
    def value(self) -> float:
        return self._sum / self._weight if self._weight else math.nan


class NoiseScaleEstimator:
    """Smoothed two-batch estimates of |G|^2 and tr(Sigma) from each step's norms.

    :param smoothing: the weight of each new step in the moving averages, in (0, 1).
    :param world_size: the number of workers (at least 2).
    """

    def __init__(self, smoothing: float, world_size: int) -> None:
        self.smoothing = smoothing
        self.world_size = world_size
        self._gradient_sq = _MovingAverage(smoothing)
        self._trace_sigma = _MovingAverage(smoothing)
        self.steps = 0

    @staticmethod
    def smoothing_of(noise_scale: bool | float) -> float | None:
        """The smoothing factor ``DistributedOptimizer(noise_scale=...)`` asks
        for, or ``None`` when it asks for no measurement.

        :raises TypeError: if ``noise_scale`` is not a bool or a float.
        :raises ValueError: if it is a number outside (0, 1).
        """
        if isinstance(noise_scale, bool):
            return DEFAULT_SMOOTHING if noise_scale else None
        if isinstance(noise_scale, (int, float)):
            if not 0.0 < noise_scale < 1.0:
                raise ValueError(
                    f"noise_scale must be True, False or a smoothing factor in (0, 1) (the "
                    f"weight of each new step in the moving averages), got {noise_scale!r}"
                )
            return float(noise_scale)
        raise TypeError(
            f"noise_scale must be True, False or a float in (0, 1), got {noise_scale!r}"
        )

    @classmethod
    def create(cls, noise_scale: bool | float, world_size: int) -> NoiseScaleEstimator | None:
        """The estimator that ``DistributedOptimizer(noise_scale=...)`` asks for, or ``None``.

        :raises TypeError: if ``noise_scale`` is not a bool or a float.
        :raises ValueError: if it is a number outside (0, 1), or if it is on
            with fewer than two workers.
        """
        smoothing = cls.smoothing_of(noise_scale)
        if smoothing is None:
            return None
        if world_size < 2:
            raise ValueError(
                f"noise_scale needs two or more workers: it compares each worker's gradient "
                f"with their average, and this run has {world_size}. Launch with torchrun or "
                f"horovodrun, or pass noise_scale=False in a single process"
            )
        return cls(smoothing, world_size)

    def observe(self, small: float, big: float) -> None:
        """Add one step: ``small`` = mean_i |g_i|^2, ``big`` = |mean_i g_i|^2."""
        size = self.world_size
        gradient_sq = (size * big - small) / (size - 1)
        trace_sigma = (small - big) / (1.0 - 1.0 / size)
        if not (math.isfinite(gradient_sq) and math.isfinite(trace_sigma)):
            return  # an overflowing norm says nothing about the noise
        self._gradient_sq.add(gradient_sq)
        self._trace_sigma.add(trace_sigma)
        self.steps += 1

    def estimate(self, batch_size: int | None = None) -> NoiseScale:
        """The current estimates; ``batch_size`` (points per worker) adds B_simple in points."""
        check_int("batch_size", batch_size, minimum=1, optional=True)
        gradient_sq, trace_sigma = self._gradient_sq.value, self._trace_sigma.value
        if self.steps == 0:
            b_simple = math.nan
        elif gradient_sq > 0:
            b_simple = trace_sigma / gradient_sq
        else:
            b_simple = math.inf
        return NoiseScale(
            gradient_sq, trace_sigma, b_simple, self.world_size, self.steps, batch_size
        )
