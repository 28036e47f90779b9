"""LowRankHook: low-rank averages with error feedback, across real workers.

An average of rank at most the hook's rank comes back exact; a full-rank one
is approximated, and error feedback makes the sum of what the steps applied
track the sum of the true averages; every worker gets the same result; a
dropped reduction leaves the hook's state as it was; state is kept by bucket
name; bad arguments are refused.
"""

from __future__ import annotations

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.exchange import GradBucket, LowRankHook, Waiting

from ..support.harness import run_workers

SHAPES = [torch.Size([40, 30]), torch.Size([7]), torch.Size([30, 20])]


def _bucket(grads: list[torch.Tensor], step: int = 0, name: str = "b") -> GradBucket:
    """A bucket as the exchange packs it: the gradients, then two tail values."""
    tail = torch.tensor([1.0, 3.0])
    buffer = torch.cat([*(g.reshape(-1) for g in grads), tail])
    size = sum(g.numel() for g in grads)
    shapes = tuple(g.shape for g in grads)
    return GradBucket(name, buffer, size, shapes, pd.world_size(), step=step)


def _kept(hook: LowRankHook, bucket: GradBucket) -> torch.Tensor:
    """The hook's result for ``bucket``, kept as the exchange keeps one (committed)."""
    reducing = hook(bucket, pd.current_engine())
    result = reducing.wait()
    reducing.commit()
    return result


def _grads(generator: torch.Generator, rank: int | None) -> list[torch.Tensor]:
    """Per member, a gradient; matrices of rank ``rank`` (full rank with ``None``)."""
    grads = []
    for shape in SHAPES:
        if len(shape) == 2 and rank is not None:
            left = torch.randn(shape[0], rank, generator=generator)
            grads.append(
                left @ torch.randn(rank, shape[1], generator=torch.Generator().manual_seed(7))
            )
        else:
            grads.append(torch.randn(shape, generator=generator))
    return grads


def low_rank_averages(
    rank_of_grads: int | None, steps: int, error_feedback: bool = True
) -> dict[str, object]:
    """Reduce the same gradients ``steps`` times; per step, the result and the exact mean."""
    hook = LowRankHook(rank=2, warmup_steps=0, error_feedback=error_feedback)
    grads = _grads(torch.Generator().manual_seed(pd.rank()), rank_of_grads)
    exact = [pd.all_mean(g.clone()) for g in grads]
    results, tails = [], []
    for step in range(steps):
        bucket = _bucket([g.clone() for g in grads], step)
        out = _kept(hook, bucket)
        assert out is bucket.buffer, "an in_place hook returns the bucket's buffer"
        results.append(out[: bucket.size].clone())
        tails.append(out[bucket.size :].tolist())
    return {"results": results, "exact": torch.cat([e.reshape(-1) for e in exact]), "tails": tails}


def test_an_average_of_low_rank_comes_back_exact_and_the_tail_summed() -> None:
    # Each worker's matrices share their row space, so the average has rank 2.
    outcomes = run_workers(low_rank_averages, 2, 2)
    for outcome in outcomes:
        assert torch.allclose(outcome["results"][-1], outcome["exact"], atol=1e-4)
        assert outcome["tails"] == [[2.0, 6.0]] * 2, "the tail is summed exactly"
    assert torch.equal(outcomes[0]["results"][-1], outcomes[1]["results"][-1])


def _relative_errors(outcome: dict[str, object], steps: int) -> tuple[float, float]:
    """Of the first step's result, and of the sum of every step's, against the exact."""
    exact, results = outcome["exact"], outcome["results"]
    assert isinstance(exact, torch.Tensor) and isinstance(results, list)
    one_step = (results[0] - exact).norm() / exact.norm()
    cumulative = (torch.stack(results).sum(0) - steps * exact).norm() / (steps * exact.norm())
    return float(one_step), float(cumulative)


def test_error_feedback_makes_the_applied_sum_track_the_true_sum() -> None:
    steps = 30
    with_feedback = run_workers(low_rank_averages, None, steps)
    without = run_workers(low_rank_averages, None, steps, False)
    for fed, plain in zip(with_feedback, without, strict=True):
        one_step, cumulative = _relative_errors(fed, steps)
        _, cumulative_plain = _relative_errors(plain, steps)
        assert one_step > 0.3, "full-rank averages are approximated, not sent whole"
        assert cumulative < cumulative_plain / 2, (cumulative, cumulative_plain)
    # Identical on every worker, step after step: the parameters stay in sync.
    for first, second in zip(with_feedback[0]["results"], with_feedback[1]["results"], strict=True):
        assert torch.equal(first, second)


def dropped_then_reduced() -> tuple[torch.Tensor, torch.Tensor]:
    """A reduction dropped, then one kept; and the same gradients by a fresh hook."""
    engine = pd.current_engine()
    grads = _grads(torch.Generator().manual_seed(pd.rank()), None)
    hook = LowRankHook(rank=2, warmup_steps=0)
    hook(_bucket([g.clone() for g in grads]), engine).drop()
    # Waited for, then dropped (a bucket sent again): nothing is committed either.
    waited = hook(_bucket([g.clone() for g in grads]), engine)
    waited.wait()
    waited.drop()
    kept = _kept(hook, _bucket([g.clone() for g in grads]))
    fresh = _kept(LowRankHook(rank=2, warmup_steps=0), _bucket([g.clone() for g in grads]))
    return kept, fresh


def test_a_dropped_reduction_leaves_the_state_as_it_was() -> None:
    for kept, fresh in run_workers(dropped_then_reduced):
        assert torch.equal(kept, fresh)


