"""The HTTP outlet on the internet: public and operations listeners apart, authentication on the
operations side, slow and idle connections closed, a connection cap, ETags by RFC 9110 and quiet
logs for malformed requests. Real sockets on loopback; every loop is bounded."""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import time

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from reconciler.credentials import user_credentials
from reconciler.fleet import Learned
from reconciler.lab.demo import free_port
from reconciler.loop.http import HttpOutlet, none_match
from reconciler.loop.listener import Credential, Limits
from reconciler.publish import LiveAnswers, Tokens
from tests.test_loop import SECRET, cluster, snapshot_after


def outlet() -> tuple[HttpOutlet, str]:
    c = cluster(3, users=2)
    snap = snapshot_after(c, Learned.fresh(c))
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snap)
    return HttpOutlet(answers, CollectorRegistry(), lambda: None, lambda: (False, "interval 7 failed: a secret reason")), \
        user_credentials(SECRET, "u0", 0).token


async def status(session: aiohttp.ClientSession, url: str, **kw: object) -> tuple[int, str]:
    async with session.get(url, **kw) as r:  # type: ignore[arg-type]
        return r.status, await r.text()


def test_the_public_listener_serves_subscriptions_and_health_only_and_operations_need_the_credential():
    http, token = outlet()
    pub, ops = free_port(), free_port()
    cred = Credential("bearer", "s3cret-operations-token")

    async def go() -> None:
        await http.start("127.0.0.1", pub, operations=("127.0.0.1", ops), credential=cred)
        try:
            async with aiohttp.ClientSession() as s:
                assert (await status(s, f"http://127.0.0.1:{pub}/sub/{token}"))[0] == 200
                assert await status(s, f"http://127.0.0.1:{pub}/healthz") == (503, "unhealthy\n")  # no reasons in public
                for page in ("/metrics", "/", "/status.json"):
                    assert (await status(s, f"http://127.0.0.1:{pub}{page}"))[0] == 404
                    code, _ = await status(s, f"http://127.0.0.1:{ops}{page}")
                    assert code == 401
                    wrong = {"Authorization": "Bearer s3cret-operations-tokeX"}
                    assert (await status(s, f"http://127.0.0.1:{ops}{page}", headers=wrong))[0] == 401
                good = {"Authorization": "Bearer s3cret-operations-token"}
                code, text = await status(s, f"http://127.0.0.1:{ops}/healthz", headers=good)
                assert code == 503 and "interval 7 failed" in text
                assert (await status(s, f"http://127.0.0.1:{ops}/metrics", headers=good))[0] == 200
                assert (await status(s, f"http://127.0.0.1:{ops}/sub/{token}", headers=good))[0] == 404
        finally:
            await http.stop()

    asyncio.run(go())


def test_basic_credentials_are_compared_whole():
    cred = Credential("basic", "ops:pa:ss")
    assert cred.accepts("Basic " + base64.b64encode(b"ops:pa:ss").decode())
    assert not cred.accepts("Basic " + base64.b64encode(b"ops:pa").decode())
    assert not cred.accepts("Basic !!!") and not cred.accepts("Bearer ops:pa:ss") and not cred.accepts(None)
    assert "pa:ss" not in repr(cred)


@pytest.mark.parametrize(("header", "match"), [
    ('"abc"', True), ('W/"abc"', True), ('"x", "abc"', True), ('"x" , W/"abc"', True), ("*", True),
    ('"abd"', False), ("", False), (None, False), ('"abc', False)])
def test_if_none_match_follows_rfc_9110(header, match):
    assert none_match(header, '"abc"') is match


@pytest.mark.parametrize("public_alone", [False, True], ids=["aiohttp", "fast"])
def test_slow_headers_and_idle_connections_are_closed_and_the_cap_holds(public_alone):
    # public_alone: the public listener on its own address runs on reconciler.loop.fastlistener, with the same guards
    http, token = outlet()
    port = free_port()
    limits = Limits(max_connections=8, header_timeout=1.0)

    async def go() -> tuple[int, int, int]:
        await http.start("127.0.0.1", port, limits=limits,
                         operations=("127.0.0.1", free_port()) if public_alone else None)
        try:
            # A slowloris: headers never finished. And an idle keep-alive connection after one request.
            slow = await asyncio.open_connection("127.0.0.1", port)
            slow[1].write(b"GET /sub/" + token.encode() + b" HTTP/1.1\r\nHost: x\r\n")
            await slow[1].drain()
            idle = await asyncio.open_connection("127.0.0.1", port)
            idle[1].write(f"GET /sub/{token} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await idle[1].drain()
            await asyncio.wait_for(idle[0].readuntil(b"\r\n\r\n"), 5)
            # The cap: 8 connections are held open; more are closed at once.
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
            settle = time.monotonic() + 5
            while http.listeners[0].refused < 2 and time.monotonic() < settle:
                await asyncio.sleep(0.05)
            refused = http.listeners[0].refused
            closed = 0
            deadline = time.monotonic() + 10
            for reader, _ in (slow, idle):
                try:
                    rest = await asyncio.wait_for(reader.read(), max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    rest = None
                closed += rest is not None  # EOF (b"" or the rest of a response): the server closed it
            for _, w in (slow, idle, *held):
                w.close()
            return refused, closed, http.listeners[0].timed_out
        finally:
            await http.stop()

    refused, closed, _ = asyncio.run(go())
    assert refused >= 2  # 8 of 12 fit (the slow and idle ones count too)
    assert closed == 2  # by the sweeper or by aiohttp's keep-alive timer, whichever comes first


def test_malformed_requests_are_logged_once_per_client_per_minute(caplog):
    http, _ = outlet()
    port = free_port()

    async def go() -> None:
        await http.start("127.0.0.1", port)
        try:
            for _ in range(50):
                with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
                    sock.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
                    sock.settimeout(3)
                    try:
                        await asyncio.to_thread(sock.recv, 1024)
                    except OSError:
                        pass
        finally:
            await http.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(go())
    lines = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(lines) == 1 and "127.0.0.1" in lines[0].getMessage()
    assert not any(r.exc_info for r in caplog.records if r.name.startswith(("aiohttp", "reconciler")))
