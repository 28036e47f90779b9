"""What a hook is told, on real workers: each bucket's index, is_last and step, and
which results it keeps.

A recording hook (the exact average, summed then divided) runs six steps of
a torch-native loop at W=2 with overlap and one bucket per parameter. At the
fifth step a gradient is edited after backward, so its bucket, which left
during backward, is stale and sent again; at the sixth, one worker's
gradient is NaN, and the step is skipped. Every step must call the hook
once per bucket with that step's number (the resend included), name one
last bucket, commit one result per bucket and drop the stale one's without
committing it; the skipped step commits nothing. A hook that keeps state
serves one optimizer. Compression together with a hook runs the hook on the
narrowed bucket: with a hook that sums then halves, fp16 at W=2 is bitwise
the built-in fp16 average (halving is exact).
"""

from __future__ import annotations

import gc
import warnings
from collections import Counter
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd

from ..support.harness import run_workers

STEPS, EDITED_AT, SKIPPED_AT = 7, 4, 5


class Recorded(pd.Reducing):
    def __init__(self, hook: Recording, bucket: pd.GradBucket, pending: Any) -> None:
        self.hook, self.bucket, self.pending = hook, bucket, pending

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        self.bucket.gradients().div_(self.bucket.world_size)
        return self.bucket.buffer

    def commit(self) -> None:
        self.hook.events.append(("commit", self.bucket.step, self.bucket.index))

    def drop(self) -> None:
        self.pending.wait()
        self.hook.events.append(("drop", self.bucket.step, self.bucket.index))


class Recording(pd.CommHook):
    in_place = True

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def __call__(self, bucket: pd.GradBucket, engine: pd.Engine) -> pd.Reducing:
        self.events.append(("call", bucket.step, bucket.index, bucket.is_last, bucket.name))
        pending = engine.allreduce_async_(bucket.buffer, "sum", bucket.name)
        return Recorded(self, bucket, pending)


def recorded_steps() -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    hook = Recording()
    optimizer = pd.DistributedTorchOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), comm_hook=hook, bucket_cap_mb=1e-9
    )
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(pd.rank()))
    edited = net[2].weight  # its bucket leaves first during backward (the carrier is last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the optimizer says the edit was made before averaging
        for step in range(STEPS):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            if step == EDITED_AT:
                assert optimizer.sync is not None and optimizer.sync.overlap_armed
                edited.grad.mul_(1.0)  # the same values, a new version: stale
            if step == SKIPPED_AT and pd.rank() == 1:
                edited.grad[0, 0] = float("nan")  # a stale bucket, and a skipped step
            optimizer.step()
    buckets = optimizer.sync.bucket_count if optimizer.sync is not None else 0
    return {
        "events": hook.events,
        "buckets": buckets,
        "weights": [p.detach() for p in net.parameters()],
    }


def test_a_hook_is_told_each_buckets_place_and_step_and_commits_only_what_is_kept() -> None:
    outcomes = run_workers(recorded_steps)
    for outcome in outcomes:
        buckets, events = outcome["buckets"], outcome["events"]
        assert buckets == 4, "one bucket per parameter"
        for step in range(STEPS):
            calls = [event for event in events if event[0] == "call" and event[1] == step]
            counted = Counter(index for _, _, index, _, _ in calls)
            resent = 1 if step in (EDITED_AT, SKIPPED_AT) else 0
            assert sorted(counted) == list(range(buckets)), (step, calls)
            assert sum(counted.values()) == buckets + resent, (step, calls)
            assert [is_last for *_, is_last, _ in calls].count(True) == 1, (step, calls)
            commits = [event for event in events if event[:2] == ("commit", step)]
            drops = [event for event in events if event[:2] == ("drop", step)]
            kept = [] if step == SKIPPED_AT else list(range(buckets))
            assert sorted(index for *_, index in commits) == kept, step
            assert len(drops) == resent, (step, drops)
        names = {event[2]: event[4] for event in events if event[0] == "call"}
        assert len(set(names.values())) == buckets, "each bucket has a name of its own"
    assert outcomes[0]["events"] == outcomes[1]["events"], "every worker is told the same"
    for first, second in zip(outcomes[0]["weights"], outcomes[1]["weights"], strict=True):
        assert torch.equal(first, second)


def narrowed(hooked: bool) -> dict[str, Any]:
    """A few SVI steps with fp16 compression, alone or with a hook that sums then halves."""

    def sum_then_halve(bucket: pd.GradBucket, engine: pd.Engine) -> pd.Reducing:
        assert bucket.buffer.dtype == torch.float16, "the hook sees the narrowed bucket"
        pending = engine.allreduce_async_(bucket.buffer, "sum", bucket.name)
        return Recorded(Recording(), bucket, pending)

    pyro.clear_param_store()
    generator = torch.Generator().manual_seed(pd.rank())
    x = torch.randn(32, 10, generator=generator)
    y = x[:, 0] + 0.1 * torch.randn(32, generator=generator)

    def model(x: torch.Tensor, y: torch.Tensor) -> None:
        w = pyro.param("w", torch.zeros(10))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)

    def guide(x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    optim = pd.DistributedOptimizer(
        pyro.optim.Adam({"lr": 0.05}),
        compression="fp16",
        comm_hook=sum_then_halve if hooked else None,
    )
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(8):
        svi.step(x, y)
    return {"w": pyro.param("w").detach().clone()}


def test_compression_with_a_hook_runs_the_hook_on_the_narrowed_bucket() -> None:
    alone = run_workers(narrowed, False)
    hooked = run_workers(narrowed, True)
    for plain, with_hook in zip(alone, hooked, strict=True):
        assert torch.equal(plain["w"], with_hook["w"])


def test_a_hook_that_keeps_state_serves_one_optimizer() -> None:
    first = torch.nn.Linear(3, 2)
    hook = pd.LowRankHook()
    kept = pd.DistributedTorchOptimizer(torch.optim.SGD(first.parameters(), lr=0.1), comm_hook=hook)
    second = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="this LowRankHook already serves another optimizer"):
        pd.DistributedTorchOptimizer(second, comm_hook=hook)
    # A hook that keeps nothing may serve several; one whose optimizer is gone is free.
    shared = Recording()
    pd.DistributedTorchOptimizer(torch.optim.SGD(first.parameters(), lr=0.1), comm_hook=shared)
    pd.DistributedTorchOptimizer(second, comm_hook=shared)
    del kept
    gc.collect()
    pd.DistributedTorchOptimizer(second, comm_hook=hook)
