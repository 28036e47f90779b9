"""Lightning checkpoints of local parameters, with real processes and real files.

``scripts/fit_regression.py --plan local`` trains a regression with a latent
offset per row whose variational parameters are owned by their worker. One
run at W=2 writes checkpoints with ``ModelCheckpoint(save_last=True)``; the
tests resume from them at W=2 (against a straight run, bitwise), at W=1 and
at W=3 (every row and its Adam moments against the block files the W=2 run
wrote), and provoke real write failures on one worker. Each run is shared by
the tests that read it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pyro_distributed import safe_files
from pyro_distributed.integrations.lightning import PyroDistributedStrategy

from ..support.harness import one_pytest_worker
from ..support.lightning_reference import fit, launch
from .scripts.fit_regression import N, listing

pytestmark = one_pytest_worker(__name__)  # every test reads the runs of `written`

PLAN = ["--plan", "local", "--val-every", "1"]  # validation draws from the RNG: every epoch
LOCAL = ("loss_fn.guide.locs.z_unconstrained", "loss_fn.guide.scales.z_unconstrained")
MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The W=2 run that writes the checkpoints (2 epochs), and the straight run (4)."""
    root = tmp_path_factory.mktemp("lightning-checkpoints")
    directory = root / "checkpoints"
    saved = fit(root / "saved", *PLAN, "--epochs", "2", "--checkpoint-dir", str(directory))
    # What the directory held when that run ended, before any resume reads it.
    listing = sorted(path.name for path in directory.iterdir())
    straight = fit(root / "straight", *PLAN, "--epochs", "4")
    return {"directory": directory, "saved": saved, "listing": listing, "straight": straight}


def main_file(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=True)  # as Lightning loads it
    return loaded


