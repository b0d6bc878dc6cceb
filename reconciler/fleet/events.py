"""The events operators act on, decided once per interval (pure: time and inputs passed in).

``user_events`` compares each user's usage and dates with what was already said (``said``: event key → the
value it was said for) so each event is sent once: a quota warning once per period, an expiry warning once per
expiry date, a device-limit breach once until the user is back under it. ``fleet_event`` says when the fleet
became degraded (a route with no healthy inbound, or most servers not ok) and when it recovered.
``verdict_events`` says which servers customers most likely cannot reach — blocked (HEALTH-9), unreachable from
one country (HEALTH-15), or marked by a lone witness (HEALTH-8) — each time a server's verdict becomes one of
these, and for every server already in one on the first interval after a start or a takeover (``last`` empty). The loop sends
them to the webhook (``settings.outputs.webhook_url``) and the log; Prometheus alerts say the same through
Alertmanager (``deploy/``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reconciler.balance import Snapshot
from reconciler.health.verdicts import Verdicts
from reconciler.model import Cluster, UserUsage
from reconciler.text import size_text


@dataclass(frozen=True)
class Event:
    kind: str  # quota_warning, quota_reached, expiring, expired, device_limit, fleet_degraded, fleet_recovered,
    # blocked, unreachable_from, pair_unreachable
    subject: str  # the user, the server, or "fleet"
    text: str  # one line for people
    data: dict[str, Any] = field(default_factory=dict)

    def payload(self, now: float) -> dict[str, Any]:
        return {"event": self.kind, "subject": self.subject, "text": self.text, "time": now, **self.data}


def _day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def user_events(cluster: Cluster, usage: Mapping[str, UserUsage], now: float, said: dict[str, str]) -> list[Event]:
    """Events due for users at ``now``; ``said`` is updated with what they say (persist it)."""
    settings = cluster.settings.users
    events: list[Event] = []

    def once(key: str, value: str, event: Event) -> None:
        if said.get(key) != value:
            said[key] = value
            events.append(event)

    roster = cluster.roster
    due = _due(cluster, usage, now, said)
    for i in np.flatnonzero(due).tolist():  # only users with something to say (a million otherwise, every interval)
        user = cluster.users[i]
        used = usage.get(user.name)
        name = user.name
        if user.data_limit and used is not None:
            period = str(int(used.period_start))
            if used.used >= user.data_limit:
                once(f"quota_reached:{name}", period, Event(
                    "quota_reached", name, f"{name} used the traffic limit ({size_text(user.data_limit)}); the servers "
                    "refuse the user" + (f" until {_day(used.next_reset)}" if used.next_reset else " until it is raised"),
                    {"used_bytes": used.used, "limit_bytes": user.data_limit}))
            elif used.used >= settings.warn_quota * user.data_limit:
                once(f"quota_warning:{name}", period, Event(
                    "quota_warning", name, f"{name} used {size_text(used.used)} of {size_text(user.data_limit)}",
                    {"used_bytes": used.used, "limit_bytes": user.data_limit}))
        end = user.expires_at
        if end is not None:
            if now > end:
                once(f"expired:{name}", str(int(end)), Event("expired", name, f"{name} expired on {_day(end)}",
                                                            {"expires": end}))
            elif end - now <= settings.warn_expiry:
                once(f"expiring:{name}", str(int(end)), Event(
                    "expiring", name, f"{name} expires on {_day(end)} (in {max(1, round((end - now) / 86400))} day(s))",
                    {"expires": end}))
        if user.device_limit is not None and used is not None:
            key = f"device_limit:{name}"
            if used.devices > user.device_limit:
                action = "refused until fewer are seen" if user.on_device_limit == "refuse" else "reported only"
                once(key, "over", Event("device_limit", name, f"{name} is used from {used.devices} devices (limit "
                                        f"{user.device_limit}): {action}", {"devices": used.devices,
                                                                            "limit": user.device_limit}))
            elif said.get(key) == "over":
                said[key] = "under"
    _forget_departed(said, roster.index)
    return events


def _due(cluster: Cluster, usage: Mapping[str, UserUsage], now: float, said: dict[str, str]) -> np.ndarray:
    """Which users (the cluster's order) may have something to say: a notice (quota, expiry, devices), or a
    device-limit breach already said that may have ended."""
    settings = cluster.settings.users
    roster = cluster.roster
    due = roster.notices(now, usage, settings.warn_quota, settings.warn_expiry).any()
    for key in said:  # a device-limit breach that may have ended
        if key.startswith("device_limit:") and (i := roster.index.get(key.split(":", 1)[1])) is not None:
            due[i] = roster.enabled[i]
    return due


def _forget_departed(said: dict[str, str], known: Mapping[str, int]) -> None:
    """Drop what was said about users that left the file (the fleet's own keys stay)."""
    for key in [k for k in said if k.split(":", 1)[-1] not in known and not k.startswith("fleet")]:
        del said[key]  # users that left the file


BLOCKED_ADVICE = ("the server's address is likely blocked: move it to a new IP (or a new server) and update `host:` in "
                  "the cluster file; its users were moved to other inbounds of their routes")


def verdict_events(verdicts: Verdicts, last: dict[str, str]) -> list[Event]:
    """Events for servers whose verdict label (``ServerVerdict.label``) became one customers feel, compared with
    ``last`` (server → label; updated in place). An empty ``last`` — a start, a takeover — reports every such
    server once."""
    events: list[Event] = []
    for name, sv in verdicts.servers().items():
        before = last.get(name)
        last[name] = sv.label
        if before == sv.label:
            continue
        base = {"server": name, "status": sv.status, "label": sv.label, "reason": sv.reason}
        if sv.status == "blocked":
            events.append(Event("blocked", name, f"{name} is blocked: {sv.reason}", {**base, "advice": BLOCKED_ADVICE}))
        elif sv.unreachable_from:
            events.append(Event("unreachable_from", name, f"customers in {sv.unreachable_from} most likely cannot reach "
                                f"{name}: {sv.reason}", {**base, "country": sv.unreachable_from, "region": sv.out_for}))
        elif sv.status == "ok" and sv.marks:
            where = sorted({m.witness_country for m in sv.marks if m.witness_country})
            events.append(Event("pair_unreachable", name, f"customers in {', '.join(where) or 'some places'} most likely "
                                f"cannot reach {name}: {sv.reason}",
                                {**base, "witnesses": sorted({m.witness for m in sv.marks}), "countries": where}))
    for name in [n for n in last if n not in verdicts.topology.servers]:
        del last[name]  # servers that left the file
    return events


def degraded_reason(snapshot: Snapshot) -> str:
    """Why the fleet is degraded ("" when it is not): routes with no inbound in rotation, or most servers not ok."""
    cluster = snapshot.cluster
    dark = [r.id for r in cluster.effective_routes
            if cluster.members.get(r.id) and not any(snapshot.in_rotation(m.inbound.id) for m in cluster.members[r.id])]
    if dark:
        return f"no inbound in rotation on route {', '.join(dark)}"
    verdicts = snapshot.verdicts
    if verdicts is None:
        return ""
    statuses = [v.status for v in verdicts.servers().values()]
    bad = sum(s not in ("ok", "no_data") for s in statuses)
    if statuses and bad * 2 > len(statuses):
        return f"{bad} of {len(statuses)} servers are not ok"
    return ""


def fleet_event(degraded: str, said: dict[str, str]) -> Event | None:
    """``degraded``: why the fleet is degraded now ("" when it is not); an event when that changed."""
    before = said.get("fleet", "")
    if bool(degraded) == bool(before):
        if degraded:
            said["fleet"] = degraded
        return None
    said["fleet"] = degraded
    if degraded:
        return Event("fleet_degraded", "fleet", f"the fleet is degraded: {degraded}")
    return Event("fleet_recovered", "fleet", "the fleet recovered: every route has a healthy inbound")
