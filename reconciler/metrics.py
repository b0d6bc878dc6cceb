"""Prometheus metrics, built at scrape time from the loop's current view (HEALTH-13).

A custom collector reads one immutable ``FleetView`` (published by the loop after
every interval) plus the loop's own counters, so a scrape never races a tick and
costs nothing between scrapes. Cardinality is bounded by the cluster file:
labels are server, inbound, route, region and a closed set of statuses and
kinds; every label set that can exist is emitted from the start (zeros), so
``rate()`` and ``absent()`` behave from the first scrape. Units are base units
(seconds, bytes, bits per second).

Users are counted, not labelled: states, near quota, expiring, over the
device limit and connected are fleet-wide gauges, and the users' traffic is
broken down by route and by server only. Per-user series exist only when
``settings.users.metrics_per_user`` is on, for at most ``metrics_user_cap`` users
(the heaviest this period); the rest are summed under ``user="other"``. A
label never holds a credential, token or client address.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import get_args

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from reconciler import __version__
from reconciler.fleet.view import FleetView
from reconciler.health.verdicts import STATUS_NAMES
from reconciler.model import Cluster, UserUsage
from reconciler.model.roster import STANDINGS, Standing
from reconciler.model.usage import UsageView

KINDS = ("collect", "plan", "apply", "load", "git", "outlets")
RESULTS = ("ok", "error")
TASKS = ("tick", "plan", "watch", "git")  # the loop's supervised tasks
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STATES: tuple[str, ...] = get_args(Standing)  # a user's standing (User.standing)
DIRECTIONS = ("up", "down")  # up: client → server, down: server → client
UNASSIGNED = "unassigned"  # the route label of user bytes not attributable to a route
OTHER = "other"  # the user label that sums the users without series of their own


#: The first words of a silent server's reason (``loop.collect.silence``) → the metric's ``cause`` label.
UNREPORTED_CAUSES = {"SSH unreachable": "ssh", "agent silent": "agent", "report refused": "refused",
                     "backing off": "backoff", "collection failed": "bug"}


def unreported_cause(why: str) -> str:
    """The ``cause`` label of a silent server's reason."""
    return next((label for head, label in UNREPORTED_CAUSES.items() if why.startswith(head)), "bug")


