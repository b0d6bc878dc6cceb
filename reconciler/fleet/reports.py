"""Agent reports → typed values → the health engine's ``Observation`` (pure, time passed in).

The agent (``reconciler/engine/agent.py``) stays dumb: it returns raw counters
and probe results. Everything that decides — what a report means, which probe
belongs to which witness/target pair, how counters become rates across engine
restarts — happens here, on the controller, where it is tested.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from reconciler.engine.singbox import CLASH_API, SERVICE
from reconciler.errors import ReportError
from reconciler.health.engine import Observation
from reconciler.health.topology import Topology
from reconciler.model import Cluster


@dataclass(frozen=True)
class Probe:
    ok: bool
    rtt_ms: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Report:
    server: str
    received: float  # controller clock
    service: str  # systemctl is-active
    listeners: dict[str, bool]  # "443/tcp" → listening
    traffic_bytes: int | None  # cumulative up + down from the engine, None when its API did not answer
    users: tuple[str, ...] = ()
    connections: int = 0
    probes: dict[str, Probe] = field(default_factory=dict)  # inbound id → result
    took_ms: float = 0.0

    @property
    def service_ok(self) -> bool:
        return self.service == "active"


def parse_report(server: str, text: str, received: float) -> Report:
    """Parse the agent's JSON (the last line of its output)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        raise ReportError("the agent printed nothing")
    try:
        raw = json.loads(lines[-1])
    except ValueError as exc:
        raise ReportError(f"the agent's output is not JSON: {exc}") from None
    if not isinstance(raw, dict) or "service" not in raw:
        raise ReportError("the agent's output is not a report")
    traffic = raw.get("traffic")
    total = None
    if isinstance(traffic, dict):
        try:
            total = int(traffic.get("up", 0)) + int(traffic.get("down", 0))
        except (TypeError, ValueError):
            total = None
    probes: dict[str, Probe] = {}
    for key, value in (raw.get("probes") or {}).items():
        if not isinstance(value, dict):
            continue
        rtt = value.get("rtt_ms")
        rtt_f = float(rtt) if isinstance(rtt, int | float) and math.isfinite(rtt) and rtt >= 0 else None
        probes[str(key)] = Probe(bool(value.get("ok")), rtt_f, value.get("error"))
    listeners = {str(k): bool(v) for k, v in (raw.get("listeners") or {}).items()}
    users = tuple(sorted(str(u) for u in raw.get("users") or ()))
    return Report(server=server, received=received, service=str(raw.get("service")), listeners=listeners,
                  traffic_bytes=total, users=users, connections=int(raw.get("connections") or 0), probes=probes,
                  took_ms=float(raw.get("took_ms") or 0.0))


def probe_kind(protocol: str) -> str:
    """How a client's first packets look: TLS handshake, bare TCP (Shadowsocks), or QUIC."""
    if protocol in ("hysteria2", "tuic"):
        return "quic"
    if protocol == "shadowsocks-2022":
        return "tcp"
    return "tls"


def agent_request(cluster: Cluster, server_name: str, clash_secret: str, timeout: float) -> dict[str, object]:
    """What one server's agent is asked: its own listeners, and every other server's inbounds to probe."""
    server = cluster.server(server_name)
    listeners = sorted({(ib.port, t) for ib in server.inbounds for t in ib.transports})
    probes = []
    for ref in cluster.inbounds:
        if ref.server.name == server_name:
            continue
        ib = ref.inbound
        entry: dict[str, object] = {"id": ib.id, "host": ref.server.host, "port": ib.port, "kind": probe_kind(ib.protocol)}
        if ib.protocol == "vless-reality":
            entry["sni"] = ib.camouflage
        elif ib.protocol != "shadowsocks-2022":
            entry["sni"] = ib.tls.server_name
        probes.append(entry)
    return {"service": SERVICE, "listeners": [list(x) for x in listeners], "clash_api": CLASH_API,
            "clash_secret": clash_secret, "probes": probes, "timeout": timeout}


def observation(topology: Topology, cluster: Cluster, reports: dict[str, Report | None], now: float) -> Observation:
    """The arrays the verdict engine reads, from whichever reports arrived this interval."""
    n, m = topology.n, topology.m
    server_index = {s: i for i, s in enumerate(topology.servers)}
    inbound_index = {t: j for j, t in enumerate(topology.inbounds)}
    reported = np.zeros(n, dtype=bool)
    service_ok = np.ones(n, dtype=bool)
    listener_ok = np.ones(m, dtype=bool)
    present = np.zeros((n, m), dtype=bool)
    ok = np.zeros((n, m), dtype=bool)
    rtt = np.full((n, m), np.nan)
    by_id = {ref.inbound.id: ref for ref in cluster.inbounds}
    for name, rep in reports.items():
        w = server_index.get(name)
        if w is None or rep is None:
            continue
        reported[w] = True
        service_ok[w] = rep.service_ok
        for t_id, probe in rep.probes.items():
            t = inbound_index.get(t_id)
            if t is None:
                continue
            present[w, t] = True
            ok[w, t] = probe.ok
            if probe.ok and probe.rtt_ms is not None:
                rtt[w, t] = probe.rtt_ms
    for t_id, t in inbound_index.items():
        ref = by_id.get(t_id)
        rep = reports.get(topology.servers[topology.inbound_server[t]])
        if ref is None or rep is None:
            continue
        listener_ok[t] = all(rep.listeners.get(f"{ref.inbound.port}/{tr}", False) for tr in ref.inbound.transports)
    return Observation(now=now, reported=reported, service_ok=service_ok, listener_ok=listener_ok,
                       probe_present=present, probe_ok=ok, probe_rtt_ms=rtt)


@dataclass(frozen=True)
class Counter:
    """The last cumulative byte counter seen from a server, and when."""

    value: int
    at: float


def traffic_rate(previous: Counter | None, value: int | None, at: float) -> tuple[float | None, Counter | None]:
    """Mbps since the previous sample, and the new counter to keep.

    A counter that went down means the engine restarted (its counters start at
    zero): that interval has no rate, and counting starts again from the new
    value. No previous sample, or no time between samples: no rate either.
    """
    if value is None:
        return None, previous
    current = Counter(value, at)
    if previous is None or value < previous.value or at <= previous.at:
        return None, current
    return (value - previous.value) * 8 / 1e6 / (at - previous.at), current
