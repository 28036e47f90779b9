"""The sparse local steps and their reference: the stated lazy rules applied on
whole blocks, checked step by step, for the Pyro and the torch front ends
(``tests/local/test_sparse*.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

import pyro_distributed as pd
from pyro_distributed.local import registry
from pyro_distributed.local import sparse as sparse_local

from .ownership import BATCH
from .torch_models import BATCH_LOCAL, D_LOCAL, N_LOCAL, LocalModel, local_plates

STEPS = 8
#: Below every local gradient's norm in these runs: clipping is active at every step.
CLIP_NORM = 1.0


SETTINGS: dict[str, dict[str, Any]] = {
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adam-l2": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled": True},
    "clipped": {"betas": (0.9, 0.999), "eps": 1e-8, "clip": 0.5, "lrd": 0.99},
    "adam-clipnorm": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "norm": CLIP_NORM},
    "sgd": {"lr": 0.002, "momentum": 0.0},
    "momentum": {"lr": 0.002, "momentum": 0.9, "nesterov": True},
}


def reference_step(
    kind: str,
    t: int,
    p: torch.Tensor,
    state: dict[str, torch.Tensor],
    g: torch.Tensor,
    mask: Any,
    stepped: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One lazy step of ``kind`` at step count ``t``; ``g`` is zero outside ``mask``.

    Written on whole blocks with the rows outside ``mask`` masked out, with
    the elementwise operations torch's own optimizers use (lerp, addcmul,
    addcdiv), so that rounding is comparable. Returns the new parameter and
    state. The parameter's update is computed from the state the step under
    test produced (``stepped``), so that each formula is held to 1 ulp on its
    own inputs and rounding does not compound.
    """
    s = SETTINGS[kind]
    lr = s.get("lr", 0.05)
    zeros = torch.zeros_like(p)
    if kind in ("sgd", "momentum"):
        if s["momentum"]:
            old = state.get("momentum_buffer", zeros)
            buf = torch.where(mask, old.mul(s["momentum"]).add(g), old)
            used = stepped["momentum_buffer"]
            direction = g.add(used, alpha=s["momentum"]) if s["nesterov"] else used
            return torch.where(mask, p.add(direction, alpha=-lr), p), {"momentum_buffer": buf}
        return torch.where(mask, p.add(g, alpha=-lr), p), {}
    b1, b2 = s["betas"]
    m, v = state.get("exp_avg", zeros), state.get("exp_avg_sq", zeros)
    if "norm" in s:
        # clip_grad_norm_ of the gradient's rows R (sorted): the norm of the
        # norm (one parameter), max_norm / (norm + 1e-6), at most 1. The dense
        # gradient's norm is the same up to the order of its sum: gradient_facts.
        rows = mask.squeeze(-1).nonzero().squeeze(-1)
        norm = torch.linalg.vector_norm(g.index_select(0, rows))
        total = torch.linalg.vector_norm(norm.reshape(1))
        g = g * torch.clamp(s["norm"] / (total + 1e-6), max=1.0)
    if kind == "clipped":
        lr = lr * s["lrd"] ** t  # decayed once per step, before the update
        g = g.clamp(-s["clip"], s["clip"])
    elif s.get("decoupled"):
        p = torch.where(mask, p.mul(1 - lr * s["weight_decay"]), p)
    elif s["weight_decay"]:
        g = torch.where(mask, g.add(p, alpha=s["weight_decay"]), g)
    if kind == "clipped":
        m_new = torch.where(mask, m.mul(b1).add(g, alpha=1 - b1), m)
    else:
        m_new = torch.where(mask, m.lerp(g, 1 - b1), m)
    v_new = torch.where(mask, v.mul(b2).addcmul(g, g, value=1 - b2), v)
    bc1, bc2 = 1 - b1**t, 1 - b2**t  # t: the parameter's global step count
    m_used, v_used = stepped["exp_avg"], stepped["exp_avg_sq"]
    if kind == "clipped":
        step_size, denom = lr * math.sqrt(bc2) / bc1, v_used.sqrt().add(s["eps"])
    else:
        step_size, denom = lr / bc1, (v_used.sqrt() / math.sqrt(bc2)).add(s["eps"])
    new_p = torch.where(mask, p.addcdiv(m_used, denom, value=-step_size), p)
    return new_p, {"exp_avg": m_new, "exp_avg_sq": v_new}


