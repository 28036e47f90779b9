"""cell2location trained through the strategy from a real Jupyter kernel, then used in it.

The notebook a user writes: ``model.train(..., strategy=...)`` on two workers
that Lightning forks from the kernel, then ``model.export_posterior(adata)``
in the same kernel, against the same model trained at W=1 in that kernel.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from ..support.notebooks import execute, notebook_of, output_of

pytestmark = [
    pytest.mark.integrations,
    pytest.mark.skipif(
        importlib.util.find_spec("cell2location") is None, reason="needs the integrations extra"
    ),
]

FIT = """
import sys
import numpy as np
import pyro, scvi, torch
from cell2location.models import Cell2location
from pyro_distributed.integrations.lightning import PyroDistributedStrategy
sys.path.insert(0, "examples")
import cell2location_spatial as example

torch.set_num_threads(1)
arguments = example.parse(["--spots", "301", "--genes", "60", "--types", "6"])


def fit(devices, seed, strategy=None, **train):
    pyro.clear_param_store()
    scvi.settings.seed = seed
    adata, signatures = example.load(arguments)
    Cell2location.setup_anndata(adata, batch_key="sample")
    model = Cell2location(
        adata, cell_state_df=signatures, N_cells_per_location=8, detection_alpha=20
    )
    model.train(
        max_epochs=150, batch_size=None, accelerator="cpu", device=devices,
        enable_progress_bar=False, logger=False, enable_checkpointing=False, **train,
        **({"strategy": strategy} if strategy is not None else {}),
    )
    model.export_posterior(adata, use_quantiles=True, add_to_obsm=["q50"])
    return adata.obsm["q50_cell_abundance_w_sf"].to_numpy()
"""


def test_export_posterior_in_the_kernel_after_two_forked_workers_matches_w1(
    tmp_path: Path,
) -> None:
    _assert_two_workers_match_w1(tmp_path, "")


def test_scvi_tools_distributed_sampler_fit_comes_back_to_the_kernel(tmp_path: Path) -> None:
    # scvi-tools' own sampler reads the process group: the kernel has none.
    _assert_two_workers_match_w1(tmp_path, "datasplitter_kwargs={'distributed_sampler': True}")


def _assert_two_workers_match_w1(tmp_path: Path, train: str) -> None:
    out = tmp_path / "abundances.npz"
    notebook = execute(
        notebook_of(
            FIT,
            "single = fit(1, 0)\nother_seed = fit(1, 1)\n"
            f"owned = fit(2, 0, PyroDistributedStrategy(own_local_params=True), {train})\n"
            f"replicated = fit(2, 0, PyroDistributedStrategy(), {train})\n"
            f"np.savez({str(out)!r}, single=single, other_seed=other_seed, owned=owned, "
            "replicated=replicated)\nprint('fitted')",
        ),
        timeout=900,
    )
    shown = "".join(output_of(cell) for cell in notebook.cells)
    assert re.search(r"^fitted$", shown, re.MULTILINE), shown[-5000:]  # not the source's echo
    found = np.load(out)

    def correlation(name: str) -> float:
        return float(np.corrcoef(found[name].ravel(), found["single"].ravel())[0, 1])

    noise = correlation("other_seed")  # two W=1 fits of different seeds
    for name in ("owned", "replicated"):
        assert found[name].shape == found["single"].shape
        assert correlation(name) >= noise - 0.01, (name, correlation(name), noise)
