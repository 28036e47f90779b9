"""cell2location's own ``model.train()`` with spots owned by their worker, real processes.

Each test runs ``examples/cell2location_spatial.py --run`` (cell2location
0.1.5 on scvi-tools, the strategy with ``own_local_params=True``, Lightning's
own launcher starting the second worker on CPU with gloo) on a small
synthetic data set, and reads what every worker wrote: the cell abundances
(``export_posterior`` inside ``owned_posterior``, on worker 0) and how many
spots' parameters each worker held.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.integrations,
    pytest.mark.skipif(
        importlib.util.find_spec("cell2location") is None, reason="needs the integrations extra"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cell2location_spatial.py"
SPOTS, GENES, TYPES = 301, 60, 6  # 301: blocks of 150 and 151 spots


def train(tmp_path: Path, name: str, *extra: str, devices: int = 2, timeout: float = 600) -> dict:
    """Run one configuration; return worker 0's results and every worker's spot count."""
    out = tmp_path / f"{name}.npz"
    command = [sys.executable, str(EXAMPLE), "--run", "--out", str(out), "--devices", str(devices)]
    command += ["--spots", str(SPOTS), "--genes", str(GENES), "--types", str(TYPES)]
    command += ["--mode", "owned" if devices > 1 else "single", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = dict(np.load(out))
    result["held"] = [int(Path(f"{out}.held{rank}").read_text()) for rank in range(devices)]
    reads = [Path(f"{out}.reads{rank}").read_text() for rank in range(devices)]
    result["reads"] = [json.loads(text) for text in reads]
    return result


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """W=1, full batch, two seeds: the answer and the noise between two equally good ones."""
    tmp = tmp_path_factory.mktemp("w1")
    first = train(tmp, "seed0", "--epochs", "150", devices=1)
    second = train(tmp, "seed1", "--epochs", "150", "--seed", "1", devices=1)
    first["noise"] = relative(second["abundance"], first["abundance"])
    return first


def test_full_batch_owned_spots_match_w1_within_seed_noise(tmp_path: Path, reference: dict) -> None:
    result = train(tmp_path, "full", "--epochs", "150")
    assert result["held"] == [150, 151], "each worker holds its block of spots' parameters"
    assert result["abundance"].shape == reference["abundance"].shape == (SPOTS, TYPES)
    difference = relative(result["abundance"], reference["abundance"])
    assert difference <= 2 * reference["noise"] + 0.02, (difference, reference["noise"])


def test_mini_batches_keep_each_worker_to_its_block(tmp_path: Path, reference: dict) -> None:
    # 150 and 151 spots in batches of 40: 4 steps on each worker, every spot once an epoch.
    result = train(tmp_path, "mini", "--epochs", "60", "--batch-size", "40")
    assert result["held"] == [150, 151]
    assert np.isfinite(result["abundance"]).all()
    assert np.corrcoef(result["abundance"].ravel(), reference["abundance"].ravel())[0, 1] > 0.8


def test_sparse_local_steps_train_from_model_train(tmp_path: Path, reference: dict) -> None:
    result = train(
        tmp_path, "sparse", "--epochs", "60", "--batch-size", "40", "--local-updates", "sparse"
    )
    assert result["held"] == [150, 151]
    assert np.corrcoef(result["abundance"].ravel(), reference["abundance"].ravel())[0, 1] > 0.8


@pytest.mark.parametrize("guide", ["AutoNormalMessenger", "AutoHierarchicalNormalMessenger"])
def test_messenger_guides_own_their_spots(tmp_path: Path, guide: str) -> None:
    # Against the same guide at W=1: another guide family converges elsewhere in
    # 150 epochs (AutoHierarchicalNormalMessenger's estimates correlate 0.78 with
    # AutoNormal's), so only its own single-process run is the reference.
    single = train(tmp_path, f"{guide}-w1", "--epochs", "150", "--guide", guide, devices=1)
    # The posterior 40 spots a batch: a messenger guide gives each batch its
    # spots, joined along the plate.
    result = train(tmp_path, guide, "--epochs", "150", "--guide", guide, "--export-batch", "40")
    assert result["held"] == [150, 151]
    assert np.corrcoef(result["abundance"].ravel(), single["abundance"].ravel())[0, 1] > 0.8


# -- counts read from the file by rows (read_h5ad_by_rows)


@pytest.fixture(scope="module")
def h5ad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same synthetic spots, written as an .h5ad with CSR counts."""
    path = tmp_path_factory.mktemp("h5ad") / "spots.h5ad"
    command = [sys.executable, str(EXAMPLE), "--write-h5ad", str(path)]
    command += ["--spots", str(SPOTS), "--genes", str(GENES), "--types", str(TYPES)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=300)
    return path


