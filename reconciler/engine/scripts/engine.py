"""Stage the engine binary under a temporary name with its sidecars (``.sha256``, ``.version``).

Uploaded (``mode: upload``): a zstd stream on stdin (``codec: zstd``, inflated by the server's libzstd, named by
its facts) or a gzip one, unpacked as the bytes arrive (Python's zlib inflates ~30% faster than gzip(1) on the
servers we target, and unpacking overlaps the transfer);
its sha256 was taken on the controller from the source. Downloaded (``mode: download``): the release
file fetched from ``url`` here (hashed as it arrives), its sha256 checked against the pin (``sha256``)
before anything is unpacked: a different file is refused and nothing is installed; then the binary
(``name``) is taken out of a ``.tar.gz``, ``.tar.zst`` (such as sing-box's Arch package: through the
server's libzstd, ``library``, ~42% of a ``.tar.gz``'s CPU for the same size), ``.gz`` or ``.zst`` release (or is
the file itself) in one pass: inflated once, read as a tar stream up to that member and written (tarfile's
random-access reader inflated a 44 MB release twice). Its ``.sha256`` sidecar is the release's pinned sha256: the
same release unpacks to the same bytes.
A release is hostile until its binary is out (a decompression bomb would fill this server's disk or memory): every
byte inflated is counted, whatever the container (gzip, zstd, bzip2, xz, tar), and the unpacking stops with an error
past ``MAX_UNPACKED_BYTES``; a tar member declaring more is refused before it is read, and so is a member named like
the binary that is not a regular file (a link, a device, a sparse file whose holes would inflate outside the count),
and a tar header whose extended data (pax records, long names, sparse maps: read whole into memory) passes
``MAX_HEADER_BYTES``. ``release`` (the controller's unpacking) calls the same code with the same cap.
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

from reconciler.engine.scripts.prelude import at  # spliced in when sent

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any, BinaryIO

REQUEST: Any = None
MAX_DOWNLOAD = 512 * 1024 * 1024  # a release is tens of MB; a server sending more is not a release
#: The most a release (or an upload) may inflate to, every member of its tar stream counted (an engine is 30-50 MB).
MAX_UNPACKED_BYTES = 512 * 1024 * 1024
#: The most one tar header's extended data may hold (pax records, a GNU long name, a sparse map: a few hundred bytes).
MAX_HEADER_BYTES = 1 << 20


class OwnDisk(Exception):
    """This machine's own disk failed a write (its ``OSError`` inside): not the release's fault, never a fetch
    failure (which would send the controller uploading to a full disk)."""


class Failed(Exception):
    def __init__(self, kind: str, error: str) -> None:
        super().__init__(error)
        self.kind = kind


def write_blocks(chunk: Any, path: str, limit: int = MAX_UNPACKED_BYTES) -> None:
    """Inflated blocks (``chunk()``: the next, empty at the end) into ``path``: an upload, hashed on the controller;
    at most ``limit`` bytes of it."""
    size = 0
    try:
        with open(path, "wb") as out:
            for block in iter(chunk, b""):
                size += len(block)
                if size > limit:
                    raise RuntimeError("it inflates to more than %d MB: not an engine binary; refused" % (limit >> 20))
                out.write(block)
    except RuntimeError as e:
        raise RuntimeError("the engine upload: %s" % e) from None


def too_big(limit: int) -> Failed:
    """The error of a release inflating past ``limit`` bytes."""
    return Failed("stage", "the release inflates to more than %d MB: not an engine release; refused (check "
                           "settings.engine.url)" % (limit >> 20))


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


class Decompressing:
    """A bzip2 or xz stream in blocks (``chunk``, as ``Inflating``'s: 64 kB in, 128 kB out at most, empty at its
    end). ``Failed("codec")`` when this Python was built without that codec (the controller unpacks the release)."""

    def __init__(self, src: BinaryIO, codec: str) -> None:
        try:
            if codec == "bzip2":
                import bz2

                self.d: Any = bz2.BZ2Decompressor()
            else:
                import lzma

                self.d = lzma.LZMADecompressor()
        except ImportError as e:
            raise Failed("codec", "this server's python3 cannot inflate %s: %s" % (codec, e)) from None
        self.src, self.codec = src, codec

    def chunk(self) -> bytes:
        while not self.d.eof:
            data = b""
            if self.d.needs_input:
                data = self.src.read(1 << 16)
                if not data:
                    raise RuntimeError("the %s stream ended early" % self.codec)
            try:
                out = self.d.decompress(data, 1 << 17)
            except (OSError, ValueError, EOFError) as e:  # bz2 says a broken stream with OSError; lzma.LZMAError too
                raise RuntimeError("the %s stream is broken: %s" % (self.codec, e)) from None
            if out:
                return bytes(out)
        return b""


def copy_hashed(src: Any, path: str, limit: int = MAX_UNPACKED_BYTES) -> str:
    """``src`` (a readable file) into ``path``, at most ``limit`` bytes of it; the sha256 of what was written."""
    return Blocks(lambda: src.read(1 << 20), limit).copy(path)


def fetch(url: str, path: str) -> str:
    """The file at ``url`` into ``path``, and its sha256; ``Failed("fetch", …)`` when it cannot be had whole from
    there (the controller may then fetch it), never for this machine's own disk (that error is raised as it is).
    An ``http``/``https`` URL with no proxy set is fetched by ``get`` (urllib's import alone, email and ssl with it,
    cost a server ~27 ms of CPU; a plain URL needs neither); anything else (a proxy, ``file:``) through urllib."""
    import hashlib

    h = hashlib.sha256()
    size = [0]

    def sink(block: Any) -> None:
        size[0] += len(block)
        if size[0] > MAX_DOWNLOAD:
            raise Failed("fetch", "more than %d MB: not a release" % (MAX_DOWNLOAD >> 20))
        h.update(block)
        try:
            out.write(block)
        except OSError as e:
            raise OwnDisk(e) from None

    with open(path, "wb") as out:  # outside the try: a full disk here is not the release's fault
        try:
            if url.partition("://")[0] in ("http", "https") and not any(
                    k.lower().endswith("_proxy") and v for k, v in os.environ.items()):
                expected = get(url, sink)
            else:
                expected = get_urllib(url, sink)
        except OwnDisk as e:
            raise e.args[0] from None
    if expected is not None and expected != size[0]:
        raise Failed("fetch", "%s ended after %d of %d bytes" % (url, size[0], expected))
    return h.hexdigest()


def get_urllib(url: str, sink: Any) -> int | None:
    """``url`` through urllib (proxies, ``file:``), each block to ``sink``: the length announced, if any."""
    import http.client
    import socket
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            expected = resp.headers.get("Content-Length")
            for block in iter(lambda: resp.read(1 << 20), b""):
                sink(block)
    except urllib.error.HTTPError as e:
        raise Failed("fetch", "%s answered HTTP %d" % (url, e.code)) from None
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, ValueError) as e:
        raise Failed("fetch", "cannot fetch %s: %s" % (url, e)) from None
    return int(expected) if expected is not None and expected.isdigit() else None


REDIRECTS = 5  # a release host redirects once (GitHub: to its asset storage); more is a loop
MAX_HEAD = 65536  # a response's status line and headers


def _address(hostport: str, default: int) -> tuple[str, int]:
    """(host, port) of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default
    host, colon, port = hostport.partition(":")
    return host, int(port) if colon else default


