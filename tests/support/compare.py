"""Comparing what workers hold: parameters, optimizer states and checkpoints, bit for bit."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_state(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}/{index}")
    else:
        assert got == want, where
