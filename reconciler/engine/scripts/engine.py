"""Stage the engine binary under a temporary name with its sidecars (``.sha256``, ``.version``).

Uploaded (``mode: upload``): a zstd stream on stdin (``codec: zstd``, inflated by the server's libzstd, named by
its facts) or a gzip one, unpacked as the bytes arrive (Python's zlib inflates ~30% faster than gzip(1) on the
servers we target, and unpacking overlaps the transfer);
its sha256 was taken on the controller from the source. Downloaded (``mode: download``): the release
file fetched from ``url`` here (hashed as it arrives), its sha256 checked against the pin (``sha256``)
before anything is unpacked: a different file is refused and nothing is installed; then the binary
(``name``) is taken out of a ``.tar.gz``, ``.tar.zst`` (such as sing-box's Arch package: through the
server's libzstd, ``library``, ~42% of a ``.tar.gz``'s CPU for the same size), ``.gz`` or ``.zst`` release (or is
the file itself) in one pass: inflated once, read as a tar stream up to that member, hashed as it is written
(tarfile's random-access reader inflated a 44 MB release twice, then the binary was read again to hash it).
The version is the controller's when it could run the same bytes (``version``), else this binary's own
(``version_args``); with ``version_later`` it is left to the controller (another server staging the same bytes
answers it for all: starting a 44 MB Go binary cost ~100 ms of CPU per server on 20 busy lab hosts), and
``mode: version`` asks it of a staged binary.

Prints one JSON line: ``{"ok": true, "sha256", "version"}``, or ``{"ok": false, "kind", "error"}`` with
``kind`` ``fetch`` (the server could not get the file: the controller may upload it instead), ``codec`` (libzstd
did not load: the controller sends gzip, or uploads a zstd release's binary), ``hash``
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


def write_blocks(chunk: Any, path: str) -> None:
    """Inflated blocks (``chunk()``: the next, empty at the end) into ``path``: an upload, hashed on the controller."""
    try:
        with open(path, "wb") as out:
            for block in iter(chunk, b""):
                out.write(block)
    except RuntimeError as e:
        raise RuntimeError("the engine upload: %s" % e) from None


def zstd_api(library: str) -> tuple[Any, Any]:
    """ctypes bindings of the server's libzstd and its buffer struct (no package to install; Python's zstd
    module is 3.14's), or ``Failed("codec")`` when it does not load (a Python without ctypes, no libffi, is the
    same case)."""
    try:
        import ctypes

        if not library:  # CDLL("") would be this program itself
            raise OSError("none found on this machine")
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
        raise Failed("codec", "cannot use %s: %s" % (library or "libzstd", e)) from None
    return lib, Buffer


class Unzstd:
    """A zstd stream as a readable file, inflated by the server's libzstd (``zstd_api``): ``view()`` the next
    inflated block (a view of a 128 kB buffer that stays in the CPU's cache, empty at the end), ``read()`` a copy
    (what tarfile's stream mode reads). The end of the input before the end of the last frame is an error."""

    def __init__(self, src: BinaryIO, library: str) -> None:
        import ctypes

        (self.lib, buffer), self.src, self.ctypes = zstd_api(library), src, ctypes
        self.inb, self.outb = ctypes.create_string_buffer(1 << 16), ctypes.create_string_buffer(1 << 17)
        self.ds = self.lib.ZSTD_createDStream()
        if not self.ds:
            raise MemoryError("ZSTD_createDStream")
        self.i = buffer(ctypes.addressof(self.inb), 0, 0)
        self.o = buffer(ctypes.addressof(self.outb), len(self.outb), 0)
        self.out = memoryview(self.outb).cast("B")
        self.whole = False  # the last frame was read to its end and flushed
        self.full = False  # the last call filled the output: more may be waiting inside

    def view(self) -> memoryview:
        byref = self.ctypes.byref
        while True:
            if self.i.pos == self.i.size and not self.full:
                n = self.src.readinto(self.inb)  # type: ignore[attr-defined]
                if not n:
                    if not self.whole:
                        raise RuntimeError("the zstd stream ended early")
                    return self.out[:0]
                self.i.size, self.i.pos = n, 0
            self.o.pos, before = 0, self.i.pos
            left = self.lib.ZSTD_decompressStream(self.ds, byref(self.o), byref(self.i))
            if self.lib.ZSTD_isError(left):
                raise RuntimeError("not a zstd stream: %s" % self.lib.ZSTD_getErrorName(left).decode())
            if self.o.pos or self.i.pos != before:  # a call that moved nothing says nothing (it hints the next frame)
                self.whole = left == 0
            self.full = self.o.pos == self.o.size
            if self.o.pos:
                return self.out[:self.o.pos]

    def close(self) -> None:
        if self.ds:
            self.lib.ZSTD_freeDStream(self.ds)
            self.ds = None


def inflate_zstd(src: BinaryIO, path: str, library: str) -> None:
    """A zstd stream on stdin into ``path`` (it inflates a 44 MB engine in ~40% of zlib's time). ``Failed("codec")``
    when the library does not load: stdin is drained first, so that the controller's upload ends and it sends gzip."""
    try:
        z = Unzstd(src, library)
    except Failed:
        for _ in iter(lambda: src.read(1 << 16), b""):  # the whole upload, so that the controller's send ends
            pass
        raise
    try:
        write_blocks(z.view, path)
    finally:
        z.close()


class Inflating:
    """A gzip stream in blocks, zlib inflating them itself (``chunk``), with no per-10-kB bookkeeping or seeking
    back (a gzip file cannot seek without inflating it again)."""

    def __init__(self, src: BinaryIO) -> None:
        import zlib

        self.src, self.d, self.tail = src, zlib.decompressobj(31), b""

    def chunk(self) -> bytes:
        """The next inflated block: 64 kB in, 128 kB out at most, so that it stays in the CPU's cache (1 MB blocks
        were ~10% slower); empty at the end of the stream."""
        while True:
            if not self.tail:
                if self.d.eof:
                    return b""
                self.tail = self.src.read(1 << 16)
                if not self.tail:
                    raise RuntimeError("the gzip stream ended early")
            out = self.d.decompress(self.tail, 1 << 17)
            self.tail = self.d.unconsumed_tail
            if out:
                return out


def copy_hashed(src: Any, path: str) -> str:
    """``src`` (a readable file) into ``path``; the sha256 of what was written."""
    return Blocks(lambda: src.read(1 << 20)).copy(path)


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


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def is_tar_header(block: bytes) -> bool:
    """Whether 512 bytes are a tar header (any format, old v7 ones too: its checksum is right)."""
    import tarfile

    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        return True
    except tarfile.HeaderError:
        return False


class Blocks:
    """Inflated blocks (``chunk()``: the next one, empty at the end) as a readable file that never reads ahead of
    what it is asked. tarfile's stream mode, asking 512-byte blocks, leaves a member's bytes here, and they are
    copied to their file from the inflater's own buffer (through tarfile's 1 MB joins and slices, a third of a
    .pkg.tar.zst's unpacking was copying)."""

    def __init__(self, chunk: Any) -> None:
        self.chunk, self.pending, self.consumed = chunk, memoryview(b""), 0

    def _fill(self) -> bool:
        if not self.pending:
            self.pending = memoryview(self.chunk()).cast("B")
        return bool(self.pending)

    def read(self, size: int = -1) -> bytes:
        """``size`` bytes (fewer only at the end; a negative size: the rest of the current block). Exactly: what
        tarfile asks beyond a block's end must not be read ahead into its buffer."""
        parts: list[bytes] = []
        while size and self._fill():
            n = len(self.pending) if size < 0 else min(size, len(self.pending))
            parts.append(bytes(self.pending[:n]))
            self.pending, self.consumed = self.pending[n:], self.consumed + n
            size = 0 if size < 0 else size - n
        return b"".join(parts)

    def peek(self, n: int) -> bytes:
        """Up to ``n`` bytes, left to be read again."""
        head = self.read(n)
        self.pending, self.consumed = memoryview(head + bytes(self.pending)), self.consumed - len(head)
        return head

    def copy(self, path: str, size: int = -1) -> str:
        """The next ``size`` bytes (all when negative) into ``path``; their sha256."""
        import hashlib

        h = hashlib.sha256()
        with open(path, "wb") as out:
            while size:
                if not self._fill():
                    if size > 0:
                        raise RuntimeError("the release ended early")
                    break
                part = self.pending if size < 0 else self.pending[:size]
                h.update(part)
                out.write(part)
                self.pending, self.consumed = self.pending[len(part):], self.consumed + len(part)
                size = size if size < 0 else size - len(part)
        return h.hexdigest()


def unpack(archive: str, dest: str, name: str, library: str = "") -> str | None:
    """The binary ``name`` out of a release: a .tar.gz, a .tar.zst (an Arch package, ``.pkg.tar.zst``: zstd
    inflates in ~40% of zlib's time, through ``library``, the server's libzstd), a .gz, a .zst, another tar, or the file
    itself; its sha256 (None: the file's own). ``Failed("codec")`` for a zstd release where libzstd does not load."""
    with open(archive, "rb") as raw:
        magic = raw.read(4)
        if magic == ZSTD_MAGIC or magic[:2] == b"\x1f\x8b":
            raw.seek(0)
            z = Unzstd(raw, library) if magic == ZSTD_MAGIC else None
            try:
                blocks = Blocks(z.view if z else Inflating(raw).chunk)
                if is_tar_header(blocks.peek(512)):  # a tar inside
                    return _from_tar(blocks, dest, name)
                return blocks.copy(dest)
            finally:
                if z:
                    z.close()
    import tarfile

    if tarfile.is_tarfile(archive):  # reads the first header only; tarfile's own stream detection (bz2, xz)
        with open(archive, "rb") as raw:
            return _from_tar(raw, dest, name)
    os.replace(archive, dest)  # the binary itself: its sha256 is the download's
    return None


def _from_tar(stream: Blocks | BinaryIO, dest: str, name: str) -> str:
    """The file named ``name`` (in any folder) of a tar stream (``Blocks``, or a file tarfile reads itself) into
    ``dest``; its sha256."""
    import tarfile

    direct = stream if isinstance(stream, Blocks) else None
    with tarfile.open(fileobj=stream, mode="r|" if direct else "r|*",  # type: ignore[call-overload]
                      bufsize=tarfile.BLOCKSIZE if direct else 1 << 20) as tar:
        for member in tar:  # a stream: the members in order, up to the binary
            if member.isfile() and os.path.basename(member.name) == name:
                if direct and direct.consumed == member.offset_data and not member.issparse():  # its bytes come next
                    return direct.copy(dest, member.size)
                src = tar.extractfile(member)
                assert src is not None
                return copy_hashed(src, dest)
    raise Failed("stage", "the release holds no file named %r" % name)


def stage(req: dict[str, Any], src: BinaryIO) -> dict[str, Any]:
    tmp = at(req.get("root", "/"), req["tmp"])
    if req["mode"] == "version":  # staged before with ``version_later``: the controller had no answer for it
        with open(tmp + ".sha256") as f:
            digest = f.read().strip()
    elif req["mode"] == "upload":
        if req.get("codec") == "zstd":
            inflate_zstd(src, tmp, str(req["library"]))
        else:
            write_blocks(Inflating(src).chunk, tmp)
        digest = str(req["sha256"])
    else:
        download = tmp + ".download"
        try:
            got = fetch(req["url"], download)
            if got != req["sha256"]:
                raise Failed("hash", "the file at %s has sha256 %s, not the pinned %s: refused, nothing installed"
                             % (req["url"], got, req["sha256"]))
            digest = unpack(download, tmp, req["name"], str(req.get("library") or "")) or got
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