def _head(f: Any) -> tuple[int, dict[str, str]]:
    """A response's status and headers (names in lower case), at most ``MAX_HEAD`` bytes of them."""
    line = f.readline(MAX_HEAD)
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ValueError("not an HTTP answer: %r" % line[:60])
    headers: dict[str, str] = {}
    size = len(line)
    while True:
        line = f.readline(MAX_HEAD)
        size += len(line)
        if size > MAX_HEAD or not line.endswith(b"\n"):
            raise ValueError("an answer's head of more than %d bytes, or cut short" % MAX_HEAD)
        if line in (b"\r\n", b"\n"):
            return int(parts[1]), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


def _body(f: Any, headers: dict[str, str], sink: Any) -> int | None:
    """The body after a head, each block to ``sink``: chunked, of a ``Content-Length``, or up to the connection's
    end. The length announced, if any (None: chunked or up to the end, where a short body is not told apart)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int(f.readline(1024).split(b";")[0].strip() or b"x", 16)
            if size == 0:
                while f.readline(MAX_HEAD) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return None
            while size:
                block = f.read(min(size, 1 << 20))
                if not block:
                    raise ValueError("the answer ended inside a chunk")
                sink(block)
                size -= len(block)
            f.readline(1024)
    length = headers.get("content-length")
    left = int(length) if length is not None and length.isdigit() else -1
    while left:
        block = f.read(1 << 20 if left < 0 else min(left, 1 << 20))
        if not block:
            break
        sink(block)
        left -= len(block) if left > 0 else 0
    return int(length) if length is not None and length.isdigit() else None


def _next(url: str, location: str) -> str:
    """Where a redirect's ``Location`` points, from ``url``."""
    scheme, _, rest = url.partition("://")
    if "://" in location:
        return location
    if location.startswith("//"):
        return scheme + ":" + location
    hostport = rest.split("/", 1)[0]
    if location.startswith("/"):
        return "%s://%s%s" % (scheme, hostport, location)
    folder = rest.split("?", 1)[0].rsplit("/", 1)[0] if "/" in rest else hostport
    return "%s://%s/%s" % (scheme, folder, location)


