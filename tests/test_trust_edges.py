"""The network edges where others' bytes come in, each held against the attack named in its test: the ACME
HTTP-01 responder, the public listener, the webhook, what servers print into a plan, and a hostile cluster file.

Real sockets on loopback only (127.0.0.1; a second client speaks from 127.0.0.2, loopback too); every loop is
bounded in count and in time, and no assertion is about how long something took."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from reconciler.config import yamlread
from reconciler.config.loader import load_cluster
from reconciler.engine.base import ManagedFile
from reconciler.engine.scripts import acme
from reconciler.errors import RemoteCommandError
from reconciler.lab.demo import free_port
from reconciler.loop import service
from reconciler.loop.client_address import networks
from reconciler.loop.listener import Limits
from reconciler.plan.actions import Action, ServerPlan, file_diff, render_human, render_json
from tests.test_http_hardening import outlet

OTHER = "127.0.0.2"  # a second client's address: loopback, as every address here


def _wait(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Poll ``check`` until it holds, at most ``seconds`` (a bound, never an assertion about time)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


# --------------------------------------------------------------------------- the ACME HTTP-01 responder


@pytest.fixture
def responder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, dict[str, Any]]]:
    """The responder script itself, in a thread, on 127.0.0.1 only; stopped as the controller stops it (the marker
    removed). Generous deadlines unless a test sets them: a connection the test holds stays open while it looks."""
    monkeypatch.setattr(acme, "READ_SECONDS", 60.0)
    monkeypatch.setattr(acme, "TOTAL_SECONDS", 60.0)
    port = free_port()
    req = {"port": port, "host": "127.0.0.1", "token": "tok-123", "validation": "tok-123.thumbprint",
           "run": "/acme.run", "out": "/acme.out", "seconds": 60, "root": str(tmp_path)}
    started: dict[str, Any] = {}

    def start() -> None:
        thread = threading.Thread(target=acme.main, args=(req,), daemon=True)
        thread.start()
        started["thread"] = thread
        out = tmp_path / "acme.out"
        assert _wait(lambda: out.exists() and '"ready"' in out.read_text()), "the responder did not start"

    req["start"] = start
    yield port, req
    (tmp_path / "acme.run").unlink(missing_ok=True)
    if "thread" in started:
        started["thread"].join(10)
        assert not started["thread"].is_alive()


def _challenge(port: int, token: str, source: str | None = None) -> bytes:
    """The CA's request for the token, as a raw HTTP/1.0 exchange (read until the responder closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0) if source else None) as s:
        s.sendall(f"GET /.well-known/acme-challenge/{token} HTTP/1.0\r\nHost: vpn.example\r\n\r\n".encode())
        chunks = []
        for _ in range(100):
            chunk = s.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _closed_by_peer(sock: socket.socket, seconds: float) -> bool:
    """Whether the other side closed ``sock`` within ``seconds`` (EOF or reset); False while it is held open."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_slow_client_does_not_hold_up_the_cas_request(responder):
    # Attack: a client connects to the responder's port 80 and sends nothing, or half a request, and holds on. A
    # responder answering one connection at a time lets the CA's request wait behind it until validation fails.
    port, req = responder
    req["start"]()
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(OTHER, 0))
            for _ in range(acme.PER_ADDRESS + 2)]
    try:
        slow[0].sendall(b"GET /.well-known/acme-chall")  # never finished
        answer = _challenge(port, "tok-123")
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"\r\n\r\ntok-123.thumbprint")
        # The slow client's connections are still held (each in its own thread), but for those past the cap of
        # one address: closed at once, so one client never takes every place the CA's requests need.
        assert all(_closed_by_peer(s, 5.0) for s in slow[acme.PER_ADDRESS:])  # accepted in order: the last two
        assert not any(_closed_by_peer(s, 0.1) for s in slow[:acme.PER_ADDRESS])
        assert b"404" in _challenge(port, "another-token")  # and the CA is still answered, token by token
    finally:
        for s in slow:
            s.close()


def test_a_dripping_client_is_cut_off_at_its_total_deadline(responder, monkeypatch):
    # Attack: a client drips one byte at a time, each well within the read deadline, to keep its connection (and,
    # with enough of them, the responder) forever. The total deadline ends it however it drips.
    monkeypatch.setattr(acme, "TOTAL_SECONDS", 1.0)
    port, req = responder
    req["start"]()
    request = b"GET /.well-known/acme-challenge/tok-123 HTTP/1.0\r\nX-Padding: " + b"a" * 200
    cut = False
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(OTHER, 0)) as s:
        for i in range(len(request)):  # at most 240 bytes, 0.05 s apart: 12 s at the very most
            try:
                s.sendall(request[i:i + 1])
            except OSError:
                cut = True
                break
            if _closed_by_peer(s, 0.05):
                cut = True
                break
    assert cut, "the responder kept a dripping connection open for the whole drip"
    assert _challenge(port, "tok-123").endswith(b"tok-123.thumbprint")


# --------------------------------------------------------------------------- the public listener


def test_one_client_cannot_take_every_connection_of_the_listener():
    # Attack: one client opens connections until the listener's cap (shared by every client) is reached and keeps
    # them open: everyone else's connections are then closed at once. A cap per client leaves room for the others.
    http, token = outlet()
    port = free_port()
    limits = Limits(max_connections=16, per_client=4, header_timeout=30.0, loopback_is_proxy=False)

    async def go() -> tuple[int, int, int]:
        await http.start("127.0.0.1", port, limits=limits)
        greedy = []
        try:
            for _ in range(20):  # more than the whole listener's cap
                greedy.append(await asyncio.open_connection("127.0.0.1", port, local_addr=(OTHER, 0)))
            listener = http.listeners[0]
            for _ in range(250):  # until the listener has seen all 20 (at most 5 s)
                if listener.refused + len(listener.open) >= 20:
                    break
                await asyncio.sleep(0.02)
            async with aiohttp.ClientSession() as s:  # another client, from 127.0.0.1
                async with s.get(f"http://127.0.0.1:{port}/sub/{token}", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    served = r.status
            return served, listener.refused, listener.by_client.get(OTHER, 0)
        finally:
            for _, w in greedy:
                w.close()
            await http.stop()

    served, refused, held = asyncio.run(go())
    assert served == 200
    assert (held, refused) == (4, 16)  # the greedy client holds its 4; its 16 more were closed at once


def test_a_trusted_proxy_is_not_capped_as_one_client():
    # Not an attack but what the cap must not break: behind a trusted proxy every client comes from the proxy's
    # address, so the cap per client would cap them all together. The listener's own cap still holds.
    http, _ = outlet()
    http.trusted_proxies = networks([f"{OTHER}/32"])
    port = free_port()

    async def go() -> tuple[int, int]:
        await http.start("127.0.0.1", port, limits=Limits(max_connections=16, per_client=4, header_timeout=30.0, loopback_is_proxy=False))
        held = []
        try:
            for _ in range(8):
                held.append(await asyncio.open_connection("127.0.0.1", port, local_addr=(OTHER, 0)))
            listener = http.listeners[0]
            for _ in range(250):
                if listener.refused + len(listener.open) >= 8:
                    break
                await asyncio.sleep(0.02)
            return len(listener.open), listener.refused
        finally:
            for _, w in held:
                w.close()
            await http.stop()

    assert asyncio.run(go()) == (8, 0)


# --------------------------------------------------------------------------- the webhook


class _Hook(http.server.ThreadingHTTPServer):
    """A loopback HTTP server that records the bodies POSTed to it and answers ``status`` (with ``location``)."""

    def __init__(self, status: int = 200, location: str = ""):
        self.bodies: list[bytes] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the name http.server calls
                hook.bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> _Hook:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


def test_a_webhook_follows_no_redirect_and_logs_no_token(caplog):
    # Attack: the webhook's endpoint (or whoever took it over) answers 307 to an address of its choosing; a client
    # that follows it POSTs the event there too. And the URL's path and query hold the webhook's token: a log line
    # with the whole URL hands it to everyone who reads the logs.
    caplog.set_level(logging.WARNING, logger="reconciler.loop")
    with _Hook() as elsewhere, _Hook(307, elsewhere.url + "/catch") as hook:
        url = f"{hook.url}/hooks/SECRET-PATH-TOKEN?token=SECRET-QUERY-TOKEN"
        asyncio.run(asyncio.wait_for(service._post(url, {"event": "server_blocked", "server": "fra-1"}), 15))
        assert len(hook.bodies) == 1 and json.loads(hook.bodies[0])["server"] == "fra-1"
    assert elsewhere.bodies == []  # the redirect was not followed: the body never left for another address
    assert "307" in caplog.text and "redirect" in caplog.text and hook.url in caplog.text
    assert "SECRET" not in caplog.text


def test_a_failing_webhook_logs_no_credential_of_its_url(caplog):
    # Attack: as above, through the error path: a webhook that cannot be reached is logged with the error's text,
    # and the URL's user information, path and query (credentials all) must not be in it either.
    caplog.set_level(logging.WARNING, logger="reconciler.loop")
    port = free_port()  # nothing listens there
    url = f"http://hook-user:SECRET-PASSWORD@127.0.0.1:{port}/hooks/SECRET-PATH-TOKEN?token=SECRET-QUERY-TOKEN"
    asyncio.run(asyncio.wait_for(service._post(url, {"event": "x"}), 15))
    assert f"127.0.0.1:{port}" in caplog.text and "failed" in caplog.text
    assert "SECRET" not in caplog.text and "hook-user" not in caplog.text


# --------------------------------------------------------------------------- what servers print into a plan

ESCAPES = "\x1b]0;pwned\x07 and \x1b[2J"  # OSC 0 (the terminal's title) and CSI 2J (clear the screen)
HIDDEN = "\x9b31m\u202etxt.exe"  # C1 CSI, and a right-to-left override


def _hostile_plans() -> list[ServerPlan]:
    unit = ManagedFile("/etc/systemd/system/sing-box.service", b"[Service]\nExecStart=/usr/local/bin/sing-box run\n",
                       engine=False)
    old = f"[Service]\nExecStart=/usr/local/bin/sing-box run\n# {ESCAPES}\n# {HIDDEN}\n".encode()
    diff = file_diff(unit, old, "0" * 64)  # the server's copy, read back for the diff
    actions = [Action("~", "write-file", unit.path, "content differs", diff),
               Action("~", "install-engine", "/usr/local/bin/sing-box", f"sing-box 1.13.0{ESCAPES} → 1.14.4")]
    return [ServerPlan("fra-1", "192.0.2.1", actions=actions),
            ServerPlan("fra-2", "192.0.2.2", error=f"ssh: the server said {ESCAPES}"),
            ServerPlan("fra-3", "192.0.2.3", problems=[f"port 443/tcp is taken by {HIDDEN}"])]


def _raw_controls(text: str) -> set[str]:
    return {c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0
            or c in "\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"}


def test_control_characters_from_a_server_reach_the_plan_escaped():
    # Attack: a hostile server (or one an intruder holds) puts terminal escape sequences in a file the plan diffs,
    # in its version string or its error text. Printed raw, they retitle or clear the operator's terminal, rewrite
    # lines of a CI log, or reorder what a line seems to say.
    plans = _hostile_plans()
    text = render_human(plans)
    assert _raw_controls(text) == set()
    assert "\\x1b]0;pwned\\x07" in text and "\\x1b[2J" in text and "\\x9b31m\\u202etxt.exe" in text
    assert text.count("\\x1b]0;pwned\\x07") == 3  # the diff, the version and the error
    painted = render_human(plans, color=True)
    assert _raw_controls(re.sub("\x1b\\[[0-9;]*m", "", painted)) == set()  # our colours are the only escapes
    document = render_json(plans, "f" * 64)
    assert _raw_controls(document) == set()
    assert json.loads(document)["servers"][1]["error"] == f"ssh: the server said {ESCAPES}"  # the same data


def test_an_error_a_server_said_is_printed_escaped(cli, monkeypatch):
    # Attack: as above, through an error: SSH's stderr becomes the message the command prints last.
    from reconciler.cli import plan

    def failing(args: Any) -> int:
        raise RemoteCommandError("fra-1", "python3 -I -S", 1, f"Traceback … {ESCAPES}")

    monkeypatch.setattr(plan, "cmd_plan", failing)
    run = cli("plan")
    assert run.rc == 1 and "\\x1b]0;pwned\\x07" in run.err and _raw_controls(run.err) == set()


def test_the_loops_log_lines_are_printable():
    # Attack: the loop logs what servers and clients sent (errors, reasons) to the journal or a CI log: there too.
    from reconciler.text import PrintableFormatter

    record = logging.LogRecord("reconciler.loop", logging.WARNING, __file__, 1, "fra-1: %s", (ESCAPES,), None)
    line = PrintableFormatter("%(message)s").format(record)
    assert line == "fra-1: \\x1b]0;pwned\\x07 and \\x1b[2J"


# --------------------------------------------------------------------------- a hostile cluster file


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the parser events the loader reads (both parsers): what the composer saw before it stopped."""
    seen = [0]

    def counted(make: Callable[[str], Iterator[Any]]) -> Callable[[str], Iterator[Any]]:
        def events_of(text: str) -> Iterator[Any]:
            for event in make(text):
                seen[0] += 1
                yield event
        return events_of

    monkeypatch.setattr(yamlread, "_c_events", counted(yamlread._c_events))
    monkeypatch.setattr(yamlread, "_pure_events", counted(yamlread._pure_events))
    return seen


