"""The strategy's collectives, on this library's engine instead of torch's process group.

Lightning calls ``reduce``, ``broadcast``, ``all_gather`` and ``barrier`` on
its strategy (``self.log(..., sync_dist=True)``, ``EarlyStopping``'s
decision, ``trainer.predict``); :class:`PyroDistributedStrategy` overrides
each with a thin call to a function here, so that they run on the engine the
optimizers average on, ``horovod`` and ``mpi`` included, where there is no
torch process group. Every function takes the engine (``broadcast`` and
``barrier`` also ``None``: Lightning may call them before there is one) and
runs the same collective on every worker:

* Lightning evaluates under ``torch.inference_mode()``; the collectives leave
  it, so that the tensors they make are ordinary ones, which an engine may
  write into in place.
* The engines reduce with ``sum``, ``mean`` and ``max``; ``min`` is the
  negated ``max`` of the negated values, and the ``mean`` of an integer
  tensor is taken in ``float64``, not truncated.
* :func:`broadcast_module` gives every worker worker 0's parameters and
  buffers when the Trainer sets the module up, local parameters excepted.
* Python objects (``broadcast``) and tensors to stack (``all_gather``) travel
  as pickled objects, through ``allgather_object``.
* :func:`gather_predictions` puts ``trainer.predict``'s results on worker 0 in
  the data's order, which is the order of the workers' blocks
  (:class:`~pyro_distributed.integrations.lightning.data.EvaluationSampler`).
* :func:`leave_together` has every worker meet once more at exit before the
  process group is torn down.
"""

from __future__ import annotations

import sys
from contextlib import suppress
from typing import Any

import torch
from torch import Tensor

from ...engines import Engine
from ...errors import PyroDistributedError
from ...local.gradients import split_local

# Lightning's names for a reduction (also torch's ReduceOp, lower-cased), to the engine's.
_REDUCE_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def reduce(engine: Engine, tensor: Tensor, group: Any | None, reduce_op: Any | None) -> Tensor:
    """``tensor`` reduced across workers: ``"mean"`` (also ``None`` and
    ``"avg"``), ``"sum"``, ``"max"`` or ``"min"``, or torch's ``ReduceOp``."""
    if group is not None:
        raise ValueError("PyroDistributedStrategy.reduce works on all workers; pass group=None")
    op = _reduce_op(reduce_op)
    with torch.inference_mode(False):  # Lightning evaluates in inference mode
        return _reduced(engine, tensor, op)


def _reduced(engine: Engine, tensor: Tensor, op: str) -> Tensor:
    result = tensor.detach().clone()
    if op == "mean" and not result.is_floating_point():
        result = result.double()
    if op == "min":
        result.neg_()
        engine.allreduce_([result], op="max")
        return result.neg_()
    engine.allreduce_([result], op=op)  # type: ignore[arg-type]
    return result


def _reduce_op(reduce_op: Any) -> str:
    name = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
    name = name.removeprefix("reduceop.")
    if name not in _REDUCE_OPS:
        raise ValueError(
            f"PyroDistributedStrategy.reduce: reduce_op {reduce_op!r} is not one of "
            f"{', '.join(sorted(_REDUCE_OPS))}"
        )
    return _REDUCE_OPS[name]


def broadcast_module(engine: Engine, module: torch.nn.Module) -> None:
    """Worker 0's parameters and buffers on every worker (those that exist
    yet; a lazily built guide's are broadcast at their first step). Local
    parameters keep each worker's own rows."""
    named = module.state_dict(keep_vars=True)
    replicated, _ = split_local({n: t for n, t in named.items() if isinstance(t, Tensor)})
    tensors = [tensor.detach() for tensor in replicated.values()]
    if tensors and engine.world_size > 1:
        with torch.no_grad():
            engine.broadcast_(tensors, src=0)


def broadcast(engine: Engine | None, obj: Any, src: int) -> Any:
    """Worker ``src``'s ``obj`` (picklable) on every worker; ``obj`` itself
    before the engine exists (one process) or with one worker."""
    if engine is None or engine.world_size == 1:
        return obj
    with torch.inference_mode(False):
        return engine.allgather_object(obj)[src]


def all_gather(engine: Engine, tensor: Tensor, group: Any | None, sync_grads: bool) -> Tensor:
    """Every worker's ``tensor``, stacked along a new first dimension, on
    ``tensor``'s device."""
    if group is not None or sync_grads:
        raise ValueError(
            "PyroDistributedStrategy.all_gather gathers values from all workers; "
            "group= and sync_grads=True are not supported"
        )
    with torch.inference_mode(False):
        pieces = engine.allgather_object(tensor.detach().cpu())
        return torch.stack(pieces).to(tensor.device)


def barrier(engine: Engine | None) -> None:
    """Wait for every worker; nothing before the engine exists (one process)."""
    if engine is not None:
        engine.barrier()


def gather_predictions(engine: Engine, loop: Any) -> None:
    """Put every worker's predictions, in the data's order, on worker 0.

    ``loop`` is the Trainer's ``predict_loop``; its ``predictions`` are the
    very list that ``trainer.predict`` returns, changed in place. Each worker
    predicted its own contiguous block, so the blocks in rank order are the
    data in its order. Other workers keep an empty list.
    """
    if engine.world_size == 1:
        return
    predictions = loop.predictions
    with torch.inference_mode(False):  # trainer.predict runs in inference mode
        pieces = engine.allgather_object(predictions)
    if engine.rank != 0:
        predictions.clear()
    elif loop.num_dataloaders == 1:
        predictions[:] = [p for piece in pieces for p in piece]
    else:
        predictions[:] = [
            [p for piece in pieces for p in piece[loader]] for loader in range(len(predictions))
        ]


def leave_together(engine: Engine) -> None:
    """At exit, meet once more and tear Lightning's process group down.

    Lightning leaves its group to the interpreter's exit. A gloo group torn
    down while a peer's is still open can abort the slower process
    ("terminate called without an active exception"), so every worker waits
    for the others (bounded by the engine's time-out) before destroying it.
    """
    if not torch.distributed.is_initialized():
        return
    if not hasattr(sys, "last_value"):  # after an uncaught exception, leave at once
        with suppress(PyroDistributedError):
            engine.barrier()
    torch.distributed.destroy_process_group()
