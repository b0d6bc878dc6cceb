"""A censor's server-name filter, for the lab: a TCP relay in a host's namespace that reads each ClientHello and
resets the connection when its server name (SNI) is one it was told to block; everything else passes unchanged.

nftables cannot match a ClientHello's server name (it sits at no fixed offset). The lab redirects the watched
witnesses' connections to an inbound's port here (``Lab.sni_reset``: a ``redirect`` rule in the target's
namespace); the relay forwards what it lets pass to the same port on the host's loopback.

    python -m reconciler.lab.middlebox LISTEN_PORT TARGET_PORT NAME[,NAME...]
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

HELLO_LIMIT = 16384
READ_SECONDS = 5.0


def server_name(hello: bytes) -> str | None:
    """The SNI of a TLS ClientHello record (None: not one, or none in it). Pure."""
    try:
        if len(hello) < 5 or hello[0] != 0x16:
            return None
        body = hello[5:5 + struct.unpack("!H", hello[3:5])[0]]
        if not body or body[0] != 0x01:
            return None
        at = 4 + 2 + 32  # handshake header, version, random
        at += 1 + body[at]  # session id
        at += 2 + struct.unpack("!H", body[at:at + 2])[0]  # cipher suites
        at += 1 + body[at]  # compression methods
        end = at + 2 + struct.unpack("!H", body[at:at + 2])[0]
        at += 2
        while at + 4 <= end:
            kind, size = struct.unpack("!HH", body[at:at + 4])
            if kind == 0:  # server_name: list length, then (type, length, name)
                name_len = struct.unpack("!H", body[at + 7:at + 9])[0]
                return body[at + 9:at + 9 + name_len].decode("ascii", "replace").lower()
            at += 4 + size
    except (IndexError, struct.error):
        return None
    return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    writer.close()


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: int, blocked: set[str]) -> None:
    hello = b""
    try:
        while len(hello) < HELLO_LIMIT:
            chunk = await asyncio.wait_for(reader.read(HELLO_LIMIT), READ_SECONDS)
            if not chunk:
                break
            hello += chunk
            if len(hello) >= 5 and len(hello) >= 5 + struct.unpack("!H", hello[3:5])[0]:
                break
    except (OSError, TimeoutError):
        writer.close()
        return
    if server_name(hello) in blocked:
        _reset(writer)
        return
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        _reset(writer)
        return
    up_writer.write(hello)
    await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))


async def main(listen: int, target: int, blocked: set[str]) -> None:
    server = await asyncio.start_server(lambda r, w: handle(r, w, target, blocked), "0.0.0.0", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), {n.lower() for n in sys.argv[3].split(",") if n}))
