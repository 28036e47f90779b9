"""The checks made around a step (pyro_distributed.optim.step_guards), in one process."""

from __future__ import annotations

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.optim.step_guards import GradStamps, check_state_fits, refuse_nonfinite


def _with_grad(values: list[float]) -> torch.Tensor:
    param = torch.nn.Parameter(torch.zeros(len(values)))
    param.grad = torch.tensor(values)
    return param


def test_refuse_nonfinite_names_the_parameters_and_skips_or_raises() -> None:
    named = [
        ("a", _with_grad([1.0, float("nan")])),
        ("b", _with_grad([1.0])),
        ("c", _with_grad([float("inf")])),
    ]
    with pytest.warns(
        RuntimeWarning, match=r"of 'a', 'c' is not finite .* at step 7; every worker skips"
    ):
        refuse_nonfinite(named, 7, "skip")
    with pytest.raises(pd.PyroDistributedError, match=r"gradient of 'a', 'c' is not finite"):
        refuse_nonfinite(named, 7, "raise")


def test_refuse_nonfinite_shows_five_names_and_counts_the_rest() -> None:
    named = [(f"p{i}", _with_grad([float("nan")])) for i in range(8)]
    with pytest.raises(pd.PyroDistributedError, match=r"'p4' and 3 more is not finite"):
        refuse_nonfinite(named, 1, "raise")


def test_grad_stamps_notice_a_change_after_backward_but_not_an_accumulation() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    stamps = GradStamps()
    stamps.watch([param])
    (param * 2).sum().backward()
    (param * 3).sum().backward()  # a second backward pass is not a change
    assert stamps.changed() is None
    (param * 2).sum().backward()
    torch.nn.utils.clip_grad_norm_([param], 0.1)  # in place, after backward
    assert stamps.changed() is param


def test_grad_stamps_watch_a_bounded_sample_that_still_sees_a_clip() -> None:
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(100)]
    stamps = GradStamps()
    stamps.watch(params)
    hooked = [p for p in params if p._post_accumulate_grad_hooks]
    assert len(hooked) == GradStamps.SAMPLE, "one hook per sampled parameter, not per parameter"
    assert hooked[0] is params[0], "spread from the first parameter on"
    sum((p * 2).sum() for p in params).backward()
    assert stamps.changed() is None
    sum((p * 2).sum() for p in params).backward()
    torch.nn.utils.clip_grad_norm_(params, 0.1)
    assert stamps.changed() is params[0]
    stamps.watch(params[:3])  # a new list: hooks move to its sample
    assert sum(bool(p._post_accumulate_grad_hooks) for p in params) == 3
    stamps.unwatch()
    assert not any(p._post_accumulate_grad_hooks for p in params)


def test_check_state_fits_refuses_state_made_for_all_the_rows() -> None:
    param = torch.nn.Parameter(torch.zeros(10, 2))
    optimizer = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.ones(10, 2)
    optimizer.step()
    check_state_fits(optimizer, {"z": param})  # fits
    with torch.no_grad():
        param.data = param.data[:4].clone()  # cut to a block, as ownership does
    with pytest.raises(pd.PyroDistributedError, match=r"state 'exp_avg' of local parameter 'z'"):
        check_state_fits(optimizer, {"z": param})
