"""Read a file the operator names — bounded, and only if it is a regular file.

The cluster file, its includes and the files it names (TLS certificates and keys,
the master secret file) are operator input: a path to ``/dev/zero``, a FIFO,
``/proc/self/environ`` or a 10 GB log must be refused with a clear error, not read
until memory runs out or block forever. Every such read goes through
``read_regular_file`` (or ``read_confined``, below); callers: ``config.loader`` (the
cluster file), ``config.includes`` and ``engine.base`` (includes, certificates and keys:
confined), ``credentials`` (the secret file).

It raises ``OSError`` (with ``strerror`` written for the operator and the path
as ``filename``), so a caller that already handles an unreadable file handles a
refused one the same way. No imports of ours: every layer may use it.

Which local files the cluster file may name (the second half of this module): those in the repository, or in a
folder the operator allows. The cluster file is what a pull request edits, and its author must not be able to read the controller's disk.
Yet the controller reads the files the cluster file names and sends them on: a TLS key or an engine binary is
uploaded to a server the file also names, an etcd password goes to the etcd the file names. So every such path
must resolve, after symlinks (``os.path.realpath``), inside the repository — the main cluster file's folder tree,
the same tree includes were always held to — or inside a folder the operator allows from *outside* the file:

- ``--allow-path DIR`` on the command line (repeatable), or
- ``RECONCILER_ALLOW_PATHS``: folders separated by ``os.pathsep`` (``:``).

No setting in the file can allow more: a pull request could edit it (``settings.include_roots`` was such a setting
and is refused now). Which fields are confined is ``config.semantic.named_files``; the paths that name the
controller's own credentials (the master secret, the operations credential, the SSH identity, etcd's client key)
are not: their contents never leave the controller, and they live outside git by design (GITOPS-6). Keep them out
of every allowed folder, or a pull request could name them as a TLS key.

``confine`` is the one place that decides: the loader's checks (``config.semantic``, ``config.includes``) call it,
and so does ``read_confined``, which the readers use. A reader checks again what it opened: it opens the resolved
path without following a symlink in its last part and confines the path of the opened descriptor, so a symlink
swapped in after validation (or between the check and the open) cannot send the read elsewhere.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from reconciler.errors import OutsideRepository as OutsideRepository  # what callers catch: raised here

#: Default bound for a file the cluster names (a PEM chain is a few KB).
MAX_NAMED_FILE_BYTES = 1024 * 1024

# Pseudo-filesystems whose "regular" files are generated on read (sizes lie, reads may not end).
_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _pseudo_devices() -> set[int]:
    devices = set()
    for root in _PSEUDO_ROOTS:
        try:
            devices.add(os.stat(root).st_dev)
        except OSError:
            pass
    return devices


def read_regular_file(path: str, max_bytes: int = MAX_NAMED_FILE_BYTES) -> bytes:
    """The content of ``path``, at most ``max_bytes`` long; ``OSError`` when it is not a regular file or larger.

    Opens without blocking (a FIFO with no writer does not hang the caller) and checks
    the opened descriptor, so a symlink swapped in between cannot change what is read.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        return read_open_file(fd, path, max_bytes)
    finally:
        os.close(fd)


