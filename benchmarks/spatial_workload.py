"""``spatial<N>x<G>``: a cell2location-shaped spatial mapping, in plain Pyro, at the users' sizes.

A benchmark workload (``benchmarks/svi_worker.py --workload spatial300000x2000``)
for what issue reports of cell2location hit: N spots by G genes of counts, a
per-spot abundance of each of F cell types (the local parameters, N x F), and
per-gene detection efficiencies and overdispersions (global). The expected
count of gene g at spot s is ``sum_f w_sf * signature_fg * m_g``; the counts
are negative binomial (``GammaPoisson``) around it. Without cell2location or
scvi-tools, so that it travels to a machine that has only torch and Pyro (the
GPU check, ``scripts/gpu_check.sh``).

Full batch: the spots plate takes every spot a worker holds at each step,
named by ``subsample=``. With ``owned=True`` that is block r
(:func:`pyro_distributed.block_range`), under
``pd.shard_subsamples(own_local_params=True)``, and the worker makes only
block r's counts; else every spot. The counts are drawn in chunks of
:data:`CHUNK` spots, each from a generator seeded by its chunk, so a spot's
counts are the same whichever worker makes them and at any W.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoNormal
from torch import Tensor

import pyro_distributed as pd

NAME = re.compile(r"spatial(\d+)x(\d+)")
CELL_TYPES = 30
CHUNK = 10_000


def counts_of(rows: range, genes: int, signatures: Tensor, seed: int) -> Tensor:
    """Counts of spots ``rows`` (float32, rows x genes), on ``signatures``' device."""
    device = signatures.device
    blocks = []
    for chunk in range(rows.start // CHUNK, (rows.stop + CHUNK - 1) // CHUNK):
        # A whole chunk is drawn whatever part of it is kept: the same numbers at any W.
        generator = torch.Generator(device).manual_seed(seed + 1 + chunk)
        abundance = torch.empty(CHUNK, CELL_TYPES, device=device).exponential_(generator=generator)
        mean = abundance @ signatures * 0.5  # a detection efficiency of one half
        drawn = torch.poisson(mean, generator=generator)
        first = chunk * CHUNK
        blocks.append(drawn[max(rows.start - first, 0) : min(rows.stop - first, CHUNK)].clone())
    return torch.cat(blocks)


def spatial_mapping(
    spots: int, genes: int, device: str, owned: bool, seed: int
) -> tuple[Callable[..., None], AutoNormal, tuple[Any, ...]]:
    """Model, guide and ``svi.step`` arguments: this worker's counts (block r's
    with ``owned``, else all), the offset of their first spot, and the
    cell types' signatures."""
    generator = torch.Generator(device).manual_seed(seed)
    signatures = torch.empty(CELL_TYPES, genes, device=device).exponential_(generator=generator)
    rows = pd.block_range(spots) if owned else range(spots)
    counts = counts_of(rows, genes, signatures, seed)
    # The spots are named, not drawn: the guide's first call traces the model
    # outside every handler (AutoNormal's prototype), where a drawn subsample
    # would name spots this worker does not hold.
    held = torch.arange(rows.start, rows.stop, device=device)

    def plate() -> pyro.plate:
        return pyro.plate("spots", spots, subsample=held)

    def model(counts: Tensor, offset: int, signatures: Tensor) -> None:
        m_g = pyro.sample("m_g", dist.Gamma(2.0, 4.0).expand([genes]).to_event(1))
        alpha_g = pyro.sample("alpha_g", dist.Gamma(9.0, 3.0).expand([genes]).to_event(1))
        with plate() as index:
            w_sf = pyro.sample("w_sf", dist.Gamma(1.0, 1.0).expand([CELL_TYPES]).to_event(1))
            mean = (w_sf @ signatures) * m_g
            # Every spot held, in order: the counts as they are, not a gathered copy.
            observed = counts if index is held else counts[index - offset]
            pyro.sample("obs", dist.GammaPoisson(alpha_g, alpha_g / mean).to_event(1), obs=observed)

    guide = AutoNormal(model, create_plates=lambda *args: plate())
    return model, guide, (counts, rows.start, signatures)