def get(url: str, sink: Any) -> int | None:
    """``GET url`` (http, or https verified against the system's CAs), following up to ``REDIRECTS`` redirects;
    each block of the body to ``sink``. The length announced, if any. ``Failed("fetch")`` when it cannot."""
    import socket

    first = url
    for _ in range(REDIRECTS + 1):
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https"):
            raise Failed("fetch", "cannot fetch %s: redirected to %s" % (first, url))
        hostport, _, path = rest.partition("/")
        path = "/" + path.split("#", 1)[0]
        try:
            if "@" in hostport:
                raise ValueError("a user name in the URL")
            host, port = _address(hostport, 443 if scheme == "https" else 80)
            sock = socket.create_connection((host, port), timeout=60)
        except (OSError, ValueError) as e:
            raise Failed("fetch", "cannot fetch %s: %s" % (url, e)) from None
        f = None
        try:
            if scheme == "https":
                import ssl

                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
            sock.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: reconciler\r\nAccept-Encoding: identity\r\n"
                          "Connection: close\r\n\r\n" % (path, hostport)).encode("ascii"))
            f = sock.makefile("rb")
            status, headers = _head(f)
            if status in (301, 302, 303, 307, 308) and headers.get("location"):
                url = _next(url, headers["location"])
                continue
            if status != 200:
                raise Failed("fetch", "%s answered HTTP %d" % (url, status))
            return _body(f, headers, sink)
        except (OSError, ValueError, UnicodeError) as e:  # ssl's errors are OSErrors (a certificate's a ValueError too)
            raise Failed("fetch", "cannot fetch %s: %s" % (url, e)) from None
        finally:
            if f is not None:
                f.close()
            sock.close()
    raise Failed("fetch", "cannot fetch %s: more than %d redirects" % (first, REDIRECTS))


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
    .pkg.tar.zst's unpacking was copying). Every block is counted as it comes: past ``limit`` bytes, ``too_big``."""

    def __init__(self, chunk: Any, limit: int = MAX_UNPACKED_BYTES) -> None:
        self.chunk, self.pending, self.consumed = chunk, memoryview(b""), 0
        self.limit, self.inflated = limit, 0

    def _fill(self) -> bool:
        if not self.pending:
            self.pending = memoryview(self.chunk()).cast("B")
            self.inflated += len(self.pending)
            if self.inflated > self.limit:
                self.pending = memoryview(b"")
                raise too_big(self.limit)
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

    def copy(self, path: str, size: int = -1, hashed: bool = True) -> str:
        """The next ``size`` bytes (all when negative) into ``path``; their sha256 ("" when not ``hashed``)."""
        import hashlib

        h = hashlib.sha256() if hashed else None
        with open(path, "wb") as out:
            while size:
                if not self._fill():
                    if size > 0:
                        raise RuntimeError("the release ended early")
                    break
                part = self.pending if size < 0 else self.pending[:size]
                if h is not None:
                    h.update(part)
                out.write(part)
                self.pending, self.consumed = self.pending[len(part):], self.consumed + len(part)
                size = size if size < 0 else size - len(part)
        return h.hexdigest() if h is not None else ""


def unpack(archive: str, dest: str, name: str, library: str = "", limit: int = MAX_UNPACKED_BYTES,
           hashed: bool = True) -> str | None:
    """The binary ``name`` out of a release: a .tar.gz, a .tar.zst (an Arch package, ``.pkg.tar.zst``: zstd
    inflates in ~40% of zlib's time, through ``library``, the server's libzstd), a .tar.bz2, a .tar.xz, a .gz, a .zst
    (or .bz2, .xz), a plain tar, or the file itself; its sha256 (None: the file's own). At most ``limit`` bytes
    inflated (``Failed`` past it). ``Failed("codec")`` for a zstd release where libzstd does not load (or a bzip2 or
    xz one where this Python lacks the codec). Not ``hashed``: "" in place of the sha256 (the release's own pinned
    sha256 already names these bytes), and the binary is written without being hashed."""
    with open(archive, "rb") as raw:
        magic = raw.read(6)
        raw.seek(0)
        z = Unzstd(raw, library) if magic[:4] == ZSTD_MAGIC else None
        try:
            chunk: Any = None
            if z:
                chunk = z.view
            elif magic[:2] == b"\x1f\x8b":
                chunk = Inflating(raw).chunk
            elif magic[:3] == b"BZh":
                chunk = Decompressing(raw, "bzip2").chunk
            elif magic == b"\xfd7zXZ\x00":
                chunk = Decompressing(raw, "xz").chunk
            if chunk is not None:
                blocks = Blocks(chunk, limit)
                if is_tar_header(blocks.peek(512)):  # a tar inside
                    return _from_tar(blocks, dest, name, limit, hashed)
                return blocks.copy(dest, hashed=hashed)  # the binary alone, compressed
        finally:
            if z:
                z.close()
        if is_tar_header(raw.read(512)):  # a plain tar: nothing inflated, it is the download (MAX_DOWNLOAD at most)
            raw.seek(0)
            return _from_tar(raw, dest, name, limit)
    os.replace(archive, dest)  # the binary itself: its sha256 is the download's
    return None


