"""Lightning integration: :class:`PyroDistributedStrategy`.

``lightning.pytorch.Trainer(strategy=PyroDistributedStrategy())``, or
``strategy="pyro_distributed"`` once this package is imported, trains a
LightningModule data-parallel with this library's optimizers instead of
torch's ``DistributedDataParallel``. Lightning is imported by this package
and nowhere else: ``import pyro_distributed`` never imports it. Install it
with ``pip install lightning`` (or the ``lightning`` extra, in a clone).
"""

from __future__ import annotations

try:
    import lightning.pytorch  # noqa: F401 (fails here, with the hint below, if missing)
except ImportError as exc:  # pragma: no cover - the tests run with Lightning installed
    raise ImportError(
        "pyro_distributed.integrations.lightning needs Lightning: pip install lightning"
    ) from exc

from ...optim.options import OptimizerOptions
from .data import IndexedDataset
from .strategy import PyroDistributedStrategy

__all__ = ["IndexedDataset", "OptimizerOptions", "PyroDistributedStrategy"]
