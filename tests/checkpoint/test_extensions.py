"""A communication hook's state in checkpoints: resumed and rolled-back runs continue bitwise.

Two stateful hooks: :class:`~pyro_distributed.LowRankHook` (warm-start factors
and each worker's error feedback) and the top-k hook with error feedback that
``examples/topk_hook.py`` writes from the docs (every worker's entries
gathered with ``Engine.all_gather``). Each trains 12 steps straight, on the
Pyro path (``save_checkpoint(path, optim)``) and the torch-native one
(``save_checkpoint(path, optimizer, module=...)``), and must be matched
bitwise by:

* a run that saves at step 6, runs on to step 9 and loads the checkpoint in
  the same process (a rollback), then runs to 12;
* a run resumed at step 6 with a new hook and a new optimizer, which learn
  everything from the file.

At W=2 with the default overlap; at W=3 with ``overlap=False``, the layout
the performance guide names for bitwise results from three workers on (the
first steps after a resume run without overlap, and at W=3 gloo's ring may
add a longer last bucket in another order). A control resumed with the
hook's state thrown away must differ: the hook's state is what the file
carries. Loading at another number of workers, a file without hook state and
a file with hook state for an optimizer without a hook are covered below.
"""

from __future__ import annotations

import importlib.util
import pickle
import warnings
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
from pyro_distributed.checkpoint import files
from pyro_distributed.exchange import AverageHook

from ..support.checkpointed import CheckpointedRun, resumed_against_straight
from ..support.harness import run_workers

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_AT, ROLLED_TO = 12, 6, 9


def topk_hook_class() -> type[pd.CommHook]:
    """``TopKHook`` of ``examples/topk_hook.py``, as a user's file defines it."""
    spec = importlib.util.spec_from_file_location("topk_hook", ROOT / "examples" / "topk_hook.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hook: type[pd.CommHook] = module.TopKHook
    return hook


def make_hook(kind: str) -> pd.CommHook:
    if kind == "low_rank":
        return pd.LowRankHook(rank=2, warmup_steps=2)
    return topk_hook_class()(0.1)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(240, 20, generator=generator)
    y = x @ torch.randn(20, 8, generator=generator) + 0.3 * torch.randn(240, 8, generator=generator)
    return pd.shard(x), pd.shard(y)


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    weight = pyro.param("weight", torch.zeros(20, 8))
    bias = pyro.param("bias", torch.zeros(8))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(x @ weight + bias, 0.5).to_event(1), obs=y)


def guide(x: torch.Tensor, y: torch.Tensor) -> None:
    pass


class Run(CheckpointedRun):
    """One training run of a front end, with a new hook and optimizer."""

    def __init__(self, front_end: str, kind: str, overlap: bool) -> None:
        self.front_end = front_end
        self.x, self.y = data()
        hook = make_hook(kind)
        pyro.clear_param_store()
        if front_end == "pyro":
            self.optim: Any = pd.DistributedOptimizer(
                pyro.optim.Adam({"lr": 0.05}), comm_hook=hook, overlap=overlap
            )
            self.svi = SVI(model, guide, self.optim, Trace_ELBO())
        else:
            torch.manual_seed(0)
            self.module = torch.nn.Linear(20, 8)
            self.optim = pd.DistributedTorchOptimizer(
                torch.optim.Adam(self.module.parameters(), lr=0.05),
                comm_hook=hook,
                overlap=overlap,
            )


def resumes(front_end: str, kind: str, overlap: bool, folder: str) -> dict[str, Any]:
    """Straight, rolled back, resumed and (the control) resumed without the hook's state."""
    return resumed_against_straight(
        lambda: Run(front_end, kind, overlap),
        f"{folder}/{front_end}-{kind}.pt",
        STEPS,
        SAVE_AT,
        ROLLED_TO,
        lambda run: run.optim.load_extension_state({}),  # the hook starts afresh
    )


def every_case(overlap: bool, folder: str) -> dict[str, dict[str, Any]]:
    return {
        f"{front_end}/{kind}": resumes(front_end, kind, overlap, folder)
        for front_end in ("pyro", "torch")
        for kind in ("low_rank", "topk")
    }


@pytest.mark.parametrize(("world_size", "overlap"), [(2, True), (3, False)])
def test_a_resumed_or_rolled_back_run_with_a_stateful_hook_continues_bitwise(
    world_size: int, overlap: bool, tmp_path: Path
) -> None:
    outcomes = run_workers(every_case, overlap, str(tmp_path), world_size=world_size, timeout=300)
    for rank, outcome in enumerate(outcomes):
        for case, found in outcome.items():
            assert found["start"], (rank, case)
            assert found["rolled back"], f"worker {rank}, {case}: the rollback differs"
            assert found["resumed"], f"worker {rank}, {case}: the resumed run differs"
            assert not found["control"], f"{case}: the hook's state made no difference"


