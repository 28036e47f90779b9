"""Sharded plate subsampling: ``pyro.plate(..., subsample_size=b)`` split across workers.

Inside :func:`shard_subsamples`, each subsampled plate takes one permutation
of ``range(size)`` from the generator all workers share, and worker r keeps
its slice ``[r*b, (r+1)*b)``: together W*b distinct indices, fresh at every
draw. It is a plain effect handler that fills in the indices only where
nothing else did: a user's ``subsample=`` is left alone, and the model
replays the guide's indices under the same name, as SVI always does. Pyro's
``size / b`` scaling is unchanged, so the workers' average is unbiased.

With ``by_block=True`` (implied by ``own_local_params=True``) worker r draws
from its contiguous block r instead (:mod:`pyro_distributed.local`). Blocks
may differ in length by one, so every site in such a plate is also scaled by
``W * len(block) / size``, which keeps the average unbiased for the whole
plate.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Self

import pyro
import torch
from pyro.poutine.messenger import Messenger

from .. import runtime
from ..checks import check_bool
from ..errors import PyroDistributedError
from ..local import registry, sparse, store
from ..partition import block_range
from ..pyro_internals import Subsample, module_param
from ..seeding import block_generator, shared_generator
from .plates import shard_lengths


class shard_subsamples(Messenger):
    """Give each worker a disjoint share of every plate's subsample.

    Use it around ``svi.step``: every ``pyro.plate(name, size,
    subsample_size=b)`` entered inside gives this worker b indices, disjoint
    from the other workers' b, all drawn from one permutation shared by every
    worker and fresh at each draw.

    :param by_block: draw worker r's indices from the r-th of W contiguous
        blocks of each plate instead, so that a data point always lands on the
        same worker.
    :param own_local_params: ``by_block``, and every local parameter (one
        declared with ``event_dim`` inside such a plate, as AutoGuides with
        ``create_plates`` do) keeps only worker r's block of rows: memory
        O(N/W) per worker and no traffic for its gradient, with bitwise the
        values the replicated path computes. Read them with
        :func:`~pyro_distributed.gather_param` and
        :func:`~pyro_distributed.local_rows`.
    :param local_updates: how ``own_local_params`` steps the local parameters:
        ``"dense"`` (default) every row of the block at every step;
        ``"sparse"`` only the rows selected since the last step, at
        O(batch) cost instead of O(N/W), with the lazy semantics of
        ``torch.optim.SparseAdam`` (:mod:`pyro_distributed.local.sparse`,
        rules in :mod:`pyro_distributed.optim.sparse_step`). Both for the
        param store (SVI with a Pyro optimizer) and for PyroModules'
        parameters in ``module_local_params`` mode (an ELBO module with a
        torch optimizer); it may change from one step to the next.

    Example::

        pd.set_rng_seed(0)          # seeds the shared permutations too
        for step in range(num_steps):
            with pd.shard_subsamples():
                loss = svi.step(data)

    Sparse local steps, the same loop::

        with pd.shard_subsamples(own_local_params=True, local_updates="sparse"):
            loss = svi.step(data)

    and on the torch-native path (``module_local_params``, an ELBO module)::

        with pd.shard_subsamples(own_local_params=True, local_updates="sparse"):
            loss_fn(data).backward()
        optimizer.step()  # pd.DistributedTorchOptimizer(torch.optim.Adam(...))

    :raises TypeError: when ``local_updates`` is not a string.
    :raises ValueError: when ``local_updates`` is neither ``"dense"`` nor
        ``"sparse"``, or is ``"sparse"`` without ``own_local_params=True``;
        when ``world_size * subsample_size`` exceeds a plate's
        size; under ``by_block``, when ``subsample_size`` exceeds a block or a
        ``subsample=`` index lies outside this worker's block; under
        ``own_local_params``, when a local parameter has neither the plate's
        size nor the block's length along the plate, or is also used outside
        its plate.

    It also watches for the commonest mistake with sharded data: a plate
    sized by this worker's shard, ``pyro.plate("data", len(x_mine))`` with
    ``x_mine = pd.shard(x)``, which fits the posterior of the shard alone.
    Such a plate gets a :class:`UserWarning` naming it and the fix
    (:func:`~pyro_distributed.data_plate`).

    .. warning::
        Every worker must enter the same plates in the same order, as the
        shared generator advances once per subsampled plate. Seed it with
        :func:`pyro_distributed.set_rng_seed` (the same seed on every worker).

    .. warning::
        With ``own_local_params``, a plate must have the same size on every
        worker, and the workers' blocks are fixed for the whole run: feed a
        DataLoader with ``pd.ShardSampler(dataset, by_block=True)``. Use a
        local parameter only inside its plate, and the same plate (by name and
        size) every time.

    .. warning::
        Local rows are initialised by their owner and never copied from worker
        0, unlike global parameters at their first step. Any initial value is
        valid for a row only one worker uses; to reproduce the replicated run
        bitwise, initialise them deterministically (AutoNormal's default
        ``init_to_feasible`` is; ``init_to_median`` draws at random).

    .. warning::
        ``local_updates="sparse"`` is lazy: rows outside a step's batch keep
        their values and optimizer state (no moment decay, no momentum, no
        weight decay), and bias correction counts the parameter's steps. It
        steps Adam, AdamW, ClippedAdam and SGD (Pyro's or torch's) and
        refuses other optimizers with a ``ValueError`` at the first step
        (:mod:`pyro_distributed.optim.sparse_step` states each rule). The
        gradient of a sparse local parameter lives in the leaves handed to
        the model, not in the parameter's ``.grad``.
    """

    def __init__(
        self,
        *,
        by_block: bool = False,
        own_local_params: bool = False,
        local_updates: sparse.LocalUpdates = "dense",
    ) -> None:
        super().__init__()
        check_bool("shard_subsamples: by_block", by_block)
        check_bool("shard_subsamples: own_local_params", own_local_params)
        # "dense" (default) or "sparse" (pyro_distributed.local.sparse).
        self.local_updates = sparse.check_local_updates(local_updates, own_local_params)
        self.own_local_params = own_local_params
        self.by_block = by_block or own_local_params
        # plate name -> (size, this step's global indices) for plates drawn by block
        self._blocks: dict[str, tuple[int, torch.Tensor]] = {}

    def __enter__(self) -> Self:
        # Re-entered at every step by the Lightning strategy: no draw of an
        # earlier use may scale this one's sites.
        self._blocks.clear()
        super().__enter__()
        return self

    def _pyro_sample(self, msg: Any) -> None:
        fn = msg["fn"]
        if not isinstance(fn, Subsample):
            self._scale_for_blocks(msg)
            return
        if self.by_block:
            self._subsample_by_block(msg, fn)
            return
        if msg["value"] is not None:
            return  # subsample= given: nothing to draw, nothing to ask the engine
        workers, rank = runtime.world_size(), runtime.rank()
        size, per_worker = fn.size, fn.subsample_size
        if workers > 1:
            _warn_if_sized_by_a_shard(msg["name"], size)
        if per_worker is None or per_worker >= size:
            return  # no subsampling: every worker sees the whole plate
        if workers * per_worker > size:
            raise ValueError(
                f"plate {msg['name']!r}: {workers} workers x subsample_size {per_worker} "
                f"exceeds its size {size}; lower subsample_size to at most {size // workers}"
            )
        # cpu: drawn from the shared CPU generator (the same on every device), then moved.
        permutation = torch.randperm(size, generator=shared_generator(), device="cpu")
        mine = permutation[rank * per_worker : (rank + 1) * per_worker]
        msg["value"] = mine.to(fn.device)

    def _subsample_by_block(self, msg: Any, fn: Subsample) -> None:
        name, size = msg["name"], fn.size
        block = block_range(size)
        if msg["value"] is None:
            per_worker = fn.subsample_size
            if per_worker is None or per_worker >= size:
                return  # not subsampled: every worker sees the whole plate, as always
            if per_worker > len(block):
                raise ValueError(
                    f"plate {name!r}: subsample_size {per_worker} exceeds worker "
                    f"{runtime.rank()}'s block of {len(block)} of its {size} rows"
                )
            if self.local_updates == "sparse":  # O(batch), not O(N/W)
                draw = sparse.draw_rows(len(block), per_worker, block_generator())
            else:
                # cpu: the CPU block generator's draw, moved to the plate's device below.
                draw = torch.randperm(len(block), generator=block_generator(), device="cpu")[
                    :per_worker
                ]
            msg["value"] = (draw + block.start).to(fn.device)
        indices = torch.as_tensor(msg["value"])  # device: the value's own, if it has one
        outside = indices[(indices < block.start) | (indices >= block.stop)]
        if outside.numel():
            raise ValueError(
                f"plate {name!r}: subsample index {int(outside[0])} lies outside worker "
                f"{runtime.rank()}'s block [{block.start}, {block.stop}) of its {size} rows; "
                f"under by_block or own_local_params each worker keeps to its block "
                f"(pd.ShardSampler(dataset, by_block=True) yields such indices)"
            )
        self._blocks[name] = (size, indices)

    def _scale_for_blocks(self, msg: Any) -> None:
        """Scale a site in a block-drawn plate by W * len(block) / size (see above)."""
        for frame in msg["cond_indep_stack"]:
            drawn = self._blocks.get(frame.name)
            if drawn is not None and frame.full_size == drawn[0]:
                size = drawn[0]
                correction = runtime.world_size() * len(block_range(size)) / size
                if correction != 1.0:
                    msg["scale"] = msg["scale"] * correction

    def _pyro_param(self, msg: Any) -> None:
        if not self.by_block:
            return
        name = msg["args"][0]
        event_dim = msg["kwargs"].get("event_dim")
        frame = next(
            (
                f
                for f in msg["cond_indep_stack"]
                if f.name in self._blocks and f.full_size == self._blocks[f.name][0]
            ),
            None,
        )
        # A PyroModule's parameter in module_local_params mode lives on the
        # module, so a record of an older module's parameter of the same name
        # (an earlier model in this process) is not this one's; a one-argument
        # message naming nothing in the param store that is not such a use is
        # the module declaring a new parameter.
        held = module_param(msg)
        if held is not None:
            known = registry.local_param(name, held[0])
        elif len(msg["args"]) == 1 and name not in pyro.get_param_store():
            known = None
        else:
            known = registry.local_param(name)
        if frame is None or event_dim is None or frame.dim is None:
            # A plain read inside the plate, pyro.param(name) (a PyroModule's,
            # after it set a PyroParam there), gets the stored rows: the block.
            reading = frame is not None and len(msg["args"]) == 1
            if known is not None and self.own_local_params and not reading:
                raise ValueError(
                    f"local parameter {name!r} of plate {known.plate!r} is used outside "
                    f"that plate; a parameter is either local to one plate or global"
                )
            return
        size, indices = self._blocks[frame.name]
        param = registry.LocalParam(name, frame.name, size, frame.dim - event_dim)
        init = msg["args"][1] if len(msg["args"]) > 1 else None
        constraint = msg["kwargs"].get("constraint")
        tensor, in_graph = None, False
        if held is not None:
            tensor, constraint, in_graph = held
        cut = False
        if self.own_local_params:
            cut = store.localize(param, init, constraint, tensor)
            registry.register(param, tensor, constraint)
        else:
            store.create(param, init, constraint, tensor)
        if self.local_updates == "sparse":
            # The selected rows in a small leaf of their own, detached from the
            # block: a backward pass through the call that cut it is fine.
            msg["value"] = sparse.select_rows(param, indices, tensor, constraint)
            msg["kwargs"] = {**msg["kwargs"], "event_dim": None}
            return
        value = store.select_rows(param, indices, self.own_local_params, tensor, constraint)
        if cut and in_graph and value.requires_grad:
            value.register_hook(_cut_in_this_call(name))  # type: ignore[no-untyped-call]
        msg["value"] = value
        # The plate must not subsample the value again: that is done.
        msg["kwargs"] = {**msg["kwargs"], "event_dim": None}


def _cut_in_this_call(name: str) -> Callable[[torch.Tensor], None]:
    """A hook refusing a backward pass through the call that cut a module's
    parameter to its block: autograd's record of the parameter still has all
    its rows then, and torch would fail with a shape error."""

    def refuse(_: torch.Tensor) -> None:
        raise PyroDistributedError(
            f"this call cut local parameter {name!r} to this worker's block of rows, so "
            f"its loss cannot be backpropagated; make one warm-up call (loss_fn(*batch), "
            f"without backward) under shard_subsamples(own_local_params=True) before "
            f"training, as for an AutoGuide's lazily created parameters"
        )

    return refuse


def _warn_if_sized_by_a_shard(name: str, size: int) -> None:
    whole = shard_lengths().get(size)
    if whole is None:
        return
    warnings.warn(
        f"plate {name!r} has size {size}, the length of this worker's shard from "
        f"pd.shard of a data set of {whole} rows: it fits the posterior of this shard "
        f"alone (widths about sqrt(W) too wide). Write the plate as "
        f"pd.data_plate({name!r}, x_mine), or pyro.plate({name!r}, {whole}, "
        f"subsample=...) with the shard's global indices",
        UserWarning,
        stacklevel=2,
    )
