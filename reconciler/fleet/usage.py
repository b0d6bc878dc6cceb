"""Per-user traffic: the servers' kernel counters → each user's usage this period (pure: time and reports passed in).

Every server counts its users' traffic in the kernel (``reconciler.engine.base.USAGE_NFT_TEXT``): one cumulative
counter per (user mark, IP version, transport) and direction. ``Ledger.fold`` turns one interval's reports into
bytes per user:

- **exact per connection**: the kernel counts every packet of every connection of the user's outbound, short or
  long, whatever the engine does; an engine restart or reload changes nothing (the counters are not the engine's);
- **payload, not packets**: the counters hold IP packet lengths; the IP and transport headers (per packet: the
  kernel counts segments after GRO/TSO, so one header per counted skb) are taken off, so the figures are the bytes
  the user's apps sent and received, as a subscription's ``upload``/``download`` mean them;
- **restarts**: a counter lower than the last one means the table started again (a reboot): what it holds now is
  new; a server seen for the first time is a baseline (its past is not this controller's to count); a mark that
  changed owner (a hash collision moved it) is a baseline too — one user's bytes are never another's;
- **periods**: bytes count into the user's current period (``User.reset``); a new period starts from zero.

The ledger is part of the learned state, so usage survives controller restarts; servers that leave the file
leave their counters, never their users' totals; a user keeps its usage under ``rotate:`` (the name is the key).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reconciler.engine.base import usage_marks
from reconciler.fleet.reports import Report
from reconciler.model import Cluster, UserUsage

# Bytes of headers per counted packet: IPv4 20 / IPv6 40, plus TCP 20 with the timestamp option Linux uses (12),
# or UDP 8. Other transports (ICMP errors about a user's connection) carry no payload of the user's.
HEADER_BYTES = {("ipv4", "tcp"): 52, ("ipv6", "tcp"): 72, ("ipv4", "udp"): 28, ("ipv6", "udp"): 48}
DEMAND_HALF_LIFE = 900.0  # seconds: how fast a user's measured demand follows a change (balancing reads it)


# Older nft versions print the numbers of families and transports (NFPROTO_IPV4 2, IPPROTO_TCP 6, ...).
NAMES = {"2": "ipv4", "10": "ipv6", "6": "tcp", "17": "udp"}


def payload(family: str, transport: str, packets: int, nbytes: int) -> int:
    """The bytes of user data in ``packets`` packets of ``nbytes`` bytes on the wire."""
    header = HEADER_BYTES.get((NAMES.get(family, family), NAMES.get(transport, transport)))
    return 0 if header is None else max(0, nbytes - header * packets)


@dataclass
class UserBook:
    """What the controller has counted of one user."""

    period_start: float = 0.0
    up: int = 0
    down: int = 0
    total: int = 0
    last_seen: float | None = None
    demand_mbps: float = 0.0
    devices: dict[str, float] = field(default_factory=dict)  # address fingerprint → last seen
    servers: tuple[str, ...] = ()

    def as_json(self) -> list[Any]:
        return [self.period_start, self.up, self.down, self.total, self.last_seen, self.demand_mbps, self.devices,
                list(self.servers)]

    @classmethod
    def from_json(cls, v: list[Any]) -> UserBook:
        return cls(float(v[0]), int(v[1]), int(v[2]), int(v[3]), None if v[4] is None else float(v[4]), float(v[5]),
                   {str(k): float(t) for k, t in dict(v[6]).items()}, tuple(str(s) for s in v[7]))


# Per server: (direction, mark, family, transport) → (the user the mark belonged to, packets, bytes) when last read.
ServerCounters = dict[tuple[int, int, str, str], tuple[str, int, int]]


@dataclass
class Ledger:
    counters: dict[str, ServerCounters] = field(default_factory=dict)
    users: dict[str, UserBook] = field(default_factory=dict)
    by_server: dict[str, list[int]] = field(default_factory=dict)  # server → [up, down] user bytes, cumulative
    by_route: dict[str, list[int]] = field(default_factory=dict)  # route → [up, down] user bytes, cumulative
    unavailable: dict[str, str] = field(default_factory=dict)  # server → why its counters could not be read
    said: dict[str, str] = field(default_factory=dict)  # events already sent (reconciler.fleet.events)
    epochs: dict[str, str] = field(default_factory=dict)  # server → its counters' epoch (boot and table)
    last_fold: float = 0.0

    def fold(self, cluster: Cluster, reports: Mapping[str, Report | None], now: float,
             assignments: Mapping[tuple[str, str], str] | None = None) -> dict[str, tuple[int, int]]:
        """Count one interval's reports; returns this interval's (up, down) bytes per user."""
        owner = {mark: name for name, mark in usage_marks(cluster).items()}
        known = set(owner.values())
        route_on = _routes_by_server(cluster, assignments or {})
        deltas: dict[str, list[int]] = {}
        open_on: dict[str, list[str]] = {}
        headers: dict[tuple[str, str], int] = {}  # (family, transport) → header bytes per packet, -1: no payload
        for server, rep in reports.items():
            if rep is None:
                continue
            for user in rep.users:
                open_on.setdefault(user, []).append(server)
            for user, fps in rep.devices.items():
                book = self.users.get(user)
                if book is None and user in known:
                    book = self.users.setdefault(user, UserBook())
                if book is not None:
                    for fp in fps:
                        book.devices[fp] = now
            if rep.usage is None:
                self.unavailable[server] = rep.usage_error
                continue
            self.unavailable.pop(server, None)
            before = self.counters.get(server)
            if before is not None and self.epochs.get(server) != rep.usage.epoch:
                before = {}  # a reboot, or the table made again: everything it holds is new
            self.epochs[server] = rep.usage.epoch
            after: ServerCounters = {}
            sums = self.by_server.setdefault(server, [0, 0])
            for side, rows in ((0, rep.usage.tx), (1, rep.usage.rx)):
                for mark, family, transport, packets, nbytes in rows:
                    user = owner.get(mark, "")
                    key = (side, mark, family, transport)
                    after[key] = (user, packets, nbytes)
                    if before is None or not user:
                        continue  # a first contact is a baseline; a mark nobody owns is nobody's
                    prev = before.get(key)
                    if prev is not None:
                        if prev[0] != user:
                            continue  # the mark changed hands: a baseline
                        if nbytes >= prev[2] and packets >= prev[1]:
                            packets, nbytes = packets - prev[1], nbytes - prev[2]
                        # else: lower than before: the counters started again, all of it is new
                    header = headers.get((family, transport))
                    if header is None:
                        header = headers[(family, transport)] = HEADER_BYTES.get(
                            (NAMES.get(family, family), NAMES.get(transport, transport)), -1)
                    got = nbytes - header * packets if header >= 0 else 0
                    if got > 0:
                        d = deltas.get(user)
                        if d is None:
                            d = deltas[user] = [0, 0]
                        d[side] += got
                        sums[side] += got
                        self.by_route.setdefault(route_on.get((user, server), ""), [0, 0])[side] += got
            self.counters[server] = after
        window = cluster.settings.users.device_window
        dt = now - self.last_fold if self.last_fold else 0.0
        alpha = 1.0 - 2.0 ** (-dt / DEMAND_HALF_LIFE) if dt > 0 else 0.0
        users = self.users
        for u in cluster.users:
            book = users.get(u.name)
            if book is None:
                book = users[u.name] = UserBook()
            start, _ = u.reset.bounds(now)
            if book.period_start != start:
                book.period_start, book.up, book.down = start, 0, 0
            up, down = deltas.get(u.name, (0, 0))
            if up or down:
                book.up += up
                book.down += down
                book.total += up + down
            if dt > 0 and (up or down or book.demand_mbps):
                book.demand_mbps += alpha * ((up + down) * 8 / 1e6 / dt - book.demand_mbps)
            servers = open_on.get(u.name)
            book.servers = tuple(sorted(servers)) if servers else ()
            if up or down or servers:
                book.last_seen = now
            if book.devices:
                book.devices = {fp: t for fp, t in book.devices.items() if now - t <= window}
        self.last_fold = now
        return {u: (d[0], d[1]) for u, d in deltas.items()}

    def view(self, cluster: Cluster, now: float) -> dict[str, UserUsage]:
        """Each user's usage as of ``now`` (a period that ended since the last fold reads as zero)."""
        window = cluster.settings.users.device_window
        out = {}
        for user in cluster.users:
            book = self.users.get(user.name)
            start, nxt = user.reset.bounds(now)
            if book is None:
                out[user.name] = UserUsage(period_start=start, next_reset=nxt)
                continue
            fresh = book.period_start == start
            out[user.name] = UserUsage(
                up=book.up if fresh else 0, down=book.down if fresh else 0, total=book.total, period_start=start,
                next_reset=nxt, devices=sum(1 for t in book.devices.values() if now - t <= window),
                last_seen=book.last_seen, servers=book.servers, demand_mbps=book.demand_mbps)
        return out

    def adopt(self, cluster: Cluster) -> None:
        """Forget the counters of servers that left the file (their users' totals stay)."""
        keep = {s.name for s in cluster.servers}
        for table in (self.counters, self.by_server, self.unavailable, self.epochs):
            for name in [k for k in table if k not in keep]:
                del table[name]

    def as_json(self) -> dict[str, Any]:
        return {"counters": {s: {":".join(map(str, k)): list(v) for k, v in c.items()} for s, c in self.counters.items()},
                "epochs": self.epochs,
                "users": {u: b.as_json() for u, b in self.users.items()}, "by_server": self.by_server,
                "by_route": self.by_route, "last_fold": self.last_fold, "said": self.said}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> Ledger:
        if not raw:
            return cls()
        return cls(counters={str(s): {_key(str(k)): (str(v[0]), int(v[1]), int(v[2])) for k, v in dict(c).items()}
                             for s, c in dict(raw["counters"]).items()},
                   epochs={str(k): str(v) for k, v in dict(raw.get("epochs") or {}).items()},
                   users={str(u): UserBook.from_json(list(b)) for u, b in dict(raw["users"]).items()},
                   by_server={str(k): [int(v[0]), int(v[1])] for k, v in dict(raw["by_server"]).items()},
                   by_route={str(k): [int(v[0]), int(v[1])] for k, v in dict(raw["by_route"]).items()},
                   last_fold=float(raw["last_fold"]), said={str(k): str(v) for k, v in dict(raw.get("said") or {}).items()})


def _key(text: str) -> tuple[int, int, str, str]:
    side, mark, family, transport = text.split(":", 3)
    return int(side), int(mark), family, transport


def _routes_by_server(cluster: Cluster, assignments: Mapping[tuple[str, str], str]) -> dict[tuple[str, str], str]:
    """(user, server) → the route whose inbound the user is assigned on that server (metrics per route)."""
    server_of = {r.inbound.id: r.server.name for r in cluster.inbounds}
    out: dict[tuple[str, str], str] = {}
    for (user, route), inbound in assignments.items():
        server = server_of.get(inbound)
        if server is not None:
            out.setdefault((user, server), route.split("@", 1)[0])
    return out
