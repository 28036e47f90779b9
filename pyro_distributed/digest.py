"""One digest for everything the workers compare without sending it whole.

Workers compare parameters and optimizer states (drift checks), results that
must be identical everywhere (gathered predictions), and the list of
parameters a step touches (agreement), by sending a short digest instead of
the values. :func:`digest` is the one way to make it: tensors by their dtype,
shape and bytes (so ``-0.0`` and ``0.0``, or two NaN payloads, differ, as
bitwise equality demands), mappings in key order, sequences in order, and
anything else by ``repr``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous().reshape(-1)
        hasher.update(f"tensor{tensor.dtype}{tuple(value.shape)}".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        hasher.update(f"mapping{len(value)}".encode())
        for key in sorted(value, key=repr):
            hasher.update(repr(key).encode())
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"sequence{len(value)}".encode())
        for item in value:
            _feed(hasher, item)
    else:
        hasher.update(f"repr{value!r}".encode())


def _hasher(value: Any) -> Any:
    hasher = hashlib.blake2b(digest_size=8)
    _feed(hasher, value)
    return hasher


def digest(value: Any) -> str:
    """A 16-hex-digit digest of ``value``: equal values, equal digests, on every worker."""
    hexdigest: str = _hasher(value).hexdigest()
    return hexdigest


def digest_int(value: Any) -> int:
    """:func:`digest` as a non-negative int of 62 bits, so that ``h`` and ``-h``
    both fit in an int64 (for a max-reduction that shows disagreement)."""
    return int.from_bytes(_hasher(value).digest(), "little") >> 2