@pytest.mark.parametrize("items", [100_000, 7_000_000], ids=["small", "16MB"])
def test_a_huge_value_under_an_unknown_key_is_refused_before_it_is_composed(tmp_path, events, items):
    # Attack: a cluster file (16 MB, one list of seven million scalars) under a top-level key the schema does not
    # have. The loader composed and converted all of it (54 s, 2.7 GB) before the schema said "unknown key 'a'".
    path = tmp_path / "cluster.yaml"
    path.write_text("a: [" + "0, " * items + "]\n")
    result = load_cluster(str(path))
    assert [(d.line, d.col, d.message) for d in result.errors] == [(1, 1, "unknown key 'a'")]
    assert "allowed keys here: settings, servers" in (result.errors[0].hint or "")
    assert events[0] <= 5  # stream, document, mapping, the key: nothing of the list


def test_a_list_where_the_schema_holds_a_mapping_is_refused_before_it_is_composed(tmp_path, events):
    # Attack: the same flood under a key the schema has, but of the other kind (settings is a mapping).
    path = tmp_path / "cluster.yaml"
    path.write_text("servers: []\nsettings: [" + "0, " * 1_000_000 + "]\n")
    [error] = load_cluster(str(path)).errors
    assert (error.line, error.col, error.message) == (2, 11, "settings: expected a mapping of keys, got a list")
    assert events[0] <= 10