class _HeaderBytes:
    """A tar stream read while tarfile reads one header and its extended data into memory: at most
    ``MAX_HEADER_BYTES`` of it (a 600 MB pax header of zeros inflates in a few MB of release)."""

    def __init__(self, src: Any) -> None:
        self.src, self.left = src, MAX_HEADER_BYTES

    def read(self, size: int) -> bytes:
        self.left -= size
        if self.left < 0:
            raise Failed("stage", "a tar header of the release holds more than %d MB of extended data (pax records, "
                                  "long names, sparse maps): not an engine release; refused (check settings.engine.url)"
                         % (MAX_HEADER_BYTES >> 20))
        return bytes(self.src.read(size))

    def __getattr__(self, name: str) -> Any:  # tell, seek: the stream's own
        return getattr(self.src, name)


def _bounded_headers(tarfile: Any) -> Any:
    """A ``TarInfo`` whose headers are read through ``_HeaderBytes`` (``_proc_member``: tarfile's own entry point for
    subclasses, on every Python 3; were it gone, headers would be read unbounded, no worse)."""

    class Header(tarfile.TarInfo):  # type: ignore[misc]
        def _proc_member(self, tar: Any) -> Any:
            stream = tar.fileobj
            tar.fileobj = _HeaderBytes(stream)
            try:
                return tarfile.TarInfo._proc_member(self, tar)
            finally:
                tar.fileobj = stream

    return Header


def _member_kind(member: Any) -> str:
    if member.issparse():
        return "a sparse file"
    if member.issym() or member.islnk():
        return "a link"
    if member.ischr() or member.isblk() or member.isfifo():
        return "a device or FIFO"
    return "a tar entry of type %r" % member.type


def _from_tar(stream: Blocks | BinaryIO, dest: str, name: str, limit: int = MAX_UNPACKED_BYTES,
              hashed: bool = True) -> str:
    """The regular file named ``name`` (in any folder) of a tar stream (``Blocks``, or a plain tar file tarfile reads
    itself) into ``dest``; its sha256. ``Failed`` for a member of that name that is not a regular file (a link, a
    device, a sparse file), and for any member declaring more than ``limit`` bytes."""
    import tarfile

    direct = stream if isinstance(stream, Blocks) else None
    with tarfile.open(fileobj=stream, mode="r|", tarinfo=_bounded_headers(tarfile),  # type: ignore[call-overload]
                      bufsize=tarfile.BLOCKSIZE if direct else 1 << 20) as tar:
        for member in tar:  # a stream: the members in order, up to the binary
            binary = os.path.basename(member.name) == name and not member.isdir()
            if binary and (not member.isreg() or member.issparse()):
                raise Failed("stage", "the release's %s is %s, not a regular file: refused (check settings.engine.url)"
                             % (member.name, _member_kind(member)))
            if member.size > limit:  # refused before its bytes are read, or skipped
                raise Failed("stage", "the release's %s declares %d bytes: the release inflates to more than %d MB, "
                                      "not an engine release; refused (check settings.engine.url)"
                             % (member.name, member.size, limit >> 20))
            if binary:
                if direct and direct.consumed == member.offset_data:  # its bytes come next
                    return direct.copy(dest, member.size, hashed)
                src = tar.extractfile(member)
                assert src is not None
                return copy_hashed(src, dest, limit)
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
            # The sidecar names the binary by its release's pinned sha256: the same release unpacks to the same
            # bytes (servers match the version answer by it), and hashing the 44 MB binary again cost ~30 ms a host.
            unpack(download, tmp, req["name"], str(req.get("library") or ""), hashed=False)
            digest = got
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


def staged(req: dict[str, Any], src: Any) -> dict[str, Any]:
    """The answer of a staging (what ``main`` prints; the commit calls it when it stages the engine itself): on any
    failure, nothing half staged stays and the answer says why."""
    os.umask(0o022)
    tmp = at(req.get("root", "/"), req["tmp"])
    try:
        return stage(req, src)
    except Exception as e:  # noqa: BLE001 — whatever failed, nothing half staged stays and the answer says why
        for path in (tmp, tmp + ".sha256", tmp + ".version"):
            if os.path.exists(path):
                os.remove(path)
        return {"ok": False, "kind": getattr(e, "kind", "stage"), "error": "cannot stage the engine: %s" % e}


def main(req: dict[str, Any]) -> None:
    print(json.dumps(staged(req, sys.stdin.buffer)))


if __name__ == "__main__":
    main(REQUEST)