def saved_at_two(path: str, kind: str = "low_rank") -> None:
    run = Run("pyro", kind, True)
    for _ in range(4):
        run.step()
    run.save(path)


def loaded_here(path: str, hook: pd.CommHook | None) -> list[str]:
    """Load ``path`` at one worker, with ``hook``; the warnings it gives."""
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), comm_hook=hook, engine="local")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pd.load_checkpoint(path, optim)
    return [str(warning.message) for warning in caught if warning.category is RuntimeWarning]


def test_another_number_of_workers_or_a_file_without_hook_state_starts_the_hook_afresh(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "run.pt")
    run_workers(saved_at_two, path)
    state = files.load_file(path)
    assert len(state["extensions"]) == 2
    assert all(worker["comm_hook"] for worker in state["extensions"]), "state for each worker"
    # At one worker, two workers' error feedback cannot be split: afresh, said.
    said = loaded_here(path, pd.LowRankHook(rank=2, warmup_steps=2))
    assert len(said) == 1 and "state of 2 workers, which cannot be split among 1" in said[0]
    # A file of format version 4 holds no hook state: afresh, said, for a stateful hook only.
    del state["extensions"]
    older = tmp_path / "older.pt"
    files.write_checkpoint(older, {**state, "world_size": 1, "rng": state["rng"][:1]})
    said = loaded_here(str(older), pd.LowRankHook(rank=2))
    assert len(said) == 1 and "holds no state of the communication hook" in said[0]
    assert loaded_here(str(older), None) == []


def test_hook_state_for_an_optimizer_without_a_stateful_hook_is_refused_by_name(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.pt"
    run_workers(saved_at_two, str(path))
    state = files.load_file(path)
    alone = tmp_path / "alone.pt"
    one = {**state, "world_size": 1, "rng": state["rng"][:1]}
    files.write_checkpoint(alone, {**one, "extensions": state["extensions"][:1]})
    pyro.clear_param_store()
    before = {name: value.clone() for name, value in pyro.get_param_store().items()}
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), engine="local")
    with pytest.raises(ValueError, match=r"alone\.pt.* holds the state of a communication hook"):
        pd.load_checkpoint(alone, optim)
    assert dict(pyro.get_param_store().items()) == before, "refused before anything changed"
    # A damaged entry is named.
    files.write_checkpoint(alone, {**one, "extensions": [{"comm_hook": [1, 2]}]})
    with pytest.raises(ValueError, match=r"'extensions'\[0\]\['comm_hook'\] must be dict"):
        pd.load_checkpoint(alone, optim)


def test_another_hooks_state_is_refused_by_name_before_anything_changes(tmp_path: Path) -> None:
    path = tmp_path / "topk.pt"
    run_workers(saved_at_two, str(path), "topk")
    state = files.load_file(path)
    alone = tmp_path / "alone.pt"
    one = {**state, "world_size": 1, "rng": state["rng"][:1]}
    files.write_checkpoint(alone, {**one, "extensions": state["extensions"][:1]})
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(
        pyro.optim.Adam({"lr": 0.05}), comm_hook=pd.LowRankHook(rank=2), engine="local"
    )
    with pytest.raises(
        ValueError, match=r"alone\.pt.* hook state that this optimizer's hook cannot"
    ):
        pd.load_checkpoint(alone, optim)
    assert not list(pyro.get_param_store().keys()), "refused before anything changed"
    assert optim.num_steps == 0


def test_a_low_rank_hook_pickles_with_its_state_and_refuses_foreign_state() -> None:
    hook = pd.LowRankHook(rank=2)
    saved = {"shapes": [[40, 30], [7]], "matrices": [0], "q": [torch.ones(30, 2)], "error": []}
    hook.load_state_dict({"b": saved})
    again = pickle.loads(pickle.dumps(hook))
    assert again.state_dict()["b"]["shapes"] == [[40, 30], [7]]
    assert torch.equal(again.state_dict()["b"]["q"][0], torch.ones(30, 2))
    with pytest.raises(ValueError, match="the state of bucket 'b' is not a LowRankHook's"):
        hook.load_state_dict({"b": {"q": []}})
    with pytest.raises(ValueError, match="holds 2 factors and 0 errors for 1 compressed"):
        hook.load_state_dict({"b": {**saved, "q": [torch.ones(30, 2)] * 2}})
    # Saved with another rank, or other settings: named, not carried on.
    with pytest.raises(ValueError, match=r"factor of shape \[30, 2\] .* rank=1 needs \[30, 1\]"):
        pd.LowRankHook(rank=1).load_state_dict({"b": saved})
    with pytest.raises(ValueError, match=r"compresses members \[0\], where this hook"):
        pd.LowRankHook(rank=2, min_compression=100.0).load_state_dict({"b": saved})
    with pytest.raises(ValueError, match=r"AverageHook\(op='mean'.* keeps no state across steps"):
        AverageHook().load_state_dict({"x": 1})
