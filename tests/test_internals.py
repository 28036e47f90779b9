"""Every reach into Pyro's and torch's private names (pyro_internals, torch_internals).

Each test exercises one reach for what the library relies on. When an
upgrade moves an internal, the failure names the installed versions, so the
reader knows at once which release broke it.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.optim import PyroOptim
from torch.distributions import constraints

from pyro_distributed import pyro_internals, torch_internals

VERSIONS = f"pyro {pyro.__version__}, torch {torch.__version__}"


@contextmanager
def reaching(what: str) -> Iterator[None]:
    """Fail with the versions named if the internal behind ``what`` has moved."""
    try:
        yield
    except (AttributeError, KeyError, TypeError, AssertionError) as exc:
        pytest.fail(f"{what} no longer works with {VERSIONS}: {type(exc).__name__}: {exc}")


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    pyro.clear_param_store()


def test_stored_unconstrained_is_the_tensor_the_store_steps() -> None:
    with reaching("ParamStore._params"):
        pyro.param("scale", torch.ones(3), constraint=constraints.positive)
        stored = pyro_internals.stored_unconstrained("scale")
        assert stored is pyro.get_param_store().named_parameters().__iter__().__next__()[1]
        assert torch.equal(stored, torch.zeros(3))  # log(1): the unconstrained value
        assert pyro_internals.stored_unconstrained("missing") is None


def test_replace_unconstrained_keeps_every_bit_and_the_name_map() -> None:
    with reaching("ParamStore._params and _param_to_name"):
        pyro.param("scale", torch.ones(3), constraint=constraints.positive)
        old = pyro_internals.stored_unconstrained("scale")
        value = torch.tensor([0.1, -2.0, 3.0])
        stored = pyro_internals.replace_unconstrained("scale", value)
        store = pyro.get_param_store()
        assert torch.equal(stored, value) and stored.requires_grad
        assert pyro_internals.stored_unconstrained("scale") is stored
        assert store.param_name(stored) == "scale"
        assert old is not None and store.param_name(old) is None


def test_param_constraint_is_the_one_it_was_created_with() -> None:
    with reaching("ParamStore._constraints"):
        pyro.param("p", torch.tensor(0.5), constraint=constraints.unit_interval)
        assert pyro_internals.param_constraint("p") is constraints.unit_interval


def test_attach_unconstrained_makes_svi_step_the_unconstrained_tensor() -> None:
    with reaching("the unconstrained / _pyro_unconstrained_param attributes"):
        pyro.param("loc", torch.zeros(4))
        unconstrained = pyro_internals.stored_unconstrained("loc")
        assert unconstrained is not None
        rows = unconstrained.index_select(0, torch.tensor([1, 2]))

        def guide() -> None:
            value = rows.clone()
            pyro_internals.attach_unconstrained(value, unconstrained)
            pyro.sample("x", dist.Normal(value, 1.0).to_event(1))

        trace = pyro.poutine.trace(guide).get_trace()
        # What SVI reads to find the tensors to step.
        value = trace.nodes["x"]["fn"].base_dist.loc
        assert value.unconstrained() is unconstrained
        assert value._pyro_unconstrained_param is unconstrained


def test_single_optimizer_and_waiting_state_are_pyro_optims_own() -> None:
    with reaching("PyroOptim._get_optim and _state_waiting_to_be_consumed"):
        param = pyro.param("w", torch.zeros(2)).unconstrained()
        optim = PyroOptim(torch.optim.Adam, {"lr": 0.5})
        param.grad = torch.ones(2)
        optim([param])
        saved = optim.get_state()
        fresh = PyroOptim(torch.optim.Adam, {"lr": 0.5})
        fresh.set_state(saved)
        waiting = pyro_internals.pop_waiting_state(fresh, "w")
        assert waiting is not None and waiting["state"][0]["step"] == 1
        assert pyro_internals.pop_waiting_state(fresh, "w") is None
        single = pyro_internals.single_optimizer(fresh, param)
        assert isinstance(single, torch.optim.Adam)
        assert single.param_groups[0]["params"] == [param]
        assert single.param_groups[0]["lr"] == 0.5


def test_a_stand_in_optimizer_takes_the_arguments_pyro_gives_its_name() -> None:
    with reaching("PyroOptim._get_optim and ParamStoreDict._param_to_name"):
        pyro.param("w", torch.zeros(2))
        optim = PyroOptim(torch.optim.Adam, lambda name: {"lr": 0.5 if name == "w" else 0.1})
        tensor = torch.zeros(2)
        made = pyro_internals.stand_in_optimizer(optim, "w", tensor)
        assert made.param_groups[0]["params"] == [tensor]
        assert made.param_groups[0]["lr"] == 0.5
        assert pyro.get_param_store().param_name(tensor) is None  # lent for the call only


def test_subsample_is_the_distribution_of_a_plates_subsample_site() -> None:
    with reaching("pyro.poutine.subsample_messenger._Subsample"):

        def model() -> None:
            with pyro.plate("data", 10, subsample_size=3):
                pass

        trace = pyro.poutine.trace(model).get_trace()
        assert isinstance(trace.nodes["data"]["fn"], pyro_internals.Subsample)


def test_grad_version_counts_in_place_changes() -> None:
    with reaching("Tensor._version"):
        grad = torch.zeros(3)
        before = torch_internals.grad_version(grad)
        grad.add_(1.0)
        assert torch_internals.grad_version(grad) == before + 1
        grad.clone()
        assert torch_internals.grad_version(grad) == before + 1


def test_prefix_store_prefixes_keys() -> None:
    with reaching("torch.distributed PrefixStore"):
        base = torch.distributed.HashStore()
        prefixed = torch_internals.PrefixStore("attempt1", base)
        prefixed.set("key", "value")
        assert base.get("attempt1/key") == b"value"


def test_grad_clip_and_state_loading_are_pyro_optims_own() -> None:
    with reaching("PyroOptim._get_grad_clip and pyro.optim.optim._load_state_dict"):
        param = pyro.param("w", torch.zeros(2)).unconstrained()
        optim = PyroOptim(torch.optim.SGD, {"lr": 0.5}, {"clip_norm": 1.0})
        clip = pyro_internals.grad_clip_of(optim, param)
        param.grad = torch.tensor([3.0, 4.0])
        clip(param)
        assert torch.allclose(param.grad.norm(), torch.tensor(1.0))
        adam = torch.optim.Adam([param], lr=0.1)
        adam.step()
        fresh = torch.optim.Adam([param], lr=0.1)
        pyro_internals.load_optimizer_state(fresh, adam.state_dict())
        assert torch.equal(fresh.state[param]["exp_avg"], adam.state[param]["exp_avg"])


def test_module_param_finds_a_pyro_modules_parameter_in_local_mode() -> None:
    with reaching("the param message of a PyroModule in module_local_params mode"):
        from pyro.nn import PyroModule, PyroParam

        class Scaled(PyroModule):
            def __init__(self) -> None:
                super().__init__()
                self.scale = PyroParam(torch.ones(3), constraint=constraints.positive)

            def forward(self) -> torch.Tensor:
                return self.scale

        seen: list[object] = []

        class Probe(pyro.poutine.messenger.Messenger):
            def _pyro_param(self, msg: dict[str, object]) -> None:
                seen.append(pyro_internals.module_param(msg))  # type: ignore[arg-type]

        pyro.settings.set(module_local_params=True)
        try:
            module = Scaled()
            with Probe():
                module()
        finally:
            pyro.settings.set(module_local_params=False)
        (found,) = seen
        assert found is not None
        tensor, constraint, in_graph = found  # type: ignore[misc]
        assert tensor is module.scale_unconstrained
        assert constraint is constraints.positive and in_graph


def test_init_optimizer_hooks_make_an_optimizer_without_init_take_step_hooks() -> None:
    with reaching("Optimizer's hook registries and _patch_step_function"):

        class Sharing(torch.optim.SGD):
            def __init__(self, other: torch.optim.Optimizer) -> None:  # no super().__init__
                self.param_groups, self.state, self.defaults = (
                    other.param_groups,
                    other.state,
                    other.defaults,
                )
                torch_internals.init_optimizer_hooks(self)

        param = torch.nn.Parameter(torch.ones(1))
        sharing = Sharing(torch.optim.SGD([param], lr=1.0))
        calls: list[str] = []
        sharing.register_step_pre_hook(lambda *_: calls.append("pre"))
        sharing.register_step_post_hook(lambda *_: calls.append("post"))
        param.grad = torch.ones(1)
        sharing.step()
        assert calls == ["pre", "post"] and torch.equal(param.detach(), torch.zeros(1))


def test_flatten_dense_copies_every_value_in_order_and_refuses_none_and_sparse() -> None:
    with reaching("torch._utils._flatten_dense_tensors"):
        a, b = torch.arange(4.0).reshape(2, 2).t(), torch.tensor([4.0, 5.0])  # a: not contiguous
        flat = torch_internals.flatten_dense([a, b])
        assert flat.tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 5.0]
        flat[0] = 9.0
        assert a[0, 0] == 0.0, "a copy, not a view"
    with pytest.raises(TypeError):
        torch_internals.flatten_dense([None, b])  # type: ignore[list-item]
    with pytest.raises(RuntimeError):
        torch_internals.flatten_dense([b.to_sparse(), b])


def test_unflatten_dense_gives_views_shaped_like_each_tensor_and_ignores_the_rest() -> None:
    with reaching("torch._utils._unflatten_dense_tensors"):
        like = [torch.zeros(2, 3), torch.zeros(()), torch.zeros(2)]
        flat = torch.arange(12.0)  # 9 values for the tensors, then 3 more
        views = torch_internals.unflatten_dense(flat, like)
        assert [v.shape for v in views] == [(2, 3), (), (2,)]
        assert [v.tolist() for v in views] == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 6.0, [7.0, 8.0]]
        flat[7] = -1.0
        assert views[2][0] == -1.0, "a view, not a copy"


def _two_site_model(x: torch.Tensor) -> None:
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(x @ w + b, 1.0), obs=torch.zeros(len(x)))


def test_reduce_autoguide_keeps_the_model_in_the_copy_and_in_the_original() -> None:
    """Pyro's own AutoGuide pickling sets the live guide's model to None."""
    import io

    import cloudpickle
    from pyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoGuideList, AutoNormal

    pyro.clear_param_store()
    x = torch.randn(5, 3)
    called = AutoNormal(_two_site_model)
    called(x)
    parts = AutoGuideList(_two_site_model)
    parts.append(AutoDiagonalNormal(pyro.poutine.block(_two_site_model, hide=["b"])))
    parts.append(AutoDelta(pyro.poutine.block(_two_site_model, expose=["b"])))
    parts(x)
    fresh = AutoNormal(_two_site_model)

    class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: object) -> object:
            reduced = pyro_internals.reduce_autoguide(obj)
            return reduced if reduced is not None else super().reducer_override(obj)

    buffer = io.BytesIO()
    Pickler(buffer).dump((called, parts, fresh))
    assert called._model is not None and parts[0].master() is parts  # left as they were
    copies = pickle.loads(buffer.getvalue())
    for copy in copies:
        assert set(copy(x)) == {"w", "b"}  # each still has its model
    assert copies[1][0].master() is copies[1]
    assert torch.equal(copies[0].locs.w, called.locs.w)
    with pytest.raises(TypeError):  # what Pyro's own pickling does to a guide
        pickle.loads(pickle.dumps(fresh))(x)
