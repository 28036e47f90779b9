"""Replacing a file all or nothing, while other processes may write it too.

:func:`write_with` writes a temporary file beside the file a path names,
fsyncs it, renames it over that file and fsyncs the directory: a reader sees
the old file or the new one, whole, and a crash leaves the old one.

A path that is a symbolic link is written through: the file it leads to is
replaced, in that file's directory, and the link stays (renaming over the
link would turn it into a file of its own and leave its target stale).
Anything but a regular file, a link to one, or a new path (a device, a
directory, a loop of links) is refused before anything is written.

Several processes may write one path at once: each writes its own
temporary, ``.<target>.<host>-<pid>-<random>.tmp``, and the last rename wins,
whole. :func:`remove_temporaries` removes what killed writers left, and only
that: a temporary is stale when its writer ran on this host (and pid
namespace) and has ended, or when nothing has written it for
:data:`STALE_AFTER`, whoever wrote it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import IO

__all__ = [
    "STALE_AFTER",
    "host_id",
    "is_stale",
    "remove_temporaries",
    "writable_target",
    "write_with",
]

#: How long a temporary may go unwritten before a clean-up counts it as a dead
#: writer's, wherever that writer ran: twice the longest a worker's file work
#: may take (``shared_io.IO_TIMEOUT``), after which its save has failed anyway.
STALE_AFTER = timedelta(hours=1)
#: A temporary's name; ``.<target>.<random>.tmp``, without a writer, is how
#: earlier versions named theirs.
_TEMPORARY = re.compile(
    r"\.(?P<target>.+)\.(?:(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-)?[0-9a-f]{8}\.tmp"
)


def write_with(
    path: Path, save: Callable[[IO[bytes]], None], *, through_links: bool = True
) -> None:
    """Replace the file ``path`` names (:func:`writable_target`) with what
    ``save(file)`` writes, all or nothing.

    ``through_links=False`` replaces a link at ``path`` itself, as Lightning's
    own checkpoint writer does: its ``last.ckpt`` may be a link to the best
    checkpoint, which a later save of ``last.ckpt`` must not overwrite.

    :raises ValueError: if ``path`` leads to anything but a regular file or a
        new path; nothing is written then.
    """
    target = path.absolute() if not through_links and path.is_symlink() else writable_target(path)
    temporary = target.with_name(
        f".{target.name}.{host_id()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    )
    # O_EXCL with 0o666: the mode follows the umask, as torch.save's open() does.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as file:
            save(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def writable_target(path: Path) -> Path:
    """The file a write to ``path`` replaces: ``path`` itself, or the file its
    symbolic links lead to (for a dangling link, the file it names, created).

    :raises ValueError: naming ``path``, if it leads to anything but a regular
        file or nothing (a device, a directory, a socket), or its links loop.
    """
    shown = repr(os.fspath(path))
    try:
        target = path.resolve()
        found = target.stat()
    except FileNotFoundError:
        return target
    except (OSError, RuntimeError) as exc:  # a loop: RuntimeError before Python 3.13
        raise ValueError(f"will not write {shown}: its links lead to no file ({exc})") from exc
    if not stat.S_ISREG(found.st_mode):
        via = "" if target == path.absolute() else f" (which leads to {os.fspath(target)!r})"
        raise ValueError(
            f"will not write {shown}{via}: it is {_kind_of(found.st_mode)}, not a regular "
            f"file; give the path of a file, or of a new one"
        )
    return target


def _kind_of(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISFIFO: "a named pipe",
        stat.S_ISSOCK: "a socket",
    }
    return next((said for test, said in kinds.items() if test(mode)), "no regular file")


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform allows it)."""
    with suppress(OSError):  # some file systems cannot open or fsync a directory
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def remove_temporaries(directory: Path, targets: re.Pattern[str]) -> None:
    """Delete the stale temporaries (:func:`is_stale`) of the files in
    ``directory`` whose names ``targets`` matches in full. Another writer's
    temporary, still being written, stays: safe to call while others write."""
    for found in directory.glob(".*.tmp"):
        match = _TEMPORARY.fullmatch(found.name)
        if match is not None and targets.fullmatch(match["target"]) and is_stale(found):
            found.unlink(missing_ok=True)


def is_stale(temporary: Path) -> bool:
    """Whether ``temporary`` is a dead writer's: its name says it was written on
    this host by a process that has ended, or nothing has written it for
    :data:`STALE_AFTER`. A pid reused since keeps it until that bound."""
    match = _TEMPORARY.fullmatch(temporary.name)
    if match is None:
        return False
    if match["host"] == host_id() and not _alive(int(match["pid"])):
        return True
    try:
        unwritten = time.time() - temporary.stat().st_mtime
    except FileNotFoundError:
        return False  # renamed or removed meanwhile
    return unwritten > STALE_AFTER.total_seconds()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@cache
def host_id() -> str:
    """This host and pid namespace, hashed to 8 hex digits: a pid names a
    process only where both match (containers may share a host name)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]
