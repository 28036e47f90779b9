"""The example's synthetic Visium HD data, streamed to a file block by block."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [
    pytest.mark.integrations,
    pytest.mark.skipif(
        importlib.util.find_spec("anndata") is None, reason="needs the integrations extra"
    ),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "example", ROOT / "examples" / "cell2location_spatial.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("umis_per_bin", [None, 300.0])
def test_the_streamed_file_holds_the_in_memory_data_set(
    tmp_path: Path, example: Any, umis_per_bin: float | None
) -> None:
    path = tmp_path / "bins.h5ad"
    shape = dict(n_spots=250, n_genes=40, n_types=5, seed=3, block=60)
    made = example.write_visium_hd(path, **shape, umis_per_bin=umis_per_bin)
    memory, signatures = example.synthetic_visium_hd(**shape, umis_per_bin=umis_per_bin)
    whole, read_signatures = example.read_h5ad(path, by_rows=False)
    assert whole.X.format == "csr" and whole.X.dtype == np.float32
    assert (whole.X != memory.X).nnz == 0 and whole.X.shape == (250, 40)
    assert made["nonzero"] == memory.X.nnz and made["bytes"] == path.stat().st_size
    assert np.array_equal(read_signatures.to_numpy(), signatures.to_numpy())
    assert list(whole.obs_names) == list(memory.obs_names) == [f"bin{s}" for s in range(250)]
    by_rows, _ = example.read_h5ad(path, by_rows=True)  # what the workers read
    assert np.array_equal(np.asarray(by_rows.X.sum(1)), np.asarray(memory.X.sum(1)))
    totals = np.asarray(memory.X.sum(1)).ravel()
    if umis_per_bin is not None:  # each bin's expected total, with the detection noise
        assert abs(totals.mean() / umis_per_bin - 1) < 0.05, totals.mean()
    else:  # counts in most bins (fewer with fewer types)
        assert (totals > 0).mean() > 0.5, totals


def test_the_default_data_set_is_the_one_the_results_were_measured_on(example: Any) -> None:
    # The blocks' draws, in the order of the generator that made the tables
    # of benchmarks/CELL2LOCATION.md (one block: the draws do not interleave).
    rng = np.random.default_rng(3)
    n_spots, n_genes, n_types = 50, 30, 4
    side = int(np.ceil(np.sqrt(n_spots)))
    centres = rng.uniform(size=(n_types, 3, 2))
    scale = rng.gamma(2.0, 0.3, size=(1, n_types))
    signatures = example._signatures(rng, n_genes, n_types)
    gene_scale = rng.gamma(5.0, 0.2, size=(1, n_genes))
    spots = np.arange(n_spots)
    grid = np.stack(np.divmod(spots, side), axis=1) / side
    distance = np.linalg.norm(grid[:, None, None, :] - centres[None], axis=-1).min(axis=2)
    density = np.exp(-((distance / 0.15) ** 2)) * scale
    abundance = density * (rng.uniform(size=density.shape) < 0.8)
    detection = rng.gamma(20.0, 0.1 / 20.0, size=(n_spots, 1))
    mean = (detection * gene_scale * (abundance @ signatures.T)).astype(np.float32)
    counts = rng.poisson(rng.gamma(20.0, mean / 20.0 + 1e-12)).astype(np.float32)
    adata, _ = example.synthetic_visium_hd(n_spots, n_genes, n_types, seed=3)
    assert np.array_equal(adata.X.toarray(), counts)
