"""How a tensor reaches MPI: by its own memory, or staged through the host.

The MPI engine hands MPI a tensor's address and length, so MPI reads and
writes the tensor itself: nothing is copied and no NumPy or DLPack object is
made per call. A tensor that is not contiguous goes through a dense copy,
written back after the collective.

CUDA tensors (untested: the tests have no GPU) go to MPI as they are when
the library reports CUDA among its memory kinds (MPI 4.1's
``mpi_memory_alloc_kinds``); otherwise they are staged through pinned host
memory, with one warning per engine. Any other device is refused, naming it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..errors import PyroDistributedError

#: What copies a collective's result back where it belongs, if anything must.
CopyBack = Callable[[], None] | None


def library_takes_cuda(comm: Any) -> bool:
    """Whether the MPI library behind ``comm`` takes CUDA buffers as they are."""
    info = comm.Get_info()
    try:
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
    finally:
        info.Free()
    return any(kind.split(":")[0] == "cuda" for kind in kinds.split(","))


class MPIBuffers:
    """MPI buffers over tensors' memory, for one engine (and its channels).

    :param MPI: the ``mpi4py.MPI`` module.
    :param cuda_aware: whether CUDA tensors go to MPI as they are.
    """

    def __init__(self, MPI: Any, cuda_aware: bool) -> None:
        self.MPI = MPI
        self.cuda_aware = cuda_aware
        self._staging_announced = False
        self._types = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.int64: MPI.INT64_T,
            torch.int32: MPI.INT32_T,
            torch.int16: MPI.INT16_T,
            torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T,
        }

    def buffer(self, tensor: Tensor, datatype: Any = None) -> list[Any]:
        """An MPI buffer over ``tensor``'s own memory (contiguous, on a device
        MPI can read): as bytes, or as elements of ``datatype``."""
        nbytes = tensor.numel() * tensor.element_size()
        memory = self.MPI.buffer.fromaddress(tensor.data_ptr(), nbytes)
        if datatype is None:
            return [memory, nbytes, self.MPI.BYTE]
        return [memory, tensor.numel(), datatype]

    def datatype(self, dtype: torch.dtype) -> Any:
        """MPI's type for ``dtype``, or a TypeError naming it."""
        if dtype not in self._types:
            raise TypeError(f"the mpi engine cannot reduce tensors of dtype {dtype}")
        return self._types[dtype]

    def on_host(self, tensor: Tensor, what: str) -> tuple[Tensor, CopyBack]:
        """A contiguous tensor MPI can read and write for ``tensor``, and what
        copies its result back (``None`` when MPI works on ``tensor`` itself)."""
        device = tensor.device.type
        if device == "cuda":
            # Untested on a GPU so far (scripts/gpu_check.sh runs it).
            torch.cuda.current_stream(tensor.device).synchronize()  # the values must be written
            if self.cuda_aware:
                return contiguous(tensor)
            if not self._staging_announced:
                self._staging_announced = True
                warnings.warn(
                    "this MPI library does not take CUDA buffers: the mpi engine copies CUDA "
                    "tensors through pinned host memory (an MPI built with CUDA support avoids "
                    "the copies)",
                    stacklevel=4,
                )
            # cpu: the pinned host copy MPI reads and writes in place of the CUDA tensor.
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True, device="cpu")
            host.copy_(tensor)
            return host, copier(tensor, host)
        if device != "cpu":
            raise PyroDistributedError(
                f"{what}: a {device} tensor cannot travel on the mpi engine, which carries "
                f"CPU and CUDA tensors; move it to the CPU first"
            )
        return contiguous(tensor)


def contiguous(tensor: Tensor) -> tuple[Tensor, CopyBack]:
    """``tensor`` if it is contiguous, else a dense copy and what writes it back."""
    if tensor.is_contiguous():
        return tensor, None
    dense = tensor.contiguous()
    return dense, copier(tensor, dense)


def copier(destination: Tensor, source: Tensor) -> Callable[[], None]:
    """A function that copies ``source`` into ``destination``."""

    def copy_back() -> None:
        destination.copy_(source)

    return copy_back