def buckets_by_name() -> dict[str, object]:
    """Two steps of bucket "b"; then the same gradients under another name, and
    under "b" with other shapes; each against a fresh hook."""
    grads = _grads(torch.Generator().manual_seed(pd.rank()), None)
    hook = LowRankHook(rank=2, warmup_steps=0)
    for step in range(2):
        _kept(hook, _bucket([g.clone() for g in grads], step))
    renamed = _kept(hook, _bucket([g.clone() for g in grads], 2, name="other"))
    reshaped = _kept(hook, _bucket([g.clone() for g in grads[:1]], 3))
    fresh = LowRankHook(rank=2, warmup_steps=0)
    return {
        "renamed": (renamed, _kept(fresh, _bucket([g.clone() for g in grads], 2, name="x"))),
        "reshaped": (reshaped, _kept(fresh, _bucket([g.clone() for g in grads[:1]], 3))),
        "names": sorted(hook.state_dict()),
    }


def test_state_is_kept_by_bucket_name_and_other_shapes_start_afresh() -> None:
    for outcome in run_workers(buckets_by_name):
        assert torch.equal(*outcome["renamed"])
        assert torch.equal(*outcome["reshaped"])
        assert outcome["names"] == ["b", "other"]


def warmup_and_vectors() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: the hook's result and the exact mean (warm-up steps, then compressed)."""
    hook = LowRankHook(rank=1, warmup_steps=2)
    pairs = []
    for step in range(3):
        grads = _grads(torch.Generator().manual_seed(10 * step + pd.rank()), None)
        exact = torch.cat([pd.all_mean(g.clone()).reshape(-1) for g in grads])
        bucket = _bucket(grads, step)
        pairs.append((_kept(hook, bucket)[: bucket.size].clone(), exact))
    return pairs


def test_warmup_steps_are_exact_and_vectors_always_are() -> None:
    vector = slice(40 * 30, 40 * 30 + 7)
    for pairs in run_workers(warmup_and_vectors):
        for got, exact in pairs[:2]:
            assert torch.allclose(got, exact, rtol=0, atol=1e-6)
        got, exact = pairs[2]
        assert not torch.allclose(got, exact, atol=1e-3), "compressed from the third step"
        assert torch.allclose(got[vector], exact[vector], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rank": 0}, ValueError, "rank must be a positive int"),
        ({"rank": True}, TypeError, "rank must be an int, got True"),
        ({"rank": 2, "warmup_steps": -1}, ValueError, "warmup_steps must be a non-negative int"),
        ({"rank": 2, "min_compression": 0.5}, ValueError, "min_compression must be at least 1"),
        ({"error_feedback": "no"}, TypeError, "error_feedback must be True or False, got 'no'"),
        ({"seed": "abc"}, TypeError, "seed must be an int, got 'abc'"),
    ],
)
def test_bad_arguments_are_refused(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        LowRankHook(**kwargs)  # type: ignore[arg-type]


def svi_with_hook(hook_name: str, steps: int) -> dict[str, object]:
    """``steps`` SVI steps of a small regression with an MLP weight, through
    ``DistributedOptimizer(comm_hook=...)``; the parameters and the losses."""
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI, Trace_ELBO

    def sum_then_halve(bucket: GradBucket, engine: pd.Engine) -> pd.Reducing:
        pending = engine.allreduce_async_(bucket.buffer, "sum", bucket.name)

        def mean() -> torch.Tensor:
            bucket.gradients().div_(bucket.world_size)
            return bucket.buffer

        return Waiting(pending, mean)

    hooks = {
        "none": None,
        "low_rank": LowRankHook(rank=2, warmup_steps=3),
        "function": sum_then_halve,
    }
    generator = torch.Generator().manual_seed(pd.rank())
    x = torch.randn(64, 20, generator=generator)
    y = torch.tanh(x[:, :3].sum(-1)) + 0.1 * torch.randn(64, generator=generator)

    def model(x: torch.Tensor, y: torch.Tensor) -> None:
        w1 = pyro.param(
            "w1", lambda: 0.1 * torch.randn(20, 16, generator=torch.Generator().manual_seed(0))
        )
        w2 = pyro.param("w2", lambda: torch.zeros(16))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(torch.tanh(x @ w1) @ w2, 0.1), obs=y)

    def guide(x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}), comm_hook=hooks[hook_name])
    svi = SVI(model, guide, optim, Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(steps)]
    store = pyro.get_param_store()
    return {
        "params": {name: store[name].detach().clone() for name in ("w1", "w2")},
        "losses": losses,
    }


def test_a_function_hook_that_sums_and_halves_is_the_default_average_at_two_workers() -> None:
    default = run_workers(svi_with_hook, "none", 8)
    function = run_workers(svi_with_hook, "function", 8)
    for plain, hooked in zip(default, function, strict=True):
        for name in ("w1", "w2"):
            assert torch.equal(plain["params"][name], hooked["params"][name])


def test_svi_with_the_low_rank_hook_trains_and_keeps_workers_identical() -> None:
    outcomes = run_workers(svi_with_hook, "low_rank", 40, world_size=3)
    for outcome in outcomes:
        losses = outcome["losses"]
        assert losses[-1] < 0.5 * losses[0]
        for name in ("w1", "w2"):
            assert torch.equal(outcome["params"][name], outcomes[0]["params"][name])


def test_a_hook_that_is_not_one_is_refused() -> None:
    import pyro

    with pytest.raises(TypeError, match="comm_hook must be a CommHook or a function"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}), comm_hook=3)  # type: ignore[arg-type]
