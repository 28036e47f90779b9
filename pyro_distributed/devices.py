"""Where tensors live: the GPU each worker takes, how CUDA tensors travel, and
where a checkpoint's tensors land when it is read back.

Each decision is a plain function of what it is told, so it is tested
without a GPU. :func:`cuda_device_index` wraps ``LOCAL_RANK`` around the GPUs
a worker sees (several workers on one GPU, or one GPU shown per worker).
:func:`cuda_transport` sends CUDA tensors over gloo, through host memory,
with one warning, when workers share a GPU, since NCCL refuses two ranks on
one device (the MPI engine stages through the host anyway).
:func:`checkpoint_location` is the ``map_location`` of every ``torch.load``
in the library: a GPU tensor onto this worker's GPU (or the CPU without
one), a CPU tensor (an RNG state, an index) stays on the CPU.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The GPU worker ``local_rank`` of a machine takes among the ``device_count`` it sees.

    Example::

        cuda_device_index(3, 4)  # 3: one GPU per worker
        cuda_device_index(1, 1)  # 0: two workers on one GPU, or one visible GPU each
    """
    if device_count < 1:
        raise ValueError(f"cuda_device_index: no GPU to choose from (device_count={device_count})")
    if local_rank < 0:
        raise ValueError(f"cuda_device_index: local_rank must be >= 0, got {local_rank}")
    return local_rank % device_count


#: What a worker reports about its GPU: ``(host, GPU uuid)``, or None without CUDA.
GpuId = tuple[str, str] | None


def this_gpu() -> GpuId:
    """This worker's ``(host, uuid)`` of its current GPU, or None when CUDA is unavailable."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", f"index {index}"))
    return socket.gethostname(), uuid


@dataclass(frozen=True)
class CudaTransport:
    """How the torch engine moves CUDA tensors; the same on every worker.

    :param backend: ``"nccl"``, ``"gloo"``, or ``None`` when no worker has CUDA
        (a CUDA tensor then has no way to travel, and the engine says so).
    :param shared: groups of ranks that share one GPU (empty when none do).
    :param warning: the one warning to give, or ``""``.
    """

    backend: Literal["nccl", "gloo"] | None
    shared: tuple[tuple[int, ...], ...] = ()
    warning: str = ""


def cuda_transport(group_backend: str, gpus: Sequence[GpuId]) -> CudaTransport:
    """How CUDA tensors travel, from the process group's backend and every worker's GPU.

    ``gpus[r]`` is worker r's :func:`this_gpu`. All workers pass the same
    arguments (``gpus`` is all-gathered), so they all decide alike.

    * no worker has CUDA: ``None``;
    * every worker has a GPU of its own and the group (or torch) has NCCL:
      ``"nccl"``;
    * workers share a GPU: ``"gloo"``, with a warning naming them, because
      NCCL would fail at the first collective;
    * a group without NCCL (the user made it with gloo): ``"gloo"``.

    Example::

        cuda_transport("cpu:gloo,cuda:nccl", [("h", "GPU-a"), ("h", "GPU-a")]).backend  # "gloo"
    """
    if all(gpu is None for gpu in gpus):
        return CudaTransport(None)
    holders: dict[tuple[str, str], list[int]] = {}
    for rank, gpu in enumerate(gpus):
        if gpu is not None:
            holders.setdefault(gpu, []).append(rank)
    shared = tuple(tuple(ranks) for ranks in holders.values() if len(ranks) > 1)
    if "nccl" not in group_backend:
        return CudaTransport("gloo", shared)
    if not shared:
        return CudaTransport("nccl")
    described = "; ".join(
        f"workers {', '.join(map(str, ranks))} on GPU {gpu[1]} of {gpu[0]}"
        for gpu, ranks in holders.items()
        if len(ranks) > 1
    )
    warning = (
        f"{described}: NCCL refuses two workers on one GPU, so pyro_distributed sends CUDA "
        f"tensors over gloo instead (through host memory: slower than NCCL, the same "
        f"numbers). Give each worker a GPU of its own (torchrun --nproc-per-node <= the "
        f"number of GPUs) for NCCL."
    )
    return CudaTransport("gloo", shared, warning)


def checkpoint_location(storage: Any, location: str) -> Any:
    """``map_location`` for ``torch.load``: CUDA tensors onto this worker's GPU (or the CPU).

    A checkpoint saved by worker 0 on ``cuda:0`` is read by every worker; each
    must get its tensors on its own current GPU, and a machine without CUDA
    must still read it. Other tensors keep torch's default (returning None).

    Example::

        state = torch.load(file, map_location=checkpoint_location, weights_only=False)
    """
    if not location.startswith("cuda"):
        return None
    # torch hands the callable each storage read onto the CPU.
    return storage.cuda(torch.cuda.current_device()) if torch.cuda.is_available() else storage
