"""What the loop knew after its last interval, as one immutable view: the metrics, the status JSON and the console
read it (pure data: the loop builds it, nothing here does I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from reconciler.balance import Snapshot
from reconciler.fleet.history import Change
from reconciler.health.verdicts import Verdicts
from reconciler.model import Cluster, UserUsage


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
    # Users: each user's usage as of this interval (snapshot.usage has it too), and the users' bytes
    # summed per server and per route since the controller began counting ([up, down], counters).
    usage: Mapping[str, UserUsage] = field(default_factory=dict)
    user_bytes_by_server: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    user_bytes_by_route: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # "" = not assigned there
    usage_unavailable: Mapping[str, str] = field(default_factory=dict)  # server → why no per-user counters
    unreported: Mapping[str, str] = field(default_factory=dict)  # server → why the last interval had no report of it
    history: Mapping[str, tuple[Change, ...]] = field(default_factory=dict)  # server → its verdict changes (a week)