class LoopStats:
    """Counters and duration histograms of the loop's work, by kind and result (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals = {(k, r): 0 for k in KINDS for r in RESULTS}
        self.buckets = {k: [0] * (len(BUCKETS) + 1) for k in KINDS}
        self.sums = dict.fromkeys(KINDS, 0.0)
        self.last_success = dict.fromkeys(KINDS, 0.0)
        self.server_errors: dict[str, int] = {}
        self.task_failures = dict.fromkeys(TASKS, 0)

    def record(self, kind: str, ok: bool, seconds: float, now: float) -> None:
        with self._lock:
            self.totals[(kind, "ok" if ok else "error")] += 1
            self.buckets[kind][bisect.bisect_left(BUCKETS, seconds)] += 1
            self.sums[kind] += seconds
            if ok:
                self.last_success[kind] = now

    def task_failed(self, task: str) -> None:
        with self._lock:
            self.task_failures[task] = self.task_failures.get(task, 0) + 1

    def server_error(self, server: str) -> None:
        with self._lock:
            self.server_errors[server] = self.server_errors.get(server, 0) + 1


class ReconcilerCollector(Collector):
    def __init__(self, view: Callable[[], FleetView | None], stats: LoopStats):
        self.view = view
        self.stats = stats

    def describe(self) -> Iterator[Metric]:  # no describe-time collection: the families depend on the cluster
        return iter(())

    def collect(self) -> Iterator[Metric]:
        view: FleetView | None = self.view()
        yield from self._loop_metrics(view)
        if view is None:
            return
        yield from _fleet_metrics(view)
        yield from _user_metrics(view)

    def _loop_metrics(self, view: FleetView | None) -> Iterator[Metric]:
        st = self.stats
        with st._lock:
            totals = dict(st.totals)
            buckets = {k: list(v) for k, v in st.buckets.items()}
            sums = dict(st.sums)
            last = dict(st.last_success)
            server_errors = dict(st.server_errors)
            task_failures = dict(st.task_failures)
        info = InfoMetricFamily("reconciler", "The reconciler's version, engine and the loaded cluster file's digest.")
        cluster = view.cluster if view else None
        info.add_metric([], {"version": __version__,
                             "engine": cluster.settings.engine.name if cluster else "",
                             "engine_version": cluster.settings.engine.version if cluster else "",
                             "cluster_digest": (view.cluster_digest[:12] if view else "")})
        yield info
        c = CounterMetricFamily("reconciler_reconcile", "Work the loop finished, by kind and result.", labels=["kind", "result"])
        for (k, r), n in sorted(totals.items()):
            c.add_metric([k, r], n)
        yield c
        h = HistogramMetricFamily("reconciler_reconcile_duration_seconds", "How long the loop's work took, by kind.",
                                  labels=["kind"])
        for k in KINDS:
            cum, acc = [], 0
            for bound, n in zip((*BUCKETS, float("inf")), buckets[k], strict=True):
                acc += n
                cum.append((_le(bound), acc))
            h.add_metric([k], cum, sums[k])
        yield h
        g = GaugeMetricFamily("reconciler_last_success_timestamp_seconds", "When each kind of work last succeeded (0: never).",
                              labels=["kind"])
        for k in KINDS:
            g.add_metric([k], last[k])
        yield g
        tf = CounterMetricFamily("reconciler_task_failures", "Times a task of the loop failed and was restarted.", labels=["task"])
        for task, n in sorted(task_failures.items()):
            tf.add_metric([task], n)
        yield tf
        servers = [s.name for s in cluster.servers] if cluster else []
        e = CounterMetricFamily("reconciler_collect_errors", "Collection runs that failed, by server (it is then no_data).",
                                labels=["server"])
        for s in servers:
            e.add_metric([s], server_errors.get(s, 0))
        yield e
        u = GaugeMetricFamily("reconciler_servers_unreported", "Servers the last interval had no report of, by why: "
                              "ssh (unreachable), agent (silent or exited), refused (its answer was not believed), "
                              "backoff (not asked: it failed before), bug.", labels=["cause"])
        causes = dict.fromkeys(UNREPORTED_CAUSES.values(), 0)
        for why in (view.unreported.values() if view else ()):
            causes[unreported_cause(why)] += 1
        for cause, n in causes.items():
            u.add_metric([cause], n)
        yield u


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _regional_and_marks(view: FleetView) -> Iterator[Metric]:
    """HEALTH-8, HEALTH-15: who cannot reach whom, and from where a server is out of rotation (sparse: a series only
    while it holds, so an alert names the server, the witness and the country customers most likely cannot use)."""
    v = view.verdicts
    ours = {s.name for s in view.cluster.servers}
    regional = GaugeMetricFamily("reconciler_server_unreachable_from",
                                 "1 while the server is unreachable from one country's witnesses only, and out of rotation "
                                 "for users of that country's region alone (HEALTH-15).", labels=["server", "country", "region"])
    mark = GaugeMetricFamily("reconciler_pair_mark", "1 while the witness alone cannot reach the server (a pair mark, "
                             "HEALTH-8): users where the witness stands most likely cannot reach it either.",
                             labels=["witness", "witness_country", "server"])
    if v is not None:
        for name, sv in v.servers().items():
            if name in ours and sv.unreachable_from and sv.out_for:
                regional.add_metric([name, sv.unreachable_from, sv.out_for], 1.0)
        pairs = {(m.witness, m.witness_country, m.server) for m in v.marks()}
        for witness, country, server in sorted(pairs):
            if server in ours:
                mark.add_metric([witness, country, server], 1.0)
    yield regional
    yield mark


@dataclass
class _Standing:
    """What the verdicts say of every server and inbound of the cluster file, as the metrics label them (no_data,
    in rotation, no witnesses while there are no verdicts yet). Made once per scrape, by ``_standing``."""

    server_status: dict[str, str]
    inbound_status: dict[str, str]
    rotation: dict[str, bool]
    witnesses: dict[str, int]
    votes: dict[str, int]
    unreliable: dict[str, bool]
    censored: dict[str, bool]


def _standing(view: FleetView) -> _Standing:
    cluster, v = view.cluster, view.verdicts
    servers = cluster.servers
    refs = cluster.inbounds
    out = _Standing(server_status={s.name: "no_data" for s in servers}, inbound_status={r.inbound.id: "no_data" for r in refs},
                    rotation={r.inbound.id: True for r in refs}, witnesses={r.inbound.id: 0 for r in refs},
                    votes={r.inbound.id: 0 for r in refs}, unreliable={s.name: False for s in servers},
                    censored={s.name: False for s in servers})
    if v is None:
        return out
    for name, sv in v.servers().items():
        out.server_status[name] = sv.status
    for j, t in enumerate(v.topology.inbounds):
        if t in out.inbound_status:
            out.inbound_status[t] = STATUS_NAMES[int(v.status[j])]
            out.rotation[t] = bool(v.in_rotation[j])
            out.witnesses[t] = int(v.witnesses[j])
            out.votes[t] = int(v.votes[j])
    assert v.censored is not None
    for i, name in enumerate(v.topology.servers):
        if name in out.unreliable:
            out.unreliable[name] = bool(v.unreliable[i])
            out.censored[name] = bool(v.censored[i])
    return out


def _fleet_metrics(view: FleetView) -> Iterator[Metric]:
    """The servers, inbounds and routes: their verdicts, the evidence behind them, their traffic and capacity, and
    the RTTs steering reads. One family after the other, each in the order a scrape has always listed them."""
    standing = _standing(view)
    yield from _status_metrics(view.cluster, standing)
    yield from _witness_metrics(view.cluster, standing)
    yield from _regional_and_marks(view)
    yield from _evidence_metrics(view)
    yield from _route_metrics(view.cluster, standing.rotation)
    yield from _server_metrics(view)
    rtt = GaugeMetricFamily("reconciler_rtt_ewma_seconds", "EWMA of probe RTTs from the witnesses of a region to an inbound (STEER-3).",
                            labels=["region", "inbound"])
    for (region, inbound), ms in sorted(view.rtt_ms.items()):
        rtt.add_metric([region, inbound], ms / 1000.0)
    yield rtt


def _status_metrics(cluster: Cluster, standing: _Standing) -> Iterator[Metric]:
    """Each server's and inbound's status, whether the inbound is in rotation, and the witnesses and votes behind it."""
    servers, refs = cluster.servers, cluster.inbounds
    server_status, inbound_status, rotation = standing.server_status, standing.inbound_status, standing.rotation
    g = GaugeMetricFamily("reconciler_server_status", "1 for the server's current status (one of five), 0 for the others.",
                          labels=["server", "country", "status"])
    for s in servers:
        for st in STATUS_NAMES:
            g.add_metric([s.name, s.country, st], 1.0 if server_status[s.name] == st else 0.0)
    yield g
    g = GaugeMetricFamily("reconciler_server_status_code",
                          "The server's status as a number for timelines: " + ", ".join(f"{i} {n}" for i, n in enumerate(STATUS_NAMES)) + ".",
                          labels=["server"])
    for s in servers:
        g.add_metric([s.name], float(STATUS_NAMES.index(server_status[s.name])))
    yield g
    g = GaugeMetricFamily("reconciler_inbound_status", "1 for the inbound's current status (one of five), 0 for the others.",
                          labels=["inbound", "server", "route", "status"])
    for r in refs:
        for st in STATUS_NAMES:
            g.add_metric([r.inbound.id, r.server.name, r.inbound.route or "", st], 1.0 if inbound_status[r.inbound.id] == st else 0.0)
    yield g
    g = GaugeMetricFamily("reconciler_inbound_in_rotation", "1 when the inbound is handed out to users (HEALTH-10).",
                          labels=["inbound", "server", "route"])
    for r in refs:
        g.add_metric([r.inbound.id, r.server.name, r.inbound.route or ""], 1.0 if rotation[r.inbound.id] else 0.0)
    yield g
    for name, help_, values in (
        ("reconciler_inbound_witnesses", "Reliable witnesses with fresh data that probe the inbound.", standing.witnesses),
        ("reconciler_inbound_votes", "Witnesses whose failure streak reached the threshold against the inbound.", standing.votes),
    ):
        g = GaugeMetricFamily(name, help_, labels=["inbound", "server"])
        for r in refs:
            g.add_metric([r.inbound.id, r.server.name], float(values[r.inbound.id]))
        yield g


def _witness_metrics(cluster: Cluster, standing: _Standing) -> Iterator[Metric]:
    """How each server was judged as a witness (HEALTH-6)."""
    g = GaugeMetricFamily("reconciler_witness_unreliable", "1 when the server's probe votes are discarded (HEALTH-6).",
                          labels=["server"])
    for s in cluster.servers:
        g.add_metric([s.name], 1.0 if standing.unreliable[s.name] else 0.0)
    yield g
    g = GaugeMetricFamily("reconciler_witness_censored", "1 when the server loses many others in a censor's pattern (it "
                          "still reaches its own country, or the controller reaches it); its votes count (HEALTH-6).",
                          labels=["server", "country"])
    for s in cluster.servers:
        g.add_metric([s.name, s.country], 1.0 if standing.censored[s.name] else 0.0)
    yield g


def _evidence_metrics(view: FleetView) -> Iterator[Metric]:
    """HEALTH-14: the evidence behind the verdicts. Streaks are sparse (only the failing pairs have a sample)."""
    v, refs = view.verdicts, view.cluster.inbounds
    streak = GaugeMetricFamily("reconciler_probe_failure_streak",
                               "Consecutive failed probes of a witness against an inbound (HEALTH-5); failing pairs only.",
                               labels=["witness", "inbound"])
    marks = GaugeMetricFamily("reconciler_inbound_pair_marks", "Pair marks on the inbound: witnesses alone in failing "
                              "to reach it (HEALTH-8).", labels=["inbound", "server"])
    if v is not None:
        ours = {r.inbound.id for r in refs}
        for wi, ti in zip(*np.nonzero(v.fail > 0), strict=True):
            inbound = v.topology.inbounds[int(ti)]
            if inbound in ours:
                streak.add_metric([v.topology.servers[int(wi)], inbound], float(v.fail[wi, ti]))
    count: dict[int, int] = {}
    for _w, target, _both in v.pair_marks if v is not None else []:
        count[target] = count.get(target, 0) + 1
    for r in refs:
        j = v.topology.inbounds.index(r.inbound.id) if v is not None and r.inbound.id in v.topology.inbounds else -1
        marks.add_metric([r.inbound.id, r.server.name], float(count.get(j, 0)) if v is not None else 0.0)
    yield streak
    yield marks


def _route_metrics(cluster: Cluster, rotation: Mapping[str, bool]) -> Iterator[Metric]:
    """Each route's inbounds, those of them in rotation, and whether its users get the best available."""
    active = GaugeMetricFamily("reconciler_route_active_inbounds", "Inbounds of the route in rotation (ROUTE, HEALTH-10).",
                               labels=["route"])
    members_g = GaugeMetricFamily("reconciler_route_inbounds", "Inbounds that belong to the route.", labels=["route"])
    best = GaugeMetricFamily("reconciler_route_best_available_only",
                             "1 when no inbound of a non-empty route is in rotation and users get the best available (HEALTH-11).",
                             labels=["route"])
    for route in cluster.effective_routes:
        members = cluster.members.get(route.id, ())
        n_active = sum(1 for m in members if rotation[m.inbound.id])
        active.add_metric([route.id], float(n_active))
        members_g.add_metric([route.id], float(len(members)))
        best.add_metric([route.id], 1.0 if members and n_active == 0 else 0.0)
    yield active
    yield members_g
    yield best


