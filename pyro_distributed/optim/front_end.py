"""What every front end shares: the face users read, and the step's end.

A front end (:class:`~pyro_distributed.DistributedOptimizer`,
:class:`~pyro_distributed.DistributedTorchOptimizer`, Horovod's contract)
holds one :class:`~.reducer.Reducer` and reads everything it shows from it:
the engine, the exchange, the step count, the noise scale. :class:`FrontEnd`
is that face, with the two things every front end does alike: the drift
check every ``check_every`` steps, which compares the front end's own
parameters and optimizer state, and :meth:`FrontEnd.forget`, the one way a
run's step state ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor

from ..engines import Engine
from ..exchange import GradientSync
from .consistency import compare_across_workers
from .noise_scale import NoiseScale
from .reducer import Reduced, Reducer


class FrontEnd(ABC):
    """What every front end reads from its :class:`~.reducer.Reducer`
    (``_reducer``): the face :func:`~pyro_distributed.assert_in_sync` and
    users read.

    It holds no state and defines no ``__init__``, so a front end that is a
    ``torch.optim.Optimizer`` still never runs ``Optimizer.__init__``.
    """

    _reducer: Reducer

    @property
    def engine(self) -> Engine:
        """The engine this optimizer averages on, chosen at its first step
        (:class:`~pyro_distributed.optim.options.EngineBinding`)."""
        return self._reducer.engine

    @property
    def sync(self) -> GradientSync | None:
        """The gradient exchange; ``None`` with one worker, which has nothing to
        exchange. Its read-only properties (``overlaps``, ``overlap_armed``,
        ``bucket_count``) show how gradients travel."""
        return self._reducer.sync

    @property
    def num_steps(self) -> int:
        """How many times the optimizer stepped (saved in checkpoints)."""
        return self._reducer.num_steps

    @num_steps.setter
    def num_steps(self, count: int) -> None:
        self._reducer.num_steps = count

    @property
    def nonfinite(self) -> str:
        """What every worker does when a gradient is not finite: ``"skip"`` or ``"raise"``."""
        return self._reducer.options.nonfinite

    @property
    def check_every(self) -> int | None:
        """Run :func:`~pyro_distributed.assert_in_sync` after every ``check_every``-th step."""
        return self._reducer.options.check_every

    @property
    def in_sync(self) -> bool:
        """Whether the last step ended at a sync point, every worker's shared
        parameters identical: always under the default step policy; under
        :class:`~pyro_distributed.LocalSGD` and :class:`~pyro_distributed.DiLoCo`
        after an average. Evaluate and save checkpoints where it is true."""
        return self._reducer.in_sync

    def noise_scale(self, batch_size: int | None = None) -> NoiseScale:
        """The gradient noise scale so far (needs ``noise_scale=True``); no communication.

        ``batch_size`` (data points per worker per step) adds B_simple in data
        points. ``print(optim.noise_scale(32))`` shows the figures and a reading.
        """
        return self._reducer.noise_scale(batch_size)

    def checked_buffers(self) -> dict[str, Tensor]:
        """The buffers of the modules this optimizer trains, by names shared by
        every worker (:mod:`.module_buffers`), all dtypes."""
        return self._reducer.buffers()

    def forget(self) -> None:
        """Treat every parameter as new, after the tensors it steps were replaced
        by other means than :func:`~pyro_distributed.load_checkpoint` (which
        does this itself, then hands the hook its saved state).

        Ends what the optimizer learned of its tensors: the exchange's plans,
        the overlap's hooks, the modules whose buffers are averaged, and the
        communication hook's state (it starts afresh). At the next step every
        parameter takes worker 0's value once more.

        Example::

            pyro.get_param_store().set_state(saved_elsewhere)  # new tensors
            optim.forget()  # on every worker

        .. warning::
            Call it on every worker at the same step.
        """
        self._reducer.forget()

    def extension_state(self) -> dict[str, Any]:
        """This worker's state of the step's extensions (the communication
        hook's :meth:`~pyro_distributed.exchange.CommHook.state_dict`, the step
        policy's), as plain data: what a checkpoint saves for every worker.

        Under a step policy that lets workers step alone
        (:class:`~pyro_distributed.LocalSGD`, :class:`~pyro_distributed.DiLoCo`)
        it holds this worker's own optimizer state too, and, between two sync
        points, its own shared parameters and module buffers: the rest of a
        checkpoint is worker 0's.
        """
        state = self._reducer.extension_state()
        if self._reducer.steps_alone:
            state["optimizer"] = self._own_optimizer_state()
        return state

    def load_extension_state(self, state: dict[str, Any]) -> None:
        """Continue the step's extensions from ``state`` (an
        :meth:`extension_state`; ``{}`` starts them afresh).

        :raises ValueError: for state the communication hook or the step policy
            does not keep.
        """
        self._reducer.load_extension_state(state)
        own = state.get("optimizer")
        if own is not None:
            self._load_own_optimizer_state(own)

    def try_extension_state(self, state: dict[str, Any]) -> None:
        """Load ``state`` into a copy of the step's extensions, changing nothing
        here: what :meth:`load_extension_state` would raise, it raises."""
        self._reducer.try_extension_state(state)

    def keeps_extension_state(self) -> bool:
        """Whether the step's extensions may keep state across steps."""
        return self._reducer.keeps_extension_state()

    def _finish(self, reduced: Reduced) -> None:
        """End a step: :meth:`.reducer.Reducer.done`, then the drift check when due."""
        self._reducer.done(reduced)
        if self._reducer.check_due():
            self.check_in_sync()

    @abstractmethod
    def _own_optimizer_state(self) -> Any:
        """This worker's wrapped optimizer's state, as a checkpoint holds it."""

    @abstractmethod
    def _load_own_optimizer_state(self, state: Any) -> None:
        """Replace the wrapped optimizer's state by ``state`` (:meth:`_own_optimizer_state`)."""

    def check_in_sync(self) -> None:
        """:func:`~pyro_distributed.assert_in_sync` on the named parameters, the
        optimizer's state and the trained modules' buffers (a collective)."""
        # Under a policy that lets workers step alone, the wrapped optimizer's
        # state is each worker's own: the parameters and buffers are compared.
        state = {} if self._reducer.steps_alone else self.get_state()
        compare_across_workers(self.engine, self.checked_tensors(), self.checked_buffers(), state)

    @abstractmethod
    def checked_tensors(self) -> dict[str, Tensor]:
        """The parameters that must be identical on every worker, by shared name."""

    @abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Per-parameter optimizer state, by the names of :meth:`checked_tensors`."""
