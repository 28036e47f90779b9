"""Every public callable refuses a bad argument by name.

One table: for each public function and class (``pyro_distributed.__all__``,
``pd.scaling``'s and the integrations' ``__all__``), a wrong type, an
out-of-range value where a range exists, and an unknown keyword; each must
raise the exception class listed (``TypeError`` for a wrong type or an
unknown keyword, ``ValueError`` for a value out of range) with a message that
names the argument. ``pd.launch`` has tests of its own (``tests/spawn/``).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed import scaling

Case = tuple[str, Callable[[], Any], type[Exception], str]


def _pyro_optim() -> Any:
    return pyro.optim.Adam({"lr": 0.01})


def _torch_optim() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def _model() -> None:
    pyro.sample("x", dist.Normal(0.0, 1.0))


def _noise() -> pd.NoiseScale:
    return pd.NoiseScale(1.0, 1.0, 1.0, world_size=2, steps=10)


def _cost() -> scaling.CollectiveCost:
    return scaling.CollectiveCost(1e-4, 1e9, world_size=2)


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))


#: The names that take no arguments to check, each with why.
NOTHING_TO_CHECK = {
    "PyroDistributedError": "an exception: its arguments are its message",
    "scaling": "a namespace: its callables are in the table",
    "launch": "reworked elsewhere, with its own table of arguments (tests/spawn/)",
    "OptimizerOptions": "a TypedDict: checked where it is passed (optimizer_options=)",
    "CommHook": "an abstract base class: a subclass's constructor is the user's",
    "Reducing": "an abstract base class: a subclass's constructor is the user's",
    "Engine": "an abstract base class: engines are made by init() (in the table)",
    "GradBucket": "made by the library for a hook, on every step, from checked parts",
    "NoiseScale": "a result the optimizer returns (noise_scale()), not an input",
    "ScalingProjection": "a result project_scaling returns, not an input",
    "Launched": "a result pd.launch returns, not an input",
    "StepPolicy": "a base class: a subclass's constructor is the user's",
    "policies": "a namespace of what a policy of one's own calls with what the library hands it",
}

CASES: list[Case] = [
    # --- the runtime ---
    ("init wrong type", lambda: pd.init(engine=1), TypeError, "engine"),
    ("init unknown engine", lambda: pd.init(engine="bogus"), ValueError, "engine"),
    ("init timeout type", lambda: pd.init(timeout="x"), TypeError, "timeout"),
    ("init timeout range", lambda: pd.init(timeout=-1), ValueError, "timeout"),
    ("init unknown keyword", lambda: pd.init(bogus=1), TypeError, "bogus"),
    ("current_engine unknown keyword", lambda: pd.current_engine(bogus=1), TypeError, "bogus"),
    ("shutdown unknown keyword", lambda: pd.shutdown(bogus=1), TypeError, "bogus"),
    ("rank unknown keyword", lambda: pd.rank(bogus=1), TypeError, "bogus"),
    ("local_rank unknown keyword", lambda: pd.local_rank(bogus=1), TypeError, "bogus"),
    ("world_size unknown keyword", lambda: pd.world_size(bogus=1), TypeError, "bogus"),
    ("is_main unknown keyword", lambda: pd.is_main(bogus=1), TypeError, "bogus"),
    ("barrier unknown keyword", lambda: pd.barrier(bogus=1), TypeError, "bogus"),
    ("all_mean wrong type", lambda: pd.all_mean("x"), TypeError, "value"),
    ("all_mean integer tensor", lambda: pd.all_mean(torch.ones(2, dtype=torch.int64)),
     TypeError, "value"),
    ("all_mean unknown keyword", lambda: pd.all_mean(1.0, bogus=1), TypeError, "bogus"),
    ("any_worker wrong type", lambda: pd.any_worker("x"), TypeError, "flag"),
    ("any_worker two flags", lambda: pd.any_worker(torch.ones(2)), ValueError, "flag"),
    ("any_worker unknown keyword", lambda: pd.any_worker(True, bogus=1), TypeError, "bogus"),
    ("all_workers wrong type", lambda: pd.all_workers(1), TypeError, "flag"),
    ("all_workers two flags", lambda: pd.all_workers(torch.ones(2)), ValueError, "flag"),
    ("all_workers unknown keyword", lambda: pd.all_workers(True, bogus=1), TypeError, "bogus"),
    ("set_rng_seed wrong type", lambda: pd.set_rng_seed("abc"), TypeError, "seed"),
    ("set_rng_seed range", lambda: pd.set_rng_seed(-1), ValueError, "seed"),
    ("set_rng_seed unknown keyword", lambda: pd.set_rng_seed(0, bogus=1), TypeError, "bogus"),
    ("block_range wrong type", lambda: pd.block_range("x"), TypeError, "n"),
    ("block_range range", lambda: pd.block_range(-1), ValueError, "n"),
    ("block_range unknown keyword", lambda: pd.block_range(1, bogus=1), TypeError, "bogus"),
    # --- data ---
    ("shard wrong type", lambda: pd.shard([1, 2]), TypeError, "data"),
    ("shard uneven", lambda: pd.shard(torch.ones(4), uneven="bogus"), ValueError, "uneven"),
    ("shard unknown keyword", lambda: pd.shard(torch.ones(4), bogus=1), TypeError, "bogus"),
    ("shard_indices wrong type", lambda: pd.shard_indices("x"), TypeError, "n"),
    ("shard_indices range", lambda: pd.shard_indices(-1), ValueError, "n"),
    ("shard_indices shuffle", lambda: pd.shard_indices(4, shuffle="yes"), TypeError, "shuffle"),
    ("shard_indices uneven", lambda: pd.shard_indices(4, uneven="bogus"), ValueError, "uneven"),
    ("shard_indices unknown keyword", lambda: pd.shard_indices(4, bogus=1), TypeError, "bogus"),
    ("ShardSampler wrong type", lambda: pd.ShardSampler(123), TypeError, "dataset"),
    ("ShardSampler seed", lambda: pd.ShardSampler(range(4), seed="x"), TypeError, "seed"),
    ("ShardSampler shuffle", lambda: pd.ShardSampler(range(4), shuffle="no"), TypeError,
     "shuffle"),
    ("ShardSampler uneven", lambda: pd.ShardSampler(range(4), uneven="bogus"), ValueError,
     "uneven"),
    ("ShardSampler unknown keyword", lambda: pd.ShardSampler(range(4), bogus=1), TypeError,
     "bogus"),
    ("even_batches wrong type", lambda: list(pd.even_batches(123)), TypeError, "batches"),
    ("even_batches unknown keyword", lambda: pd.even_batches([], bogus=1), TypeError, "bogus"),
    ("data_plate name", lambda: pd.data_plate(1, torch.ones(4)), TypeError, "name"),
    ("data_plate data", lambda: pd.data_plate("rows", [1, 2]), TypeError, "data"),
    ("data_plate dim", lambda: pd.data_plate("rows", torch.ones(4), dim="x"), TypeError, "dim"),
    ("data_plate dim range", lambda: pd.data_plate("rows", torch.ones(4), dim=0), ValueError,
     "dim"),
    ("data_plate unknown keyword", lambda: pd.data_plate("rows", torch.ones(4), bogus=1),
     TypeError, "bogus"),
    ("shard_subsamples by_block", lambda: pd.shard_subsamples(by_block="x"), TypeError,
     "by_block"),
    ("shard_subsamples local_updates", lambda: pd.shard_subsamples(local_updates="bogus"),
     ValueError, "local_updates"),
    ("shard_subsamples unknown keyword", lambda: pd.shard_subsamples(bogus=1), TypeError,
     "bogus"),
    # --- rows owned by this worker ---
    ("gather_param name", lambda: pd.gather_param(1), TypeError, "name"),
    ("gather_param to", lambda: pd.gather_param("w", to="bogus"), ValueError, "to"),
    ("gather_param module", lambda: pd.gather_param("w", module=1), TypeError, "module"),
    ("gather_param unknown keyword", lambda: pd.gather_param("w", bogus=1), TypeError, "bogus"),
    ("local_rows name", lambda: pd.local_rows(1), TypeError, "name"),
    ("local_rows module", lambda: pd.local_rows("w", module=1), TypeError, "module"),
    ("local_rows unknown keyword", lambda: pd.local_rows("w", bogus=1), TypeError, "bogus"),
    # --- optimizers ---
    ("DistributedOptimizer wrong type", lambda: pd.DistributedOptimizer(123), TypeError,
     "pyro_optim"),
    ("DistributedOptimizer bucket_cap_mb type",
     lambda: pd.DistributedOptimizer(_pyro_optim(), bucket_cap_mb="x"), TypeError,
     "bucket_cap_mb"),
    ("DistributedOptimizer bucket_cap_mb range",
     lambda: pd.DistributedOptimizer(_pyro_optim(), bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    ("DistributedOptimizer unknown keyword",
     lambda: pd.DistributedOptimizer(_pyro_optim(), bogus=1), TypeError, "bogus"),
    ("DistributedOptimizer step_policy type",
     lambda: pd.DistributedOptimizer(_pyro_optim(), step_policy=16), TypeError, "step_policy"),
    ("DistributedOptimizer step_policy beside noise_scale",
     lambda: pd.DistributedOptimizer(_pyro_optim(), step_policy=pd.LocalSGD(4), noise_scale=True),
     ValueError, "step_policy"),
    ("DistributedTorchOptimizer wrong type", lambda: pd.DistributedTorchOptimizer(123),
     TypeError, "optimizer"),
    ("DistributedTorchOptimizer check_every type",
     lambda: pd.DistributedTorchOptimizer(_torch_optim(), check_every="x"), TypeError,
     "check_every"),
    ("DistributedTorchOptimizer check_every range",
     lambda: pd.DistributedTorchOptimizer(_torch_optim(), check_every=0), ValueError,
     "check_every"),
    ("DistributedTorchOptimizer nonfinite",
     lambda: pd.DistributedTorchOptimizer(_torch_optim(), nonfinite="bogus"), ValueError,
     "nonfinite"),
    ("DistributedTorchOptimizer unknown keyword",
     lambda: pd.DistributedTorchOptimizer(_torch_optim(), bogus=1), TypeError, "bogus"),
    ("DistributedTorchOptimizer step_policy type",
     lambda: pd.DistributedTorchOptimizer(_torch_optim(), step_policy="diloco"), TypeError,
     "step_policy"),
    ("HorovodOptimizer wrong type", lambda: pd.HorovodOptimizer(123), TypeError, "pyro_optim"),
    ("HorovodOptimizer backward_passes_per_step",
     lambda: pd.HorovodOptimizer(_pyro_optim(), backward_passes_per_step=0), ValueError,
     "backward_passes_per_step"),
    ("HorovodOptimizer unknown keyword", lambda: pd.HorovodOptimizer(_pyro_optim(), bogus=1),
     TypeError, "bogus"),
    ("assert_in_sync wrong type", lambda: pd.assert_in_sync(123), TypeError, "optim"),
    ("assert_in_sync unknown keyword", lambda: pd.assert_in_sync(bogus=1), TypeError, "bogus"),
    # --- communication hooks ---
    ("LowRankHook rank type", lambda: pd.LowRankHook(rank="abc"), TypeError, "rank"),
    ("LowRankHook rank range", lambda: pd.LowRankHook(rank=0), ValueError, "rank"),
    ("LowRankHook warmup_steps type", lambda: pd.LowRankHook(warmup_steps=1.5), TypeError,
     "warmup_steps"),
    ("LowRankHook warmup_steps range", lambda: pd.LowRankHook(warmup_steps=-1), ValueError,
     "warmup_steps"),
    ("LowRankHook min_compression type", lambda: pd.LowRankHook(min_compression="x"), TypeError,
     "min_compression"),
    ("LowRankHook min_compression range", lambda: pd.LowRankHook(min_compression=0.5),
     ValueError, "min_compression"),
    ("LowRankHook error_feedback", lambda: pd.LowRankHook(error_feedback="no"), TypeError,
     "error_feedback"),
    ("LowRankHook seed type", lambda: pd.LowRankHook(seed="abc"), TypeError, "seed"),
    ("LowRankHook seed range", lambda: pd.LowRankHook(seed=-1), ValueError, "seed"),
    ("LowRankHook unknown keyword", lambda: pd.LowRankHook(bogus=1), TypeError, "bogus"),
    # --- step policies ---
    ("LocalSGD period type", lambda: pd.LocalSGD("4"), TypeError, "period"),
    ("LocalSGD period range", lambda: pd.LocalSGD(0), ValueError, "period"),
    ("LocalSGD warmup_steps type", lambda: pd.LocalSGD(4, warmup_steps=1.5), TypeError,
     "warmup_steps"),
    ("LocalSGD warmup_steps range", lambda: pd.LocalSGD(4, warmup_steps=-1), ValueError,
     "warmup_steps"),
    ("LocalSGD unknown keyword", lambda: pd.LocalSGD(4, bogus=1), TypeError, "bogus"),
    ("DiLoCo period type", lambda: pd.DiLoCo(None), TypeError, "period"),
    ("DiLoCo period range", lambda: pd.DiLoCo(-2), ValueError, "period"),
    ("DiLoCo outer_lr type", lambda: pd.DiLoCo(4, outer_lr="x"), TypeError, "outer_lr"),
    ("DiLoCo outer_lr range", lambda: pd.DiLoCo(4, outer_lr=0.0), ValueError, "outer_lr"),
    ("DiLoCo momentum type", lambda: pd.DiLoCo(4, momentum="x"), TypeError, "momentum"),
    ("DiLoCo momentum range", lambda: pd.DiLoCo(4, momentum=1.5), ValueError, "momentum"),
    ("DiLoCo nesterov", lambda: pd.DiLoCo(4, nesterov=1), TypeError, "nesterov"),
    ("DiLoCo warmup_steps range", lambda: pd.DiLoCo(4, warmup_steps=-1), ValueError,
     "warmup_steps"),
    ("DiLoCo unknown keyword", lambda: pd.DiLoCo(4, bogus=1), TypeError, "bogus"),
    # --- evaluation ---
    ("evaluate_loss batch_size type",
     lambda: pd.evaluate_loss(pyro.infer.Trace_ELBO(), _model, _model, torch.ones(4),
                              batch_size="x"), TypeError, "batch_size"),
    ("evaluate_loss batch_size range",
     lambda: pd.evaluate_loss(pyro.infer.Trace_ELBO(), _model, _model, torch.ones(4),
                              batch_size=0), ValueError, "batch_size"),
    ("evaluate_loss loss", lambda: pd.evaluate_loss(123, _model, _model, torch.ones(4)),
     TypeError, "loss"),
    ("evaluate_loss unknown keyword",
     lambda: pd.evaluate_loss(pyro.infer.Trace_ELBO(), _model, _model, torch.ones(4), bogus=1),
     TypeError, "bogus"),
    ("Predictive model", lambda: pd.Predictive(123, num_samples=2), TypeError, "model"),
    ("Predictive num_samples type", lambda: pd.Predictive(_model, num_samples="x"), TypeError,
     "num_samples"),
    ("Predictive num_samples range", lambda: pd.Predictive(_model, num_samples=0), ValueError,
     "num_samples"),
    ("Predictive split", lambda: pd.Predictive(_model, num_samples=2, split="bogus"), ValueError,
     "split"),
    ("Predictive gather", lambda: pd.Predictive(_model, num_samples=2, gather="bogus"),
     ValueError, "gather"),
    ("Predictive unknown keyword", lambda: pd.Predictive(_model, num_samples=2, bogus=1),
     TypeError, "bogus"),
    # --- checkpoints ---
    ("save_checkpoint path", lambda: pd.save_checkpoint(123, pd.DistributedOptimizer(
        _pyro_optim())), TypeError, "path"),
    ("save_checkpoint optim", lambda: pd.save_checkpoint("x.pt", 123), TypeError, "optim"),
    ("save_checkpoint unknown keyword", lambda: pd.save_checkpoint(
        "x.pt", pd.DistributedOptimizer(_pyro_optim()), bogus=1), TypeError, "bogus"),
    ("load_checkpoint path", lambda: pd.load_checkpoint(123, pd.DistributedOptimizer(
        _pyro_optim())), TypeError, "path"),
    ("load_checkpoint optim", lambda: pd.load_checkpoint("x.pt", 123), TypeError, "optim"),
    ("load_checkpoint missing_ok", lambda: pd.load_checkpoint(
        "x.pt", pd.DistributedOptimizer(_pyro_optim()), missing_ok="yes"), TypeError,
     "missing_ok"),
    ("load_checkpoint unknown keyword", lambda: pd.load_checkpoint(
        "x.pt", pd.DistributedOptimizer(_pyro_optim()), bogus=1), TypeError, "bogus"),
    # --- the progress bar ---
    ("progress iterable", lambda: list(pd.progress(123)), TypeError, "iterable"),
    ("progress total range", lambda: list(pd.progress([], total=-1)), ValueError, "total"),
    ("progress desc", lambda: list(pd.progress([], desc=1)), TypeError, "desc"),
    ("progress unknown keyword", lambda: pd.progress([], bogus=1), TypeError, "bogus"),
    # --- pd.scaling ---
    ("CollectiveCost latency_s type", lambda: scaling.CollectiveCost("x", 1e9, 2), TypeError,
     "latency_s"),
    ("CollectiveCost bandwidth range", lambda: scaling.CollectiveCost(1e-4, -1.0, 2), ValueError,
     "bandwidth"),
    ("CollectiveCost unknown keyword", lambda: scaling.CollectiveCost(1e-4, 1e9, 2, bogus=1),
     TypeError, "bogus"),
    ("measure_collective repeats type", lambda: scaling.measure_collective(repeats="x"),
     TypeError, "repeats"),
    ("measure_collective repeats range", lambda: scaling.measure_collective(repeats=0),
     ValueError, "repeats"),
    ("measure_collective unknown keyword", lambda: scaling.measure_collective(bogus=1),
     TypeError, "bogus"),
    ("project_scaling noise", lambda: scaling.project_scaling(1, 0.1, 1e6, _cost()), TypeError,
     "noise"),
    ("project_scaling compute_s", lambda: scaling.project_scaling(_noise(), -1.0, 1e6, _cost()),
     ValueError, "compute_s"),
    ("project_scaling unknown keyword",
     lambda: scaling.project_scaling(_noise(), 0.1, 1e6, _cost(), bogus=1), TypeError, "bogus"),
    ("scaling_advice optim", lambda: scaling.scaling_advice(123, lambda: None), TypeError,
     "optim"),
    ("scaling_advice measure_steps",
     lambda: scaling.scaling_advice(pd.DistributedOptimizer(_pyro_optim()), lambda: None,
                                    measure_steps=0), ValueError, "measure_steps"),
    ("scaling_advice unknown keyword",
     lambda: scaling.scaling_advice(pd.DistributedOptimizer(_pyro_optim()), lambda: None,
                                    bogus=1), TypeError, "bogus"),
]  # fmt: skip


def _integration_cases() -> list[Case]:
    """The integrations' callables, where their host library is installed."""
    cases: list[Case] = []
    try:
        lightning = importlib.import_module("pyro_distributed.integrations.lightning")
    except ImportError:
        pass
    else:
        cases += [
            ("IndexedDataset wrong type", lambda: lightning.IndexedDataset(123), TypeError,
             "dataset"),
            ("IndexedDataset unknown keyword", lambda: lightning.IndexedDataset([], bogus=1),
             TypeError, "bogus"),
            ("PyroDistributedStrategy engine", lambda: lightning.PyroDistributedStrategy(
                engine="bogus"), ValueError, "engine"),
            ("PyroDistributedStrategy seed", lambda: lightning.PyroDistributedStrategy(
                seed="x"), TypeError, "seed"),
            ("PyroDistributedStrategy own_local_params", lambda: lightning.PyroDistributedStrategy(
                own_local_params="no"), TypeError, "own_local_params"),
            ("PyroDistributedStrategy unknown keyword", lambda: lightning.PyroDistributedStrategy(
                bogus=1), TypeError, "bogus"),
        ]  # fmt: skip
    try:
        scvi = importlib.import_module("pyro_distributed.integrations.scvi")
    except ImportError:
        pass
    else:
        cases += [
            ("RowsOnDisk path", lambda: scvi.RowsOnDisk(123), TypeError, "path"),
            ("RowsOnDisk key", lambda: scvi.RowsOnDisk("x.h5ad", key=1), TypeError, "key"),
            ("RowsOnDisk unknown keyword", lambda: scvi.RowsOnDisk("x.h5ad", bogus=1), TypeError,
             "bogus"),
            ("owned_posterior to", lambda: scvi.owned_posterior(object(), to="bogus").__enter__(),
             ValueError, "to"),
            ("owned_posterior unknown keyword", lambda: scvi.owned_posterior(object(), bogus=1),
             TypeError, "bogus"),
            ("read_h5ad_by_rows path", lambda: scvi.read_h5ad_by_rows(123), TypeError, "path"),
            ("read_h5ad_by_rows unknown keyword", lambda: scvi.read_h5ad_by_rows("x", bogus=1),
             TypeError, "bogus"),
            ("write_owned_obsm path", lambda: scvi.write_owned_obsm(123, {}, obs_names=[]),
             TypeError, "path"),
            ("write_owned_obsm blocks", lambda: scvi.write_owned_obsm("x.h5ad", 1, obs_names=[]),
             TypeError, "blocks"),
            ("write_owned_obsm unknown keyword", lambda: scvi.write_owned_obsm(
                "x.h5ad", {}, obs_names=[], bogus=1), TypeError, "bogus"),
        ]  # fmt: skip
    return cases


