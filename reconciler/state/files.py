"""The one way to replace a file: a uniquely named temporary file beside it, written in full,
fsynced, renamed over the target, and the folder fsynced. A reader or a crash sees the old
content or the new, never a part; after ``write_atomic`` returns, the new content survives a
power loss. Every writer in the project goes through here (``put_in_place`` for a file a stream writer or an
unpacker made; the server scripts have the same in their prelude, ``engine.scripts.prelude.write``).

``sync=False`` skips both fsyncs for files that are cheap to regenerate and many (subscription
documents: the outlet's manifest, written with ``sync=True`` after them, is what records them).

Folders the service makes for itself (``make_private_dirs``) are 0700, and so is every folder above them
it had to make; folders that were already there are left as they are.

Bytes the service writes for itself and reads back later — a pickled snapshot handed to worker processes, the
learned state a leader publishes — are authenticated with an HMAC-SHA256 under a key derived from the master
secret (``Mac``, ``mac_matches``), and checked before anything is made of them: a file someone else put in
the folder is refused, never unpickled. ``sealed`` and ``unsealed`` keep the HMAC at the end of the file itself.
"""

from __future__ import annotations

import contextlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from reconciler.errors import MacMismatch

PRIVATE_DIR = 0o700
MAC_BYTES = 32  # HMAC-SHA256


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
            make_private_dirs(folder)
            write_new(tmp, data, mode, sync)
        os.chmod(tmp, mode)  # the umask may have narrowed it
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_folder(folder)


def put_in_place(tmp: str | Path, target: str | Path, mode: int | None = None) -> None:
    """Put a file written whole elsewhere (by a stream writer, an unpacker) at ``target`` as ``write_atomic`` would:
    fsynced, ``mode`` set, renamed over the target, the folder fsynced. ``tmp`` must be in the target's folder."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, target)
    fsync_folder(os.path.dirname(os.path.abspath(os.fspath(target))))


def make_private_dirs(path: str | Path) -> None:
    """Make ``path`` and every missing folder above it, each 0700: chmod after mkdir, because the umask may have
    narrowed or widened the mode. Folders that were already there, or that another process made meanwhile, are
    left as they are (they need not be ours)."""
    missing: list[str] = []
    folder = os.path.abspath(os.fspath(path))
    while not os.path.isdir(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_DIR)
        except FileExistsError:
            if os.path.isdir(folder):  # another process made it first: not ours to change
                continue
            raise
        os.chmod(folder, PRIVATE_DIR)




class Mac:
    """HMAC-SHA256 under ``key`` of the bytes given to ``update`` (in pieces: a big pickle is never whole twice)."""

    def __init__(self, key: bytes) -> None:
        self._mac = hmac.new(key, digestmod="sha256")
        self.update = self._mac.update

    def hexdigest(self) -> str:
        return self._mac.hexdigest()


def mac_matches(key: bytes, data: bytes | memoryview, mac: bytes | memoryview | str) -> bool:
    """Whether ``mac`` (raw, or hex as ``Mac.hexdigest`` gives it) is ``data``'s HMAC-SHA256 under ``key``; compared in
    constant time. The one check of every HMAC the service reads back."""
    want = hmac.digest(key, data, "sha256")
    if isinstance(mac, str):
        if not mac.isascii():
            return False
        return hmac.compare_digest(want.hex(), mac)
    return hmac.compare_digest(want, mac)


def sealed(key: bytes, data: bytes) -> tuple[bytes, bytes]:
    """What a sealed file holds: ``data``, then its HMAC (pieces for ``write_atomic``)."""
    return data, hmac.digest(key, data, "sha256")


def unsealed(key: bytes, content: bytes, where: str) -> memoryview:
    """The data of a sealed file's ``content`` (``sealed``), once its HMAC is checked; ``MacMismatch`` naming
    ``where`` when the HMAC is missing or wrong (the data is then never looked at)."""
    view = memoryview(content)
    if len(view) < MAC_BYTES or not mac_matches(key, view[:-MAC_BYTES], view[-MAC_BYTES:]):
        raise MacMismatch(f"{where} was not written by this service with this master secret (its HMAC does not "
                          "match): not read")
    return view[:-MAC_BYTES]
