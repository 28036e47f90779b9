"""Files of tensors and plain data: a header checked first, nothing that runs code.

Every checkpoint and block file the library writes has this layout::

    MAGIC                 16 bytes, "\\x89PYRO-DIST\\r\\n\\x1a\\n\\0\\0" (as PNG's, it
                          catches files mangled as text)
    header                HEADER_BYTES of UTF-8 JSON, padded with spaces: the
                          format version, the versions that wrote it, the
                          payload's length and SHA-256, what the file is
    payload               torch.save of tensors, numbers, strings, lists and dicts

Reading checks, in order, the header (a foreign file, another kind or a newer
format is refused before the payload is touched), the payload's length and
checksum (a truncated or bit-flipped file is refused by name), and only then
unpickles with ``torch.load(weights_only=True)`` and the caller's allow-list:
a file holds data, never chooses code. ``trusted=True`` unpickles in full,
for the user's own classes and for format version 3 and older. Writing is
all or nothing, through :mod:`pyro_distributed.atomic_write`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO, Any, cast

import torch

from .atomic_write import write_with
from .devices import checkpoint_location

MAGIC = b"\x89PYRO-DIST\r\n\x1a\n\x00\x00"
HEADER_BYTES = 4096
#: Version 4 and later files have a checked header before a payload of plain
#: data; a version 5 checkpoint also holds every worker's state of the step's
#: extensions (a communication hook's), which a reader of version 4 would
#: silently drop. Files of versions 1 to 3 are plain ``torch.save`` files of
#: any object.
FORMAT_VERSION = 5
#: How a file of version 3 and older starts: a zip archive, torch.save's format.
_LEGACY_START = b"PK\x03\x04"

_DISTRIBUTIONS = ("pyro-distributed", "pyro-ppl")


def versions() -> dict[str, str]:
    """The versions of the library, torch and Pyro that write a file now.

    torch's is ``torch.__version__``, which is what ran and names its build
    (``2.15.0+cu132``, ``2.13.0+cpu``), where the distribution's metadata of a
    wheel from PyPI says ``2.15.0``; the others carry no build label.
    """
    found = {"torch": str(torch.__version__)}
    for name in _DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "unknown"
    return found


@dataclass(frozen=True)
class Header:
    """What a file says of itself, read before its payload.

    :param kind: what the file holds (``"checkpoint"``, ``"block"``).
    :param meta: the writer's small JSON-able description (a block's token, rank, ...).
    :param versions: the library, torch and Pyro versions that wrote it.
    :param payload_bytes: the payload's length.
    :param payload_sha256: the payload's SHA-256, hex.
    :param format_version: the layout's version; 3 for a plain ``torch.save`` file.
    """

    kind: str
    meta: dict[str, Any]
    versions: dict[str, str]
    payload_bytes: int
    payload_sha256: str
    format_version: int = FORMAT_VERSION


class _HashingWriter:
    """A write-only file that hashes and counts what passes through (torch.save streams)."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.length = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.length += len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def write(path: Path, kind: str, meta: dict[str, Any], payload: Any) -> None:
    """Write ``payload`` (tensors and plain data) to ``path`` with a header, all
    or nothing; the previous file at ``path`` stays until the rename."""

    def save(file: IO[bytes]) -> None:
        file.write(MAGIC + b" " * HEADER_BYTES)  # the header is written last, here
        hashing = _HashingWriter(file)
        torch.save(payload, cast(IO[bytes], hashing))
        header = {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "meta": meta,
            "versions": versions(),
            "payload_bytes": hashing.length,
            "payload_sha256": hashing.sha256.hexdigest(),
        }
        encoded = json.dumps(header, sort_keys=True).encode()
        if len(encoded) > HEADER_BYTES:
            raise ValueError(f"a file header of {len(encoded)} bytes does not fit")
        file.seek(len(MAGIC))
        file.write(encoded)

    write_with(path, save)


class _MemoryReader(io.RawIOBase):
    """A seekable file over bytes already in memory, read without a copy
    (``io.BytesIO`` would copy them, holding the payload twice)."""

    def __init__(self, data: bytearray | memoryview) -> None:
        self._view = memoryview(data)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), len(self._view) - self._position))
        buffer[:count] = self._view[self._position : self._position + count]
        self._position += count
        return count

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: len(self._view)}
        self._position = base[whence] + offset
        return self._position

    def tell(self) -> int:
        return self._position


class UnreadableFile(ValueError):
    """A file that is missing, damaged, foreign, or holds what may not be loaded."""