ALL_CASES = CASES + _integration_cases()


@pytest.fixture(autouse=True)
def _fresh_param_store() -> None:
    pyro.clear_param_store()


def _as_param(case: Case) -> Any:
    """A row, marked ``horovod`` where the call starts the Horovod engine before its
    checks, so that it runs where Horovod is built (the test command's newest lane)."""
    marks = [pytest.mark.horovod] if case[0].startswith("HorovodOptimizer") else []
    return pytest.param(*case[1:], id=case[0], marks=marks)


@pytest.mark.parametrize(("call", "error", "named"), [_as_param(case) for case in ALL_CASES])
def test_a_bad_argument_is_refused_by_name(
    call: Callable[[], Any], error: type[Exception], named: str, tmp_path: Any, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)  # a call that got past its checks writes nothing here
    with pytest.raises(error) as info:
        call()
    assert re.search(rf"\b{re.escape(named)}\b", str(info.value)), str(info.value)


def _called(case: Case) -> str:
    return case[0].split()[0]


@pytest.mark.parametrize(
    "module", ["pyro_distributed", "pyro_distributed.integrations.lightning",
               "pyro_distributed.integrations.scvi"]
)  # fmt: skip
def test_every_public_callable_has_its_bad_arguments_in_the_table(module: str) -> None:
    try:
        public = importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} needs its host library")
    listed = {_called(case) for case in ALL_CASES}
    names = set(public.__all__)
    if module == "pyro_distributed":
        names |= set(scaling.__all__)
    missing = sorted(names - listed - set(NOTHING_TO_CHECK))
    assert missing == [], f"no bad-argument cases for {missing}"
    # Every callable with a keyword has an unknown keyword among its cases.
    without = sorted(
        name for name in names - set(NOTHING_TO_CHECK)
        if not any(_called(case) == name and "unknown keyword" in case[0] for case in ALL_CASES)
    )  # fmt: skip
    assert without == [], f"no unknown keyword for {without}"