def _server_metrics(view: FleetView) -> Iterator[Metric]:
    """Each server's traffic, capacity, users, drift and last report, and how often every server reports."""
    v, servers = view.verdicts, view.cluster.servers
    traffic = GaugeMetricFamily("reconciler_server_traffic_bytes_per_second", "Traffic through the engine over the last interval.",
                                labels=["server"])
    cap = GaugeMetricFamily("reconciler_server_capacity_bytes_per_second",
                            "Capacity estimate from observed peaks (LB-3); 0 until a real peak was seen.", labels=["server"])
    known = GaugeMetricFamily("reconciler_server_capacity_known", "1 once the server has a capacity estimate.", labels=["server"])
    users = GaugeMetricFamily("reconciler_server_connected_users", "Users with open connections (from the engine).",
                              labels=["server"])
    assigned = GaugeMetricFamily("reconciler_server_assigned_users", "Users whose subscription points at this server.",
                                 labels=["server"])
    drift = GaugeMetricFamily("reconciler_server_drift_changes", "Changes the last plan found pending (drift), by server.",
                              labels=["server"])
    carried = CounterMetricFamily("reconciler_server_traffic_bytes",
                                  "Bytes the engine carried (both directions), across engine restarts: rate() it.",
                                  labels=["server"])
    reported = GaugeMetricFamily("reconciler_server_last_report_timestamp_seconds",
                                 "When the server last reported (no sample until it has).", labels=["server"])
    interval = GaugeMetricFamily("reconciler_report_interval_seconds", "How often every server reports (HEALTH-1).")
    interval.add_metric([], float(view.cluster.settings.health.report_interval))
    report_index = {name: i for i, name in enumerate(v.topology.servers)} if v is not None else {}
    for s in servers:
        traffic.add_metric([s.name], view.traffic_mbps.get(s.name, 0.0) * 1e6 / 8)
        c = view.capacity_mbps.get(s.name)
        cap.add_metric([s.name], (c or 0.0) * 1e6 / 8)
        known.add_metric([s.name], 0.0 if c is None else 1.0)
        users.add_metric([s.name], float(view.connected.get(s.name, 0)))
        assigned.add_metric([s.name], float(view.assigned.get(s.name, 0)))
        drift.add_metric([s.name], float(view.drift.get(s.name, 0)))
        carried.add_metric([s.name], float(view.traffic_bytes.get(s.name, 0)))
        at = report_index.get(s.name)
        last = float(v.last_report[at]) if (v is not None and at is not None) else float("-inf")
        if math.isfinite(last):
            reported.add_metric([s.name], last)
    yield from (traffic, cap, known, users, assigned, drift, carried, reported, interval)


