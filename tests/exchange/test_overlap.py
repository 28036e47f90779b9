"""Averaging during backward: buckets really leave early, and nothing changes but the timing.

Each scenario trains the same workers twice, without and with overlap, from
the same seeds, and the parameters must come out bitwise equal. The scenarios
are the ones that could trip an early send: several backward passes per step,
clipping after averaging, workers that use different parameters, compression,
and a backward pass on one worker outside any step.
"""

from __future__ import annotations

from typing import Any, Literal

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

import pyro_distributed as pd
from pyro_distributed.exchange.averager import GradientAverager, Reduction
from pyro_distributed.exchange.overlap import BackwardOverlap
from pyro_distributed.exchange.sync import GradientSync

from ..support.harness import ENGINES, CountingEngine, run_workers, with_engines
from ..support.models import param_values, regression_data

WEIGHTS = 24
DIM = 16
# 24 weights of 16 floats (64 bytes each): a 256-byte cap makes several buckets.
SMALL_CAP_MB = 256 / 2**20
STEPS = 8


def wide_model(x: torch.Tensor, y: torch.Tensor, skip: frozenset[int]) -> None:
    """A latent offset plus many weight vectors; weights in ``skip`` sit this step out."""
    mean = pyro.sample("z", dist.Normal(0.0, 1.0))
    for i in range(WEIGHTS):
        if i not in skip:
            mean = mean + x @ pyro.param(f"w{i:02d}", torch.full((DIM,), 0.01 * (i + 1)))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mean, 1.0), obs=y)


def wide_guide(x: torch.Tensor, y: torch.Tensor, skip: frozenset[int]) -> None:
    loc = pyro.param("z_loc", torch.tensor(0.0))
    scale = pyro.param("z_scale", torch.tensor(1.0), constraint=constraints.positive)
    pyro.sample("z", dist.Normal(loc, scale))


def skipped(scenario: str, step: int) -> frozenset[int]:
    """Weights a worker leaves out at ``step``: only in the "differing" scenario."""
    if not scenario.startswith("differing") or step == 0:
        return frozenset()
    if step % 3 == 0:
        return frozenset({0, 5}) if pd.rank() == 1 else frozenset()
    if step % 4 == 0:
        return frozenset({7})  # nobody uses it this step
    return frozenset()


def diagnose(x: torch.Tensor, y: torch.Tensor) -> None:
    """A backward pass on this worker alone, outside any step; it sends buckets early."""
    Trace_ELBO().differentiable_loss(wide_model, wide_guide, x, y, frozenset()).backward()
    pyro.infer.util.zero_grads([p for _, p in pyro.get_param_store().named_parameters()])


def train(
    scenario: str, overlap: bool, cap_mb: float = SMALL_CAP_MB
) -> tuple[dict[str, torch.Tensor], GradientSync]:
    pyro.clear_param_store()
    pyro.set_rng_seed(100 + pd.rank())
    x, y = regression_data(pd.rank(), 16, dim=DIM)
    base = (
        pyro.optim.ClippedAdam({"lr": 0.05, "clip_norm": 0.5})
        if scenario == "clipped"
        else pyro.optim.Adam({"lr": 0.05})
    )
    optim = pd.DistributedOptimizer(
        base,
        bucket_cap_mb=cap_mb,
        overlap=overlap,
        compression="fp16" if scenario.endswith("fp16") else "none",
    )
    # Three particles, not vectorised: three backward passes per step.
    elbo = Trace_ELBO(num_particles=3 if scenario == "particles" else 1)
    svi = SVI(wide_model, wide_guide, optim, elbo)
    for step in range(STEPS):
        if scenario == "diagnostic" and pd.rank() == 0 and step >= 3:
            diagnose(x, y)
        svi.step(x, y, skipped(scenario, step))
    assert optim.sync is not None and optim.sync.overlaps == overlap
    return param_values(), optim.sync


def _both_ways(scenario: str, cap_mb: float = SMALL_CAP_MB) -> dict[str, Any]:
    without, _ = train(scenario, overlap=False, cap_mb=cap_mb)
    with_overlap, sync = train(scenario, overlap=True, cap_mb=cap_mb)
    hooks = len(sync._overlap._hooks) if sync._overlap is not None else None
    return {"without": without, "with": with_overlap, "armed": sync.overlap_armed, "hooks": hooks}


