"""Read a file the operator names — bounded, and only if it is a regular file.

The cluster file, its includes and the files it names (TLS certificates and keys,
the master secret file) are operator input: a path to ``/dev/zero``, a FIFO,
``/proc/self/environ`` or a 10 GB log must be refused with a clear error, not read
until memory runs out or block forever. Every such read goes through
``read_regular_file``; callers: ``config.loader`` (cluster file and includes),
``engine.singbox`` (certificates and keys), ``credentials`` (the secret file).

It raises ``OSError`` (with ``strerror`` written for the operator and the path
as ``filename``), so a caller that already handles an unreadable file handles a
refused one the same way. No imports of ours: every layer may use it.
"""

from __future__ import annotations

import errno
import os
import stat

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
    finally:
        os.close(fd)
