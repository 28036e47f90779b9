"""``read_h5ad_by_rows``: counts read from the file by rows, in one process.

The trainings that read them (cell2location, scvi-tools, Lightning's own
launcher) are in test_cell2location_owned.py and test_scvi_tools.py.
"""

from __future__ import annotations

import importlib.util
import pickle
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


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """An .h5ad of 20,000 x 30 sparse counts (more rows than one streamed block),
    with a layer, annotations and a spatial graph; and the counts in memory."""
    import anndata
    import pandas
    import scipy.sparse

    rng = np.random.default_rng(0)
    counts = scipy.sparse.random(20_000, 30, density=0.2, format="csr", random_state=1)
    counts.data = rng.poisson(5.0, counts.nnz).astype(np.float32) + 1
    adata = anndata.AnnData(
        X=counts,
        obs=pandas.DataFrame({"sample": "s1"}, index=[f"spot{i}" for i in range(20_000)]),
        var=pandas.DataFrame(index=[f"gene{j}" for j in range(30)]),
    )
    adata.layers["counts"] = counts.copy()
    adata.obsm["spatial"] = rng.uniform(size=(20_000, 2))
    adata.obsp["neighbours"] = scipy.sparse.identity(20_000, format="csr")
    adata.uns["note"] = "synthetic"
    path = tmp_path_factory.mktemp("h5ad") / "spots.h5ad"
    adata.write_h5ad(path)
    return path, counts


def test_rows_are_read_in_any_order_and_only_they_are_counted(written: tuple[Path, Any]) -> None:
    import anndata.abc

    from pyro_distributed.integrations.scvi.rows_on_disk import RowsOnDisk

    path, counts = written
    rows = RowsOnDisk(path)
    assert rows.shape == counts.shape and rows.dtype == counts.dtype
    assert isinstance(rows, anndata.abc.CSRDataset)  # scvi-tools reads it as a backed matrix
    for index in ([7, 3, 7, 19_999], np.arange(100, 900), slice(5, 50, 3), [-1, 0]):
        expected = counts[index]
        got = rows[index]
        assert (got != expected).nnz == 0 and got.shape == expected.shape, index
    mask = np.zeros(20_000, dtype=bool)
    mask[[4, 40, 400]] = True
    assert (rows[mask] != counts[mask]).nnz == 0
    assert (rows[[2, 9], [0, 5]] != counts[[2, 9]][:, [0, 5]]).nnz == 0
    assert rows.rows_read == 4 + 800 + 15 + 2 + 3 + 2
    assert rows.row_span == (0, 20_000) and rows.largest_read == 800
    rows.reset_counts()
    rows[1000:1010]
    assert (rows.rows_read, rows.row_span, rows.largest_read) == (10, (1000, 1010), 10)
    assert rows.bytes_read == counts[1000:1010].data.nbytes + counts[1000:1010].indices.nbytes


def test_row_sums_stream_and_equal_the_in_memory_matrix_bitwise(written: tuple[Path, Any]) -> None:
    from pyro_distributed.integrations.scvi.rows_on_disk import STREAM_ROWS, RowsOnDisk

    path, counts = written
    rows = RowsOnDisk(path)
    assert counts.shape[0] > 2 * STREAM_ROWS  # several blocks
    totals = rows.sum(1)
    assert type(totals) is type(counts.sum(1)) and totals.shape == (20_000, 1)
    assert np.array_equal(totals, counts.sum(1))
    assert totals.mean() == counts.sum(1).mean()  # cell2location's detection mean
    assert np.allclose(rows.sum(0), counts.sum(0), rtol=1e-6)
    assert np.isclose(rows.sum(), counts.sum(), rtol=1e-6)
    # streamed past, never held: not counted as rows read
    assert (rows.rows_read, rows.rows_streamed) == (0, 3 * 20_000)
    with pytest.raises(ValueError, match="axis=2"):
        rows.sum(2)


def test_the_anndata_keeps_annotations_in_memory_and_counts_on_disk(
    written: tuple[Path, Any],
) -> None:
    import anndata.abc

    from pyro_distributed.integrations.scvi.rows_on_disk import RowsOnDisk, read_h5ad_by_rows

    path, counts = written
    adata = read_h5ad_by_rows(path)
    assert isinstance(adata.X, RowsOnDisk) and isinstance(adata.X, anndata.abc.CSRDataset)
    assert isinstance(adata.layers["counts"], RowsOnDisk)
    assert adata.layers["counts"].key == "layers/counts"
    assert adata.shape == counts.shape and adata.obs_names[3] == "spot3"
    assert adata.obsm["spatial"].shape == (20_000, 2) and adata.uns["note"] == "synthetic"
    assert adata.obsp["neighbours"].nnz == 20_000
    assert adata.X.rows_read == 0  # nothing read until asked
    restored = pickle.loads(pickle.dumps(adata.X))  # a spawned process opens the file itself
    assert (restored[[5]] != counts[[5]]).nnz == 0


def test_counts_stored_dense_are_refused_with_the_fix(tmp_path: Path) -> None:
    import anndata

    from pyro_distributed.integrations.scvi import read_h5ad_by_rows

    path = tmp_path / "dense.h5ad"
    anndata.AnnData(X=np.ones((4, 3), dtype=np.float32)).write_h5ad(path)
    with pytest.raises(TypeError, match=r"reads CSR matrices.*'X'.*'array'.*csr_matrix"):
        read_h5ad_by_rows(path)