@pytest.mark.parametrize("batches", ["full batch", "mini-batches"])
def test_each_worker_reads_only_its_spots_and_trains_as_from_memory(
    tmp_path: Path, h5ad: Path, batches: str
) -> None:
    epochs = 10 if batches == "full batch" else 5
    options = ["--h5ad", str(h5ad), "--epochs", str(epochs)]
    if batches == "mini-batches":
        options += ["--batch-size", "40"]  # 4 batches of each worker's 150 or 151 spots
    # Read by rows, the owners also write the abundances into a file block by
    # block (write_owned_obsm), summarised 40 spots a batch; whole,
    # export_posterior summarises each block in one batch and joins them.
    results = tmp_path / "abundances.h5ad"
    by_rows = train(
        tmp_path, "by-rows", *options, "--results", str(results), "--export-batch", "40"
    )
    whole = train(tmp_path, "whole", *options, "--in-memory")
    assert results.exists()
    # The same counts, the same arithmetic: the same abundances, bitwise.
    assert by_rows["abundance"].shape == (SPOTS, TYPES)
    assert np.array_equal(by_rows["abundance"], whole["abundance"])
    assert by_rows["held"] == whole["held"] == [150, 151]
    for block, reads in zip([(0, 150), (150, 301)], by_rows["reads"], strict=True):
        size = block[1] - block[0]
        # Set-up: cell2location's mean total count streams past every spot,
        # scvi-tools' count check reads the first 100 rows; nothing else.
        assert reads["setup"]["streamed"] == SPOTS
        assert reads["setup"]["rows"] == 100 and reads["setup"]["span"] == [0, 100]
        # Training and the owned posterior: this worker's spots only.
        assert reads["train"]["span"] == list(block), reads
        # The posterior's quantiles: AutoNormal's are its parameters', every
        # spot's from any batch, so one batch of the 40 spots asked for is
        # read, and 16 spots that find the plate's sites (cell2location's own
        # method reads the whole block at once).
        assert reads["export"]["span"] == [block[0], block[0] + 40], reads
        assert reads["export"]["largest"] == 40 and reads["export"]["rows"] == 40 + 16, reads
        if batches == "full batch":  # copied to the device once
            assert reads["train"]["rows"] == size
        else:  # every spot once an epoch, and the guide's warm-up batch
            assert epochs * size < reads["train"]["rows"] <= epochs * size + 40


# -- checkpoints through Lightning: c2l_checkpoint.py

CHECKPOINT_SCRIPT = Path(__file__).parent / "scripts" / "c2l_checkpoint.py"


def checkpoint_run(out: Path, tag: str, *extra: str, devices: int) -> None:
    command = [sys.executable, str(CHECKPOINT_SCRIPT), "--out", str(out), "--tag", tag]
    command += ["--devices", str(devices), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def joined(out: Path, tag: str, devices: int) -> dict[str, dict[str, object]]:
    """Every parameter's rows in global order, joined from every worker's
    snapshot, with its optimizer state's tensors joined the same way."""
    import torch

    snapshots = [torch.load(out / f"{tag}.rank{r}.pt", weights_only=False) for r in range(devices)]
    result = {}
    for name in snapshots[0]:
        parts = [snapshot[name] for snapshot in snapshots]
        whole = all(len(part["indices"]) == len(parts[0]["indices"]) for part in parts) and all(
            torch.equal(part["indices"], parts[0]["indices"]) for part in parts
        )
        if whole:  # a global parameter: the same on every worker
            for part in parts[1:]:
                assert torch.equal(part["value"], parts[0]["value"]), name
            optim = parts[0]["optim"]
            result[name] = {"value": parts[0]["value"], "optim": optim and optim["state"][0]}
            continue
        axis = -2  # cell2location's obs_plate
        value = torch.cat([part["value"] for part in parts], dim=axis)
        state = [part["optim"]["state"][0] for part in parts if part["optim"] is not None]
        moments = (
            {
                key: torch.cat([s[key] for s in state], dim=axis)
                if state[0][key].dim()
                else state[0][key]
                for key in state[0]
            }
            if len(state) == devices
            else None
        )
        result[name] = {"value": value, "optim": moments}
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """W=2, four epochs, a checkpoint after the second."""
    out = tmp_path_factory.mktemp("checkpoints")
    checkpoint_run(out, "full", "--epochs", "4", "--save-at", "1", devices=2)
    return out


def test_resuming_at_the_same_world_size_continues_bitwise(uninterrupted: Path) -> None:
    import torch

    out = uninterrupted
    checkpoint_run(
        out, "resumed", "--epochs", "4", "--ckpt-path", str(out / "epoch1.ckpt"), devices=2
    )
    for r in range(2):
        expected = torch.load(out / f"full.rank{r}.pt", weights_only=False)
        got = torch.load(out / f"resumed.rank{r}.pt", weights_only=False)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(expected[name]["indices"], got[name]["indices"]), name
            assert torch.equal(expected[name]["value"], got[name]["value"]), name
            state, resumed_state = (
                expected[name]["optim"]["state"][0],
                got[name]["optim"]["state"][0],
            )
            for key in state:
                assert torch.equal(state[key], resumed_state[key]), (name, key)


@pytest.mark.parametrize("devices", [1, 3])
def test_resuming_at_another_world_size_repartitions_every_row(
    uninterrupted: Path, devices: int
) -> None:
    import torch

    out = uninterrupted
    tag = f"restored{devices}"
    # max_epochs=2: the checkpoint's epochs are done, so the run restores and stops.
    checkpoint_run(
        out, tag, "--epochs", "2", "--ckpt-path", str(out / "epoch1.ckpt"), devices=devices
    )
    saved, restored = joined(out, "full-at-save", 2), joined(out, tag, devices)
    assert saved.keys() == restored.keys()
    for name, expected in saved.items():
        assert torch.equal(expected["value"], restored[name]["value"]), name
        if expected["optim"] is not None:
            for key, tensor in expected["optim"].items():
                assert torch.equal(tensor, restored[name]["optim"][key]), (name, key)
