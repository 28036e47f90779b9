"""The strategy in a real Jupyter kernel: forked workers, and what they trained back in it.

examples/svi_lightning.py --local, cell by cell in a kernel driven by nbclient:
Lightning's notebook launcher alone would leave the kernel's guide without the
parameters the workers created, and with none of the rows they owned.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from ..support.notebooks import execute, notebook_of, output_of

SIZE = 400

SET_UP = f"""
import sys
import lightning.pytorch as pl
import pyro, torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.utils.data import DataLoader
from pyro_distributed.integrations.lightning import IndexedDataset, PyroDistributedStrategy
sys.path.insert(0, "examples")
import svi_lightning as example

torch.set_num_threads(1)
pyro.set_rng_seed(0)
pyro.settings.set(module_local_params=True)
dataset = IndexedDataset(example.make_data({SIZE}, True))
model = example.Regression({SIZE}, True)
guide = AutoNormal(
    model, create_plates=lambda idx, *_: pyro.plate("data", {SIZE}, subsample=idx)
)
module = example.PyroLightningModule(Trace_ELBO()(model, guide), dataset, lr=0.05, local=True)
trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy=PyroDistributedStrategy(own_local_params=True),
    max_epochs=5, enable_progress_bar=False, enable_model_summary=False, logger=False,
    enable_checkpointing=False,
)
"""


RECORD = """
class Record(pl.Callback):  # what each worker holds as training ends
    def on_train_end(self, trainer, module):
        torch.save(
            {"w": guide.locs.w.detach().clone(), "z": guide.locs.z.detach().clone()},
            f"{OUT}.rank{trainer.global_rank}",
        )
trainer.callbacks.append(Record())
"""


def test_the_local_example_in_a_kernel_brings_every_owned_row_back(tmp_path: Path) -> None:
    out = tmp_path / "held"
    notebook = execute(
        notebook_of(
            SET_UP,
            f"OUT = {str(out)!r}\n" + RECORD,
            "module.setup('fit')  # the guide's parameters, here, before fit\n"
            "trainer.fit(module, DataLoader(dataset, batch_size=50, shuffle=True))\n"
            "torch.save({'w': guide.locs.w.detach(), 'z': guide.locs.z.detach()}, OUT)\n"
            "print('trained on', trainer.world_size, 'workers')",
        )
    )
    shown = "".join(output_of(cell) for cell in notebook.cells)
    assert "trained on 2 workers" in shown, shown[-4000:]
    kernel = torch.load(out)
    workers = [torch.load(f"{out}.rank{rank}") for rank in range(2)]
    assert [len(worker["z"]) for worker in workers] == [SIZE // 2, SIZE // 2]
    # Every worker's block of rows, joined in order, and worker 0's global value.
    assert torch.equal(kernel["z"], torch.cat([worker["z"] for worker in workers]))
    assert torch.equal(kernel["w"], workers[0]["w"])


RECORD_ALL = """
class Record(pl.Callback):  # each worker's module, guide rows and param store as training ends
    def on_train_end(self, trainer, module):
        torch.save(
            {
                "module": {k: v.clone() for k, v in module.state_dict().items()},
                "store": {k: v.detach().clone() for k, v in pyro.get_param_store().items()},
                "z": guide.locs.z.detach().clone(),
            },
            f"{OUT}.rank{trainer.global_rank}",
        )
