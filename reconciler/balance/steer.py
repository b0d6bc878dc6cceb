"""Choosing a route's pool for a user (STEER-1..5). Pure.

A pool is healthy while at least ``minimum_healthy`` of its inbounds are in
rotation (STEER-5). ``choose_pool`` returns the pool and why, or ``None`` when
no pool is healthy — the caller then serves the route's best available inbound
(STEER never overrides LB-8).

- failover: the healthy pool of highest priority; the fallback pool only when
  every other pool is unhealthy (STEER-1);
- random: a healthy pool chosen by the user's hash, fallback included (STEER-2);
- dynamic: the healthy pool with the lowest RTT EWMA from the user's region,
  fallback included; failover order until the region has ``dynamic_warmup``
  of fresh data (STEER-3);
- geo: the region's mapped pools in order, then the default failover order; the
  fallback pool takes part when healthy (STEER-4).
"""

from __future__ import annotations

from typing import cast

import numpy as np

from reconciler.balance.hashing import exponentials, key64
from reconciler.balance.snapshot import Snapshot
from reconciler.model import InboundRef, Route
from reconciler.model.cluster import Region


def pool_members(snapshot: Snapshot, route: Route, pool: str) -> list[InboundRef]:
    return [r for r in snapshot.cluster.members[route.id] if r.inbound.pool == pool and snapshot.usable(r)]


def healthy_pools(snapshot: Snapshot, route: Route, region: str | None = None) -> dict[str, bool]:
    """Pool → healthy, for users of ``region`` (a regional verdict counts only there, HEALTH-15)."""
    out = {}
    for pool in route.pools or []:
        in_rotation = sum(1 for r in pool_members(snapshot, route, pool) if snapshot.in_rotation(r.inbound.id, region))
        out[pool] = in_rotation >= route.minimum_healthy
    return out


def failover_order(route: Route) -> list[str]:
    pools = list(route.pools or [])
    if route.fallback_pool in pools:
        pools.remove(route.fallback_pool)
        pools.append(route.fallback_pool)
    return pools


def choose_pool(snapshot: Snapshot, route: Route, user_key: int, region: str | None,
                healthy: dict[str, bool] | None = None) -> tuple[str | None, str]:
    healthy = healthy if healthy is not None else healthy_pools(snapshot, route)
    if route.steering == "failover":
        return _failover(route, healthy)
    if route.steering == "random":
        return _random_pool(route, healthy, user_key)
    if route.steering == "dynamic":
        return _dynamic_pool(snapshot, route, region, healthy)
    return _geo_pool(route, region, healthy)


def _failover(route: Route, healthy: dict[str, bool], prefix: str = "") -> tuple[str | None, str]:
    """STEER-1: the first healthy pool in failover order; ``prefix`` says why another steering fell back to it."""
    for i, pool in enumerate(failover_order(route)):
        if healthy.get(pool):
            if pool == route.fallback_pool and i > 0:
                return pool, f"{prefix}fallback pool: every other pool is unhealthy"
            return pool, f"{prefix}failover: {'highest-priority' if i == 0 else 'first'} healthy pool"
    return None, "no pool is healthy"


def _random_pool(route: Route, healthy: dict[str, bool], user_key: int) -> tuple[str | None, str]:
    """STEER-2: a healthy pool by the user's hash (rendezvous), so a user keeps its pool while it stays healthy."""
    live = [p for p in route.pools or [] if healthy.get(p)]
    if not live:
        return None, "no pool is healthy"
    keys = np.array([key64(f"{route.id}/{p}") for p in live], dtype=np.uint64)
    pick = int(np.argmin(exponentials(np.array([user_key], dtype=np.uint64), keys)[0]))
    return live[pick], "random (fixed per user)"


def _dynamic_pool(snapshot: Snapshot, route: Route, region: str | None, healthy: dict[str, bool]) -> tuple[str | None, str]:
    """STEER-3: the healthy pool with the lowest RTT from the user's region, once the region has enough fresh data."""
    if region is None:
        return _failover(route, healthy, "no region for this user; ")
    warm = snapshot.cluster.settings.steering.dynamic_warmup
    timed = []
    for pool in route.pools or []:
        profile = snapshot.rtt.get((region, route.id, pool))
        if healthy.get(pool) and profile and profile.fresh and profile.seconds_of_data >= warm:
            timed.append((profile.ewma_ms, pool))
    if not timed:
        return _failover(route, healthy, f"no RTT profile from {region} yet; ")
    ms, pool = min(timed)
    return pool, f"dynamic: lowest RTT from {region} ({ms:.0f} ms)"


def _geo_pool(route: Route, region: str | None, healthy: dict[str, bool]) -> tuple[str | None, str]:
    """STEER-4: the region's mapped pools in order, then the default failover order."""
    # A region not in the table (any string a request brings) simply maps to nothing.
    mapped = route.geo.get(cast(Region, region)) if route.geo and region else None
    if mapped:
        for pool in mapped:
            if healthy.get(pool):
                return pool, f"geo: {region} → {pool}"
        return _failover(route, healthy, f"geo: {region}'s pools are unhealthy; ")
    return _failover(route, healthy, f"geo: no mapping for {region or 'unknown region'}; ")
