"""Per-user traffic: the servers' kernel counters → each user's usage this period (pure: time and reports passed in).

Every server counts its users' traffic in the kernel (``reconciler.engine.base.USAGE_NFT_TEXT``): one cumulative
counter per (user mark, IP version, transport) and direction. ``Ledger.fold`` turns one interval's reports into
bytes per user:

- **exact per connection**: the kernel counts every packet of every connection of the user's outbound, short or
  long, whatever the engine does; an engine restart or reload changes nothing (the counters are not the engine's);
- **payload, not packets**: the counters hold IP packet lengths; the IP and transport headers (per packet: the
  kernel counts segments after GRO/TSO, so one header per counted skb) are taken off, so the figures are the bytes
  the user's apps sent and received, as a subscription's ``upload``/``download`` mean them;
- **restarts**: a new epoch (a reboot, the table made again) or a counter lower than the last one is a new
  baseline: what it holds is not added (a server that claims a restart every interval gains nothing); a server
  seen for the first time is a baseline (its past is not this controller's to count); a mark that changed owner
  (a hash collision moved it) is a baseline too — one user's bytes are never another's;
- **a server is believed only about itself** (``Trust``): its rows count only for users the controller sent to
  it (an assignment there, or a place in the user's failover order); each row adds at most what the server's link
  could carry since its last read (its learned capacity, with headroom); the same holds for its device lists;
- **periods**: bytes count into the user's current period (``User.reset``); a new period starts from zero.

The ledger is part of the learned state, so usage survives controller restarts; servers that leave the file
leave their counters, never their users' totals; a user keeps its usage under ``rotate:`` (the name is the key).

At a million users the counters are arrays (``CounterTable``: one sorted key per counter, the owner it had, its
packets and bytes), matched against the last read by a sorted search, not a dict per row; they are persisted as
arrays too (``Ledger.pack``). Saving the learned state late loses nothing of the usage: the kernel's counters are
cumulative, so the next fold after a restart counts everything since the counters that were saved.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reconciler.fleet.attribution import RouteServers, count_routes, routes_on_servers, served_by
from reconciler.fleet.counters import (
    DELTA_CAP,
    SIDE_SHIFT,
    CounterTable,
    RowOrder,
    UserIndex,
    counted,
    old_key,
    owner_id,
    read_counters,
    user_index,
)
from reconciler.fleet.reports import Report, UsageCounters
from reconciler.model import Cluster
from reconciler.model.roster import Roster
from reconciler.model.usage import BYTES_CAP, UsageView, saturated_sum

DEMAND_HALF_LIFE = 900.0  # seconds: how fast a user's measured demand follows a change (balancing reads it)
TOTAL_CAP = BYTES_CAP  # a user's bytes saturate here (the state keeps them as 64-bit integers)
# What one server's row may add per second of the interval: its learned capacity (Mbps) times this headroom, and at
# least LINK_FLOOR_MBPS (a server whose peak is not learned yet), at most LINK_CEILING_MBPS (a learned figure is the
# server's own report too).
LINK_HEADROOM = 4.0
LINK_FLOOR_MBPS = 1_000.0
LINK_CEILING_MBPS = 100_000.0
REACH_BUDGET = 4096  # users per server and interval checked against their failover order (the rest: not counted)
DEVICE_ID_BYTES = 8  # a stored device fingerprint: 64 bits of an HMAC under the controller's own key


@dataclass(frozen=True)
class Trust:
    """What the fold needs to believe each server only about itself.

    ``mark_key``: the users' marks' key (``engine.base.mark_key``). ``reach``: which of the given users (names,
    distinct) the controller's last answers put on ``server`` other than by assignment (a place in a failover
    order); None: only assignments count. ``device_key``: the controller's own key the servers' device fingerprints
    are stored under (the servers share the day's key, so what is kept must not be theirs to search).
    ``capacity_mbps``: each server's learned capacity (NaN: not learned). ``device_epoch``: the day of the key the
    interval's device fingerprints were made with."""

    mark_key: bytes
    reach: Callable[[str, list[str]], np.ndarray] | None = None
    device_key: bytes = b""
    capacity_mbps: Mapping[str, float] = field(default_factory=dict)
    device_epoch: int = 0


def link_bytes(capacity_mbps: float, seconds: float) -> int:
    """The most one row of a server may add in ``seconds``."""
    mbps = LINK_FLOOR_MBPS if capacity_mbps != capacity_mbps else capacity_mbps * LINK_HEADROOM
    mbps = min(max(mbps, LINK_FLOOR_MBPS), LINK_CEILING_MBPS)
    return int(min(mbps * 1e6 / 8 * max(seconds, 1.0), DELTA_CAP))


def device_count(fps: Mapping[str, float], now: float, window: float) -> int:
    """Distinct devices seen within ``window``: fingerprints are made with a key of the day (``d<epoch>:``), so at a
    change of day one device shows under two keys for a moment; the larger day's count is the count."""
    per: dict[str, int] = {}
    for fp, t in fps.items():
        if now - t <= window:
            day = fp.partition(":")[0] if ":" in fp else ""
            per[day] = per.get(day, 0) + 1
    return max(per.values(), default=0)


@dataclass
class UserBook:
    """What the controller has counted of one user (one row of ``Books``, as tests and commands read it)."""

    period_start: float = 0.0
    up: int = 0
    down: int = 0
    total: int = 0
    last_seen: float | None = None
    demand_mbps: float = 0.0
    devices: dict[str, float] = field(default_factory=dict)  # address fingerprint → last seen
    servers: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, v: list[Any]) -> UserBook:
        """A book as state format 1 kept it."""
        return cls(float(v[0]), int(v[1]), int(v[2]), int(v[3]), None if v[4] is None else float(v[4]), float(v[5]),
                   {str(k): float(t) for k, t in dict(v[6]).items()}, tuple(str(s) for s in v[7]))


