"""The strategy in a real Jupyter kernel: forked workers, and what they trained back in it.

examples/svi_lightning.py --local, cell by cell in a kernel driven by nbclient:
Lightning's notebook launcher alone would leave the kernel's guide without the
parameters the workers created, and with none of the rows they owned.
"""

from __future__ import annotations

from pathlib import Path

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


def test_parameters_the_workers_created_are_named_not_dropped() -> None:
    notebook = execute(
        notebook_of(SET_UP, "trainer.fit(module, DataLoader(dataset, batch_size=50))")
    )
    failed = output_of(notebook.cells[1])
    assert "PyroDistributedError" in failed, failed[-3000:]
    assert "parameters that this process's LightningModule does not have" in failed
    assert "loss_fn.guide.locs.w_unconstrained" in failed, failed[-3000:]
    assert "module.setup('fit')" in failed