@pytest.mark.parametrize(
    ("engine", "scenario"),
    with_engines(
        ["plain", "particles", "clipped", "differing", "fp16", "diagnostic"],
        on_mpi=["particles", "fp16"],
    ),
)
@pytest.mark.slow
def test_overlap_is_bitwise_equal_to_no_overlap(engine: str, scenario: str) -> None:
    results = run_workers(_both_ways, scenario, engine=engine)
    for rank, result in enumerate(results):
        assert result["armed"], f"worker {rank} never overlapped"
        assert result["with"].keys() == result["without"].keys()
        for name, value in result["without"].items():
            assert torch.equal(result["with"][name], value), (scenario, rank, name)
            assert torch.equal(value, results[0]["without"][name]), (scenario, rank, name)
    # The runs really trained: the weights moved from their initial values.
    assert not torch.equal(results[0]["with"]["w00"], torch.full((DIM,), 0.01))


@pytest.mark.parametrize(
    "scenario", ["plain", "particles", "differing", "diagnostic", "fp16", "differing-fp16"]
)
@pytest.mark.slow
def test_one_bucket_runs_backward_without_hooks_and_bitwise_equal(scenario: str) -> None:
    # Every parameter fits one bucket, which carries the header at the call
    # (compressed to fp16 too: the header is left out of the pre-division and
    # cast in pieces that sum exactly in fp16): nothing can leave early, so
    # once armed the hooks are gone.
    results = run_workers(_both_ways, scenario, 25.0)
    for rank, result in enumerate(results):
        assert result["armed"] and result["hooks"] == 0, (scenario, rank)
        for name, value in result["without"].items():
            assert torch.equal(result["with"][name], value), (scenario, rank, name)
            assert torch.equal(value, results[0]["without"][name]), (scenario, rank, name)


@pytest.mark.parametrize("scenario", ["plain", "fp16", "differing-fp16"])
@pytest.mark.slow
def test_at_three_workers_the_header_can_move_the_last_bit_but_not_the_sync(
    scenario: str,
) -> None:
    """At W >= 3 the carrier's header slots lengthen the last bucket, and gloo's
    ring all-reduce, which adds each chunk in its own order, may then add
    some elements in another order than without overlap: equal to the last
    bits (of fp32, or of fp16 with compression), not bitwise. The header
    itself stays exact. Every worker still ends bitwise in sync, and the
    header still carries the agreement (the differing scenario). Measured
    (fp32, one bucket): 'w00' to 'w04' differ in the last bits; at W=2, and
    with many small buckets here, the results are bitwise equal."""
    results = run_workers(_both_ways, scenario, 25.0, world_size=3)
    for rank, result in enumerate(results):
        assert result["armed"] and result["hooks"] == 0, (scenario, rank)
        for name, value in result["without"].items():
            assert torch.equal(value, results[0]["without"][name]), (scenario, rank, name)
            assert torch.equal(result["with"][name], results[0]["with"][name]), (rank, name)
            # fp16 rounds each partial sum to fp16, so another order moves it by
            # its rounding (u = 2**-11), which Adam's steps carry on.
            tolerance = 1e-3 if scenario.endswith("fp16") else 1e-6
            assert torch.allclose(result["with"][name], value, atol=tolerance), name


def _collectives_by_phase(
    steps: int, compression: Literal["none", "fp16"] = "none"
) -> list[dict[str, list[tuple[str, int]]]]:
    engine = CountingEngine(pd.current_engine())
    params = [pyro.param(f"p{i:03d}", torch.zeros(10)).unconstrained() for i in range(400)]
    # 400 x 10 floats x 4 bytes = 16000 bytes; a 4000-byte cap gives 4 buckets.
    optim = pd.DistributedOptimizer(
        pyro.optim.SGD({"lr": 0.1}),
        engine=engine,
        bucket_cap_mb=4000 / 2**20,
        compression=compression,
    )
    phases = []
    for _ in range(steps):
        engine.calls.clear()
        sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
        in_backward = list(engine.calls)
        engine.calls.clear()
        optim(set(params))
        phases.append({"backward": in_backward, "call": list(engine.calls)})
    return phases


