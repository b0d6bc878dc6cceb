"""Answer an ACME HTTP-01 challenge on this server (RFC 8555 §8.3): serve ``validation`` at
``/.well-known/acme-challenge/<token>`` on ``port`` while the ``run`` marker exists (the controller removes it once
the CA has validated) and at most ``seconds``. Started detached; its state is ``out`` (``{"ready": true}`` once
listening, or ``{"error": …}``): a port that is taken says so at once.
"""

from __future__ import annotations

import json
import os
import socket
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any

REQUEST: Any = None


def at(root: str, path: str) -> str:
    """Where a server path is: under ``root`` (a fake host's directory in tests), else itself."""
    return path if root == "/" else root.rstrip("/") + path


class Server6(HTTPServer):
    address_family = socket.AF_INET6  # "::" with IPV6_V6ONLY off (Linux's default) takes IPv4 too


def main(req: dict[str, Any]) -> None:
    root = req.get("root", "/")
    run, out = at(root, req["run"]), at(root, req["out"])
    path, validation = "/.well-known/acme-challenge/" + req["token"], req["validation"].encode()

    class Answer(BaseHTTPRequestHandler):
        timeout = 10  # an idle connection never holds the responder (and port 80) past its time

        def do_GET(self) -> None:  # noqa: N802 — the name http.server calls
            body = validation if self.path == path else b"not found\n"
            self.send_response(200 if self.path == path else 404)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    try:
        try:
            server: HTTPServer = Server6(("::", int(req["port"])), Answer)
        except OSError:
            server = HTTPServer(("0.0.0.0", int(req["port"])), Answer)  # no IPv6 on this host
    except OSError as e:
        with open(out, "w") as f:
            f.write(json.dumps({"error": "cannot listen on port %s for the CA's HTTP-01 check: %s" % (req["port"], e)}))
        return
    with open(run, "w") as f:
        f.write(str(os.getpid()))
    with open(out, "w") as f:
        f.write(json.dumps({"ready": True}))
    server.timeout = 0.25
    end = time.monotonic() + float(req.get("seconds", 180))
    try:
        while os.path.exists(run) and time.monotonic() < end:
            server.handle_request()
    finally:
        server.server_close()
        for leftover in (run, out):
            if os.path.exists(leftover):
                os.remove(leftover)


if __name__ == "__main__":
    main(REQUEST)
