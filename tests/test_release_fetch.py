"""How a server fetches a release (``reconciler/engine/scripts/engine.py``: ``get``, without urllib) against real
HTTP servers on loopback: a plain answer, a chunked one, redirects, refusals, a short body, a proxy, and TLS
verified. The same answers through urllib (``get_urllib``, what a proxy or a ``file:`` URL takes) agree."""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import ssl
import threading

import pytest

from reconciler.certificates import derived_certificate
from reconciler.credentials import Secret
from reconciler.engine.scripts import engine as script

BODY = os.urandom(3 * (1 << 20) + 12345)  # a few 1 MB blocks and a tail


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        Handler.seen.append(self.path)
        path = self.path.split("://", 1)[-1].split("/", 1)[-1]  # a proxy is asked for the whole URL
        path = "/" + path
        if path == "/file":
            self._send(200, BODY, {"Content-Length": str(len(BODY))})
        elif path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(BODY), 700_001):
                part = BODY[i:i + 700_001]
                self.wfile.write(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\nX-Trailer: yes\r\n\r\n")
        elif path == "/relative":
            self._send(302, b"", {"Location": "file", "Content-Length": "0"})
        elif path == "/absolute":
            self._send(301, b"", {"Location": f"http://127.0.0.1:{self.server.server_address[1]}/relative",
                                  "Content-Length": "0"})
        elif path == "/rooted":
            self._send(307, b"", {"Location": "/absolute", "Content-Length": "0"})
        elif path == "/loop":
            self._send(302, b"", {"Location": "/loop", "Content-Length": "0"})
        elif path == "/short":
            self._send(200, BODY[:1000], {"Content-Length": str(len(BODY))})
            self.close_connection = True
        else:
            self._send(404, b"no", {"Content-Length": "2"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def served():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Handler.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for k in list(os.environ):
        if k.lower().endswith("_proxy"):
            monkeypatch.delenv(k)


def _fetch(url: str, tmp_path) -> tuple[str, bytes]:
    out = tmp_path / "download"
    digest = script.fetch(url, str(out))
    return digest, out.read_bytes()


@pytest.mark.parametrize("path", ["/file", "/chunked", "/relative", "/absolute", "/rooted"])
def test_a_release_comes_whole_plain_chunked_or_redirected(served, tmp_path, path):
    digest, data = _fetch(served + path, tmp_path)
    assert data == BODY and digest == hashlib.sha256(BODY).hexdigest()
    # urllib, what a proxy or a file: URL takes, gets the same bytes
    got = bytearray()
    script.get_urllib(served + path, got.extend)
    assert bytes(got) == BODY


@pytest.mark.parametrize(("path", "says"), [("/missing", "answered HTTP 404"), ("/loop", "more than 5 redirects"),
                                            ("/short", "ended after 1000 of")])
def test_what_cannot_be_had_whole_is_a_fetch_failure(served, tmp_path, path, says):
    # kind "fetch": the controller may fetch the release itself and upload it
    with pytest.raises(script.Failed) as e:
        _fetch(served + path, tmp_path)
    assert e.value.kind == "fetch" and says in str(e.value), str(e.value)


def test_a_full_disk_here_is_not_a_fetch_failure(served):
    # The controller would upload the binary to a server whose own disk is full: the disk's error is raised as it is
    with pytest.raises(OSError) as e:
        script.fetch(served + "/file", "/dev/full")
    assert not isinstance(e.value, script.Failed) and e.value.errno == 28  # ENOSPC


def test_nothing_listening_and_not_http_are_fetch_failures(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(script.Failed) as e:
        _fetch(f"http://127.0.0.1:{port}/x", tmp_path)
    assert e.value.kind == "fetch"
    listener = socket.create_server(("127.0.0.1", 0))

    def babble() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        conn.close()

    threading.Thread(target=babble, daemon=True).start()
    with pytest.raises(script.Failed) as e:
        _fetch(f"http://127.0.0.1:{listener.getsockname()[1]}/x", tmp_path)
    listener.close()
    assert e.value.kind == "fetch" and "not an HTTP answer" in str(e.value)


def test_https_is_verified_against_the_systems_authorities(tmp_path):
    # A self-signed certificate is refused: the pin would refuse the bytes anyway, but nothing is fetched from a
    # server that is not who it says.
    cert = derived_certificate(Secret(b"fetch-test-secret-0123456789abcdef"), "fetch", "localhost")
    (tmp_path / "c.pem").write_text(cert.cert_pem)
    (tmp_path / "k.pem").write_text(cert.key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(script.Failed) as e:
            _fetch(f"https://localhost:{server.server_address[1]}/file", tmp_path)
        assert e.value.kind == "fetch" and "CERTIFICATE_VERIFY_FAILED" in str(e.value), str(e.value)
    finally:
        server.shutdown()
        server.server_close()


def test_a_proxy_in_the_environment_is_honoured(served, tmp_path):
    # The whole script, in a Python of its own as on a server (urllib keeps the proxies it first saw per process);
    # the test server stands in for the proxy: it is asked for the whole URL.
    import json
    import subprocess
    import sys

    from reconciler.engine import remote

    tmp = tmp_path / "sing-box.reconciler-new"
    text, _ = remote.ENGINE.prepare({"tmp": str(tmp), "mode": "download", "url": "http://release.invalid/file",
                                     "name": "sing-box", "sha256": hashlib.sha256(BODY).hexdigest(), "version": "v"})
    env = {"PATH": os.environ.get("PATH", ""), "http_proxy": served}
    out = subprocess.run([sys.executable, "-I", "-S", "-c", text], capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(out.stdout)["ok"] is True, out.stdout + out.stderr
    assert tmp.read_bytes() == BODY and Handler.seen == ["http://release.invalid/file"]
