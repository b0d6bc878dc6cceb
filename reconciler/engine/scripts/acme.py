"""Answer an ACME HTTP-01 challenge on this server (RFC 8555 §8.3): serve ``validation`` at
``/.well-known/acme-challenge/<token>`` on ``port`` while the ``run`` marker exists (the controller removes it once
the CA has validated) and at most ``seconds``. Started detached; its state is ``out`` (``{"ready": true}`` once
listening, or ``{"error": …}``): a port that is taken says so at once.

Port 80 is open to anyone while it runs, and the CA asks from several places at once: each connection is answered
in a thread of its own, so a client that connects and sends nothing (or drips a byte at a time) never holds up the
CA's requests. Each connection has ``READ_SECONDS`` for every read and ``TOTAL_SECONDS`` in all, then it is closed;
at most ``MAX_CONNECTIONS`` are open at once, ``PER_ADDRESS`` of them from one client (an address; an IPv6 one by
its /64, which one host often holds whole), and more are closed at once.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn

from reconciler.engine.scripts.prelude import at  # spliced in when sent

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any

REQUEST: Any = None

#: Seconds one read of a request may wait for its next bytes.
READ_SECONDS = 5.0
#: Seconds a connection may stay open in all, however it drips.
TOTAL_SECONDS = 10.0
#: Connections open at once (each is a thread); the CA's few requests need a handful.
MAX_CONNECTIONS = 64
def _client(peer: str) -> str:
    """Whose connection it is: its address, an IPv4-mapped one as IPv4, an IPv6 one by its /64."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))
    return str(address)


#: Connections open at once from one address: one client cannot take the places the CA's requests need.
PER_ADDRESS = 8


class Server(ThreadingMixIn, HTTPServer):
    """A thread per connection, within the caps; ``reap`` closes the connections past their ``TOTAL_SECONDS``."""

    daemon_threads = True  # a connection still open never keeps the responder alive past its time
    request_queue_size = 128
    block_on_close = False

    def __init__(self, address: Any, handler: Any, family: int) -> None:
        self.address_family = family
        self.lock = threading.Lock()
        self.open: dict[Any, tuple[str, float]] = {}  # connection → (its address, its deadline)
        self.refused = 0
        HTTPServer.__init__(self, address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = _client(str(client_address[0]) if isinstance(client_address, tuple) and client_address else "")
        with self.lock:
            mine = sum(1 for who, _ in self.open.values() if who == peer)
            if len(self.open) >= MAX_CONNECTIONS or mine >= PER_ADDRESS:
                self.refused += 1
                full = True
            else:
                self.open[request] = (peer, time.monotonic() + TOTAL_SECONDS)
                full = False
        if full:
            self.shutdown_request(request)
            return
        try:
            ThreadingMixIn.process_request(self, request, client_address)
        except Exception:  # noqa: BLE001 — no thread to be had: this connection is closed, the responder goes on
            self.forget(request)
            self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            ThreadingMixIn.process_request_thread(self, request, client_address)
        finally:
            self.forget(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # the client left in the middle of an answer: nothing to tell
            return
        HTTPServer.handle_error(self, request, client_address)

    def forget(self, request: Any) -> None:
        with self.lock:
            self.open.pop(request, None)

    def reap(self, everyone: bool = False) -> None:
        """Shut the connections past their deadline, or all (their threads then see the end of the stream and finish)."""
        now = time.monotonic()
        with self.lock:
            late = [conn for conn, (_, deadline) in self.open.items() if everyone or deadline <= now]
        for conn in late:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(req: dict[str, Any]) -> None:
    root = req.get("root", "/")
    run, out = at(root, req["run"]), at(root, req["out"])
    path, validation = "/.well-known/acme-challenge/" + req["token"], req["validation"].encode()

    class Answer(BaseHTTPRequestHandler):
        timeout = READ_SECONDS  # each read of the request; TOTAL_SECONDS bounds them all (Server.reap)

        def do_GET(self) -> None:  # the name http.server calls
            body = validation if self.path == path else b"not found\n"
            self.send_response(200 if self.path == path else 404)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    # "::" with IPV6_V6ONLY off (Linux's default) takes IPv4 too; ``host``: one address only (the tests' loopback)
    host = req.get("host")
    binds = [(host, socket.AF_INET6 if ":" in host else socket.AF_INET)] if host else \
        [("::", socket.AF_INET6), ("0.0.0.0", socket.AF_INET)]  # the second: no IPv6 on this host
    server = None
    for i, (address, family) in enumerate(binds):
        try:
            server = Server((address, int(req["port"])), Answer, family)
            break
        except OSError as e:
            if i == len(binds) - 1:
                with open(out, "w") as f:
                    f.write(json.dumps({"error": "cannot listen on port %s for the CA's HTTP-01 check: %s" % (req["port"], e)}))
                return
    assert server is not None
    with open(run, "w") as f:
        f.write(str(os.getpid()))
    with open(out, "w") as f:
        f.write(json.dumps({"ready": True}))
    server.timeout = 0.25
    end = time.monotonic() + float(req.get("seconds", 180))
    try:
        while os.path.exists(run) and time.monotonic() < end:
            server.handle_request()  # accepts one connection (its thread answers it) or waits 0.25 s
            server.reap()
    finally:
        server.server_close()
        server.reap(everyone=True)
        for leftover in (run, out):
            if os.path.exists(leftover):
                os.remove(leftover)


if __name__ == "__main__":
    main(REQUEST)
