"""The public listener with the least Python per request: a compiled HTTP/1.1 parser (httptools, the one uvicorn
uses) under a plain ``asyncio.Protocol``, and answers kept as encoded bytes.

What it answers is ``reconciler.loop.public.PublicSide``'s, byte for byte the aiohttp listener's (a test compares
the two). A GET without ``If-None-Match`` whose answer depends on nothing but its URL and the headers the answer
names (``Reply.varies``) is kept as its encoded head and body, until the snapshot or the settings change
(``PublicSide.epoch``); the next such request is a dictionary lookup and one vectored write. Everything else is
asked of ``PublicSide`` each time.

The guards are the aiohttp listener's (``reconciler.loop.listener.Guards``): the connection caps, slow headers and
idle connections closed after ``header_timeout``, malformed requests logged once per client per minute. Beyond
them, what only a parser of our own has to enforce: a request head is at most ``MAX_HEAD`` bytes and
``MAX_HEADERS`` fields; a request with a body, or any method but GET and HEAD, is answered once (400, 405) and its
connection closed, so nothing is ever read that is not a request head; a client that does not read its answers
(pipelining without reading) stops being read until it does.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import time
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import httptools

from reconciler.loop.client_address import Network
from reconciler.loop.listener import Guards, Limits
from reconciler.loop.public import NOT_ALLOWED, PublicSide, Reply, text

#: Bytes read while a request head is awaited (its line and header fields; what one read brings of the next
#: pipelined requests counts too, so not small).
MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
#: Answers kept per snapshot at most (each ~0.5 kB besides the document it shares): past it, answers are still
#: given, only not kept, until the next snapshot.
KEPT_MAX = 100_000
BAD_REQUEST = text(400, "bad request\n")
FAILED = text(500, "internal error\n")
_EMPTY: dict[str, str] = {}


class _Headers(dict[str, str]):
    """A request's header fields by lower-case name; ``get`` takes any case (as aiohttp's). The first of a
    repeated field counts, as aiohttp's ``get`` gives it."""

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)


_date: dict[int, bytes] = {}


def date_line() -> bytes:
    """``Date: ...\\r\\n`` for this second (made once a second)."""
    now = int(time.time())
    line = _date.get(now)
    if line is None:
        _date.clear()
        line = _date[now] = b"Date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
    return line


def encode_head(reply: Reply) -> bytes:
    """The status line and the reply's header fields with ``Content-Length``; ``Date``, ``Connection`` and the
    blank line are added per response. A field that would split the head (CR or LF in it) is a bug: ValueError."""
    fields = [f"{name}: {value}" for name, value in reply.headers.items()]
    if any("\r" in field or "\n" in field for field in fields):
        raise ValueError("a header field holds a line break")
    if reply.status != 304:
        fields.append(f"Content-Length: {len(reply.body)}")
    status = f"HTTP/1.1 {reply.status} {http.HTTPStatus(reply.status).phrase}"
    return "\r\n".join([status, *fields, ""]).encode()


class FastListener(Guards):
    """One listening socket answering ``side``'s public requests."""

    def __init__(self, name: str, side: PublicSide, limits: Limits | None = None,
                 trusted_proxies: Callable[[], tuple[Network, ...]] | None = None):
        super().__init__(name, limits, trusted_proxies)
        self.side = side
        # URL → (the header names the answer varies by, {their values: (encoded head, body)})
        self.kept: dict[bytes, tuple[tuple[str, ...], dict[tuple[str | None, ...], tuple[bytes, bytes]]]] = {}
        self._kept_count = 0
        self._epoch: object = None
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Protocol(self), host, port, reuse_address=True,
                                                reuse_port=reuse_port or None, backlog=1024)
        self._start_sweeper()

    async def stop(self) -> None:
        self._stop_sweeper()
        if self._server is not None:
            self._server.close()
            for proto in list(self.open):
                if proto.transport is not None:
                    proto.transport.close()
            await self._server.wait_closed()
            self._server = None

    def respond(self, method: bytes, url: bytes, headers: _Headers, peer: str) -> tuple[bytes, bytes, bool]:
        """(encoded head, body or b"", whether to close after it) for one complete GET or HEAD request."""
        self.served += 1
        keep = method == b"GET" and "if-none-match" not in headers
        if keep:
            epoch = self.side.epoch
            if epoch != self._epoch:
                self.kept.clear()
                self._kept_count, self._epoch = 0, epoch
            slot = self.kept.get(url)
            if slot is not None:
                hit = slot[1].get(tuple(headers.get(name) for name in slot[0]) if slot[0] else ())
                if hit is not None:
                    return hit[0], hit[1], False
        raw_path, _, raw_query = url.partition(b"?")
        path = raw_path.decode("utf-8", "replace")
        if "%" in path:
            path = unquote(path)
        query = _EMPTY
        if raw_query:
            query = {}
            for name, value in parse_qsl(raw_query.decode("utf-8", "replace"), keep_blank_values=True):
                query.setdefault(name, value)
        try:
            reply = self.side.answer(method.decode("latin-1"), path, query, headers, peer, False)
            head = encode_head(reply)
        except Exception as exc:  # noqa: BLE001 — a bug answers 500 and is logged; the listener goes on
            self.malformed(peer, f"{method!r} {url[:100]!r}: {type(exc).__name__}: {exc}", bug=exc)
            return encode_head(FAILED), FAILED.body, True
        body = b"" if method == b"HEAD" else reply.body
        if keep and reply.varies is not None and self._kept_count < KEPT_MAX:
            slot = self.kept.get(url)
            if slot is None or slot[0] != reply.varies:
                slot = self.kept[url] = (reply.varies, {})
            slot[1][tuple(headers.get(name) for name in reply.varies)] = (head, body)
            self._kept_count += 1
        return head, body, False


