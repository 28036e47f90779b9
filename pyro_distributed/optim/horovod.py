"""HorovodOptimizer: the contract of ``pyro.optim.HorovodOptimizer``, fixed.

Scripts written for Pyro's class run unchanged after swapping the import. The
keyword arguments are those of ``horovod.torch.DistributedOptimizer`` and keep
their meaning; they are checked here, up front, and turned into a
:class:`~pyro_distributed.exchange.Reduction`. The per-step work is
:class:`~pyro_distributed.DistributedOptimizer`'s, on the horovod engine, so
this module only translates arguments.

Where Pyro's class wraps one ``hvd.DistributedOptimizer`` per parameter, with
gradient hooks that fire during backward, this one treats averages that
leave during backward as provisional (:mod:`pyro_distributed.exchange.overlap`): a
gradient that changes afterwards is sent again, and the wrapped optimizer
steps only on the final averages. That is why multi-particle ELBOs work, why
clipping sees the averaged gradient, and why schedulers are kept. It also
steps through one multi-tensor optimizer where that is exact, as
``DistributedOptimizer`` does by default.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from pyro.optim import PyroOptim
from torch import Tensor

from .. import runtime
from ..checks import check_bool, check_int, check_number
from ..engines.horovod import HorovodEngine
from ..exchange import Reduction
from .distributed import DistributedOptimizer
from .options import ReducerOptions

_HOROVOD_KWARGS = (
    "compression",
    "backward_passes_per_step",
    "op",
    "gradient_predivide_factor",
    "num_groups",
    "groups",
    "sparse_as_dense",
    "process_set",
)

#: Horovod's tensor-fusion threshold defaults to 64 MiB; so do our buffers here.
_FUSION_MB = 64.0


class HorovodOptimizer(DistributedOptimizer):
    """Distributed wrapper for a :class:`~pyro.optim.PyroOptim`, on Horovod.

    A drop-in replacement for ``pyro.optim.HorovodOptimizer``: change the
    import to ``from pyro_distributed import HorovodOptimizer`` and launch with
    ``horovodrun``. ``hvd.init()`` is called for you if you have not called it.

    :param pyro_optim: the Pyro optimizer to distribute.
    :param horovod_kwargs: those of ``horovod.torch.DistributedOptimizer``,
        with the same meaning:

        - ``compression``: ``hvd.Compression.none`` (default) or
          ``hvd.Compression.fp16``. With fp16 the division by the world size
          happens before summation, so the half-precision sum cannot overflow.
        - ``op``: ``hvd.Average`` (default) or ``hvd.Sum``.
        - ``gradient_predivide_factor``: with ``hvd.Average``, divide by this
          before summing and by ``size / factor`` after.
        - ``backward_passes_per_step``: how many backward passes to expect
          per call (at least 1). Every backward pass made before the call is
          included in the average, whatever the number, so multi-particle
          ELBOs need no setting here.
        - ``groups`` (or its older name ``num_groups``): a number of groups to
          fuse the sorted parameters into, or lists of parameters to fuse
          together. Grouping changes how gradients travel, not the result.
        - ``sparse_as_dense``: accepted; sparse gradients are always sent
          dense, which gives the same average.
        - ``process_set``: an ``hvd.ProcessSet`` to average within.

    :raises TypeError: for an unknown keyword or a value of the wrong type.
    :raises ValueError: for an invalid combination, as Horovod does.

    Example::

        import pyro
        from pyro_distributed import HorovodOptimizer

        optim = HorovodOptimizer(pyro.optim.Adam({"lr": 0.01}))
        svi = pyro.infer.SVI(model, guide, optim, loss=pyro.infer.Trace_ELBO())

    Run with ``horovodrun --gloo -np 2 -H localhost:2 python train.py``.

    .. warning::
        Every rule of :class:`~pyro_distributed.DistributedOptimizer` applies:
        the same number of calls on every worker, the same parameters, and
        worker 0's values for parameters on their first step.
    """

    def __init__(self, pyro_optim: PyroOptim, **horovod_kwargs: Any) -> None:
        unknown = sorted(set(horovod_kwargs) - set(_HOROVOD_KWARGS))
        if unknown:
            raise TypeError(
                f"HorovodOptimizer got unexpected keyword argument(s) "
                f"{', '.join(map(repr, unknown))}; it takes those of "
                f"horovod.torch.DistributedOptimizer: {', '.join(_HOROVOD_KWARGS)}"
            )
        engine = runtime.init("horovod")
        assert isinstance(engine, HorovodEngine)  # init("horovod") returns nothing else
        reduction, process_set = _parse(engine, horovod_kwargs)
        if process_set is not None:
            engine = engine.within(process_set)
        options = ReducerOptions.of(bucket_cap_mb=_FUSION_MB, reduction=reduction)
        self._configure(pyro_optim, engine, options)

    def __repr__(self) -> str:
        return f"HorovodOptimizer({self.wrapped!r}, engine={self.engine!r})"


def _parse(engine: HorovodEngine, kwargs: Mapping[str, Any]) -> tuple[Reduction, Any]:
    """Check Horovod's keyword arguments as Horovod does; return what they mean."""
    op = kwargs.get("op")
    op_name = engine.op_name(op) if "op" in kwargs else "mean"
    if op_name == "adasum":
        size = engine.world_size
        if size & (size - 1):
            raise ValueError(f"op=hvd.Adasum needs a power-of-2 number of workers, got {size}")
        raise ValueError(
            "op=hvd.Adasum is not supported: Horovod applies Adasum to each worker's "
            "optimizer update, which needs one torch optimizer over all parameters; "
            "use hvd.Average or hvd.Sum"
        )
    if op_name not in ("mean", "sum"):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")

    predivide = kwargs.get("gradient_predivide_factor", 1.0)
    check_number("gradient_predivide_factor", predivide, positive=True)
    if predivide != 1.0 and op_name != "mean":
        raise ValueError("gradient_predivide_factor not supported with op != Average")

    passes = kwargs.get("backward_passes_per_step", 1)
    check_int("backward_passes_per_step", passes, minimum=1)

    groups = kwargs.get("groups")
    num_groups = kwargs.get("num_groups", 0)
    if num_groups != 0:
        warnings.warn(
            "num_groups is Horovod's older name for groups; pass groups instead",
            DeprecationWarning,
            stacklevel=3,
        )
        if groups is None:
            groups = num_groups
    if groups is not None and not _valid_groups(groups):
        raise ValueError(
            f"groups should be a non-negative integer or a list of lists of torch.Tensor, "
            f"got {groups!r}"
        )

    sparse_as_dense = kwargs.get("sparse_as_dense", False)
    check_bool("sparse_as_dense", sparse_as_dense)

    compression = kwargs.get("compression")
    lossless = "compression" not in kwargs or engine.is_no_compression(compression)
    if not lossless and not (
        hasattr(compression, "compress") and hasattr(compression, "decompress")
    ):
        raise TypeError(
            f"compression must be hvd.Compression.none, hvd.Compression.fp16 or another "
            f"object with compress() and decompress(), got {compression!r}"
        )
    reduction = Reduction(
        op="mean" if op_name == "mean" else "sum",
        predivide=float(predivide),
        compression=None if lossless else compression,
        groups=groups or None,
    )
    return reduction, kwargs.get("process_set")


def _valid_groups(groups: Any) -> bool:
    if isinstance(groups, bool):
        return False
    if isinstance(groups, int):
        return groups >= 0
    return isinstance(groups, list) and all(
        isinstance(group, list) and all(isinstance(t, Tensor) for t in group) for group in groups
    )
