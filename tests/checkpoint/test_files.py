"""Where a checkpoint's files land (pyro_distributed.checkpoint.files): through a
link, with every worker's blocks beside the file it leads to, and a refusal
on every worker for a link to anything but a file."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pyro
import torch

import pyro_distributed as pd

from ..support.blocks import owned_svi, train_owned
from ..support.harness import run_workers


def save_through_links(root: str) -> dict[str, Any]:
    directory = Path(root)
    svi, optim, x = owned_svi()
    train_owned(svi, x, 2)
    pd.save_checkpoint(directory / "run.pt", optim)  # a link into store/
    saved = {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}
    train_owned(svi, x, 1)
    start = pd.load_checkpoint(directory / "run.pt", optim)
    loaded = {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}
    try:
        pd.save_checkpoint(directory / "null.pt", optim)  # a link to /dev/null
        refusal = ""
    except pd.PyroDistributedError as error:
        refusal = str(error)
    same = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    return {"start": start, "same": same, "refusal": refusal}


def test_a_link_is_written_through_with_its_blocks_at_two_workers(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (tmp_path / "run.pt").symlink_to(store / "run.pt")  # dangling until the first save
    (tmp_path / "null.pt").symlink_to("/dev/null")
    workers = run_workers(save_through_links, str(tmp_path), world_size=2)
    for worker in workers:
        assert worker["start"] == 2 and worker["same"], worker
        assert "null.pt" in worker["refusal"] and "a character device" in worker["refusal"]
    assert (tmp_path / "run.pt").is_symlink() and (tmp_path / "null.pt").is_symlink()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    # The file and both workers' blocks beside it; nothing beside the links.
    assert sorted(p.name.split(".")[-1] for p in store.iterdir()) == [
        "block0of2",
        "block1of2",
        "pt",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null.pt", "run.pt", "store"]
