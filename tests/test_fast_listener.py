"""The public listener on its own (``reconciler.loop.fastlistener``): the same answers as the aiohttp listener byte
for byte, answers kept only while they hold, and a parser of our own that refuses what it must. Real sockets on
loopback, raw HTTP so that every header is seen; every loop is bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket

from prometheus_client import CollectorRegistry

from reconciler.fleet import Learned
from reconciler.lab.demo import free_port
from reconciler.loop.fastlistener import MAX_HEAD, MAX_HEADERS, FastListener
from reconciler.loop.http import HttpOutlet
from reconciler.loop.listener import Limits
from reconciler.model import Cluster
from reconciler.publish import LiveAnswers, Tokens
from tests.test_http_hardening import outlet
from tests.test_loop import SECRET, cluster, snapshot_after


def _outlet(c: Cluster | None = None) -> tuple[HttpOutlet, LiveAnswers]:
    c = c or cluster(3, users=3, protocol="shadowsocks-2022")  # documents with entries in every format
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snapshot_after(c, Learned.fresh(c)))
    return HttpOutlet(answers, CollectorRegistry(), lambda: None, lambda: (True, "ok")), answers


async def _exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send ``request`` and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def _undated(raw: bytes) -> bytes:
    return re.sub(rb"\r\nDate: [^\r]*", b"", raw)


def test_the_fast_listener_answers_as_the_aiohttp_listener_does():
    http, answers = _outlet()
    fast, ops, shared = free_port(), free_port(), free_port()
    tokens = [answers.tokens.token(f"u{i}", 0) for i in range(3)]
    browser = "User-Agent: Mozilla/5.0 (X11; Linux x86_64) Firefox/120.0\r\nAccept: text/html\r\n"
    requests = []
    for token in tokens:
        for tail, extra in [("", ""), ("/links", ""), ("/clash", ""), ("/sing-box.json", ""), ("?format=clash", ""),
                            ("", "User-Agent: sing-box 1.10\r\n"), ("", "User-Agent: ClashMeta/1.18\r\n"),
                            ("", browser), ("?lang=ru", browser), ("/links", "If-None-Match: *\r\n"),
                            ("/nope", ""), ("/links/x", "")]:
            requests.append(f"GET /sub/{token}{tail} HTTP/1.1\r\nHost: vpn.lab.test\r\n{extra}Connection: close\r\n\r\n")
    requests += [f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                 for path in ("/sub/unknown-token", "/sub/", "/sub/%41%42")]
    # Not under /sub/: the shared listener gives them to the operations pages; the public one says only this.
    alone = {"/healthz": b"200 OK", "/": b"404 Not Found", "/metrics": b"404 Not Found", "/status.json": b"404 Not Found"}

    async def go() -> tuple[list[tuple[bytes, bytes]], dict[str, bytes]]:
        other, _ = _outlet()
        await http.start("127.0.0.1", fast, operations=("127.0.0.1", ops))
        other.answers = http.answers
        other.side.answers = http.answers
        await other.start("127.0.0.1", shared)  # one aiohttp listener for both sides
        try:
            assert isinstance(http.listeners[0], FastListener)
            out = []
            for request in requests * 2:  # the second time from what the fast listener kept
                out.append((await _exchange(fast, request.encode()), await _exchange(shared, request.encode())))
            public = {path: await _exchange(fast, f"GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
                      for path in alone}
            return out, public
        finally:
            await http.stop()
            await other.stop()

    pairs, public = asyncio.run(go())
    for path, status in alone.items():
        assert public[path].startswith(b"HTTP/1.1 " + status), path
    assert {raw.split(b" ", 2)[1] for raw, _ in pairs} >= {b"200", b"304", b"404"}
    for (mine, theirs), request in zip(pairs, requests * 2, strict=True):
        assert _undated(mine) == _undated(theirs), request
    assert any(b"proxies:" in mine for mine, _ in pairs)  # real documents, not only empty ones


def test_kept_answers_last_only_as_long_as_their_snapshot_and_settings():
    http, answers = _outlet()
    port, ops = free_port(), free_port()
    token = answers.tokens.token("u0", 0)
    request = f"GET /sub/{token}/clash HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    snap = answers.snapshot
    assert snap is not None
    data = snap.cluster.model_dump(mode="json", exclude_unset=True)
    data["users"][0]["enabled"] = False
    disabled = Cluster.model_validate(data)

    async def go() -> list[bytes]:
        await http.start("127.0.0.1", port, operations=("127.0.0.1", ops))
        listener = http.listeners[0]
        assert isinstance(listener, FastListener)
        try:
            first = await _exchange(port, request)
            assert len(listener.kept) == 1
            again = await _exchange(port, request)
            answers.publish(dataclasses.replace(snap, cluster=disabled))
            refused = await _exchange(port, request)
            http.region_of = lambda address: None  # answers that depend on the peer are not kept
            await _exchange(port, request)
            kept_with_regions = len(listener.kept)
            return [first, again, refused, bytes([kept_with_regions])]
        finally:
            await http.stop()

    first, again, refused, kept = asyncio.run(go())
    assert first.startswith(b"HTTP/1.1 200") and _undated(first) == _undated(again)
    assert refused.startswith(b"HTTP/1.1 403") and b"proxies:" not in refused
    assert kept == bytes([0])


def test_the_fast_listener_refuses_what_it_must_and_logs_it_once(caplog):
    http, _ = outlet()
    port, ops = free_port(), free_port()
    token = http.answers.tokens.token("u0", 0)
    ok = f"GET /sub/{token}/clash HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    async def go() -> dict[str, bytes]:
        await http.start("127.0.0.1", port, operations=("127.0.0.1", ops))
        try:
            out = {
                "pipelined": await _exchange(port, ok * 3 + b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"),
                "long head": await _exchange(port, b"GET /sub/x HTTP/1.1\r\nX-Pad: " + b"a" * (MAX_HEAD + 10) + b"\r\n\r\n"),
                "many fields": await _exchange(port, b"GET /sub/x HTTP/1.1\r\n" + b"X-A: b\r\n" * (MAX_HEADERS + 1) + b"\r\n"),
                "a body": await _exchange(port, b"GET /healthz HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello" + ok),
                "post": await _exchange(port, b"POST /sub/x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello" + ok),
                "upgrade": await _exchange(port, b"GET /sub/x HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n"
                                           + ok),
                "tls": await _exchange(port, b"\x16\x03\x01 not http at all\r\n\r\n"),
            }
            for _ in range(20):  # more of the same from this client: not logged again
                await _exchange(port, b"\x16\x03\x01 again\r\n\r\n")
            return out
        finally:
            await http.stop()

    with caplog.at_level(logging.DEBUG):
        out = asyncio.run(go())
    # four answers in order on one connection (this outlet's loop is unhealthy: the last is a 503)
    assert out["pipelined"].count(b"HTTP/1.1 200 OK") == 3 and out["pipelined"].endswith(b"unhealthy\n")
    assert out["long head"].startswith(b"HTTP/1.1 431") and out["many fields"].startswith(b"HTTP/1.1 431")
    assert out["a body"].startswith(b"HTTP/1.1 400") and out["a body"].count(b"HTTP/1.1") == 1  # nothing after it read
    assert out["post"].startswith(b"HTTP/1.1 405") and out["post"].count(b"HTTP/1.1") == 1
    assert out["upgrade"].startswith(b"HTTP/1.1 400") and out["upgrade"].count(b"HTTP/1.1") == 1
    assert out["tls"].startswith(b"HTTP/1.1 400")
    lines = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(lines) == 1 and "127.0.0.1" in lines[0].getMessage()
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("reconciler"))


def test_a_client_that_does_not_read_is_not_read_either():
    # Pipelined requests without reading the answers: the listener stops reading once its send buffer is full, so
    # what it holds for that client stays bounded however many requests are sent.
    http, answers = _outlet()
    port, ops = free_port(), free_port()
    token = answers.tokens.token("u0", 0)
    request = f"GET /sub/{token}/clash HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    async def go() -> tuple[int, int]:
        await http.start("127.0.0.1", port, operations=("127.0.0.1", ops), limits=Limits(header_timeout=30))
        listener = http.listeners[0]
        try:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                sent = 0
                for _ in range(20_000):  # bounded: stops as soon as the kernel takes no more
                    try:
                        sent += sock.send(request * 50)
                    except BlockingIOError:
                        await asyncio.sleep(0.05)
                        try:
                            sent += sock.send(request * 50)
                        except BlockingIOError:
                            break
                    await asyncio.sleep(0)
                await asyncio.sleep(0.3)
                return sent // len(request), listener.served
        finally:
            await http.stop()

    sent, served = asyncio.run(go())
    assert served < sent  # it stopped reading: the rest waits in the kernel's buffers, not in ours
