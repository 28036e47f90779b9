"""scvi-tools and cell2location trained data-parallel from their own ``model.train(...)``.

Each test runs ``scripts/train_scvi.py`` as a user would, with Lightning's own
launcher (``device=2, accelerator="cpu", strategy="pyro_distributed"``), and
reads what every worker ended with. These tests need the real packages: they
run in the venv that ``scripts/setup_integrations.sh`` makes (marked
``integrations``; the main venv deselects them), and fail, not skip, there
if a package is missing.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ..support.harness import run_script

pytestmark = pytest.mark.integrations

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_scvi.py"


def launch(out: Path, *options: str, devices: int = 2, timeout: float = 900) -> tuple[int, str]:
    """Run the script on ``devices`` workers; its exit code and the end of its output."""
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--devices", str(devices), *options]
    return run_script(command, ROOT, timeout)


def train(out: Path, *options: str, devices: int = 2) -> list[dict[str, Any]]:
    """Every worker's record, by rank."""
    code, output = launch(out, *options, devices=devices)
    assert code == 0, f"exit {code}\n{output}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(devices)]


def assert_in_sync(records: list[dict[str, Any]]) -> None:
    """Every worker ends with the same Pyro parameters and module buffers, bitwise."""
    first = records[0]["params"]
    assert first, "no Pyro parameters were trained"
    for record in records[1:]:
        for kind in ("params", "buffers"):
            assert record[kind].keys() == records[0][kind].keys()
            for name, value in records[0][kind].items():
                assert torch.equal(record[kind][name], value), name