def within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    ulp = (torch.nextafter(want, torch.full_like(want, math.inf)) - want).abs()
    return bool(((got - want).abs() <= ulp).all())


@dataclass
class Before:
    """A sparse parameter just before a step: what the reference needs, and what was seen."""

    value: torch.Tensor
    state: dict[str, torch.Tensor]
    grad: torch.Tensor  # the dense gradient the leaves stand for, times 1/W
    mask: torch.Tensor  # the rows R
    reads: int  # rows read, with repeats
    distinct: int


def before_step(name: str, p: torch.Tensor, state: Any) -> Before:
    """Record ``p`` (local parameter ``name``, optimizer state ``state``) before a step."""
    uses = [
        (rows, leaf) for rows, leaf in sparse_local.pending_reads(name) if leaf.grad is not None
    ]
    rows = torch.cat([r for r, _ in uses])
    # Summed by index_put here, by index_add in the library.
    g = torch.zeros_like(p).index_put_(
        (rows,), torch.cat([leaf.grad for _, leaf in uses]), accumulate=True
    ) * (1.0 / pd.world_size())
    mask = torch.zeros(len(p), 1, dtype=torch.bool)
    mask[rows] = True
    kept = {k: v.clone() for k, v in (state or {}).items() if torch.is_tensor(v)}
    distinct = len(torch.unique(rows))
    return Before(p.detach().clone(), kept, g, mask, len(rows), distinct)


def check_step(kind: str, t: int, where: str, before: Before, p: torch.Tensor, state: Any) -> None:
    """The step just made on ``p`` is the stated rule, within 1 ulp; rows outside R keep bits."""
    assert p.grad is None, "no dense gradient exists in sparse mode"
    p0, state0, mask = before.value, before.state, before.mask
    want_p, want_state = reference_step(kind, t, p0, state0, before.grad, mask, state)
    assert within_one_ulp(p.detach(), want_p), f"{where} {kind} step {t}"
    untouched = ~mask.expand_as(p0)
    assert torch.equal(p.detach()[untouched], p0[untouched]), "rows outside R keep bits"
    for key, want in want_state.items():
        assert within_one_ulp(state[key], want), f"{where} {kind} {key} step {t}"
        if key in state0:
            assert torch.equal(state[key][untouched], state0[key][untouched])
    assert int(state.get("step", t)) == t, "the step count is global"


def gradient_facts(seen: dict[str, Any], before: Before) -> None:
    """Accumulate what the test asserts about the gradients the steps saw."""
    g, rows = before.grad, before.mask.squeeze(-1).nonzero().squeeze(-1)
    # The norm clip_args' clip_norm sees (the rows) and the dense gradient's.
    dense_norm = torch.linalg.vector_norm(g)
    rows_norm = torch.linalg.vector_norm(g.index_select(0, rows))
    ulp = float(torch.nextafter(dense_norm, torch.tensor(math.inf)) - dense_norm)
    apart = abs(float(rows_norm) - float(dense_norm)) / ulp
    seen["norm_ulps"] = max(seen.get("norm_ulps", 0.0), apart)
    seen["norms"] = seen.get("norms", 0) + 1
    seen["norms_bitwise"] = seen.get("norms_bitwise", 0) + int(apart == 0)
    seen["min_norm"] = min(seen.get("min_norm", math.inf), float(dense_norm))
    seen["max_abs"] = max(seen.get("max_abs", 0.0), float(g.abs().max()))
    seen["repeats"] = seen.get("repeats", 0) + before.reads - before.distinct
    seen["rows"] = max(seen.get("rows", 0), before.reads)