def _user_metrics(view: FleetView) -> Iterator[Metric]:
    """The users: counts by state and by what operators act on, the users' traffic by route and by
    server, whether each server counts per user, and, only when the file asks, capped per-user series."""
    cluster, usage = view.cluster, view.usage
    settings = cluster.settings.users
    now = view.snapshot.now if view.snapshot is not None else time.time()
    snap = view.snapshot  # its standings are decided already, when it is the one these figures come from
    roster = cluster.roster
    codes = snap.standings if snap is not None and snap.cluster is cluster and snap.usage is usage else \
        roster.standings(now, usage)
    counts = np.bincount(codes, minlength=len(STANDINGS))
    states = dict.fromkeys(STATES, 0) | {st: int(counts[i]) for i, st in enumerate(STANDINGS)}
    notices = roster.notices(now, usage, settings.warn_quota, settings.warn_expiry)  # counts only, whatever the users
    expiring, near = int(notices.expiring.sum()), int(notices.near_quota.sum())
    over_devices = int(notices.over_devices.sum())
    connected = sum(1 for x in usage.servers.values() if x) if isinstance(usage, UsageView) else \
        sum(1 for x in usage.values() if x.servers)
    g = GaugeMetricFamily("reconciler_users", "Users in the cluster file by state (User.standing): active, disabled, "
                          "expired, over_quota, device_limit (refused over its device limit).", labels=["state"])
    for st in STATES:
        g.add_metric([st], float(states[st]))
    yield g
    for name, help_, n in (
        ("reconciler_users_near_quota", "Users with a data_limit who used at least settings.users.warn_quota of it "
                                        "this period and are not over it yet.", near),
        ("reconciler_users_expiring", "Users whose `expires` comes within settings.users.warn_expiry.", expiring),
        ("reconciler_users_over_device_limit", "Users seen on more devices than their device_limit (refused or "
                                               "only reported, as on_device_limit says).", over_devices),
        ("reconciler_users_connected", "Users with open connections on at least one server.",
         connected),
    ):
        g = GaugeMetricFamily(name, help_)
        g.add_metric([], float(n))
        yield g

    by_route = CounterMetricFamily("reconciler_route_user_traffic_bytes",
                                   "Payload bytes of the users' connections (the servers' per-user kernel counters), "
                                   f'by route and direction: rate() it; route="{UNASSIGNED}": not attributable to a route.',
                                   labels=["route", "direction"])
    routes: dict[str, list[int]] = {r.id: [0, 0] for r in cluster.effective_routes}
    routes.setdefault(UNASSIGNED, [0, 0])  # a route with that id shares the label with the unattributed bytes
    for route, (up, down) in view.user_bytes_by_route.items():
        key = route or UNASSIGNED
        if key in routes:  # a route that left the file is no longer exported (its counter would only go stale)
            routes[key][0] += up
            routes[key][1] += down
    for route, pair in routes.items():
        for d, n in zip(DIRECTIONS, pair, strict=True):
            by_route.add_metric([route, d], float(n))
    yield by_route
    by_server = CounterMetricFamily("reconciler_server_user_traffic_bytes",
                                    "Payload bytes of the users' connections through the server (its per-user kernel "
                                    "counters), by direction: rate() it.", labels=["server", "direction"])
    counting = GaugeMetricFamily("reconciler_server_usage_counting",
                                 "1 while the server's per-user traffic counters are read; 0 when its last report had "
                                 "none (no nftables, the table missing): its users' traffic is not counted.",
                                 labels=["server"])
    for s in cluster.servers:
        for d, n in zip(DIRECTIONS, view.user_bytes_by_server.get(s.name, (0, 0)), strict=True):
            by_server.add_metric([s.name, d], float(n))
        counting.add_metric([s.name], 0.0 if s.name in view.usage_unavailable else 1.0)
    yield by_server
    yield counting
    if settings.metrics_per_user:
        yield from _per_user_metrics(cluster, usage, settings.metrics_user_cap)


