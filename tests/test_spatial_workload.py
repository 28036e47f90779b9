"""The GPU check's spatial workload (``benchmarks/spatial_workload.py``): a worker
that makes only its block of counts makes the same numbers as one that makes all."""

from __future__ import annotations

import sys
from itertools import pairwise
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from spatial_workload import CELL_TYPES, CHUNK, counts_of


def test_blocks_that_cut_chunks_make_the_same_counts_as_the_whole() -> None:
    genes, spots = 7, 2 * CHUNK + 501
    signatures = torch.rand(CELL_TYPES, genes, generator=torch.Generator().manual_seed(1))
    whole = counts_of(range(spots), genes, signatures, seed=3)
    cuts = [0, CHUNK // 3, CHUNK + 17, 2 * CHUNK, spots]  # inside, across and on chunk edges
    blocks = [counts_of(range(a, b), genes, signatures, seed=3) for a, b in pairwise(cuts)]
    assert whole.shape == (spots, genes)
    assert torch.equal(torch.cat(blocks), whole)
    assert whole.sum() > 0 and torch.equal(whole, whole.round())  # counts
    assert not torch.equal(whole, counts_of(range(spots), genes, signatures, seed=4))