class _Protocol(asyncio.Protocol):
    """One connection: requests parsed as they arrive, each answered at once, in order."""

    __slots__ = ("listener", "transport", "parser", "peer", "url", "headers", "fields", "head_bytes", "in_head",
                 "closing")

    def __init__(self, listener: FastListener):
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = ""
        self.url = b""
        self.headers = _Headers()
        self.fields = 0  # of the request head being read
        self.head_bytes = 0  # of the request head being read
        self.in_head = True
        self.closing = False

    # ---------------------------------------------------------------- the connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio's classes, only alike
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.listener.admit(self, transport):
            self.closing = True
            transport.close()
            return
        self.transport = transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.listener.release(self)
        self.transport = None

    def pause_writing(self) -> None:  # a client that does not read its answers is not read either
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if self.in_head:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                return self._refuse(text(431, "request header fields too large\n"), "a request head over 64 kB")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(BAD_REQUEST, "an upgrade or CONNECT request")
        except httptools.HttpParserError as exc:
            if not self.closing:
                self._refuse(BAD_REQUEST, f"{type(exc).__name__}: {exc}")

    def _refuse(self, reply: Reply, why: str) -> None:
        """Answer ``reply`` once, log why (once per client per minute), and close: nothing more is read."""
        self.listener.malformed(self.peer, why)
        self._send(encode_head(reply), reply.body, close=True)

    def _send(self, head: bytes, body: bytes, close: bool) -> None:
        transport = self.transport
        if transport is None or self.closing:
            return
        conn = b"Connection: close\r\n" if close else b"" if self.parser.get_http_version() == "1.1" else \
            b"Connection: keep-alive\r\n"
        transport.writelines((head, date_line(), conn, b"\r\n", body))
        opened = self.listener.open.get(self)
        if opened is not None:
            opened.since = time.monotonic()
        if close:
            self.closing = True
            transport.close()

    # ---------------------------------------------------------------- httptools' callbacks

    def on_message_begin(self) -> None:
        self.url, self.headers, self.fields = b"", _Headers(), 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.headers
        self.fields += 1
        if self.fields > MAX_HEADERS:
            self._refuse(text(431, "request header fields too large\n"), f"over {MAX_HEADERS} header fields")
            raise httptools.HttpParserError("too many header fields")
        headers.setdefault(name.decode("latin-1").lower(), value.decode("utf-8", "replace"))

    def on_headers_complete(self) -> None:
        self.in_head, self.head_bytes = False, 0
        method = self.parser.get_method()
        if self.parser.should_upgrade():
            return self._refuse(BAD_REQUEST, "an upgrade or CONNECT request")
        if method not in (b"GET", b"HEAD"):
            return self._send(encode_head(NOT_ALLOWED), NOT_ALLOWED.body, close=True)
        if "transfer-encoding" in self.headers or self.headers.get("content-length", "0").strip() not in ("", "0"):
            return self._refuse(BAD_REQUEST, "a GET or HEAD request with a body")

    def on_message_complete(self) -> None:
        self.in_head = True
        if self.closing:
            return
        head, body, close = self.listener.respond(self.parser.get_method(), self.url, self.headers, self.peer)
        self._send(head, body, close or not self.parser.should_keep_alive())
