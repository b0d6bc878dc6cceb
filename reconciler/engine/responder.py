#!/usr/bin/env python3
"""The probe responder: what a probe or a user's app fetches *through* an inbound to see the flow work (HEALTH-16).

Python 3 standard library only, installed on every server as a managed file
(``/usr/local/lib/reconciler/responder.py``) and run by its own unit, socket-activated: the engine's unit pulls in
the listener (systemd holds it) and the responder starts at the first request (``handed_socket``). It
listens on the server's loopback only (the engine's ``direct`` outbound reaches it; nothing outside does) and
answers ``GET /pad/<n>`` with ``204 No Content`` whose *headers* carry ``n`` bytes of padding.

Why headers: an app's health check (Mihomo's ``fallback``, sing-box's ``urltest``) reads a response's headers
and closes it; it never reads a body. A censor that lets the handshake through and stalls the flow after some
kilobytes passes a small answer; padding in the headers means the check completes only when ``n`` bytes
crossed the path, so the check sees the stall as a user's download would. The agent's probe reads the same
answer to the end.

**An order for apps that choose by delay.** sing-box's ``urltest`` keeps no written order: it picks the lowest
measured delay and, with a tolerance, sticks to its pick. A profile that wants "the balanced choice first, the
others in order, and back to the first when it recovers" adds ``?o=<id>.<id>…`` to the check: the members'
inbound ids, hashed (``rank_id``), in the order wanted. The responder finds its own inbounds' ids in
``IDS_FILE`` and answers ``RANK_STEP`` seconds later per place in that order (``BASE`` for the first): the app
measures the order as delays, and its tolerance keeps it from reordering on jitter.

Bounded: ``n`` at most ``MAX_PAD``, the request line within ``LINE`` bytes and ``READ_SECONDS``, at most
``MAX_CLIENTS`` at once (a busy server's apps and the fleet's witnesses), and every answer ``Connection: close``.
"""

import asyncio
import hashlib
import json
import os
import sys
from typing import Any, Dict, FrozenSet  # typing's generics: the servers' Python may predate frozenset[...]

PORT = 9097
MAX_PAD = 256 * 1024  # the settings' bounds (app_probe_bytes, failover.check_bytes) are the same
LINE = 1024
READ_SECONDS = 2.0
WRITE_SECONDS = 30.0
MAX_CLIENTS = 1024
_CHUNK = b"X-Pad: " + b"a" * 1014 + b"\r\n"  # 1 KiB per header line: well within every client's line limit

IDS_FILE = "/etc/reconciler/responder.json"  # {"ids": [rank_id of each of this server's inbounds]}
BASE = 0.02  # the first in an order: never 0 ms (sing-box's urltest takes a 0 ms delay for "not measured")
RANK_STEP = 0.4
MAX_RANK = 8

_busy = [0]
_ids: Dict[str, Any] = {"mtime": -1.0, "ids": frozenset()}


def rank_id(inbound_id: str) -> str:
    """An inbound's id as an order names it (no operator's name in a URL): ``reconciler.model.types.order_id``."""
    return hashlib.blake2b(inbound_id.encode(), digest_size=4).hexdigest()


def own_ids(path: str = IDS_FILE) -> FrozenSet[str]:
    try:
        mtime = os.stat(path).st_mtime
        if mtime != _ids["mtime"]:
            with open(path) as f:
                data = json.load(f)
            _ids["ids"] = frozenset(str(x) for x in data.get("ids", [])[:4096])
            _ids["mtime"] = mtime
    except (OSError, ValueError, AttributeError):
        _ids["ids"], _ids["mtime"] = frozenset(), -1.0
    found: FrozenSet[str] = _ids["ids"]
    return found


def delay(path: str, ids: FrozenSet[str]) -> float:
    """How long to wait before answering: by this server's place in the order the query gives (none: no wait)."""
    _, _, query = path.partition("?")
    for item in query.split("&"):
        key, _, value = item.partition("=")
        if key == "o":
            order = value.split(".")[:MAX_RANK]
            rank = next((i for i, x in enumerate(order) if x in ids), len(order))
            return BASE + RANK_STEP * rank
    return 0.0


BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
HEAD = b"HTTP/1.1 204 No Content\r\nCache-Control: no-store\r\nConnection: close\r\n"


def padding(path: str) -> int:
    """The padding ``GET path`` asks for (at most ``MAX_PAD``); -1: not a padding path."""
    if not path.startswith("/pad/"):
        return -1
    try:
        return min(MAX_PAD, max(0, int(path[5:].split("?", 1)[0])))
    except ValueError:
        return 0


def answer(path: str) -> bytes:
    """The whole answer to ``GET path`` (what ``serve`` writes a chunk at a time): 204 with at least ``n`` bytes of
    headers, else 404."""
    n = padding(path)
    return NOT_FOUND if n < 0 else HEAD + _CHUNK * -(-n // len(_CHUNK)) + b"\r\n"


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    if _busy[0] >= MAX_CLIENTS:  # say so: a witness then learns nothing of the path, rather than a failure
        try:  # the request first: closing on unread bytes would send a reset, not the answer
            await asyncio.wait_for(reader.readline(), 0.5)
            writer.write(BUSY)
            await asyncio.wait_for(writer.drain(), 1.0)
        except (asyncio.TimeoutError, OSError, ValueError):
            pass
        writer.close()
        return
    _busy[0] += 1
    try:
        line = await asyncio.wait_for(reader.readline(), READ_SECONDS)
        parts = line[:LINE].decode("latin-1").split()
        if len(parts) >= 2 and parts[0] in ("GET", "HEAD"):
            wait = delay(parts[1], own_ids())
            if wait:
                await asyncio.sleep(wait)
            n = padding(parts[1])
            if n < 0:
                writer.write(NOT_FOUND)
            else:  # 16 KiB at a time: a slow reader holds the socket's buffers, not the whole answer
                writer.write(HEAD)
                lines = -(-n // len(_CHUNK))
                for done in range(0, lines, 16):
                    writer.write(_CHUNK * min(16, lines - done))
                    await asyncio.wait_for(writer.drain(), WRITE_SECONDS)
                writer.write(b"\r\n")
            await asyncio.wait_for(writer.drain(), WRITE_SECONDS)
    except (asyncio.TimeoutError, OSError, ValueError):
        pass
    finally:
        _busy[0] -= 1
        writer.close()


def handed_socket() -> Any:
    """The listening socket systemd hands over (socket activation: ``LISTEN_PID`` names this process, ``LISTEN_FDS``
    at least one, the first is fd 3), or None: then the responder listens itself."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if count < 1:
        return None
    import socket

    return socket.socket(fileno=3)


async def main(host: str, port: int) -> None:
    sock = handed_socket()
    if sock is not None:
        server = await asyncio.start_server(serve, sock=sock, limit=LINE * 2)
    else:
        server = await asyncio.start_server(serve, host, port, limit=LINE * 2, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    address = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RESPONDER", "127.0.0.1:%d" % PORT)
    host, _, port = address.rpartition(":")
    asyncio.run(main(host or "127.0.0.1", int(port)))
