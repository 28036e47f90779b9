"""A loss over a whole data set, split across workers, each point evaluated once.

:func:`evaluate_loss` gives worker r the r-th contiguous block of the rows
(nothing padded or dropped), evaluates it batch by batch and adds the
workers' parts in one collective. Adding batch losses is right only if each
batch's plate is scaled the right way, so a probe watches the plates the
model and guide enter: under a plate sized by the whole data set (what
:func:`~pyro_distributed.data_plate` gives here, or ``subsample=``) each
batch's loss estimates the whole, and batch losses are averaged, weighted by
length; under a plate sized by the batch, each is its own share, and they
are added, which is exact only when every latent variable is inside that
plate, so one outside it is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pyro.poutine.messenger import Messenger

from .. import runtime
from ..checks import check_int
from ..data.shards import Data, block_batches, data_columns
from ..pyro_internals import Subsample


class _PlateProbe(Messenger):
    """Records how the plates over a batch of ``batch`` rows (of ``size``) are sized."""

    def __init__(self, batch: int, size: int) -> None:
        super().__init__()
        self.batch, self.size = batch, size
        self.whole_sized: set[str] = set()
        self.batch_sized: set[str] = set()
        self.foreign: dict[str, int] = {}  # plate name -> a size that is neither
        self.outside: set[str] = set()  # latent sites outside every batch plate

    def _pyro_post_sample(self, msg: Any) -> None:
        if isinstance(msg["fn"], Subsample):
            return
        over_batch = [f for f in msg["cond_indep_stack"] if f.size == self.batch]
        for frame in over_batch:
            if frame.full_size == self.batch:
                self.batch_sized.add(frame.name)
            elif frame.full_size == self.size:
                self.whole_sized.add(frame.name)
            elif frame.full_size is not None:
                self.foreign[frame.name] = frame.full_size
        if not over_batch and not msg["is_observed"]:
            self.outside.add(msg["name"])

    def weight(self) -> float:
        """What this batch's loss counts for in the whole data set's loss."""
        if self.foreign:
            name, size = next(iter(self.foreign.items()))
            raise ValueError(
                f"evaluate_loss: plate {name!r} has size {size}, but the data passed to "
                f"evaluate_loss has {self.size} rows; size the plate by the data it is "
                f"given (pd.data_plate does)"
            )
        if self.batch == self.size or not self.whole_sized:
            if self.outside and self.batch != self.size:
                raise ValueError(
                    f"evaluate_loss: the latent variable(s) {sorted(self.outside)} lie outside "
                    f"the plate over the data, which is sized by the batch, so they would be "
                    f"counted once per batch. Write that plate as pd.data_plate(name, x), "
                    f"or as pyro.plate(name, size, subsample=indices)"
                )
            return 1.0
        return self.batch / self.size


def evaluate_loss(
    loss: Any,
    model: Callable[..., Any],
    guide: Callable[..., Any],
    data: Data,
    *,
    batch_size: int | None = None,
    **kwargs: Any,
) -> float:
    """The loss of ``model`` and ``guide`` on all of ``data``, with its rows split across workers.

    Every row is evaluated exactly once, on one worker, also when the number
    of rows does not divide by the number of workers; the parts are added in
    one collective and every worker returns the same value, the loss that one
    process would compute on the whole data set (up to Monte Carlo noise,
    which each worker draws independently).

    :param loss: an ELBO, such as ``pyro.infer.Trace_ELBO(num_particles=10)``
        (anything with ``loss(model, guide, *args, **kwargs)``).
    :param data: a tensor, a tuple of tensors of equal length, or a
        ``TensorDataset``; the model and guide are called with one batch of
        each tensor as positional arguments, ``model(*batch, **kwargs)``.
    :param batch_size: rows per call on each worker (default: the worker's
        whole share at once).
    :param kwargs: passed to the model and guide with every batch.
    :returns: the loss on the whole data set (for an ELBO, minus the ELBO).

    Write the model's data plate as ``pd.data_plate(name, x)``: inside
    ``evaluate_loss`` it spans the whole data set and the batch's rows, so
    global latent variables count once. ``pyro.plate(name, len(x))`` works
    too when every latent variable is local to the data plate (as in a VAE).

    Example::

        test_loss = pd.evaluate_loss(
            Trace_ELBO(num_particles=10), model, guide, (x_test, y_test), batch_size=256
        )
        if pd.is_main():
            print("held-out ELBO per point:", -test_loss / len(x_test))

    .. warning::
        A collective: call it on every worker with the same data (every
        worker loads the whole data set and evaluates its own block of it).
    """
    if not callable(getattr(loss, "loss", None)):
        raise TypeError(
            f"evaluate_loss: loss must be an ELBO such as pyro.infer.Trace_ELBO(), "
            f"got {type(loss).__name__}"
        )
    check_int("evaluate_loss: batch_size", batch_size, minimum=1, optional=True)
    columns = data_columns(data, "evaluate_loss")
    size = len(columns[0])
    total, refusal = 0.0, None
    for batch, rows in block_batches(columns, batch_size):
        probe = _PlateProbe(len(rows), size)
        with torch.no_grad(), probe:
            value = float(loss.loss(model, guide, *batch, **kwargs))
        try:
            total += probe.weight() * value
        except ValueError as error:
            refusal = error
            break
    # The refusal travels with the sum, so that workers whose block raised no
    # doubt (an empty one, say) fail with the others instead of waiting.
    # cpu: a Python float and a flag, read back at once; every engine carries CPU tensors.
    buffer = torch.tensor([total, float(refusal is not None)], dtype=torch.float64, device="cpu")
    engine = runtime.current_engine()
    engine.allreduce_([buffer], op="sum")
    if refusal is not None:
        raise refusal
    if buffer[1] > 0:
        raise ValueError(
            f"evaluate_loss: another worker refused the model's plates (worker "
            f"{engine.rank} saw nothing wrong in its block); see that worker's error"
        )
    return float(buffer[0].item())