def saved_rows(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every local parameter's N rows and Adam moments, joined from the block files
    that the checkpoint at ``path`` names."""
    local = main_file(path)["pyro_distributed"]["local"]
    workers = local["world_size"]
    blocks = [
        safe_files.load(
            path.with_name(f"{path.name}.{local['token']}.block{r}of{workers}"),
            "block",
            trusted=False,
        )[1]
        for r in range(workers)
    ]
    rows: dict[str, dict[str, torch.Tensor]] = {}
    for name in LOCAL:
        assert [tuple(block["rows"][name]) for block in blocks] == [(0, 500), (500, 1000)]
        rows[name] = {"value": torch.cat([block["params"][name] for block in blocks])}
        for moment in MOMENTS:
            rows[name][moment] = torch.cat([block["optim"][name][moment] for block in blocks])
    return rows


def assert_same_params(first: dict[str, Any], second: dict[str, Any], where: str) -> None:
    assert first.keys() == second.keys(), where
    for name, entry in first.items():
        assert torch.equal(entry["indices"], second[name]["indices"]), (where, name)
        assert torch.equal(entry["value"], second[name]["value"]), (where, name)
        assert entry["state"].keys() == second[name]["state"].keys(), (where, name)
        for key, value in entry["state"].items():
            assert torch.equal(value, second[name]["state"][key]), (where, name, key)


def test_a_checkpoint_holds_every_workers_block_and_lightnings_file_none(
    written: dict[str, Any],
) -> None:
    checkpoint = written["directory"] / "last.ckpt"
    saved = main_file(checkpoint)
    assert not set(LOCAL) & set(saved["state_dict"]), "local rows are not in Lightning's file"
    rows = saved_rows(checkpoint)
    # The blocks hold exactly what each worker trained (the last save is at the run's end).
    for record in written["saved"]:
        for name in LOCAL:
            ours = record["params"][name]
            assert torch.equal(rows[name]["value"][ours["indices"]], ours["value"]), name
            for moment in MOMENTS:
                assert torch.equal(rows[name][moment][ours["indices"]], ours["state"][moment])
    first = written["saved"][0]["params"]["loss_fn.guide.locs.w_unconstrained"]["value"]
    assert torch.equal(saved["state_dict"]["loss_fn.guide.locs.w_unconstrained"], first)


def test_model_checkpoint_keeps_the_blocks_of_its_files_and_removes_the_rest(
    written: dict[str, Any],
) -> None:
    # Epoch 0's top-1 file was removed at epoch 1 with its blocks; last.ckpt,
    # saved at both epochs, keeps only its newest save's blocks.
    listing = written["listing"]
    for name in ("epoch=1-step=10.ckpt", "last.ckpt"):
        token = main_file(written["directory"] / name)["pyro_distributed"]["local"]["token"]
        assert name in listing
        assert [entry for entry in listing if entry.startswith(f"{name}.")] == [
            f"{name}.{token}.block0of2",
            f"{name}.{token}.block1of2",
        ]
    assert len(listing) == 6, listing


def test_resuming_at_the_same_world_size_continues_bitwise(
    written: dict[str, Any], tmp_path: Path
) -> None:
    last = written["directory"] / "last.ckpt"
    resumed = fit(tmp_path, *PLAN, "--epochs", "4", "--resume", str(last))
    for rank, (straight, again) in enumerate(zip(written["straight"], resumed, strict=True)):
        assert again["global_step"] == straight["global_step"] == 20
        # Every parameter, each worker's block of the local ones included, and its Adam state.
        assert_same_params(straight["params"], again["params"], f"worker {rank}")
        assert again["metrics"]["train_loss"] == straight["metrics"]["train_loss"]


@pytest.mark.parametrize("workers", [1, 3])
def test_resuming_at_another_world_size_repartitions_every_row(
    written: dict[str, Any], tmp_path: Path, workers: int
) -> None:
    checkpoint = written["directory"] / "epoch=1-step=10.ckpt"
    if workers == 3:  # through a relative symlink, as save_last="link" makes one
        link = tmp_path / "links" / "linked.ckpt"
        link.parent.mkdir()
        link.symlink_to(os.path.relpath(checkpoint, link.parent))
        checkpoint = link
    records = fit(tmp_path, *PLAN, "--epochs", "3", "--resume", str(checkpoint), workers=workers)
    rows = saved_rows(written["directory"] / "epoch=1-step=10.ckpt")
    covered: list[int] = []
    for rank, record in enumerate(records):
        restored = record["restored"]  # right after the restore, before any step
        indices = restored[LOCAL[0]]["indices"]
        block = range(rank * N // workers, (rank + 1) * N // workers)
        assert indices.tolist() == list(block), f"worker {rank}: its block at W={workers}"
        covered += indices.tolist()
        for name in LOCAL:
            assert torch.equal(restored[name]["value"], rows[name]["value"][indices]), name
            for moment in MOMENTS:
                assert torch.equal(restored[name]["state"][moment], rows[name][moment][indices])
            assert int(restored[name]["state"]["step"]) == 10
        saved_w = written["saved"][0]["params"]["loss_fn.guide.locs.w_unconstrained"]
        assert torch.equal(
            restored["loss_fn.guide.locs.w_unconstrained"]["value"], saved_w["value"]
        )
        # And training went on, on this worker's new block.
        assert record["global_step"] > 10 and set(record["seen"]) <= set(block)
        assert torch.isfinite(torch.tensor(record["metrics"]["train_loss"]))
    assert covered == list(range(N))
    assert len({r["global_step"] for r in records}) == 1
    w = [r["params"]["loss_fn.guide.locs.w_unconstrained"]["value"] for r in records]
    assert all(torch.equal(value, w[0]) for value in w), "the global parameters stay in sync"


# Block files are 15 kB, Lightning's file 47 kB: a limit of 2 kB stops worker 1's
# block, one of 30 kB lets worker 0 write its block but not the file.
FAILURES = {
    "a block": (1, 2048, "could not write the local parameters' blocks", "worker 1: OSError"),
    "lightnings file": (0, 30_000, "worker 0 could not write the checkpoint", "OSError"),
}


@pytest.mark.parametrize("what", list(FAILURES))
def test_a_save_that_fails_on_one_worker_fails_on_every_worker_and_keeps_the_last(
    tmp_path: Path, what: str
) -> None:
    worker, limit, message, cause = FAILURES[what]
    directory = tmp_path / "checkpoints"
    options = [*PLAN, "--epochs", "2", "--checkpoint-dir", str(directory)]
    failing = ["--fail-save-at-epoch", "1", "--failing-worker", str(worker)]
    code, output = launch(tmp_path, *options, *failing, "--file-limit", str(limit))
    assert code != 0, output
    out = tmp_path / "out"
    for rank in range(2):  # every worker raised PyroDistributedError, naming the cause
        error = torch.load(out / f"rank{rank}.pt")["error"]
        assert message in error and cause in error and "[Errno 27] File too large" in error
        assert "epoch=1-step=10.ckpt" in error and "intact" in error
    # The directory is byte for byte what the epoch-0 saves left: nothing of the failed save.
    before = torch.load(out / "before_failure.pt")
    assert before == listing(directory)
    assert sorted(before) == sorted(
        f"{name}{suffix}"
        for name in ("epoch=0-step=5.ckpt", "last.ckpt")
        for suffix in ("", *(f".{token_of(directory / name)}.block{r}of2" for r in range(2)))
    )
    # The limit falls where this test means it to (should the files' sizes change).
    sizes = {name: (directory / name).stat().st_size for name in before}
    blocks = [size for name, size in sizes.items() if ".block" in name]
    files = [size for name, size in sizes.items() if ".block" not in name]
    assert (limit < min(blocks)) if worker == 1 else (max(blocks) < limit < min(files)), sizes


def token_of(path: Path) -> str:
    token: str = main_file(path)["pyro_distributed"]["local"]["token"]
    return token


def test_removing_a_checkpoint_removes_its_blocks_and_a_links_none(tmp_path: Path) -> None:
    # What ModelCheckpoint calls for a top-k file it drops, on worker 0.
    strategy = PyroDistributedStrategy()
    files = [
        "epoch=0.ckpt",
        "epoch=0.ckpt.00aa11.block0of2",
        "epoch=0.ckpt.00aa11.block1of2",
        "epoch=0.ckpt.ckpt",
        "epoch=0.ckpt.ckpt.22bb33.block0of2",
        "epoch=1.ckpt",
        "epoch=1.ckpt.44cc55.block0of2",
    ]
    for name in files:
        (tmp_path / name).write_text(name)
    (tmp_path / "last.ckpt").symlink_to("epoch=1.ckpt")
    strategy.remove_checkpoint(tmp_path / "last.ckpt")
    strategy.remove_checkpoint(str(tmp_path / "epoch=0.ckpt"))
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "epoch=0.ckpt.ckpt",
        "epoch=0.ckpt.ckpt.22bb33.block0of2",
        "epoch=1.ckpt",
        "epoch=1.ckpt.44cc55.block0of2",
    ]
