"""What of the launching process's interpreter a launched worker starts from.

A forked worker is a copy of the launching process; a worker started by the
forkserver or spawn is a fresh interpreter, and would silently train with
torch's default dtype, a fixed seed and Pyro's default settings where the
kernel had set others. So the launch carries what a Pyro script sets at its
top and a kernel holds: the param store, the default dtype, whether torch
runs deterministic algorithms, Pyro's settings (validation included) and the
torch, Python and NumPy random states (as fork would; ``pd.set_rng_seed``
inside the function draws each worker's own). It travels in the same pickle
as the function, so that a module's parameters and the store keep sharing
their tensors.

Not carried, as no pickle can: a module's attributes changed in the kernel
(a worker imports the module afresh), and environment variables that
libraries read once when they are imported (OpenMP's, MKL's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyro
import torch
from pyro.params.param_store import StateDict
from pyro.util import get_rng_state, set_rng_state


@dataclass
class Carried:
    """The launching process's state, applied in a worker before the function runs."""

    store: StateDict
    default_dtype: torch.dtype
    deterministic: bool
    pyro_settings: dict[str, Any]
    rng: dict[str, Any]

    @classmethod
    def capture(cls) -> Carried:
        return cls(
            store=pyro.get_param_store().get_state(),
            default_dtype=torch.get_default_dtype(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            pyro_settings=pyro.settings.get(),
            rng=get_rng_state(),
        )

    def apply(self) -> None:
        pyro.get_param_store().set_state(self.store)
        torch.set_default_dtype(self.default_dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        pyro.settings.set(**self.pyro_settings)
        set_rng_state(self.rng)
