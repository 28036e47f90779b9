"""Lightning's workers forked from a Jupyter kernel, and what they trained carried back.

Lightning's notebook launcher sends worker 0's ``state_dict`` back to the
kernel and loads it with ``strict=False``. For a Pyro model that loses three
things without a word: the param store, where Pyro plans (scvi-tools',
cell2location's) keep their parameters; the owned local parameters' rows,
which differ from worker to worker; and parameters the workers created (a
guide's, at its first call or in ``setup()``), which the kernel's module does
not have, so ``strict=False`` drops them.

:class:`KernelLauncher` saves, on every worker as fitting ends, the param
store and the module's owned local rows with the library's checkpoints, and
loads them in the kernel at one worker: rows joined in order, values written
into the tensors that exist there. A module parameter the workers trained
and the kernel's module lacks is refused by name, with what to do.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyro
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn

from ...checkpoint import files, param_store
from ...checkpoint.modules import module_locals
from ...engines import Engine
from ...engines.local import LocalEngine
from ...errors import PyroDistributedError
from ...local.blocks import load_blocks
from ...local.registry import LocalParam
from ..scvi import guides
from . import internals

STORE = "store.pt"
MODULE_ROWS = "module_rows.pt"


class KernelLauncher(internals.MultiProcessingLauncher):
    """Lightning's launcher of forked (or spawned) workers, which also carries
    the param store and the owned local rows back to the launching process."""

    def __init__(self, strategy: Any, start_method: str) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        self._carry: str | None = None
        self._datamodule: Any = None

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # fit's datamodule (an scvi-tools DataSplitter), to set up a Pyro plan's
        # guide here afterwards: it was first called in the workers.
        self._datamodule = next((a for a in args if isinstance(a, LightningDataModule)), None)
        self._carry = tempfile.mkdtemp(prefix="pyro-distributed-lightning-")
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            shutil.rmtree(self._carry, ignore_errors=True)
            # Not held past the fit: the user's data (a DataSplitter holds the AnnData).
            self._carry, self._datamodule = None, None

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        # On every worker: a collective, before worker 0 sends its state_dict.
        if trainer.state.fn == TrainerFn.FITTING and self._carry is not None:
            engine = self._strategy.engine  # type: ignore[attr-defined]
            save_trained(Path(self._carry), engine, trainer.lightning_module)
        return super()._collect_rank_zero_results(trainer, results)

    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        module = trainer.lightning_module
        carry = Path(self._carry) if self._carry is not None else None
        lacking: list[str] = []
        if worker_output.weights_path is not None and carry is not None:
            checkpoint_io = self._strategy.checkpoint_io
            lacking = _keep_what_loads(checkpoint_io, worker_output.weights_path, module, carry)
        super()._recover_results_in_main_process(worker_output, trainer)
        if carry is not None and (carry / STORE).exists():
            lacking += load_trained(carry, module)
            guides.set_up_trained_guide(module, self._datamodule)
        lacking = [name for name in lacking if not _in_the_param_store(name)]
        if lacking:
            raise PyroDistributedError(
                f"the workers trained parameters that this process's LightningModule does "
                f"not have: {sorted(set(lacking))}. They were created inside the workers (a "
                f"guide's, at its first call or in setup()), so their trained values cannot "
                f"be put here. Create them in this process before trainer.fit (call the "
                f"model and guide once, or module.setup('fit')), or train from a script "
                f"under torchrun. The param store and the module's other parameters hold "
                f"the trained values"
            )


def save_trained(directory: Path, engine: Engine, module: torch.nn.Module) -> None:
    """On every worker: the param store, and the module's owned local rows (a collective)."""
    param_store.save_store(directory / STORE, engine)
    local = module_locals(module)
    records = {name: held.record for name, held in local.items()}
    values = {name: held.param for name, held in local.items()}

    def state(meta: dict[str, Any] | None) -> dict[str, Any]:
        return {**files.header(engine, 0, "module_rows"), "rng": [], "local": meta}

    files.commit(directory / MODULE_ROWS, engine, state, records, values, {})


def load_trained(directory: Path, module: torch.nn.Module) -> list[str]:
    """In the launching process: the param store and every owned local row,
    joined; the module's local parameters that this process lacks."""
    param_store.load_store_here(directory / STORE)
    meta = files.load_file(directory / MODULE_ROWS)["local"]
    if meta is None:
        return []
    named = dict(module.named_parameters())
    lacking = [name for name in meta["params"] if name not in named]
    wanted = {
        name: LocalParam(name, *spec) for name, spec in meta["params"].items() if name in named
    }
    values, _ = load_blocks(directory / MODULE_ROWS, meta, wanted, LocalEngine())
    with torch.no_grad():
        for name, value in values.items():
            named[name].data = value.to(named[name].device)  # every row, in order
    return lacking


def _keep_what_loads(
    checkpoint_io: Any, weights_path: str, module: torch.nn.Module, carry: Path
) -> list[str]:
    """Worker 0's state_dict without the owned local rows (its block alone, which
    :func:`load_trained` replaces with every row); the names it holds that this
    process's module lacks, which Lightning's ``strict=False`` would drop."""
    saved = checkpoint_io.load_checkpoint(weights_path)
    meta = files.load_file(carry / MODULE_ROWS)["local"]
    local = set(meta["params"]) if meta is not None else set()
    kept = {name: value for name, value in saved.items() if name not in local}
    checkpoint_io.save_checkpoint(kept, weights_path)
    here = set(module.state_dict())
    return [name for name in kept if name not in here]


def _in_the_param_store(name: str) -> bool:
    """Whether module parameter ``name`` mirrors a param-store entry, where a guide
    made in this process takes its value from (a ``PyroModule``'s parameter,
    ``<path>.locs.z_unconstrained``, is the store's ``<root>.locs.z`` unless
    ``module_local_params`` keeps it on the module)."""
    if pyro.settings.get("module_local_params") or not name.endswith("_unconstrained"):
        return False
    stem = name.removesuffix("_unconstrained")
    for stored, _ in pyro.get_param_store().named_parameters():
        rest = stored.split(".", 1)[-1]
        if stem == stored or stem.endswith(f".{rest}"):
            return True
    return False