def _per_user_metrics(cluster: Cluster, usage: Mapping[str, UserUsage], cap: int) -> Iterator[Metric]:
    """Series per user for the ``cap`` heaviest users this period; the others' traffic is summed as ``other``
    (a user named ``other`` is always counted there). At most cap + 1 user label values per family."""
    empty = UserUsage()
    roster = cluster.roster
    heavy = roster.measured(usage)[0].astype(np.float64)
    heavy[[i for i in (roster.index.get(OTHER),) if i is not None]] = -1.0  # never a series of its own
    top = np.argsort(-heavy, kind="stable")[:min(cap, int((heavy >= 0).sum()))]  # the heaviest, the file's order in a tie
    heaviest = [cluster.users[i] for i in top.tolist()]
    chosen = {u.name for u in heaviest}
    traffic = GaugeMetricFamily("reconciler_user_traffic_period_bytes",
                                "Payload bytes the user carried this period (both count against data_limit), by "
                                f'direction; the heaviest settings.users.metrics_user_cap users, the rest summed as user="{OTHER}".',
                                labels=["user", "direction"])
    ratio = GaugeMetricFamily("reconciler_user_quota_ratio", "This period's traffic over the user's data_limit (1: "
                              "the servers refuse it); users with a limit and series of their own.", labels=["user"])
    devices = GaugeMetricFamily("reconciler_user_devices", "Distinct client addresses seen within "
                                "settings.users.device_window; users with series of their own.", labels=["user"])
    for u in heaviest:
        used = usage.get(u.name, empty)
        traffic.add_metric([u.name, "up"], float(used.up))
        traffic.add_metric([u.name, "down"], float(used.down))
        if u.data_limit:
            ratio.add_metric([u.name], used.used / u.data_limit)
        devices.add_metric([u.name], float(used.devices))
    rest_up = rest_down = 0
    if isinstance(usage, UsageView) and usage.names == roster.names:
        rest = np.ones(len(roster), bool)
        rest[top] = False
        rest_up, rest_down = int(usage.up[rest].sum()), int(usage.down[rest].sum())
    else:
        for u in cluster.users:
            if u.name not in chosen and (other := usage.get(u.name)) is not None:
                rest_up += other.up
                rest_down += other.down
    traffic.add_metric([OTHER, "up"], float(rest_up))
    traffic.add_metric([OTHER, "down"], float(rest_down))
    dropped = GaugeMetricFamily("reconciler_user_series_dropped", "Users without series of their own (over "
                                f'settings.users.metrics_user_cap): their traffic is in user="{OTHER}".')
    dropped.add_metric([], float(len(cluster.users) - len(heaviest)))
    yield from (traffic, ratio, devices, dropped)
