"""What each console page shows, as plain data (pure: the fleet view, the time and the lookups are arguments).

The fleet is ``status``'s table; a server's card is ``status SERVER`` (inbounds with their verdicts, reasons, marks
and the witnesses' current streaks against each, the week's verdict history, the learned capacity and load); a
user's card is ``status USER`` (each entry with its verdict) with the usage, the devices and the subscription URL;
the routes page is the topology coloured by health and each route's active inbounds. Nothing here reads the master
secret or a user's credentials: the one secret a page may hold, a user's subscription URL, comes from ``token_of``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reconciler.balance import decide
from reconciler.fleet.history import KEEP_SECONDS, History
from reconciler.fleet.view import FleetView
from reconciler.health.verdicts import ServerVerdict
from reconciler.model import Cluster
from reconciler.model.roster import ACTIVE
from reconciler.subscriptions.urls import subscription_url
from reconciler.text import iso_time, lasted_text, size_text
from reconciler.topology import colour_of, svg

#: At most this many users are listed by a search, and witnesses shown per inbound (the worst streaks first).
USERS_LISTED = 100
WITNESSES_SHOWN = 40
#: The width of the history strip's drawing (its viewBox; the stylesheet scales it).
STRIP_WIDTH = 700


@dataclass(frozen=True)
class Unknown:
    """A name the fleet does not hold: the page says so (404)."""

    kind: str
    name: str


@dataclass(frozen=True)
class Witness:
    """A server that probes an inbound, and how many of its probes in a row failed (0: its last one reached it)."""

    name: str
    country: str
    streak: int


def _no_data(name: str) -> ServerVerdict:
    return ServerVerdict(name, "no_data", True, (), 0, 0, "no health data yet", False, None)


def _server_verdict(view: FleetView, name: str) -> ServerVerdict:
    return view.verdicts.server(name) if view.verdicts is not None else _no_data(name)


def _mbps(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def fleet(view: FleetView, now: float) -> dict[str, Any]:
    rows = []
    counts: dict[str, int] = {}
    for s in view.cluster.servers:
        sv = _server_verdict(view, s.name)
        counts[sv.status] = counts.get(sv.status, 0) + 1
        rows.append({"name": s.name, "host": s.host, "country": s.country, "label": sv.label, "colour": colour_of(sv.label),
                     "rotation": sv.rotation, "in_rotation": sv.in_rotation, "reason": sv.reason,
                     "marks": [m.text for m in sv.marks], "assigned": view.assigned.get(s.name, 0),
                     "connected": view.connected.get(s.name, 0), "mbps": _mbps(view.traffic_mbps.get(s.name, 0.0)),
                     "capacity": _mbps(view.capacity_mbps.get(s.name)), "unreported": view.unreported.get(s.name, "")})
    users = view.cluster.users
    # Counted over the snapshot's standings array at once: a page of a million users costs one comparison each
    active = int((view.snapshot.standings == ACTIVE).sum()) if view.snapshot is not None else None
    return {"as_of": iso_time(view.verdicts.now if view.verdicts is not None else now), "servers": rows,
            "counts": sorted(counts.items()), "users": len(users), "active_users": active,
            "routes": len(view.cluster.effective_routes), "ready": view.verdicts is not None}


def server(view: FleetView, name: str, now: float) -> dict[str, Any] | Unknown:
    cluster = view.cluster
    s = next((x for x in cluster.servers if x.name == name), None)
    if s is None:
        return Unknown("server", name)
    sv = _server_verdict(view, name)
    v = view.verdicts
    country = {x.name: x.country for x in cluster.servers}
    inbounds = []
    for ib in s.inbounds:
        iv = v.inbound(ib.id) if v is not None else None
        label = iv.label if iv is not None else "no_data"
        witnesses: list[Witness] = []
        if v is not None:
            t = v.topology.inbounds.index(ib.id)
            for i, w in enumerate(v.topology.servers):
                streak = int(v.fail[i, t])
                if w != name and streak >= 0:  # -1: that witness does not probe it
                    witnesses.append(Witness(w, country.get(w, ""), streak))
            witnesses.sort(key=lambda w: (-w.streak, w.name))
        inbounds.append({"id": ib.id, "name": ib.name, "protocol": ib.protocol, "port": ib.port, "route": ib.route or "",
                         "pool": ib.pool or "", "label": label, "colour": colour_of(label),
                         "rotation": iv.rotation if iv is not None else "yes",
                         "reason": iv.reason if iv is not None else "no health data yet",
                         "marks": [m.text for m in iv.marks] if iv is not None else [],
                         "witnesses": witnesses[:WITNESSES_SHOWN], "failing": sum(1 for w in witnesses if w.streak > 0),
                         "witnesses_more": max(0, len(witnesses) - WITNESSES_SHOWN)})
    eng = cluster.engine_of(s)
    up, down = view.user_bytes_by_server.get(name, (0, 0))
    history = History({name: list(view.history.get(name, ()))}).of(name, now)
    return {"name": name, "host": s.host, "country": s.country, "region": s.region, "engine": f"{eng.name} {eng.version}",
            "label": sv.label, "colour": colour_of(sv.label), "rotation": sv.rotation, "in_rotation": sv.in_rotation,
            "reason": sv.reason, "marks": [m.text for m in sv.marks], "sees": sv.sees,
            "unreliable_witness": sv.unreliable_witness, "censored_witness": sv.censored_witness,
            "since_report": lasted_text(sv.seconds_since_report) if sv.seconds_since_report is not None else "",
            "unreported": view.unreported.get(name, ""), "drift": view.drift.get(name, 0),
            "mbps": _mbps(view.traffic_mbps.get(name, 0.0)), "capacity": _mbps(view.capacity_mbps.get(name)),
            "connected": view.connected.get(name, 0), "assigned": view.assigned.get(name, 0),
            "coefficient": s.coefficient, "carried": size_text(up + down), "inbounds": inbounds,
            "history": [{"since": iso_time(c.at), "status": c.status, "colour": colour_of(c.status),
                         "lasted": lasted_text(lasted), "reason": c.reason} for c, lasted in reversed(history)],
            "strip": _strip(history, now)}


def _strip(history: list[tuple[Any, float]], now: float) -> list[dict[str, Any]]:
    """The week as coloured spans (x and width in ``STRIP_WIDTH`` units): what the history table says, at a glance."""
    start = now - KEEP_SECONDS
    spans = []
    for change, lasted in history:
        a, b = max(change.at, start), min(change.at + lasted, now)
        if b > a:
            x = (a - start) / KEEP_SECONDS * STRIP_WIDTH
            spans.append({"x": round(x, 2), "width": round(max(0.5, (b - a) / KEEP_SECONDS * STRIP_WIDTH), 2),
                          "colour": colour_of(change.status), "title": f"{iso_time(change.at)} {change.status}"})
    return spans


def user(view: FleetView, name: str, token_of: Callable[[str, int], str]) -> dict[str, Any] | Unknown:
    cluster = view.cluster
    i = cluster.roster.index.get(name)
    if i is None:
        return Unknown("user", name)
    u = cluster.users[i]
    snap = view.snapshot
    usage = view.usage.get(name) or (snap.usage.get(name) if snap is not None else None)
    standing = snap.standing(u) if snap is not None else ""  # no snapshot yet: not judged, and no URL shown
    entries = []
    if snap is not None:
        for e in decide(snap, name):
            iv = view.verdicts.inbound(e.ref.inbound.id) if view.verdicts is not None else None
            label = iv.label if iv is not None else "no_data"
            entries.append({"route": e.route.id, "entry": e.name, "server": e.ref.server.name, "inbound": e.ref.inbound.id,
                            "label": label, "colour": colour_of(label), "in_rotation": e.in_rotation, "why": e.why,
                            "reason": iv.reason if iv is not None else "no health data yet"})
    used = usage.used if usage else 0
    base = cluster.settings.outputs.public_url
    url = subscription_url(base, token_of(name, u.rotate)) if base and standing == "active" else ""
    return {"name": name, "standing": standing, "region": u.region or "",
            "used": used, "used_text": size_text(used), "limit": u.data_limit,
            "limit_text": size_text(u.data_limit) if u.data_limit else "",
            "percent": min(100, round(100 * used / u.data_limit)) if u.data_limit else 0,
            "devices": usage.devices if usage else 0, "device_limit": u.device_limit,
            "next_reset": iso_time(usage.next_reset)[:10] if usage and usage.next_reset else "",
            "expires": iso_time(u.expires_at)[:10] if u.expires_at else "", "entries": entries, "url": url,
            "public_url_missing": not base, "ready": snap is not None}


def users(cluster: Cluster, query: str, view: FleetView) -> dict[str, Any]:
    """The users whose names hold ``query`` (all when empty), the first ``USERS_LISTED`` of them, with their standing."""
    needle = query.strip().lower()[:64]
    found: list[dict[str, str]] = []
    more = 0
    snap = view.snapshot
    for u in cluster.users:
        if needle in u.name.lower():
            if len(found) < USERS_LISTED:
                used = view.usage.get(u.name)
                found.append({"name": u.name, "standing": snap.standing(u) if snap is not None else "",
                              "used_text": size_text(used.used if used else 0),
                              "limit_text": size_text(u.data_limit) if u.data_limit else ""})
            else:
                more += 1
    return {"query": query[:64], "users": found, "more": more, "total": len(cluster.users)}


def routes(view: FleetView) -> dict[str, Any]:
    v = view.verdicts
    labels = v.labels() if v is not None else {}
    rows = []
    for route in view.cluster.effective_routes:
        members = view.cluster.members.get(route.id, ())
        inbounds = []
        for m in members:
            iv = v.inbound(m.inbound.id) if v is not None else None
            label = iv.label if iv is not None else "no_data"
            inbounds.append({"id": m.inbound.id, "server": m.server.name, "pool": m.inbound.pool or "", "label": label,
                             "colour": colour_of(label), "rotation": iv.rotation if iv is not None else "yes"})
        active = sum(1 for ib in inbounds if ib["rotation"] == "yes")
        rows.append({"id": route.id, "name": route.name, "inbounds": inbounds, "active": active,
                     "best_available_only": bool(inbounds) and not any(ib["rotation"] != "no" for ib in inbounds)})
    return {"routes": rows, "topology": svg(view.cluster, labels)}
