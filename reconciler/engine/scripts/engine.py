"""Stage the engine binary under a temporary name with its sidecars (``.sha256``, ``.version``).

Uploaded (``mode: upload``): a zstd stream on stdin (``codec: zstd``, inflated by the server's libzstd, named by
its facts) or a gzip one, unpacked as the bytes arrive (Python's zlib inflates ~30% faster than gzip(1) on the
servers we target, and unpacking overlaps the transfer);
its sha256 was taken on the controller from the source. Downloaded (``mode: download``): the release
file fetched from ``url`` here (hashed as it arrives), its sha256 checked against the pin (``sha256``)
before anything is unpacked: a different file is refused and nothing is installed; then the binary
(``name``) is taken out of a ``.tar.gz`` or ``.gz`` release (or is the file itself) in one pass: inflated
once, read as a tar stream up to that member, hashed as it is written (tarfile's random-access reader
inflated a 44 MB release twice, then the binary was read again to hash it). The version is the controller's when
it could run the same bytes (``version``), else this binary's own (``version_args``); with ``version_later``
it is left to the controller (another server staging the same bytes answers it for all: starting a 44 MB Go
binary cost ~100 ms of CPU per server on 20 busy lab hosts), and ``mode: version`` asks it of a staged binary.

Prints one JSON line: ``{"ok": true, "sha256", "version"}``, or ``{"ok": false, "kind", "error"}`` with
``kind`` ``fetch`` (the server could not get the file: the controller may upload it instead), ``codec`` (libzstd
did not load: the controller sends gzip), ``hash``
(the file is not the pinned one) or ``stage``; on failure whatever was staged is removed.
"""

from __future__ import annotations

import json
import os
import sys

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any, BinaryIO

REQUEST: Any = None
MAX_DOWNLOAD = 512 * 1024 * 1024  # a release is tens of MB; a server sending more is not a release


class Failed(Exception):
    def __init__(self, kind: str, error: str) -> None:
        super().__init__(error)
        self.kind = kind


def at(root: str, path: str) -> str:
    """Where a server path is: under ``root`` (a fake host's directory in tests), else itself."""
    return path if root == "/" else root.rstrip("/") + path


def inflate(src: BinaryIO, path: str) -> None:
    import zlib

    d = zlib.decompressobj(31)
    with open(path, "wb") as out:  # 64 kB in, ~180 kB out: stays in the CPU's cache (1 MB blocks: ~10% slower)
        for block in iter(lambda: src.read(1 << 16), b""):
            out.write(d.decompress(block))
        out.write(d.flush())
    if not d.eof:
        raise RuntimeError("the engine upload ended early")


def inflate_zstd(src: BinaryIO, path: str, library: str) -> None:
    """A zstd stream on stdin into ``path``, through the server's own libzstd (ctypes: no package to install;
    Python's zstd module is 3.14's). It inflates a 44 MB engine in ~40% of zlib's time. ``Failed("codec")`` when
    the library does not load: stdin is drained first, so that the controller's upload ends and it sends gzip."""
    try:  # a Python without ctypes (no libffi) is the same case as a missing library
        import ctypes

        lib = ctypes.CDLL(library)

        class Buffer(ctypes.Structure):  # ZSTD_inBuffer and ZSTD_outBuffer: {pointer, size, pos}
            _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]

        stream = lib.ZSTD_decompressStream
        stream.argtypes = [ctypes.c_void_p, ctypes.POINTER(Buffer), ctypes.POINTER(Buffer)]
        stream.restype = ctypes.c_size_t
        lib.ZSTD_createDStream.restype = ctypes.c_void_p
        lib.ZSTD_freeDStream.argtypes = [ctypes.c_void_p]
        lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
        lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
        lib.ZSTD_getErrorName.restype = ctypes.c_char_p
    except (ImportError, OSError, AttributeError) as e:
        for _ in iter(lambda: src.read(1 << 16), b""):  # the whole upload, so that the controller's send ends
            pass
        raise Failed("codec", "cannot use %s: %s" % (library, e)) from None
    ds = lib.ZSTD_createDStream()
    if not ds:
        raise MemoryError("ZSTD_createDStream")
    try:
        inb, outb = ctypes.create_string_buffer(1 << 16), ctypes.create_string_buffer(1 << 17)  # stay in the cache
        i, o = Buffer(ctypes.addressof(inb), 0, 0), Buffer(ctypes.addressof(outb), len(outb), 0)
        view, whole = memoryview(outb).cast("B"), False  # whole: the last frame was read to its end and flushed
        with open(path, "wb") as out:
            for n in iter(lambda: src.readinto(inb), 0):  # type: ignore[attr-defined]
                i.size, i.pos = n, 0
                while True:
                    o.pos, before = 0, i.pos
                    left = stream(ds, ctypes.byref(o), ctypes.byref(i))
                    if lib.ZSTD_isError(left):
                        raise RuntimeError("the engine upload is not a zstd stream: %s"
                                           % lib.ZSTD_getErrorName(left).decode())
                    if o.pos or i.pos != before:  # a call that moved nothing says nothing (it hints the next frame)
                        whole = left == 0
                    out.write(view[:o.pos])
                    if i.pos == i.size and o.pos < o.size:  # this block consumed and nothing left inside
                        break
    finally:
        lib.ZSTD_freeDStream(ds)
    if not whole:
        raise RuntimeError("the engine upload ended early")