def assert_reference_facts(results: list[dict[str, Any]], kinds: Any) -> None:
    """What every reference run must have seen, so that each rule was exercised."""
    for result in results:
        assert set(result) == set(kinds)
        assert result["adam"]["rows"] == 2 * BATCH
        # ClippedAdam's clip_norm clamps elements: some were beyond it.
        assert result["clipped"]["max_abs"] > SETTINGS["clipped"]["clip"]
        for facts in result.values():
            # The norm of the rows is the dense gradient's, up to the order of
            # the sum (these runs: at most 2 ulps; bitwise in about 70% of steps).
            assert facts["norm_ulps"] <= 4, facts
            assert facts["norms_bitwise"] > 0
    # Two particles drew some row twice in a step somewhere: duplicates were summed.
    assert any(r["adam"]["repeats"] > 0 for r in results)


def plates(x: torch.Tensor) -> pyro.plate:
    return pyro.plate("data", len(x), subsample_size=BATCH)


Make = Callable[[Any], torch.optim.Optimizer]


def x_data() -> torch.Tensor:
    return torch.randn(N_LOCAL, D_LOCAL, generator=torch.Generator().manual_seed(2)) + 1.0


class RowGuide(PyroModule):
    """A hand-written guide: PyroParams, the local ones read inside the plate."""

    def __init__(self) -> None:
        super().__init__()
        self.mu_loc = PyroParam(torch.zeros(D_LOCAL))
        init = torch.arange(float(N_LOCAL * D_LOCAL)).reshape(N_LOCAL, D_LOCAL) / 100
        self.z_loc = PyroParam(init, event_dim=1)
        self.z_scale = PyroParam(
            torch.ones(N_LOCAL, D_LOCAL), constraint=constraints.positive, event_dim=1
        )

    def forward(self, x: torch.Tensor) -> None:
        pyro.sample("mu", dist.Normal(self.mu_loc, 1.0).to_event(1))
        with pyro.plate("data", N_LOCAL, subsample_size=BATCH_LOCAL):
            pyro.sample("z", dist.Normal(self.z_loc, self.z_scale).to_event(1))


@contextmanager
def module_local_params() -> Iterator[None]:
    pyro.settings.set(module_local_params=True)
    try:
        yield
    finally:
        pyro.settings.set(module_local_params=False)


def sparse() -> pd.shard_subsamples:
    return pd.shard_subsamples(own_local_params=True, local_updates="sparse")


def elbo_module(guide_name: str, elbo: Trace_ELBO | None = None) -> torch.nn.Module:
    """The ELBO module, after the warm-up call that creates (and cuts) its parameters."""
    fresh_run()
    pd.set_rng_seed(0)
    model = LocalModel()
    guide = AutoNormal(model, create_plates=local_plates) if guide_name == "auto" else RowGuide()
    loss_fn: torch.nn.Module = (elbo or Trace_ELBO(num_particles=2))(model, guide)
    with sparse():
        loss_fn(x_data())
    return loss_fn


def fresh_run() -> None:
    """Forget the local parameters of an earlier run in this process: its module
    may still be alive, and a new guide's parameters take the same names."""
    registry.unregister(list(registry.local_params()))
    sparse_local.drop_reads()


def trained(guide_name: str, make: Make, steps: int, mode: str = "sparse") -> dict[str, Any]:
    with module_local_params():
        loss_fn = elbo_module(guide_name)
        optimizer = pd.DistributedTorchOptimizer(make(loss_fn.parameters()))
        for _ in range(steps):
            optimizer.zero_grad()
            with pd.shard_subsamples(own_local_params=True, local_updates=mode):
                loss_fn(x_data()).backward()
            optimizer.step()
        return {name: p.detach().clone() for name, p in loss_fn.named_parameters()}