def read_header(file: io.BufferedIOBase, name: str, kind: str) -> Header:
    """The header of the open ``file`` (shown as ``name``), which must be of ``kind``.

    A plain ``torch.save`` file of format version 3 and older gives a header of
    ``format_version=3`` and no checksum.

    :raises UnreadableFile: naming the file and what is wrong with it.
    """
    start = file.read(len(MAGIC) + HEADER_BYTES)
    if start.startswith(_LEGACY_START):
        size = file.seek(0, os.SEEK_END)
        file.seek(0)
        return Header(kind, {}, {}, size, "", format_version=3)
    if not start.startswith(MAGIC):
        raise UnreadableFile(f"{name} is not a pyro_distributed file (its first bytes differ)")
    if len(start) < len(MAGIC) + HEADER_BYTES:
        raise UnreadableFile(f"{name} is truncated: it ends inside its header")
    try:
        fields = json.loads(start[len(MAGIC) :].decode())
        header = Header(
            kind=_field(fields, "kind", str),
            meta=_field(fields, "meta", dict),
            versions=_field(fields, "versions", dict),
            payload_bytes=_field(fields, "payload_bytes", int),
            payload_sha256=_field(fields, "payload_sha256", str),
            format_version=_field(fields, "format_version", int),
        )
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError) as exc:
        raise UnreadableFile(f"{name} has a damaged header ({exc})") from exc
    if header.payload_bytes < 0:
        raise UnreadableFile(
            f"{name} has a damaged header (a payload of {header.payload_bytes} bytes)"
        )
    if header.format_version > FORMAT_VERSION:
        raise UnreadableFile(
            f"{name} has format version {header.format_version} (written by "
            f"{_written_by(header)}); this pyro_distributed reads version "
            f"{FORMAT_VERSION} and older: upgrade it"
        )
    if header.kind != kind:
        raise UnreadableFile(f"{name} is a {header.kind} file, not a {kind} file")
    return header


def _field(fields: Any, key: str, kind: type) -> Any:
    if not isinstance(fields, dict):
        raise TypeError("it is not a JSON object")
    value = fields[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"header entry {key!r} is {value!r}, not of type {kind.__name__}")
    return value


def _written_by(header: Header) -> str:
    if not header.versions:
        return "an unknown version"
    return ", ".join(f"{name} {version}" for name, version in sorted(header.versions.items()))


def read_payload(file: io.BufferedIOBase, header: Header, name: str) -> bytearray:
    """The payload that follows the header, checked against its length and checksum.

    :raises UnreadableFile: if the file is truncated, too long or damaged.
    """
    # The claim is compared with the file before anything is allocated: a
    # damaged header must not make a reader zero gigabytes to refuse it.
    start = file.tell()
    available = file.seek(0, os.SEEK_END) - start
    file.seek(start)
    if header.payload_bytes > available:
        raise UnreadableFile(
            f"{name} is truncated: its header promises {header.payload_bytes} bytes of "
            f"data and {available} follow"
        )
    payload = bytearray(header.payload_bytes)
    got = file.readinto(payload)
    if got != header.payload_bytes:
        raise UnreadableFile(f"{name} is truncated: it ended while it was read")
    if file.read(1):
        raise UnreadableFile(f"{name} is damaged: data follows the end its header gives")
    if header.format_version > 3 and hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise UnreadableFile(f"{name} is damaged: its data does not match the header's checksum")
    return payload


def decode(
    payload: bytearray | memoryview,
    header: Header,
    name: str,
    *,
    trusted: bool,
    allowed: Iterable[Any] = (),
) -> Any:
    """Unpickle a checked payload: as data, with the ``allowed`` classes and
    functions, unless ``trusted``.

    :raises UnreadableFile: naming a class the file needs and may not load, or
        what else stopped it.
    """
    if header.format_version <= 3 and not trusted:
        raise UnreadableFile(
            f"{name} is a plain torch.save file, not a pyro_distributed file of format "
            f"version 4 or later: reading it means unpickling it, which can run any code "
            f"it holds. If it was written by pyro_distributed 0.x and you trust it, "
            f"load it once with trusted=True, and save it again"
        )
    stream = cast(IO[bytes], _MemoryReader(payload))
    try:
        if trusted:
            return torch.load(stream, map_location=checkpoint_location, weights_only=False)
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(stream, map_location=checkpoint_location, weights_only=True)
    except Exception as exc:
        needed = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if needed is not None:
            raise UnreadableFile(
                f"{name} needs {needed.group(1)}, which this process does not allow "
                f"a file to load (written by {_written_by(header)}; this is "
                f"{_written_by(Header('', {}, versions(), 0, ''))}). If it is a class "
                f"of yours, or you trust the file, load it with trusted=True"
            ) from None
        raise UnreadableFile(
            f"{name} could not be read ({type(exc).__name__}: {_first_line(exc)})"
        ) from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def load(
    path: Path, kind: str, *, trusted: bool, allowed: Iterable[Any] = ()
) -> tuple[Header, Any]:
    """Read, check and decode the file at ``path`` in one go (a block file, say).

    :raises FileNotFoundError: if there is none.
    :raises UnreadableFile: if it cannot be loaded, saying why.
    """
    name = repr(os.fspath(path))
    with open(path, "rb") as file:
        header = read_header(file, name, kind)
        payload = read_payload(file, header, name)
    return header, decode(payload, header, name, trusted=trusted, allowed=allowed)
