"""Builders for balancing tests: clusters in a few lines, verdicts from the real health engine."""

from __future__ import annotations

import numpy as np

from reconciler.balance import ServerLoad, Snapshot
from reconciler.health import HealthEngine, Observation, Topology
from reconciler.model import Cluster
from reconciler.model.cluster import HealthSettings


def cluster(servers: list[dict], routes: list[dict], users: int | list[dict] = 3, settings: dict | None = None) -> Cluster:
    """servers: {name, country?, coefficient?, prober?, inbounds: [(id, route, pool?) ...] or 'route[/pool]'}."""
    out = []
    port = 10000
    for s in servers:
        inbounds = []
        specs = s.get("inbounds") or [(f"{s['name']}-in", s["route"], s.get("pool"))]
        for spec in specs:
            iid, route, pool = (spec + (None,))[:3] if isinstance(spec, tuple) else spec
            port += 1
            ib = {"id": iid, "name": f"In {iid}", "protocol": "shadowsocks-2022", "port": port, "route": route}
            if pool:
                ib["pool"] = pool
            inbounds.append(ib)
        out.append({"name": s["name"], "host": f"192.0.2.{len(out) + 1}", "country": s.get("country", "DE"),
                    "coefficient": s.get("coefficient", 1.0), "prober": s.get("prober", False), "inbounds": inbounds})
    user_list = users if isinstance(users, list) else [{"name": f"u{i}"} for i in range(users)]
    return Cluster.model_validate({"servers": out, "routes": routes, "users": user_list, "settings": settings or {}})


def verdicts(c: Cluster, down: tuple[str, ...] = (), silent: tuple[str, ...] = (), pairs: tuple[tuple[str, str], ...] = (),
             ticks: int = 12):
    """Run the real engine: `down` servers report their service stopped; `pairs` (a, b): a cannot reach b."""
    topo = Topology.from_cluster(c)
    engine = HealthEngine(topo, HealthSettings())
    idx = {s: i for i, s in enumerate(topo.servers)}
    n, m = topo.n, topo.m
    v = None
    for t in range(ticks):
        ok = np.ones((n, m), dtype=bool)
        for a, b in pairs:
            ok[idx[a], np.asarray(topo.inbound_server) == idx[b]] = False
        service = np.array([s not in down for s in topo.servers])
        reported = np.array([s not in silent for s in topo.servers])
        v = engine.evaluate(Observation(now=60.0 * t, reported=reported, service_ok=service,
                                        listener_ok=np.ones(m, dtype=bool), probe_present=np.ones((n, m), dtype=bool),
                                        probe_ok=ok))
    return v


def snapshot(c: Cluster, **kw) -> Snapshot:
    loads = kw.pop("loads", {})
    return Snapshot(cluster=c, now=kw.pop("now", 1.0e9), loads={k: ServerLoad(*v) for k, v in loads.items()}, **kw)
