"""Where the library puts tensors: the device decisions, and a static check of
every allocation in the package.

The GPU paths themselves run only on a machine with CUDA (the tests marked
``cuda``, and ``scripts/gpu_check.sh``). What a CPU machine can check is
here: the decisions are plain functions, and the package's source can be read
for tensors allocated without a device.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest
import torch

import pyro_distributed
from pyro_distributed.devices import (
    CudaTransport,
    checkpoint_location,
    cuda_device_index,
    cuda_transport,
    this_gpu,
)

from .support.harness import run_workers

PACKAGE = Path(pyro_distributed.__file__).parent

#: torch functions that allocate a new tensor on the default device unless told.
FACTORIES = frozenset(
    {
        "arange",
        "as_tensor",
        "empty",
        "eye",
        "full",
        "linspace",
        "ones",
        "rand",
        "randint",
        "randn",
        "randperm",
        "tensor",
        "zeros",
    }
)

#: The marker that waives ``device=`` for one allocation, saying why (``torch.as_tensor``
#: of a value that keeps its own device, say). An allocation meant for the CPU says
#: ``device="cpu"``: a user's ``torch.set_default_device("cuda")`` must not move it.
WAIVER = "# device:"


def _torch_call(node: ast.Call) -> str | None:
    func = node.func
    named = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
    return func.attr if named and func.value.id == "torch" else None  # type: ignore[attr-defined]


def _marked(lines: list[str], node: ast.Call) -> bool:
    """Whether a line of the call, or the comment lines just above it, waive ``device=``."""
    first, last = node.lineno, node.end_lineno or node.lineno
    if any(WAIVER in lines[n - 1] for n in range(first, last + 1)):
        return True
    above = first - 1
    while above >= 1 and lines[above - 1].strip().startswith("#"):
        if WAIVER in lines[above - 1]:
            return True
        above -= 1
    return False


def unplaced_allocations(source: str, where: str) -> list[str]:
    """``where:line name`` of each allocation without ``device=`` or a waiver,
    and of each ``torch.load`` without ``map_location=``."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _torch_call(node)
        keywords = {keyword.arg for keyword in node.keywords}
        if name in FACTORIES and "device" not in keywords and not _marked(lines, node):
            found.append(f"{where}:{node.lineno} torch.{name}")
        if name == "load" and "map_location" not in keywords:
            found.append(f"{where}:{node.lineno} torch.load without map_location")
    return found


def test_every_allocation_in_the_package_names_its_device() -> None:
    # torch.cat/stack and the *_like and .new_* methods take the device of
    # their inputs; the factories above take torch's default device, which
    # is the CPU unless the user changed it (torch.set_default_device).
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        found += unplaced_allocations(path.read_text(), where)
    assert not found, (
        "tensors allocated without device= (give them the device of the tensors they serve, "
        "device='cpu' with a comment saying why for a host-side one, or waive it with "
        "'# device: <why>'):\n" + "\n".join(found)
    )


def test_the_static_check_finds_a_bare_allocation_and_accepts_placed_or_waived_ones() -> None:
    source = (
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.zeros(3, device=x.device)\n"
        "c = torch.as_tensor(v)  # device: v's own\n"
        "# device: read back at once\n"
        "d = torch.arange(\n"
        "    4)\n"
        "e = torch.load(f)\n"
        "f = torch.zeros_like(b)\n"
    )
    assert unplaced_allocations(source, "m.py") == [
        "m.py:2 torch.zeros",
        "m.py:8 torch.load without map_location",
    ]


def test_each_worker_takes_its_own_gpu_while_there_are_enough() -> None:
    assert [cuda_device_index(rank, 4) for rank in range(4)] == [0, 1, 2, 3]


def test_workers_beyond_the_visible_gpus_wrap_around_instead_of_naming_a_missing_one() -> None:
    assert [cuda_device_index(rank, 1) for rank in range(3)] == [0, 0, 0]
    assert [cuda_device_index(rank, 2) for rank in range(4)] == [0, 1, 0, 1]


def test_a_device_index_needs_a_gpu_and_a_non_negative_rank() -> None:
    with pytest.raises(ValueError, match="no GPU"):
        cuda_device_index(0, 0)
    with pytest.raises(ValueError, match="local_rank"):
        cuda_device_index(-1, 2)


def test_workers_with_a_gpu_each_use_nccl() -> None:
    gpus = [("host", "GPU-a"), ("host", "GPU-b"), ("other", "GPU-a")]
    assert cuda_transport("cpu:gloo,cuda:nccl", gpus) == CudaTransport("nccl")


def test_workers_sharing_a_gpu_use_gloo_and_are_named_in_one_warning() -> None:
    gpus = [("host", "GPU-a"), ("host", "GPU-a"), ("host", "GPU-b")]
    transport = cuda_transport("cpu:gloo,cuda:nccl", gpus)
    assert transport.backend == "gloo"
    assert transport.shared == ((0, 1),)
    assert "workers 0, 1 on GPU GPU-a of host" in transport.warning
    assert "NCCL refuses two workers on one GPU" in transport.warning


def test_without_cuda_no_transport_is_chosen() -> None:
    assert cuda_transport("gloo", [None, None]) == CudaTransport(None)


def test_a_group_without_nccl_carries_cuda_tensors_on_gloo_without_a_warning() -> None:
    transport = cuda_transport("gloo", [("host", "GPU-a"), ("host", "GPU-a")])
    assert (transport.backend, transport.warning) == ("gloo", "")


def test_this_gpu_is_none_without_cuda_and_names_host_and_device_with_it() -> None:
    gpu = this_gpu()
    if torch.cuda.is_available():
        assert gpu is not None and gpu[1]
    else:
        assert gpu is None


def test_a_checkpoint_keeps_cpu_tensors_on_the_cpu() -> None:
    buffer = io.BytesIO()
    torch.save({"rows": torch.arange(3), "rng": torch.get_rng_state()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location=checkpoint_location, weights_only=False)
    assert state["rows"].device.type == "cpu" and state["rng"].device.type == "cpu"
    assert state["rows"].tolist() == [0, 1, 2]


def test_a_tensor_saved_on_a_gpu_lands_on_this_workers_gpu_or_the_cpu() -> None:
    storage = torch.arange(3.0).untyped_storage()  # torch hands it over read onto the CPU
    placed = checkpoint_location(storage, "cuda:3")
    expected = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    assert str(placed.device) == expected
    assert checkpoint_location(storage, "cpu") is None  # torch's default: stays where saved


def _cuda_transport_chosen() -> str | None:
    return pyro_distributed.current_engine()._cuda_backend  # type: ignore[attr-defined, no-any-return]


def test_the_torch_engine_agrees_at_start_on_how_cuda_tensors_travel() -> None:
    chosen = run_workers(_cuda_transport_chosen, world_size=2, engine="torch")
    if not torch.cuda.is_available():
        assert chosen == [None, None]
    else:  # two workers on one GPU share it; on two GPUs each has its own
        assert chosen == 2 * ["gloo" if torch.cuda.device_count() < 2 else "nccl"]
