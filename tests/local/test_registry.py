"""The record of local parameters: what changes its generation, and what does not."""

from __future__ import annotations

import pyro
import torch

from pyro_distributed.local import registry


def test_generation_changes_when_a_tensor_becomes_or_stops_being_local() -> None:
    pyro.clear_param_store()
    pyro.param("z", torch.zeros(4, 3))
    param = registry.LocalParam("z", "cells", size=4, axis=-2)
    before = registry.generation()
    registry.register(param)
    registered = registry.generation()
    assert registered != before
    assert registry.local_of(pyro.get_param_store().get_param("z").unconstrained()) == param
    # The model reads it again at every step: nothing changes, so a step may keep its plan.
    registry.register(param)
    assert registry.generation() == registered
    # Re-created under the same name: a new tensor, recorded afresh.
    pyro.clear_param_store()
    pyro.param("z", torch.zeros(4, 3))
    registry.register(param)
    assert registry.generation() != registered
    renewed = registry.generation()
    registry.unregister(["z"])
    assert registry.generation() != renewed
    assert registry.local_param("z") is None
    pyro.clear_param_store()


def test_a_module_parameter_read_again_keeps_one_record() -> None:
    module_tensor = torch.nn.Parameter(torch.zeros(4, 3))
    param = registry.LocalParam("m.z", "cells", size=4, axis=-2)
    registry.register(param, module_tensor, None)
    registered = registry.generation()
    for _ in range(3):
        registry.register(param, module_tensor, None)
    assert registry.generation() == registered
    assert registry.local_of(module_tensor) == param
    registry.unregister(["m.z"])
    assert registry.local_of(module_tensor) is None
