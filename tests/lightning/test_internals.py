"""Every Lightning private name that integrations/lightning/internals.py uses is still there.

A failure names the installed Lightning version: read internals.py when upgrading.
"""

from __future__ import annotations

import inspect

import lightning
from lightning.pytorch import Trainer
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, SequentialSampler

from pyro_distributed.integrations.lightning import internals

VERSION = f"lightning {lightning.__version__}"


def test_the_trainer_still_has_the_sampler_flag() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert trainer._accelerator_connector.use_distributed_sampler is True, VERSION
    internals.disable_sampler_injection(trainer)
    assert trainer._accelerator_connector.use_distributed_sampler is False, VERSION


def test_the_dataloader_helpers_keep_their_signatures() -> None:
    assert list(inspect.signature(_update_dataloader).parameters) == [
        "dataloader",
        "sampler",
        "mode",
    ], VERSION
    wrapper = _IndexBatchSamplerWrapper(BatchSampler(SequentialSampler(range(4)), 2, False))
    assert isinstance(wrapper._batch_sampler, BatchSampler), VERSION


def test_rank_zero_can_be_set() -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    before = rank_zero_only.rank  # type: ignore[attr-defined]
    try:
        internals.set_rank_zero(3)
        assert rank_zero_only.rank == 3, VERSION  # type: ignore[attr-defined]
    finally:
        internals.set_rank_zero(before)


def test_local_paths_are_told_from_urls() -> None:
    assert internals.is_local_path("checkpoints/last.ckpt"), VERSION
    assert internals.is_local_path("file:///tmp/last.ckpt"), VERSION
    assert not internals.is_local_path("s3://bucket/last.ckpt"), VERSION


def test_the_notebook_launcher_keeps_the_hooks_the_kernel_launcher_overrides() -> None:
    launcher = internals.MultiProcessingLauncher
    # The worker's entry point, where forked workers are made single-threaded first.
    assert parameters(launcher._wrapping_function)[:2] == ["self", "process_idx"], VERSION
    assert parameters(launcher._collect_rank_zero_results) == ["self", "trainer", "results"], (
        VERSION
    )
    assert parameters(launcher._recover_results_in_main_process) == [
        "self",
        "worker_output",
        "trainer",
    ], VERSION
    # The field the kernel launcher blanks so that Lightning loads nothing itself.
    assert "weights_path" in _WorkerOutput._fields, VERSION


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]