def read_open_file(fd: int, path: str, max_bytes: int = MAX_NAMED_FILE_BYTES) -> bytes:
    """``read_regular_file`` of a file already open as ``fd`` (``path`` names it in errors); the caller closes it."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
        raise OSError(code, f"is {_kind(st.st_mode)}, not a regular file", path)
    if st.st_dev in _pseudo_devices():
        raise OSError(errno.EINVAL, "is a file of /proc, /sys or /dev, not a regular file", path)
    if st.st_size > max_bytes:
        raise OSError(errno.EFBIG, f"is {st.st_size} bytes, more than the {max_bytes} allowed", path)
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(1 << 16, max_bytes + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:  # it grew while we read
            raise OSError(errno.EFBIG, f"is more than the {max_bytes} bytes allowed", path)
    return b"".join(chunks)


# --------------------------------------------------------------------------- files a cluster file names

#: The environment variable that allows more folders (separated by ``os.pathsep``).
ENV = "RECONCILER_ALLOW_PATHS"
#: The command-line option that allows one more folder (repeatable).
OPTION = "--allow-path"

OUTSIDE = f"is outside the cluster file's folder (the repository) and every folder allowed with {OPTION} or {ENV}"
_from_command_line: tuple[str, ...] = ()  # set by the CLI for the duration of a command (``allowed``)




def _real(folder: str) -> str:
    return os.path.realpath(os.path.expanduser(folder))


@contextmanager
def allowed(folders: Iterable[str]) -> Iterator[None]:
    """Allow ``folders`` (the command line's ``--allow-path``, relative to the working directory) while in the block."""
    global _from_command_line
    before = _from_command_line
    _from_command_line = tuple(_real(f) for f in folders if f and "\x00" not in f)
    try:
        yield
    finally:
        _from_command_line = before


def allowed_folders() -> list[str]:
    """The folders the operator allows besides the repository: the command line's, then ``RECONCILER_ALLOW_PATHS``'s."""
    from_env = [_real(f) for f in os.environ.get(ENV, "").split(os.pathsep) if f.strip() and "\x00" not in f]
    return [*_from_command_line, *from_env]


def repository(base: str) -> str:
    """The repository of a cluster file whose folder is ``base``: that folder, resolved."""
    return os.path.realpath(base)


def roots(base: str) -> list[str]:
    """Where files named by the cluster file in folder ``base`` may be: its repository and the allowed folders."""
    return [repository(base), *allowed_folders()]


def inside(path: str, folders: Sequence[str]) -> bool:
    """Whether the absolute, already resolved ``path`` lies in one of ``folders`` (compared as text)."""
    return any(os.path.commonpath([path, folder]) == folder for folder in folders)


def named(value: str, base: str) -> str:
    """The path a value of the cluster file names: ``~`` expanded, relative to ``base``."""
    return os.path.join(base, os.path.expanduser(value))


PRIVATE = ("is one of the controller's own files (its state folder with the ACME keys, the subscription files, or a "
           "credential): those never leave the controller")


def confine(path: str, folders: Sequence[str], private: Sequence[str] = ()) -> str:
    """``path`` resolved (symlinks followed), when it lies in one of ``folders`` and in none of ``private`` (the
    controller's own files and folders, resolved: ``private_paths``); else ``OutsideRepository``.

    ``folders`` are resolved (``roots``). ``ValueError`` for a path with a NUL character."""
    resolved = os.path.realpath(os.path.abspath(path))
    if not inside(resolved, folders):
        raise OutsideRepository(path, resolved, OUTSIDE)
    if private and inside(resolved, private):
        raise OutsideRepository(path, resolved, PRIVATE)
    return resolved


def private_paths(values: Iterable[str], base: str) -> list[str]:
    """The controller's own files and folders (``Cluster.controller_private``), resolved as their readers resolve
    them (relative to the cluster file's folder ``base``)."""
    return [os.path.realpath(named(v, base)) for v in values if v and "\x00" not in v]


def through_symlink(path: str, folders: Sequence[str]) -> bool:
    """Whether ``path`` (absolute) lies in one of ``folders`` as written, so that only a symlink takes it out."""
    return inside(os.path.normpath(os.path.abspath(path)), folders)


def read_confined(value: str, base: str, max_bytes: int = MAX_NAMED_FILE_BYTES, private: Sequence[str] = ()) -> bytes:
    """The content of the file ``value`` names (relative to ``base``, the cluster file's folder), bounded, and only
    when it is confined (``confine``); ``OSError`` otherwise, as ``read_regular_file`` raises it.

    The check is made again on what was opened: the resolved path is opened without following a symlink in its
    last part, and the opened descriptor's own path (``/proc/self/fd``; elsewhere the resolved path, checked to be
    the same file) must be confined too."""
    folders = roots(base)
    path = named(value, base)
    resolved = confine(path, folders, private)
    flags = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last part became a symlink after it was resolved
            raise OutsideRepository(path, resolved, "changed into a symlink while it was being read; it was not read") from None
        raise OSError(exc.errno, exc.strerror, path) from None
    try:
        opened = _opened_path(fd, resolved)
        if opened is not None and private and inside(opened, private):
            raise OutsideRepository(path, opened, PRIVATE)
        if opened is None or not inside(opened, folders):
            raise OutsideRepository(path, opened or resolved, "changed while it was being read (a folder on its way was "
                                                              "swapped for a symlink); it was not read")
        return read_open_file(fd, path, max_bytes)
    finally:
        os.close(fd)


def _opened_path(fd: int, resolved: str) -> str | None:
    """Where the open file ``fd`` is, as the kernel knows it; None when that cannot be told."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        link = None
    if link is not None:
        return link if os.path.isabs(link) and not link.endswith(" (deleted)") else None
    try:  # no /proc: the resolved path must still be itself and the same file as the one opened
        same = os.path.realpath(resolved) == resolved and os.path.samestat(os.fstat(fd), os.stat(resolved))
    except OSError:
        return None
    return resolved if same else None
