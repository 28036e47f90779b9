"""Lightning's workers forked from a Jupyter kernel, and what they trained carried back.

Lightning's notebook launcher sends worker 0's ``state_dict`` back to the
kernel and loads it with ``strict=False``. For a Pyro model that loses three
things without a word: the param store, where Pyro plans (scvi-tools',
cell2location's) keep their parameters; the owned local parameters' rows,
which differ from worker to worker; and parameters the workers created (a
guide's, in ``setup()`` or at its first call), which the kernel's module does
not have, so ``strict=False`` drops them.

:class:`KernelLauncher` saves, on every worker as fitting ends, the param
store and the module (worker 0's global values, every worker's owned local
rows) with the library's checkpoints, into one folder, and loads them in the
kernel at one worker (:func:`load_trained`): rows joined in order, values
written into the tensors that exist there. Parameters the workers built in
the module's ``setup()`` are built in the kernel the same way first: its
``setup("fit")`` runs there, so the kernel's guide is set up by the user's
own code (its plates, its prototype), not only given tensors of the right
names, which a guide would build afresh, over them, at its next call.

Nothing in the kernel needs the workers' process group, which is gone by
then. If loading fails all the same (a ``setup()`` that needs the workers),
the folder is kept and the error names it: :func:`load_trained` loads it
once the cause is fixed.

Forked workers run torch on one thread each, as torch's own DataLoader
workers do: GNU OpenMP's thread pool does not survive ``fork()``, and a
child of a kernel that has run one multi-threaded op hangs at its next one
unless it uses one thread (:func:`one_thread`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import suppress
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
MODULE = "module.pt"


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
            if self._carry is not None:  # None when a failed load keeps it for the user
                shutil.rmtree(self._carry, ignore_errors=True)
            # Not held past the fit: the user's data (a DataSplitter holds the AnnData).
            self._carry, self._datamodule = None, None

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        # In the worker, before its first torch op (and before Lightning's
        # launcher picks a thread count, which it leaves alone once set).
        if self._start_method == "fork":
            one_thread()
        super()._wrapping_function(*args, **kwargs)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        # On every worker: a collective, before worker 0 sends its state_dict.
        if trainer.state.fn == TrainerFn.FITTING and self._carry is not None:
            engine = self._strategy.engine  # type: ignore[attr-defined]
            save_trained(Path(self._carry), engine, trainer.lightning_module)
        return super()._collect_rank_zero_results(trainer, results)

    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        carry = Path(self._carry) if self._carry is not None else None
        if carry is None or not (carry / MODULE).exists():  # not a fit: Lightning's own
            super()._recover_results_in_main_process(worker_output, trainer)
            return
        # The module comes from the carried folder, which also has what
        # Lightning's file lacks; Lightning's copy is removed unread.
        if worker_output.weights_path is not None:
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            with suppress(OSError):  # the folder Lightning made for it, now empty
                os.rmdir(os.path.dirname(worker_output.weights_path))
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
        module = trainer.lightning_module
        try:
            load_trained(carry, module, set_up=lambda: _run_setup(module, trainer))
            guides.set_up_trained_guide(module, self._datamodule)
        except Exception as error:
            self._carry = None  # kept: the only copy of what the workers trained
            raise PyroDistributedError(
                f"the workers finished training, but loading what they trained into this "
                f"process failed: {type(error).__name__}: {error}. It is all kept in "
                f"{str(carry)!r} (the param store with every owned row, {STORE}, and the "
                f"module, {MODULE}); once the cause is fixed, load it with "
                f"PyroDistributedStrategy.load_trained({str(carry)!r}, module), then delete "
                f"the folder"
            ) from error


def one_thread() -> None:
    """In a forked worker, before its first torch op: one thread for torch's
    intra-op work (and for OpenMP in anything the worker starts)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def save_trained(directory: Path, engine: Engine, module: torch.nn.Module) -> None:
    """On every worker: the param store, and the module, its owned local rows
    from every worker and the rest from worker 0 (a collective)."""
    param_store.save_store(directory / STORE, engine)
    local = module_locals(module)
    records = {name: held.record for name, held in local.items()}
    values = {name: held.param for name, held in local.items()}
    # On every worker, as Lightning takes it: a state_dict may be a collective (metrics).
    state_dict = module.state_dict()
    rest = {name: value.detach().cpu() for name, value in state_dict.items() if name not in local}

    def state(meta: dict[str, Any] | None) -> dict[str, Any]:
        header = files.header(engine, 0, "lightning_module")
        return {**header, "rng": [], "local": meta, "module": rest}

    files.commit(directory / MODULE, engine, state, records, values, {})


def load_trained(
    directory: str | os.PathLike[str], module: torch.nn.Module | None, *, set_up: Any = None
) -> None:
    """In this process alone: the param store with every owned row, joined; then,
    with ``module``, worker 0's values of its parameters and buffers and every
    owned local row, joined, written into the tensors that exist here.

    ``set_up()``, if given, runs when ``module`` lacks a parameter the workers
    trained (the launcher runs the module's ``setup("fit")``), before anything
    is written into the module.

    :raises PyroDistributedError: naming the module's parameters that the
        workers trained and this process's module lacks.
    """
    folder = Path(directory)
    param_store.load_store_here(folder / STORE)
    if module is None:
        return
    saved = files.load_file(folder / MODULE)
    meta = saved["local"]
    local = dict(meta["params"]) if meta is not None else {}
    trained = [*saved["module"], *local]
    lacking = _lacking(module, trained)
    if lacking and set_up is not None:
        set_up()
        lacking = _lacking(module, trained)
    if lacking:
        if set_up is not None:
            what = (
                ", even after its setup('fit') ran here: the workers created them later "
                "(in configure_optimizers or a training step), which this process does not "
                "run. Create them in the module's setup() (which runs in every worker, and "
                "here to bring the values back) or by calling the model and guide once "
                "before trainer.fit"
            )
        else:
            what = "; create them first (module.setup('fit'), or call the model and guide once)"
        raise PyroDistributedError(
            f"the workers trained parameters that this process's LightningModule does not "
            f"have: {lacking}{what}"
        )
    present = set(module.state_dict())
    module.load_state_dict(
        {name: value for name, value in saved["module"].items() if name in present}, strict=False
    )
    named = dict(module.named_parameters())
    # A local parameter that mirrors the param store took its rows from there.
    wanted = {name: LocalParam(name, *spec) for name, spec in local.items() if name in named}
    if not wanted:
        return
    values, _ = load_blocks(folder / MODULE, meta, wanted, LocalEngine())
    with torch.no_grad():
        for name, value in values.items():
            named[name].data = value.to(named[name].device)  # every row, in order


def _lacking(module: torch.nn.Module, trained: list[str]) -> list[str]:
    """The names in ``trained`` that ``module`` has no tensor for, less those that
    mirror a param-store entry (a guide made here takes its value from there)."""
    here = set(module.state_dict())
    return sorted(name for name in trained if name not in here and not _in_the_param_store(name))


def _run_setup(module: Any, trainer: Any) -> None:
    """The module's ``setup("fit")`` in the launching process, attached to the
    trainer as Lightning attaches it in a worker before calling it there."""
    module.trainer = trainer
    module.setup("fit")


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
