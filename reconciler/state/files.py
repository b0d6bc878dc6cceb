"""The one way to replace a file: a uniquely named temporary file beside it, written in full,
fsynced, renamed over the target, and the folder fsynced. A reader or a crash sees the old
content or the new, never a part; after ``write_atomic`` returns, the new content survives a
power loss. Every writer in the project goes through here.

``sync=False`` skips both fsyncs for files that are cheap to regenerate and many (subscription
documents: the outlet's manifest, written with ``sync=True`` after them, is what records them).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a short write is not an error; a full disk is)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover — os.write raises on errors; 0 would loop forever
            raise OSError(f"write returned {n}")
        view = view[n:]


def fsync_folder(folder: str | Path) -> None:
    """Make a rename inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_new(path: str | Path, data: bytes | Iterable[bytes], mode: int = 0o600, sync: bool = True) -> None:
    """Create ``path`` (it must not exist) with all of ``data`` (bytes, or pieces of it: a big document need not be
    one object in memory); used inside a staging folder."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        for piece in (data,) if isinstance(data, bytes) else data:
            write_all(fd, piece)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes | Iterable[bytes], mode: int = 0o600, sync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring). ``mode`` is the new file's."""
    target = os.fspath(path)
    folder = os.path.dirname(target) or "."
    tmp = os.path.join(folder, f".{os.path.basename(target)}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        try:
            write_new(tmp, data, mode, sync)
        except FileNotFoundError:  # the folder is not there yet (made only then: most writes replace a file)
            os.makedirs(folder, exist_ok=True)
            write_new(tmp, data, mode, sync)
        os.chmod(tmp, mode)  # the umask may have narrowed it
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_folder(folder)
