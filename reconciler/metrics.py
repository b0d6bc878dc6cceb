"""Prometheus metrics, built at scrape time from the loop's current view (HEALTH-13).

A custom collector reads one immutable ``FleetView`` (published by the loop after
every interval) plus the loop's own counters, so a scrape never races a tick and
costs nothing between scrapes. Cardinality is bounded by the cluster file:
labels are server, inbound, route, region and a closed set of statuses and
kinds; every label set that can exist is emitted from the start (zeros), so
``rate()`` and ``absent()`` behave from the first scrape. Units are base units
(seconds, bytes, bits per second).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from reconciler import __version__
from reconciler.balance import Snapshot
from reconciler.health.verdicts import STATUS_NAMES, Verdicts
from reconciler.model import Cluster, UserUsage

KINDS = ("collect", "plan", "apply", "load", "git", "outlets")
RESULTS = ("ok", "error")
TASKS = ("tick", "plan", "watch", "git")  # the loop's supervised tasks
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class FleetView:
    """What the loop knew after its last interval; replaced whole, never mutated."""

    cluster: Cluster
    verdicts: Verdicts | None = None
    snapshot: Snapshot | None = None
    traffic_mbps: Mapping[str, float] = field(default_factory=dict)
    connected: Mapping[str, int] = field(default_factory=dict)
    capacity_mbps: Mapping[str, float | None] = field(default_factory=dict)
    assigned: Mapping[str, int] = field(default_factory=dict)  # server → users assigned to its inbounds
    rtt_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (witness region, inbound) → EWMA
    drift: Mapping[str, int] = field(default_factory=dict)  # server → pending changes seen by the last plan
    traffic_bytes: Mapping[str, int] = field(default_factory=dict)  # server → bytes carried (a counter)
    cluster_digest: str = ""
    # Users (issue 16): each user's usage as of this interval (snapshot.usage has it too), and the users' bytes
    # summed per server and per route since the controller began counting ([up, down], counters).
    usage: Mapping[str, UserUsage] = field(default_factory=dict)
    user_bytes_by_server: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    user_bytes_by_route: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # "" = not assigned there
    usage_unavailable: Mapping[str, str] = field(default_factory=dict)  # server → why no per-user counters


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


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _fleet_metrics(view: FleetView) -> Iterator[Metric]:
    cluster, v = view.cluster, view.verdicts
    servers = cluster.servers
    refs = cluster.inbounds
    server_status = {s.name: "no_data" for s in servers}
    inbound_status = {r.inbound.id: "no_data" for r in refs}
    rotation = {r.inbound.id: True for r in refs}
    witnesses = {r.inbound.id: 0 for r in refs}
    votes = {r.inbound.id: 0 for r in refs}
    unreliable = {s.name: False for s in servers}
    if v is not None:
        for name, sv in v.servers().items():
            server_status[name] = sv.status
        for j, t in enumerate(v.topology.inbounds):
            if t in inbound_status:
                inbound_status[t] = STATUS_NAMES[int(v.status[j])]
                rotation[t] = bool(v.in_rotation[j])
                witnesses[t] = int(v.witnesses[j])
                votes[t] = int(v.votes[j])
        for i, name in enumerate(v.topology.servers):
            if name in unreliable:
                unreliable[name] = bool(v.unreliable[i])

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
        ("reconciler_inbound_witnesses", "Reliable witnesses with fresh data that probe the inbound.", witnesses),
        ("reconciler_inbound_votes", "Witnesses whose failure streak reached the threshold against the inbound.", votes),
    ):
        g = GaugeMetricFamily(name, help_, labels=["inbound", "server"])
        for r in refs:
            g.add_metric([r.inbound.id, r.server.name], float(values[r.inbound.id]))
        yield g
    g = GaugeMetricFamily("reconciler_witness_unreliable", "1 when the server's probe votes are discarded (HEALTH-6).",
                          labels=["server"])
    for s in servers:
        g.add_metric([s.name], 1.0 if unreliable[s.name] else 0.0)
    yield g
    # HEALTH-14: the evidence behind the verdicts. Streaks are sparse (only the failing pairs have a sample).
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

    rtt = GaugeMetricFamily("reconciler_rtt_ewma_seconds", "EWMA of probe RTTs from the witnesses of a region to an inbound (STEER-3).",
                            labels=["region", "inbound"])
    for (region, inbound), ms in sorted(view.rtt_ms.items()):
        rtt.add_metric([region, inbound], ms / 1000.0)
    yield rtt