@dataclass
class Books:
    """Every counted user's book as columns: the current cluster's users first, in its order (``Ledger.align``), then
    the users who left the file (their totals are kept). Devices and open connections are sparse (few users)."""

    names: tuple[str, ...] = ()
    period_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    up: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    down: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    total: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))  # nan: never
    demand: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    devices: dict[str, dict[str, float]] = field(default_factory=dict)  # user → address fingerprint → last seen
    servers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # user → servers with its open connections

    COLUMNS = ("period_start", "up", "down", "total", "last_seen", "demand")

    @classmethod
    def of(cls, names: list[str], rows: list[UserBook]) -> Books:
        n = len(rows)
        return cls(tuple(names), np.fromiter((b.period_start for b in rows), np.float64, n),
                   np.fromiter((min(b.up, TOTAL_CAP) for b in rows), np.int64, n),
                   np.fromiter((min(b.down, TOTAL_CAP) for b in rows), np.int64, n),
                   np.fromiter((min(b.total, TOTAL_CAP) for b in rows), np.int64, n),
                   np.fromiter((np.nan if b.last_seen is None else b.last_seen for b in rows), np.float64, n),
                   np.fromiter((b.demand_mbps for b in rows), np.float64, n),
                   {nm: dict(b.devices) for nm, b in zip(names, rows, strict=True) if b.devices},
                   {nm: b.servers for nm, b in zip(names, rows, strict=True) if b.servers})

    def reordered(self, names: tuple[str, ...]) -> Books:
        """The books in the order of ``names`` first (a new user's book is empty), then the others as they were."""
        if names == self.names[:len(names)]:
            return Books(names + self.names[len(names):], self.period_start, self.up, self.down, self.total,
                         self.last_seen, self.demand, self.devices, self.servers)
        at = {n: i for i, n in enumerate(self.names)}
        wanted = set(names)
        order = list(names) + [n for n in self.names if n not in wanted]
        src = np.fromiter((at.get(n, -1) for n in order), np.int64, len(order))
        have = src >= 0
        out = Books(tuple(order))
        for c in self.COLUMNS:
            old = getattr(self, c)
            col = np.full(len(order), np.nan if c == "last_seen" else 0, old.dtype)
            col[have] = old[src[have]]
            setattr(out, c, col)
        out.devices, out.servers = self.devices, self.servers
        return out


