class Inflating:
    """A gzip stream as a readable file (what tarfile's stream mode reads): zlib inflates the big blocks itself,
    with no per-10-kB bookkeeping or seeking back (a gzip file cannot seek without inflating it again)."""

    def __init__(self, src: BinaryIO) -> None:
        import zlib

        self.src, self.d, self.tail = src, zlib.decompressobj(31), b""

    def read(self, size: int = -1) -> bytes:
        size = size if size > 0 else 1 << 20
        while True:
            if not self.tail:
                if self.d.eof:
                    return b""
                self.tail = self.src.read(1 << 16)
                if not self.tail:
                    raise RuntimeError("the release ended early (truncated gzip stream)")
            out = self.d.decompress(self.tail, size)
            self.tail = self.d.unconsumed_tail
            if out:
                return out


def copy_hashed(src: Any, path: str) -> str:
    """``src`` (a readable file) into ``path``; the sha256 of what was written."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "wb") as out:
        for block in iter(lambda: src.read(1 << 20), b""):
            h.update(block)
            out.write(block)
    return h.hexdigest()


def fetch(url: str, path: str) -> str:
    """The file at ``url`` into ``path``, and its sha256; ``Failed("fetch", …)`` when it cannot be had whole from
    there (the controller may then fetch it), never for this machine's own disk (that error is raised as it is)."""
    import hashlib
    import http.client
    import socket
    import urllib.error
    import urllib.request

    h = hashlib.sha256()
    with open(path, "wb") as out:  # outside the try: a full disk here is not the release's fault
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                expected = resp.headers.get("Content-Length")
                size = 0
                while True:
                    block = resp.read(1 << 20)
                    if not block:
                        break
                    size += len(block)
                    if size > MAX_DOWNLOAD:
                        raise Failed("fetch", "more than %d MB: not a release" % (MAX_DOWNLOAD >> 20))
                    h.update(block)
                    out.write(block)
        except urllib.error.HTTPError as e:
            raise Failed("fetch", "%s answered HTTP %d" % (url, e.code)) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, ValueError) as e:
            raise Failed("fetch", "cannot fetch %s: %s" % (url, e)) from None
    if expected is not None and expected.isdigit() and int(expected) != size:
        raise Failed("fetch", "%s ended after %d of %s bytes" % (url, size, expected))
    return h.hexdigest()


def unpack(archive: str, dest: str, name: str) -> str | None:
    """The binary ``name`` out of a .tar.gz release, a .gz, or the file itself; its sha256 (None: the file's own)."""
    import tarfile

    with open(archive, "rb") as f:
        magic = f.read(2)
    if tarfile.is_tarfile(archive):  # reads the first header only
        with open(archive, "rb") as raw:
            stream: Any = Inflating(raw) if magic == b"\x1f\x8b" else raw  # others: tarfile's own stream detection
            tar = tarfile.open(fileobj=stream, mode="r|" if stream is not raw else "r|*", bufsize=1 << 20)
            with tar:
                for member in tar:  # a stream: the members in order, up to the binary
                    if member.isfile() and os.path.basename(member.name) == name:
                        src = tar.extractfile(member)
                        assert src is not None
                        return copy_hashed(src, dest)
        raise Failed("stage", "the release holds no file named %r" % name)
    if magic == b"\x1f\x8b":
        with open(archive, "rb") as raw:
            return copy_hashed(Inflating(raw), dest)
    os.replace(archive, dest)  # the binary itself: its sha256 is the download's
    return None


def stage(req: dict[str, Any], src: BinaryIO) -> dict[str, Any]:
    tmp = at(req.get("root", "/"), req["tmp"])
    if req["mode"] == "version":  # staged before with ``version_later``: the controller had no answer for it
        with open(tmp + ".sha256") as f:
            digest = f.read().strip()
    elif req["mode"] == "upload":
        if req.get("codec") == "zstd":
            inflate_zstd(src, tmp, str(req["library"]))
        else:
            inflate(src, tmp)
        digest = str(req["sha256"])
    else:
        download = tmp + ".download"
        try:
            got = fetch(req["url"], download)
            if got != req["sha256"]:
                raise Failed("hash", "the file at %s has sha256 %s, not the pinned %s: refused, nothing installed"
                             % (req["url"], got, req["sha256"]))
            digest = unpack(download, tmp, req["name"]) or got
        finally:
            if os.path.exists(download):
                os.remove(download)
    if req["mode"] != "version":
        with open(tmp + ".sha256", "w") as f:
            f.write(digest)
        os.chmod(tmp, 0o755)
    version = req.get("version")
    if not version and req.get("version_later"):  # another server with the same bytes answers it (sidecar: the commit)
        return {"ok": True, "sha256": digest, "version": None}
    if not version:  # the controller could not run these bytes: the server does
        import subprocess

        run = subprocess.run([tmp] + list(req.get("version_args", ["version"])), capture_output=True, text=True,
                             timeout=60)
        if run.returncode != 0:
            raise Failed("stage", "`%s %s` exited %d: %s" % (req["name"], " ".join(req.get("version_args", [])),
                                                             run.returncode, run.stderr.strip()[-300:]))
        version = run.stdout
    with open(tmp + ".version", "w") as f:
        f.write(version)
    return {"ok": True, "sha256": digest, "version": version}


def main(req: dict[str, Any]) -> None:
    os.umask(0o022)
    tmp = at(req.get("root", "/"), req["tmp"])
    try:
        out = stage(req, sys.stdin.buffer)
    except Exception as e:
        for path in (tmp, tmp + ".sha256", tmp + ".version"):
            if os.path.exists(path):
                os.remove(path)
        out = {"ok": False, "kind": getattr(e, "kind", "stage"), "error": "cannot stage the engine: %s" % e}
    print(json.dumps(out))


if __name__ == "__main__":
    main(REQUEST)