trainer.callbacks.append(Record())
"""

HELD = """
held = {
    "module": {k: v.clone() for k, v in module.state_dict().items()},
    "store": {k: v.detach().clone() for k, v in pyro.get_param_store().items()},
    "z": guide.locs.z.detach().clone(),
}
"""


def _assert_the_kernel_holds_what_the_workers_trained(out: Path) -> None:
    kernel = torch.load(out)
    workers = [torch.load(f"{out}.rank{rank}") for rank in range(2)]
    assert [len(worker["z"]) for worker in workers] == [SIZE // 2, SIZE // 2]
    assert torch.equal(kernel["z"], torch.cat([worker["z"] for worker in workers]))
    assert kernel["module"].keys() == workers[0]["module"].keys()
    owned = {name for name in kernel["module"] if name.endswith(".z_unconstrained")}
    assert len(owned) == 2  # the loc and the scale of every row's z
    for name, value in kernel["module"].items():
        parts = [worker["module"][name] for worker in workers]
        assert torch.equal(value, torch.cat(parts) if name in owned else parts[0]), name
    assert kernel["store"].keys() == workers[0]["store"].keys()
    for name, value in kernel["store"].items():
        assert torch.equal(value, workers[0]["store"][name]), name


def test_the_example_building_its_guide_in_setup_comes_back_whole(tmp_path: Path) -> None:
    # The example as it is: the guide's parameters are built in setup(), in the
    # workers (each its own rows), never in the kernel before fit.
    out = tmp_path / "held"
    notebook = execute(
        notebook_of(
            SET_UP,
            f"OUT = {str(out)!r}\n" + RECORD_ALL,
            "trainer.fit(module, DataLoader(dataset, batch_size=50, shuffle=True))\n"
            "w_after_fit = guide.locs.w.detach().clone()\n"
            "module.loss_fn(*dataset[torch.arange(8)])  # the guide is set up: nothing is redrawn\n"
            "assert torch.equal(guide.locs.w.detach(), w_after_fit)\n"
            + HELD
            + "torch.save(held, OUT)\nprint('trained on', trainer.world_size, 'workers')",
        )
    )
    shown = "".join(output_of(cell) for cell in notebook.cells)
    assert "trained on 2 workers" in shown, shown[-4000:]
    _assert_the_kernel_holds_what_the_workers_trained(out)


def test_parameters_created_after_setup_are_named_not_dropped() -> None:
    notebook = execute(
        notebook_of(
            SET_UP,
            "class Late(example.PyroLightningModule):  # builds the guide after setup()\n"
            "    def setup(self, stage):\n"
            "        pass\n"
            "    def configure_optimizers(self):\n"
            "        super().setup('fit')\n"
            "        return super().configure_optimizers()\n"
            "module = Late(module.loss_fn, dataset, lr=0.05, local=True)\n"
            "trainer.fit(module, DataLoader(dataset, batch_size=50))",
        )
    )
    failed = output_of(notebook.cells[1])
    assert "PyroDistributedError" in failed, failed[-3000:]
    assert "parameters that this process's LightningModule does not have" in failed
    assert "loss_fn.guide.locs.w_unconstrained" in failed, failed[-3000:]
    assert "even after its setup('fit') ran here" in failed
    _remove_kept_folder(failed)


def test_a_failed_load_keeps_what_the_workers_trained_and_names_where(tmp_path: Path) -> None:
    # A setup() that needs the workers' process group works in the workers and
    # fails in the kernel, after training: the trained values must survive it.
    out = tmp_path / "held"
    notebook = execute(
        notebook_of(
            SET_UP,
            f"OUT = {str(out)!r}\n" + RECORD_ALL,
            "class NeedsTheGroup(example.PyroLightningModule):\n"
            "    def setup(self, stage):\n"
            "        torch.distributed.get_world_size()\n"
            "        super().setup(stage)\n"
            "module = NeedsTheGroup(module.loss_fn, dataset, lr=0.05, local=True)\n"
            "trainer.fit(module, DataLoader(dataset, batch_size=50, shuffle=True))",
            # What the error tells the user to do, once the cause is fixed.
            "import os, re, sys\n"
            "failure = str(sys.last_value)\n"
            "folder = re.search(r\"kept in '([^']+)'\", failure).group(1)\n"
            "print('kept:', sorted(os.listdir(folder)))\n"
            "example.PyroLightningModule.setup(module, 'fit')\n"
            "PyroDistributedStrategy.load_trained(folder, module)\n"
            + HELD
            + "torch.save(held, OUT)\nprint('loaded by hand')",
        )
    )
    failed = output_of(notebook.cells[2])
    try:
        assert "PyroDistributedError" in failed, failed[-3000:]
        assert "Default process group has not been initialized" in failed, failed[-3000:]
        recovered = output_of(notebook.cells[3])
        assert "loaded by hand" in recovered, recovered[-3000:]
        kept = re.search(r"kept: (\[.*\])", recovered)
        assert kept is not None and "'store.pt'" in kept.group(1) and "'module.pt'" in kept.group(1)
        _assert_the_kernel_holds_what_the_workers_trained(out)
    finally:
        _remove_kept_folder(failed)


def _remove_kept_folder(failure: str) -> None:
    kept = re.search(r"kept in '([^']+)'", failure)
    assert kept is not None, failure[-3000:]
    assert Path(kept.group(1)).is_dir()
    shutil.rmtree(kept.group(1))


THREADS = """
import os
os.environ.pop("OMP_NUM_THREADS", None)  # the machine's default threads (conftest sets 1)
import torch
torch.ones(2**22).mul_(2)  # the kernel's OpenMP pool now has its threads
print("kernel threads:", torch.get_num_threads())
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no pool")
def test_forked_workers_of_a_kernel_that_computed_do_not_hang() -> None:
    # One worker: Lightning gives each of W forked workers cpu_count // W threads,
    # so one worker would take them all on any machine with two cores or more.
    notebook = execute(
        notebook_of(
            THREADS,
            SET_UP.replace("torch.set_num_threads(1)\n", "")
            .replace("devices=2", "devices=1")
            .replace("own_local_params=True", "start_method='fork'"),
            "class Compute(pl.Callback):\n"
            "    def on_train_start(self, trainer, module):\n"
            "        torch.ones(2**22).mul_(2)  # a multi-threaded op in the forked worker\n"
            "        print('worker threads:', torch.get_num_threads(), flush=True)\n"
            "trainer.callbacks.append(Compute())\n"
            "module.setup('fit')\n"
            "trainer.fit(module, DataLoader(dataset, batch_size=50))\n"
            "print('fitted')",
        ),
        timeout=120,
    )
    shown = "".join(output_of(cell) for cell in notebook.cells)
    assert re.search(r"kernel threads: ([2-9]|\d\d)", shown), shown[-3000:]
    assert "worker threads: 1" in shown, shown[-3000:]
    assert "fitted" in shown, shown[-3000:]