def test_a_flood_of_scalars_where_records_belong_stops_the_file(tmp_path, events):
    # Attack: the same flood as the users list: each item is something the schema cannot hold (a user is a
    # mapping); past MAX_NOT_RECORDS of them the file is read no further.
    path = tmp_path / "cluster.yaml"
    path.write_text("users: [" + "0, " * 7_000_000 + "]\n")
    [error] = load_cluster(str(path)).errors
    assert (error.line, error.col, error.code) == (1, 9, "many")
    assert error.message.startswith("users[0] must be a mapping, not a number") and "read no further" in error.message
    assert events[0] <= yamlread.MAX_NOT_RECORDS + 10


def test_the_node_budget_says_where_it_ran_out():
    # Attack: a flood its bytes do not pay for; the refusal points at the node where the budget ran out, not at
    # the top of the file, so the operator sees which part is too large.
    text = "settings: {}\nusers:\n" + "".join(f"  - {{name: u{i}}}\n" for i in range(40_000))
    with pytest.raises(yamlread.Problem, match="expands to more than") as info:
        yamlread.parse_yaml(text, "f.yaml", yamlread.Budget())  # text never read: the budget is MAX_NODES only
    d = info.value.diagnostic
    assert d.line > 1000 and d.render().startswith(f"f.yaml:{d.line}:{d.col}: error: the cluster expands")


def test_the_responder_script_stays_python_3_7():
    # The servers' own python3 runs the responder (the oldest we meet is 3.7), as it runs the other scripts.
    import ast

    from reconciler.engine import remote

    ast.parse(remote.ACME.source, feature_version=(3, 7))