def assert_disjoint_shares(
    records: list[dict[str, Any]], epochs: int, shuffled: bool = True
) -> None:
    """Each epoch, each worker trains on its own rows: none twice, none left out
    but the ``n % W`` that an equal share leaves over; in a new order each
    epoch if the loader shuffles (scvi-tools' mini-batch loaders), in the same
    order if not (its full-batch ``DeviceBackedDataSplitter``)."""
    n_train, workers = records[0]["n_train"], len(records)
    for epoch in range(epochs):
        shares = [record["rows"][epoch] for record in records]
        assert all(len(share) == n_train // workers for share in shares), epoch
        seen = [row for share in shares for row in share]
        assert len(set(seen)) == len(seen), f"epoch {epoch}: workers share rows"
        assert set(seen) <= set(range(n_train))
    # The loader's sampler is told the epoch.
    assert (records[0]["rows"][0] != records[0]["rows"][1]) == shuffled


@pytest.fixture(scope="module")
def lda(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """AmortizedLDA runs shared by the tests: W=2 as shipped, W=2 with scvi-tools'
    distributed sampler, and W=1 with two seeds (the noise between seeds)."""
    root = tmp_path_factory.mktemp("lda")
    # W=1 with the batch of both workers together: the same number of steps.
    alone = ["--model", "lda", "--batch-size", "128"]
    return {
        "w2": train(root / "w2", "--model", "lda", "--batch-size", "64"),
        "w2-sampler": train(root / "w2-sampler", "--model", "lda", "--distributed-sampler"),
        "w3": train(root / "w3", "--model", "lda", "--batch-size", "43", devices=3),
        "w1": train(root / "w1", *alone, devices=1),
        "w1-seed1": train(root / "w1-seed1", *alone, "--seed", "1", devices=1),
    }


@pytest.mark.parametrize("workers", [2, 3])
def test_amortized_lda_trains_one_model_on_disjoint_shares_from_its_own_train(
    lda: dict[str, list[dict[str, Any]]], workers: int
) -> None:
    # scvi-tools' PyroTrainingPlan steps its own SVI, with its own pyro.optim
    # optimizer, on its default loader (a BatchSampler as the sampler): the
    # strategy wrapped the one and split the other.
    records = lda[f"w{workers}"]
    assert [r["world_size"] for r in records] == [workers] * workers
    assert records[0]["buffers"], "AmortizedLDA's encoder has BatchNorm statistics"
    assert_in_sync(records)
    assert_disjoint_shares(records, epochs=3)


def test_amortized_lda_with_scvi_tools_distributed_sampler(
    lda: dict[str, list[dict[str, Any]]],
) -> None:
    records = lda["w2-sampler"]
    assert_in_sync(records)
    n_train = records[0]["n_train"]
    for epoch in range(3):  # BatchDistributedSampler pads to equal shares
        shares = [set(r["rows"][epoch]) for r in records]
        assert shares[0] | shares[1] == set(range(n_train))
        assert len(shares[0] & shares[1]) <= n_train % 2


def test_amortized_lda_at_two_workers_matches_one_within_seed_noise(
    lda: dict[str, list[dict[str, Any]]],
) -> None:
    one, other_seed, two = lda["w1"][0]["loss"], lda["w1-seed1"][0]["loss"], lda["w2"][0]["loss"]
    noise = abs(one - other_seed)
    assert abs(two - one) <= 3 * noise + 1e-3 * abs(one), (one, other_seed, two)
    assert lda["w2"][1]["loss"] == two  # the same parameters on both workers


def topic_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean absolute difference of two cells-by-topics matrices, under the
    matching of topics that makes it least (topics have no fixed labels)."""
    return min(
        float((a[:, list(order)] - b).abs().mean())
        for order in itertools.permutations(range(a.shape[1]))
    )


def test_get_latent_representation_gives_every_cell_in_anndata_order_on_every_worker(
    lda: dict[str, list[dict[str, Any]]],
) -> None:
    records = lda["w2"]
    for record in records:
        latent = record["latent"]
        assert record["latent_index"] == record["obs_names"]  # the AnnData's order
        assert latent.shape == (len(record["obs_names"]), 4)
        assert torch.allclose(latent.sum(dim=1), torch.ones(len(latent), dtype=latent.dtype))
        assert torch.equal(latent, records[0]["latent"])  # the same on every worker
    one, other_seed = lda["w1"][0]["latent"], lda["w1-seed1"][0]["latent"]
    noise = topic_distance(other_seed, one)
    assert topic_distance(records[0]["latent"], one) <= 3 * noise + 1e-3, noise


def test_a_plan_whose_svi_the_strategy_cannot_find_stops_training(tmp_path: Path) -> None:
    # The plan steps an SVI it keeps in a list, with a plain pyro.optim
    # optimizer: each worker would step on its own gradient. The strategy's
    # check after the first step stops it on every worker, naming a parameter.
    code, output = launch(tmp_path, "--model", "lda", "--hidden-svi", "--epochs", "1")
    assert code != 0, output
    assert "PyroDistributedError" in output, output
    assert "the workers' parameters differ after the first training step" in output, output


def test_cell2location_regression_model_trains_one_model_on_disjoint_shares(
    tmp_path: Path,
) -> None:
    records = train(tmp_path, "--model", "regression", "--batch-size", "100")
    assert_in_sync(records)
    assert_disjoint_shares(records, epochs=3)


@pytest.fixture(scope="module")
def spatial(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Cell2location, full batch (its default, batch_size=None), per-spot parameters
    replicated: W=2, and W=1 with two seeds."""
    root = tmp_path_factory.mktemp("cell2location")
    options = ["--model", "cell2location", "--batch-size", "0", "--epochs", "30"]
    return {
        "w2": train(root / "w2", *options),
        "w1": train(root / "w1", *options, devices=1),
        "w1-seed1": train(root / "w1-seed1", *options, "--seed", "1", devices=1),
    }


def test_cell2location_full_batch_gives_each_worker_half_the_spots_each_step(
    spatial: dict[str, list[dict[str, Any]]],
) -> None:
    records = spatial["w2"]
    assert_in_sync(records)
    assert_disjoint_shares(records, epochs=30, shuffled=False)


def test_cell2location_at_two_workers_matches_one_within_seed_noise(
    spatial: dict[str, list[dict[str, Any]]],
) -> None:
    one = spatial["w1"][0]["loss"]
    other_seed = spatial["w1-seed1"][0]["loss"]
    two = spatial["w2"][0]["loss"]
    assert abs(two - one) <= 3 * abs(one - other_seed) + 1e-3 * abs(one), (one, other_seed, two)


def test_amortized_lda_on_counts_read_by_rows_reads_its_share_and_trains_as_from_memory(
    lda: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    import importlib.util

    import scipy.sparse

    spec = importlib.util.spec_from_file_location("train_scvi", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    adata = script.synthetic(script.SEED, 400, 50, 5)  # the script's default data set
    adata.X = scipy.sparse.csr_matrix(adata.X)
    adata.write_h5ad(tmp_path / "cells.h5ad")
    by_rows = train(tmp_path / "by-rows", "--model", "lda", "--h5ad", str(tmp_path / "cells.h5ad"))
    for record, from_memory in zip(by_rows, lda["w2"], strict=True):
        # The same counts, the same batches: the same model, bitwise.
        for name, value in from_memory["params"].items():
            assert torch.equal(record["params"][name], value), name
        assert torch.equal(record["latent"], from_memory["latent"])
        # Each worker read the rows of its share, once per epoch, and the
        # guide's warm-up batch: one worker reading every row would read twice as many.
        trained = sum(len(epoch) for epoch in record["rows"])
        assert trained <= record["reads"]["rows"] <= trained + 64, (trained, record["reads"])