@pytest.mark.parametrize("engine", ENGINES)
def test_buckets_leave_during_backward_from_the_third_step(engine: str) -> None:
    first, second, third, fourth = run_workers(_collectives_by_phase, 4, engine=engine)[0]
    # Step 1 makes the plan (and broadcasts the new parameters); hooks go in.
    # The step's one-time check that every worker found the same module buffers
    # (none here) follows it: once, not at later steps.
    assert first["backward"] == []
    assert first["call"] == [
        ("allreduce_max", 1), ("broadcast", 4), ("allreduce_sum", 4), ("allgather_object", 1),
    ]  # fmt: skip
    # Step 2 still averages at the call, then agrees on worker 0's order.
    assert second["backward"] == []
    assert second["call"] == [("allreduce_max", 1), ("allreduce_sum", 4), ("broadcast", 1)]
    # From step 3 on, three buckets leave during backward; the last waits for
    # the call and carries the agreement header (and stale flags) in its sum.
    for step in (third, fourth):
        assert step["backward"] == [("allreduce_sum", 1)] * 3
        assert step["call"] == [("allreduce_sum", 1)]


def test_a_compressed_step_costs_no_collective_beyond_its_buckets() -> None:
    """With fp16 the header rides in the last bucket too (it once travelled
    as a max-reduction of its own at every call, when the bucket was narrowed)."""
    for phases in run_workers(_collectives_by_phase, 4, "fp16"):
        for step in phases[2:]:
            assert step["backward"] == [("allreduce_sum", 1)] * 3
            assert step["call"] == [("allreduce_sum", 1)]


def _other_collective_between_backward_and_step() -> dict[str, Any]:
    """Worker 0's buckets all leave in backward; worker 1 holds one back (a weight
    it does not use) until the call. Both run an all_mean in between, which must
    not pair with a bucket."""
    x, y = regression_data(pd.rank(), 16, dim=DIM)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), bucket_cap_mb=SMALL_CAP_MB)
    params: set[torch.Tensor] = set()
    means = []
    for step in range(6):
        skip = frozenset({3}) if pd.rank() == 1 and step >= 3 else frozenset()
        with pyro.poutine.trace(param_only=True) as capture:
            loss = Trace_ELBO().differentiable_loss(wide_model, wide_guide, x, y, skip)
        loss.backward()
        means.append(pd.all_mean(torch.tensor(float(pd.rank() + step))))
        params = {site["value"].unconstrained() for site in capture.trace.nodes.values()}
        optim(params)
        pyro.infer.util.zero_grads(params)
    assert optim.sync is not None
    return {"means": means, "params": param_values(), "armed": optim.sync.overlap_armed}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_collective_between_backward_and_step_does_not_pair_with_a_bucket(engine: str) -> None:
    results = run_workers(_other_collective_between_backward_and_step, engine=engine)
    for step, mean in enumerate(results[0]["means"]):
        assert float(mean) == step + 0.5
    assert results[0]["armed"] and results[1]["armed"]
    for name, value in results[0]["params"].items():
        assert torch.equal(results[1]["params"][name], value), name


def test_the_same_plan_handed_over_again_arms_and_another_starts_over() -> None:
    # The steady state hands the overlap the very same bucket plan at every
    # step: the second step arms it. A plan of its own, even of the same
    # tensors, gets hooks of its own and observes one step again.
    engine = pd.current_engine()
    averager = GradientAverager(engine, 1 << 20, Reduction())
    overlap = BackwardOverlap(engine)
    params = (torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True))
    plan = averager.plan(("a", "b"), params)
    overlap.after_step(plan)
    assert not overlap.armed and overlap.sends(plan)
    overlap.after_step(plan)
    assert overlap.armed
    again = averager.plan(("a", "b"), params)
    overlap.after_step(again)
    assert not overlap.armed and overlap.sends(again) and not overlap.sends(plan)


def test_a_plan_with_nothing_to_send_never_arms() -> None:
    # Every parameter local to its worker: the exchange has no tensor, and the
    # overlap stays idle step after step instead of arming on no buckets.
    engine = pd.current_engine()
    averager = GradientAverager(engine, 1 << 20, Reduction())
    overlap = BackwardOverlap(engine)
    empty = averager.plan((), ())
    for _ in range(3):
        overlap.after_step(empty)
        assert not overlap.armed and overlap.sends(empty)