@dataclass
class Ledger:
    counters: dict[str, CounterTable] = field(default_factory=dict)
    books: Books = field(default_factory=Books)
    by_server: dict[str, list[int]] = field(default_factory=dict)  # server → [up, down] user bytes, cumulative
    by_route: dict[str, list[int]] = field(default_factory=dict)  # route → [up, down] user bytes, cumulative
    unavailable: dict[str, str] = field(default_factory=dict)  # server → why its counters could not be read
    said: dict[str, str] = field(default_factory=dict)  # events already sent (reconciler.fleet.events)
    epochs: dict[str, str] = field(default_factory=dict)  # server → its counters' epoch (boot and table)
    read_at: dict[str, float] = field(default_factory=dict)  # server → when its counters were last read
    refused: dict[str, tuple[int, int]] = field(default_factory=dict)  # server → (users, bytes) not believed last fold
    last_fold: float = 0.0
    _view: tuple[Cluster, float, UsageView] | None = field(default=None, repr=False, compare=False)
    _orders: dict[str, RowOrder] = field(default_factory=dict, repr=False, compare=False)  # read_counters' memo

    def align(self, cluster: Cluster) -> Roster:
        """The books in the order of the cluster's users (once per loaded file: a new user's book is empty)."""
        roster = cluster.roster
        if self.books.names[:len(roster)] is not roster.names and self.books.names[:len(roster)] != roster.names:
            self.books = self.books.reordered(roster.names)
        return roster

    def book(self, name: str) -> UserBook:
        """One user's book (an empty one when never counted)."""
        b = self.books
        try:
            i = b.names.index(name)
        except ValueError:
            return UserBook()
        seen = float(b.last_seen[i])
        return UserBook(float(b.period_start[i]), int(b.up[i]), int(b.down[i]), int(b.total[i]),
                        None if seen != seen else seen, float(b.demand[i]), dict(b.devices.get(name, {})),
                        b.servers.get(name, ()))

    def fold(self, cluster: Cluster, reports: Mapping[str, Report | None], now: float,
             assignments: Mapping[tuple[str, str], str] | None = None, trust: Trust | None = None) -> Counted:
        """Count one interval's reports; returns this interval's (up, down) bytes per user who had traffic.

        With ``trust`` (the loop always gives it), each server is believed only about the users the controller sent
        to it and only up to what its link could carry (``Trust``); without it (tests of the counting alone), every
        row of a known user counts, under unkeyed marks."""
        roster = self.align(cluster)
        index = user_index(roster.names, trust.mark_key if trust is not None else b"")
        n = len(roster)
        routes = routes_on_servers(cluster, assignments or {}, roster)
        server_at = {s.name: i for i, s in enumerate(cluster.servers)}
        up, down = np.zeros(n, np.int64), np.zeros(n, np.int64)
        open_on: dict[str, list[str]] = {}
        self.refused = {}
        for gone in [s for s in self._orders if s not in server_at]:  # left the file: its memo goes with it
            del self._orders[gone]
        # Per server, arrays of its rows: the helpers below run once per server and interval, never per user.
        for server, rep in reports.items():
            if rep is None:
                continue
            believe = self._believer(server, server_at.get(server, -1), routes, roster, trust)
            self._note_clients(server, rep, roster, believe, trust, now, open_on)
            if rep.usage is None:
                self.unavailable[server] = rep.usage_error
                continue
            self.unavailable.pop(server, None)
            after, row_user, got, cap = self._read(cluster, server, rep.received, rep.usage, index, trust)
            if not got.any():
                continue
            side = after.keys >> SIDE_SHIFT
            if trust is not None:
                row_user = self._limit(server, got, row_user, side, believe, cap)
            sums = self.by_server.setdefault(server, [0, 0])
            for s in (0, 1):
                sums[s] += int(got[side == s].sum())
            count_routes(self.by_route, routes, server_at.get(server, -1), row_user, side, got)
            counts = got > 0  # only rows of known users count (counted): their index is >= 0
            for s, per_user in ((0, up), (1, down)):
                np.add.at(per_user, row_user[counts & (side == s)], got[counts & (side == s)])
        start, nxt, window = self._close_books(cluster, roster, now, up, down, open_on)
        self.last_fold = now
        self._view = (cluster, now, self._usage(roster, start, nxt, now, window))  # what view() would build
        return Counted(roster.names, np.flatnonzero((up > 0) | (down > 0)), up, down)

    def _note_clients(self, server: str, rep: Report, roster: Roster, believe: Callable[[np.ndarray], np.ndarray],
                      trust: Trust | None, now: float, open_on: dict[str, list[str]]) -> None:
        """The users ``server`` says are connected (into ``open_on``) and the devices it saw them on (into the
        books), of those it is believed about."""
        claimed = [u for u in rep.users if u in roster.index]
        for user in _believed_names(claimed, roster, believe):
            open_on.setdefault(user, []).append(server)
        device_users = [u for u, fps in rep.devices.items() if fps and u in roster.index]
        day = f"d{trust.device_epoch}:" if trust is not None else ""
        for user in _believed_names(device_users, roster, believe):
            devices = self.books.devices.setdefault(user, {})
            for fp in rep.devices[user]:
                devices[day + _device_id(trust, fp)] = now

    def _read(self, cluster: Cluster, server: str, received: float, usage: UsageCounters, index: UserIndex,
              trust: Trust | None) -> tuple[CounterTable, np.ndarray, np.ndarray, int]:
        """Read ``server``'s counters against its last read (kept for the next): the table, each row's user, the
        bytes each row adds, and the most one row may add since the last read (``cap``)."""
        before = self.counters.get(server)
        if before is not None and self.epochs.get(server) != usage.epoch:
            before = None  # a reboot, or the table made again: a new baseline, never a whole counter added
        self.epochs[server] = usage.epoch
        after, row_user, order = read_counters(usage, index, self._orders.get(server))
        if order is None:
            self._orders.pop(server, None)
        else:
            self._orders[server] = order
        last = self.read_at.get(server)
        self.read_at[server] = received
        cap = DELTA_CAP
        if trust is not None:
            seconds = received - last if last is not None else cluster.settings.health.report_interval
            cap = link_bytes(float(trust.capacity_mbps.get(server, float("nan"))), seconds)
        got = counted(before, after, row_user, cap)
        self.counters[server] = after
        return after, row_user, got, cap

    def _limit(self, server: str, got: np.ndarray, row_user: np.ndarray, side: np.ndarray,
               believe: Callable[[np.ndarray], np.ndarray], cap: int) -> np.ndarray:
        """Believe ``server`` only about its own users and its link: ``got`` loses (in place) the rows of users it
        may not report on (noted in ``refused``) and is scaled down to ``cap`` per direction. Returns the rows'
        users with the refused rows' made nobody's (a copy when any was refused)."""
        claim = np.flatnonzero(got > 0)
        ok = believe(row_user[claim])
        if not ok.all():
            no = claim[~ok]
            self.refused[server] = (len(np.unique(row_user[no])), int(got[no].sum()))
            got[no] = 0
            row_user = row_user.copy()
            row_user[no] = -1
        for s in (0, 1):  # and all of the server's rows together: no more than its link either
            total = int(got[side == s].sum())
            if total > cap:
                got[side == s] = got[side == s] * (cap / total)
        return row_user

    def _close_books(self, cluster: Cluster, roster: Roster, now: float, up: np.ndarray, down: np.ndarray,
                     open_on: dict[str, list[str]]) -> tuple[np.ndarray, np.ndarray, float]:
        """Add the interval's bytes to the cluster's users' books (a new period starts from zero), follow their
        demand, and note where they are connected, when they were last seen and which devices are still recent.
        Returns the users' periods [start, next) and the device window."""
        books = self.books
        start, nxt = roster.bounds(now)
        mine = slice(0, len(roster))  # the cluster's users' books (those who left the file follow them, untouched)
        new_period = books.period_start[mine] != start
        books.period_start[mine] = start
        books.up[mine][new_period] = 0
        books.down[mine][new_period] = 0
        for col, add in ((books.up, up), (books.down, down), (books.total, up + down)):
            col[mine] = saturated_sum(col[mine], add)
        dt = now - self.last_fold if self.last_fold else 0.0
        if dt > 0:
            alpha = 1.0 - 2.0 ** (-dt / DEMAND_HALF_LIFE)
            books.demand[mine] += alpha * ((up + down) * (8 / 1e6 / dt) - books.demand[mine])
        books.servers = {u: tuple(sorted(s)) for u, s in open_on.items() if u in roster.index}
        seen = (up > 0) | (down > 0)
        if books.servers:
            seen[[roster.index[u] for u in books.servers]] = True
        books.last_seen[mine][seen] = now
        window = cluster.settings.users.device_window
        books.devices = {u: kept for u, fps in books.devices.items()
                         if (kept := {fp: t for fp, t in fps.items() if now - t <= window})}
        return start, nxt, window

    @staticmethod
    def _believer(server: str, at: int, routes: RouteServers, roster: Roster,
                  trust: Trust | None) -> Callable[[np.ndarray], np.ndarray]:
        """Which of the given users (indices; -1: nobody) ``server`` may report on: assigned there, or (at most
        ``REACH_BUDGET`` distinct users per server and interval) placed there by a failover order; everyone
        without ``trust``."""
        if trust is None:
            return lambda users: users >= 0
        assigned = served_by(routes, at)
        budget = [REACH_BUDGET]

        def believe(users: np.ndarray) -> np.ndarray:
            ok = assigned(users)
            rest = np.unique(users[~ok & (users >= 0)])
            if len(rest) and trust.reach is not None and budget[0] > 0:
                look = rest[:budget[0]]
                budget[0] -= len(look)
                placed = look[trust.reach(server, [roster.names[int(u)] for u in look])]
                ok |= np.isin(users, placed)
            return ok
        return believe

    def view(self, cluster: Cluster, now: float) -> UsageView:
        """Each user's usage as of ``now`` (a period that ended since the last fold reads as zero)."""
        if self._view is not None and self._view[0] is cluster and self._view[1] == now:
            return self._view[2]  # the loop's interval: the fold just now made it
        roster = self.align(cluster)
        start, nxt = roster.bounds(now)
        return self._usage(roster, start, nxt, now, cluster.settings.users.device_window)

    def _usage(self, roster: Roster, start: np.ndarray, nxt: np.ndarray, now: float, window: float) -> UsageView:
        """The books as decisions read them at ``now``, in each user's period [start, nxt) (one that began since the
        book's reads as zero). Copies: the books change at the next fold, a view never does."""
        b, n = self.books, len(roster)
        fresh = b.period_start[:n] == start
        devices = np.zeros(n, np.int64)
        for user, fps in b.devices.items():
            i = roster.index.get(user)
            if i is not None:
                devices[i] = device_count(fps, now, window)
        return UsageView(roster.names, np.where(fresh, b.up[:n], 0), np.where(fresh, b.down[:n], 0), b.total[:n].copy(),
                         start, nxt, devices, b.last_seen[:n].copy(), b.demand[:n].copy(), dict(b.servers),
                         roster.index)

    def adopt(self, cluster: Cluster) -> None:
        """Forget the counters of servers that left the file (their users' totals stay)."""
        keep = {s.name for s in cluster.servers}
        for table in (self.counters, self.by_server, self.unavailable, self.epochs, self.read_at):
            for name in [k for k in table if k not in keep]:
                del table[name]

    # ------------------------------------------------------------------ the persisted form

    def pack(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The ledger as a small JSON document and arrays (a million users' books and counters are arrays: a
        JSON text of them took seconds every interval)."""
        servers = list(self.counters)
        tables = [self.counters[s] for s in servers]
        b = self.books
        sparse = {n: [b.devices.get(n, {}), list(b.servers.get(n, ()))] for n in sorted({*b.devices, *b.servers})}
        meta = {"epochs": self.epochs, "by_server": self.by_server, "by_route": self.by_route, "last_fold": self.last_fold,
                "said": self.said, "read_at": self.read_at, "counter_servers": servers, "counter_rows": [len(t) for t in tables],
                "sparse": sparse}

        def joined(pick: str) -> np.ndarray:
            parts = [getattr(t, pick) for t in tables]
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)

        arrays = {"c_keys": joined("keys"), "c_owners": joined("owners"), "c_packets": joined("packets"),
                  "c_bytes": joined("nbytes"), "u_names": np.frombuffer("\n".join(b.names).encode(), np.uint8),
                  "u_period": b.period_start, "u_up": b.up, "u_down": b.down, "u_total": b.total, "u_seen": b.last_seen,
                  "u_demand": b.demand}
        return meta, arrays

    @classmethod
    def unpack(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Ledger:
        """``pack``'s output read back (untrusted: a state file; any inconsistency raises ValueError)."""
        text = arrays["u_names"].astype(np.uint8).tobytes().decode()
        names = tuple(text.split("\n")) if text else ()
        keys = ("u_period", "u_up", "u_down", "u_total", "u_seen", "u_demand")
        columns = [np.asarray(arrays[k]) for k in keys]
        if any(c.ndim != 1 or c.dtype.kind not in "iuf" for c in columns) or any(len(c) != len(names) for c in columns):
            raise ValueError("the users' columns differ in length")
        if len(set(names)) != len(names) or "" in names:
            raise ValueError("the users' names are not unique")
        ints = [np.clip(c, 0, TOTAL_CAP).astype(np.int64) if c.dtype.kind == "f" else c.astype(np.int64) for c in columns[1:4]]
        if any((c < 0).any() for c in ints):
            raise ValueError("a user's bytes are negative")
        sparse = dict(meta.get("sparse") or {})
        devices = {str(n): {str(k): float(t) for k, t in dict(v[0]).items()} for n, v in sparse.items() if dict(v[0])}
        servers = {str(n): tuple(str(x) for x in v[1]) for n, v in sparse.items() if list(v[1])}
        books = Books(names, columns[0].astype(np.float64), ints[0], ints[1], ints[2], columns[4].astype(np.float64),
                      columns[5].astype(np.float64), devices, servers)
        servers_ = [str(x) for x in meta["counter_servers"]]
        rows = [int(x) for x in meta["counter_rows"]]
        cols = [arrays[k] for k in ("c_keys", "c_owners", "c_packets", "c_bytes")]
        if any(c.ndim != 1 or c.dtype != np.int64 for c in cols):
            raise ValueError("the counters' columns are not one-dimensional 64-bit integers")
        if len(servers_) != len(rows) or any(len(c) != sum(rows) for c in cols) or min(rows, default=0) < 0:
            raise ValueError("the counters' columns do not add up")
        counters, at = {}, 0
        for server, n in zip(servers_, rows, strict=True):
            keys_ = cols[0][at:at + n]
            if n > 1 and not bool(np.all(keys_[1:] > keys_[:-1])):
                raise ValueError(f"the counters of {server} are not sorted")
            counters[server] = CounterTable(keys_, cols[1][at:at + n], cols[2][at:at + n], cols[3][at:at + n])
            at += n
        return cls(counters=counters, books=books,
                   epochs={str(k): str(v) for k, v in dict(meta.get("epochs") or {}).items()},
                   read_at={str(k): float(v) for k, v in dict(meta.get("read_at") or {}).items()},
                   by_server={str(k): [int(v[0]), int(v[1])] for k, v in dict(meta["by_server"]).items()},
                   by_route={str(k): [int(v[0]), int(v[1])] for k, v in dict(meta["by_route"]).items()},
                   last_fold=float(meta["last_fold"]), said={str(k): str(v) for k, v in dict(meta.get("said") or {}).items()})

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> Ledger:
        """The ledger as state format 1 kept it (JSON inside the learned state's document)."""
        if not raw:
            return cls()
        counters = {}
        for server, entries in dict(raw["counters"]).items():
            rows = sorted(((old_key(str(k)), owner_id(str(v[0])) if v[0] else 0, int(v[1]), int(v[2]))
                           for k, v in dict(entries).items()), key=lambda r: r[0])
            rows = [r for i, r in enumerate(rows) if i + 1 == len(rows) or rows[i + 1][0] != r[0]]
            counters[str(server)] = CounterTable(*(np.array([r[i] for r in rows], np.int64) for i in range(4))) \
                if rows else CounterTable.empty()
        users = {str(u): UserBook.from_json(list(b)) for u, b in dict(raw["users"]).items() if u and "\n" not in str(u)}
        return cls(counters=counters, books=Books.of(list(users), list(users.values())),
                   epochs={str(k): str(v) for k, v in dict(raw.get("epochs") or {}).items()},
                   by_server={str(k): [int(v[0]), int(v[1])] for k, v in dict(raw["by_server"]).items()},
                   by_route={str(k): [int(v[0]), int(v[1])] for k, v in dict(raw["by_route"]).items()},
                   last_fold=float(raw["last_fold"]), said={str(k): str(v) for k, v in dict(raw.get("said") or {}).items()})


class Counted(Mapping[str, tuple[int, int]]):
    """One fold's (up, down) bytes per user who had traffic, read as a mapping (made only when asked)."""

    def __init__(self, names: tuple[str, ...], which: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        self._names, self._which, self._up, self._down = names, which, up, down

    @functools.cached_property
    def _at(self) -> dict[str, int]:
        return {self._names[i]: i for i in self._which.tolist()}

    def __getitem__(self, name: str) -> tuple[int, int]:
        i = self._at[name]
        return int(self._up[i]), int(self._down[i])

    def __iter__(self) -> Iterator[str]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._which)


def _device_id(trust: Trust | None, fp: str) -> str:
    """What is kept of a server's device fingerprint: an HMAC under the controller's own key (the servers all hold
    the day's key the fingerprints were made with; the state and etcd must give nothing they could search)."""
    if trust is None or not trust.device_key:
        return fp
    return hmac.digest(trust.device_key, fp.encode(), "sha256")[:DEVICE_ID_BYTES].hex()


def _believed_names(names: list[str], roster: Roster, believe: Callable[[np.ndarray], np.ndarray]) -> list[str]:
    """The names (of the cluster's users) a server's report is believed about."""
    if not names:
        return []
    ok = believe(np.fromiter((roster.index[u] for u in names), np.int64, len(names)))
    return [u for u, y in zip(names, ok.tolist(), strict=True) if y]




# Per route key (in the assignments' order): the server index each user is assigned to on it (-1: none).










