"""Which inbound each user gets on each route (LB-1..9, ROUTE-1,2,5,7, HEALTH-10,11). Pure.

Two entry points over one immutable ``Snapshot``:

- ``rebalance(snapshot)`` — the batch, run once per report interval: assigns
  every active user on every route, in three steps per route (and pool):
  1. **targets**: how many of the route's users each candidate should hold —
     round-robin in proportion to the coefficients (LB-4); least-loaded in
     proportion to the capacity left for our users, ``max(0, C − T) + U·t̄``
     with ``t̄`` the route's traffic per connected user, so a server whose users
     are heavier than average gets fewer (LB-2); a saturated server (traffic at
     ``SATURATED`` of capacity) gets no new users; the whole route is
     round-robin while any candidate has no capacity estimate (LB-5);
  2. **stickiness** (LB-6): users keep their inbound unless it left the
     candidates (out of rotation, LB-7; another pool) or its server holds more
     than ``stickiness`` above its target — then only the excess leaves, the
     users with the weakest hash for it first;
  3. **placement** (LB-9): the free users (new, evicted, displaced) go by
     weighted rendezvous hashing to the candidates' remaining deficits, a chunk
     at a time, so a batch fills the targets instead of herding onto the
     single best server.
- ``decide(snapshot, user)`` — per request: the user's entries in route order,
  empty routes hidden. A user with a valid assignment in the snapshot keeps it,
  so files written from the batch and live answers always agree; a user without
  one is placed by the same hashing on the snapshot's deficits.

Where a live request's client address can choose another pool than the user's
record (``geo`` and ``dynamic`` steering, STEER-3/4), the batch also places every
user in every pool of the route, remembered per user and pool under
``pool_key(route, pool)``: the server within the pool the address chooses comes
from the same sticky, policy-weighted placement as the files (LB-6, LB-9), never
from one snapshot's deficits for every request alike (which herds).

**Users by their demand.** Once the fleet has measured users' recent demand
(``Snapshot.usage``, ``demand_mbps``), least-loaded placement counts demand
(Mbps) instead of heads: a user without a measurement weighs the mean of the
measured active users (else of everyone measured), a measured user at least
``DEMAND_FLOOR`` of that mean (an idle user may wake up). The target of a candidate
is its share of the route's demand, in proportion to the capacity left for
our users, ``C − max(0, T − D)`` with ``D`` the demand of the route's users it holds
(what remains of ``T`` is someone else's traffic); stickiness compares demand
held with the target (same ``stickiness`` margin), the excess leaves by weakest
hash until its demand is gone; free users are placed heaviest first — the
heaviest (above ``1/HEAVY`` of the mean target) one at a time where they leave
the lowest utilisation, so heavy users spread, the rest by the same hashing on
the deficits (in Mbps), a chunk at a time, where a user who would overshoot its
pick's deficit waits for the next chunk. With no demand measured (an empty
``usage``), round-robin routes, and while a route is round-robin for want of an
estimate (LB-5), users are counted as before.

Pair-marked inbounds (HEALTH-8) count at ``PAIR_PENALTY`` of their weight. When no
pool is healthy, the route balances over all its inbounds in rotation; with none
in rotation, the best available inbound is served (LB-8, HEALTH-11).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from reconciler.balance.assignments import NONE, Assignments
from reconciler.balance.hashing import exponentials, key64, scores
from reconciler.balance.snapshot import Slot, Snapshot
from reconciler.balance.steer import choose_pool, healthy_pools
from reconciler.model import Cluster, InboundRef, Route
from reconciler.model.roster import ACTIVE
from reconciler.model.usage import UsageView

PAIR_PENALTY = 0.5
ADDRESS_STEERED = ("geo", "dynamic")  # steering modes where a live request's address can choose the pool


POOL_SEPARATOR = "@"  # never in an id (the model's ID pattern): a key with it is a place in a pool


def pool_key(route_id: str, pool: str) -> str:
    """The assignment key of a user's place in ``pool`` of a route (an ``@`` never appears in an id)."""
    return f"{route_id}{POOL_SEPARATOR}{pool}"


def is_pool_key(key: str) -> bool:
    """Whether an assignment key is a user's place in a pool (``pool_key``) rather than on a whole route."""
    return POOL_SEPARATOR in key


def route_of_key(key: str) -> str:
    """The route an assignment key belongs to, whether it is a route id or a ``pool_key``."""
    return key.split(POOL_SEPARATOR, 1)[0]


def held_by_server(cluster: Cluster, assignments: Mapping[tuple[str, str], str]) -> dict[str, int]:
    """server → how many (user, route) pairs hold one of its inbounds now (the users' places in other pools,
    ``pool_key``, left out)."""
    per_inbound: dict[str, int] = {}
    if isinstance(assignments, Assignments):
        for (key, inbound), n in assignments.counts().items():
            if not is_pool_key(key):
                per_inbound[inbound] = per_inbound.get(inbound, 0) + n
    else:
        for (_, route), inbound in assignments.items():
            if not is_pool_key(route):
                per_inbound[inbound] = per_inbound.get(inbound, 0) + 1
    out: dict[str, int] = {}
    for ref in cluster.inbounds:
        if (held := per_inbound.get(ref.inbound.id, 0)) > 0:
            out[ref.server.name] = out.get(ref.server.name, 0) + held
    return out


SATURATED = 0.95  # traffic at this share of capacity: the server takes no new users (LB-2)
DEMAND_FLOOR = 0.1  # a measured user weighs at least this share of the mean demand (an idle user may wake up)
HEAVY = 16  # a free user above 1/HEAVY of the mean target is placed on its own, where it leaves the lowest utilisation
HEAVY_MAX = 4096  # at most this many users per batch are placed one at a time


@dataclass(frozen=True)
class Entry:
    """One line of a user's subscription: a route and the inbound chosen for it."""

    route: Route
    ref: InboundRef
    pool: str | None
    status: str
    in_rotation: bool
    why: str  # why this inbound
    health: str  # the inbound's health reason (HEALTH-13)
    backups: tuple[InboundRef, ...] = ()  # the app's failover order after ``ref``: as the balancer would pick them

    @property
    def name(self) -> str:
        return self.ref.inbound.name  # ROUTE-2: the entry is named after the chosen inbound


def _usable_members(snapshot: Snapshot, route: Route) -> tuple[InboundRef, ...]:
    return tuple(r for r in snapshot.cluster.members[route.id] if snapshot.usable(r))


def _candidates(snapshot: Snapshot, members: tuple[InboundRef, ...], pool: str | None,
                region: str | None = None) -> tuple[InboundRef, ...]:
    return tuple(r for r in members
                 if (pool is None or r.inbound.pool == pool) and snapshot.in_rotation(r.inbound.id, region))


def _kept_candidates(snapshot: Snapshot, route: Route, members: tuple[InboundRef, ...], pool: str | None,
                     region: str | None) -> tuple[InboundRef, ...]:
    """``_candidates``, kept in the snapshot's memo with a map of them by inbound id (``_CANDIDATE_IDS``)."""
    memo, key = snapshot.memo, (route.id, pool, region)
    cands = memo[_CANDIDATES].get(key)
    if cands is None:
        cands = _candidates(snapshot, members, pool, region)
        # The ids first: the live endpoint decides in its thread while the file outlet does in another, on one
        # snapshot; whoever finds the candidates finds their ids.
        memo[_CANDIDATE_IDS][key] = {r.inbound.id: r for r in cands}
        memo[_CANDIDATES][key] = cands
    return cands


def _loads(snapshot: Snapshot, cands: tuple[InboundRef, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    loads = [snapshot.load(r.server.name) for r in cands]
    traffic = np.array([x.traffic_mbps for x in loads], dtype=np.float64)
    users = np.array([x.users for x in loads], dtype=np.float64)
    cap = np.array([np.nan if x.capacity_mbps is None else x.capacity_mbps for x in loads], dtype=np.float64)
    missing = sorted({r.server.name for r, c in zip(cands, cap, strict=True) if np.isnan(c)})
    return traffic, users, cap, missing


@dataclass(frozen=True)
class Weights:
    """A route's (pool's) candidates and the share of its users each should hold."""

    share: np.ndarray  # (K,) target share, sums to 1
    closed: np.ndarray  # (K,) bool: takes no new users (saturated)
    mode: str
    detail: tuple[str, ...]  # per candidate, for the reason
    by_demand: bool = False  # shares of the route's demand (Mbps), not of its users


@dataclass(frozen=True)
class Demand:
    """A route's (pool's) users in demand units: the Mbps each candidate holds now, and the mean per user."""

    held: np.ndarray  # (K,) Mbps of the route's users assigned to each candidate
    per_user: float  # mean demand of the users being placed, Mbps (> 0)


def weights(snapshot: Snapshot, route: Route, cands: tuple[InboundRef, ...], population: int,
            held: np.ndarray | None = None, demand: Demand | None = None) -> Weights:
    """Target shares of ``population`` users over the candidates, by the route's policy.

    ``held``: users each candidate holds now (assignments); a saturated candidate's target is what it holds.
    ``demand``: the users' measured demand; least-loaded shares are then shares of the route's demand
    (``by_demand``), the capacity left for our users being ``C − max(0, T − demand.held)``.
    """
    held = np.zeros(len(cands)) if held is None else held
    traffic, users, cap, missing = _loads(snapshot, cands)
    marked = np.array([snapshot.marked(r.inbound.id) for r in cands])
    penalty = np.where(marked, PAIR_PENALTY, 1.0)
    closed = np.zeros(len(cands), dtype=bool)
    by_demand = False
    if route.balance == "least-loaded" and not missing:
        saturated = traffic >= SATURATED * cap
        by_demand = demand is not None
        if saturated.all():  # nobody has room: share by size rather than drop the route (LB-8)
            w, mode = cap.copy(), "least-loaded: every candidate is saturated; shared by capacity"
        elif demand is not None:  # in users of mean demand: room for ours, held (Mbps) / mean
            room = cap * penalty - np.maximum(0.0, traffic - demand.held)
            w = _equal_spare(room, demand.per_user, saturated, population, demand.held / demand.per_user)
            mode, closed = "least-loaded by demand", saturated
        else:
            w, mode = _equal_spare_per_user(cap * penalty, traffic, users, saturated, population, held), "least-loaded"
            closed = saturated
        spare = np.maximum(0.0, cap - traffic) / (users + 1.0)
        detail = tuple(f"least-loaded: {x:.1f} Mbps spare per user" for x in spare)
    else:
        w = np.array([r.server.coefficient for r in cands], dtype=np.float64) * penalty
        if route.balance == "round-robin":
            mode = "round-robin"
            detail = tuple(f"round-robin by coefficient {r.server.coefficient:g}" for r in cands)
        else:
            mode = f"round-robin: no capacity estimate yet for {', '.join(missing)}"
            detail = (mode,) * len(cands)
    if w.sum() <= 0:
        w = np.ones(len(cands))
    return Weights(share=w / w.sum(), closed=closed, mode=mode, detail=detail, by_demand=by_demand)


def _equal_spare_per_user(cap: np.ndarray, traffic: np.ndarray, users: np.ndarray, closed: np.ndarray,
                          population: int, held: np.ndarray) -> np.ndarray:
    """User counts that make spare bandwidth per user equal across candidates (LB-2), as shares.

    A candidate holding n users (U now, carrying T) is expected to carry T + (n - U)·t̄, t̄ the
    traffic per user; its spare per user is (C - T - (n - U)·t̄) / (n + 1). Solve for the common
    value λ with Σ n = the users being placed, by bisection.
    """
    per_user = float(traffic.sum() / users.sum()) if users.sum() > 0 else 0.0
    room = cap - traffic + users * per_user  # capacity available to our users
    return _equal_spare(room, per_user, closed, population, held)


def _equal_spare(room: np.ndarray, per_user: float, closed: np.ndarray, population: float,
                 held: np.ndarray) -> np.ndarray:
    """Users per candidate (of ``per_user`` Mbps each) that leave every open one the same spare per user,
    ``(room − n·per_user) / (n + 1)``, with ``Σ n = population``; a closed candidate keeps ``held``."""
    population = max(population, 1)

    def counts(lam: float) -> np.ndarray:
        return np.where(closed, held, np.maximum(0.0, (room - lam) / (lam + per_user)))

    lo, hi = 0.0, float(room.max())
    if per_user == 0.0:
        lo = 1e-9
    for _ in range(60):
        mid = (lo + hi) / 2
        if counts(mid).sum() > population:
            lo = mid
        else:
            hi = mid
    n = counts(hi)
    return n if n.sum() > 0 else np.where(closed, 0.0, np.maximum(room, 0.0))


def decide(snapshot: Snapshot, user_name: str, region: str | None = None) -> list[Entry]:
    """The user's subscription entries in route order (ROUTE-7); empty routes hidden (ROUTE-5).

    ``region`` overrides the user record's region (a live request's client address, STEER-4).
    An unknown, disabled or expired user gets no entries.
    """
    cluster = snapshot.cluster
    try:
        user = cluster.user(user_name)
    except KeyError:
        return []
    if not snapshot.active(user):
        return []
    region = region or user.region
    rkey = snapshot.rotation_region(region)  # rotation for this user's region, where a verdict is regional
    ukey = key64(user.name)
    entries: list[Entry] = []
    memo = snapshot.memo
    members_of, healthy_of, candidate_ids_of = memo[_MEMBERS], memo[_HEALTHY], memo[_CANDIDATE_IDS]
    for route in cluster.effective_routes:
        members = members_of.get(route.id)
        if members is None:
            members = members_of[route.id] = _usable_members(snapshot, route)
        if not members:
            continue
        pool: str | None = None
        pool_why = ""
        if route.pools:
            healthy = healthy_of.get((route.id, rkey))
            if healthy is None:
                healthy = healthy_of[(route.id, rkey)] = healthy_pools(snapshot, route, rkey)
            pool, pool_why = choose_pool(snapshot, route, ukey, region, healthy)
        cands = _kept_candidates(snapshot, route, members, pool, rkey)
        if not cands:
            ref = snapshot.best_available(members)
            why = "best available: every inbound of this route is out of rotation (HEALTH-11)"
            entries.append(_entry(snapshot, route, ref, pool, why, rkey))
            continue
        by_id = candidate_ids_of[(route.id, pool, rkey)]
        prev = snapshot.assignments.get((user.name, route.id))
        kept = by_id.get(prev) if prev is not None else None
        if kept is None and pool is not None:  # the address chose another pool than the record: its placement there
            prev = snapshot.assignments.get((user.name, pool_key(route.id, pool)))
            kept = by_id.get(prev) if prev is not None else None
        ukeys = np.array([ukey], dtype=np.uint64)
        if kept is not None:
            entries.append(_entry(snapshot, route, kept, pool, _join(pool_why, KEPT_WHY), rkey,
                                  _backups(snapshot, route, members, cands, pool, kept, ukeys, rkey)))
            continue
        w, keys, deficit = _placement(snapshot, route, cands)
        draws = exponentials(ukeys, keys)  # the user's fixed draws for the candidates: its pick and its order
        best = int(np.argmax(deficit / draws[0]))
        entries.append(_entry(snapshot, route, cands[best], pool, _join(pool_why, w.detail[best]), rkey,
                              _backups(snapshot, route, members, cands, pool, cands[best], ukeys, rkey, draws)))
    return entries


def failover_servers(snapshot: Snapshot, user_name: str) -> frozenset[str]:
    """The servers the user's subscription sends its app to (every entry's inbound and its failover order)."""
    return frozenset(r.server.name for e in decide(snapshot, user_name) for r in (e.ref, *e.backups))


def _backups(snapshot: Snapshot, route: Route, members: tuple[InboundRef, ...], cands: tuple[InboundRef, ...],
             pool: str | None, chosen: InboundRef, ukeys: np.ndarray, rkey: str | None,
             draws: np.ndarray | None = None) -> tuple[InboundRef, ...]:
    """Where the user's app goes when ``chosen`` fails, in order: the other candidates by the user's rendezvous
    scores on their target shares (the balancer's pick once ``chosen`` is gone: users who leave one server spread
    over the others in the policy's proportions, LB-9), then the route's other inbounds in rotation (other pools)
    the same way; at most ``failover.members - 1``."""
    limit = snapshot.cluster.settings.outputs.failover.members - 1
    if limit <= 0:
        return ()
    out: list[InboundRef] = []
    for n, (refs, keys, share) in enumerate(_failover_sets(snapshot, route, members, cands, pool, rkey)):
        if refs:  # ``draws``: the candidates' (the first set's) draws, when the pick already made them
            strength = -(share / draws) if n == 0 and draws is not None else -scores(ukeys, keys, share)
            out += [refs[i] for i in _strongest(strength, limit + 1)[0].tolist() if refs[i] is not chosen]
        if len(out) >= limit:
            break
    return tuple(out[:limit])


def _failover_sets(snapshot: Snapshot, route: Route, members: tuple[InboundRef, ...], cands: tuple[InboundRef, ...],
                   pool: str | None, rkey: str | None) -> tuple[FailoverSet, FailoverSet]:
    """The sets a failover order is drawn from, in turn: the candidates, then the route's other inbounds in rotation."""
    memo = snapshot.memo[_FAILOVER]
    found = memo.get((route.id, pool, rkey))
    if found is None:
        chosen_ids = {r.inbound.id for r in cands}  # by id: a model's ``==`` walks its fields (1,000² of them)
        rest = tuple(r for r in members if r.inbound.id not in chosen_ids and snapshot.in_rotation(r.inbound.id, rkey))
        found = memo[(route.id, pool, rkey)] = (_order_weights(snapshot, route, cands), _order_weights(snapshot, route, rest))
    return found


def _strongest(strength: np.ndarray, count: int) -> np.ndarray:
    """Each row's ``count`` strongest columns (the lowest ``strength``), strongest first: the few that can be in an
    order, not a sort of the route. One user or a block of them, the same operations row by row."""
    rows, width = strength.shape
    k = min(count, width)
    top = np.argpartition(strength, k - 1, axis=1)[:, :k] if k < width else np.broadcast_to(np.arange(width), (rows, width))
    ordered: np.ndarray = np.take_along_axis(top, np.argsort(np.take_along_axis(strength, top, 1), axis=1, kind="stable"), 1)
    return ordered


def _kept_columns(snapshot: Snapshot, positions: np.ndarray, routes: tuple[Route, ...] | list[Route]
                  ) -> list[tuple[Route, tuple[InboundRef, ...], tuple[InboundRef, ...], np.ndarray]]:
    """For each route with members: its members, its candidates (no pool, no region) and the candidate each of these
    users keeps (``_previous``; -1: none, placed afresh)."""
    members_of = snapshot.memo[_MEMBERS]
    out = []
    for route in routes:
        members = members_of.get(route.id)
        if members is None:
            members = members_of[route.id] = _usable_members(snapshot, route)
        if not members:
            continue
        cands = _kept_candidates(snapshot, route, members, None, None)
        out.append((route, members, cands, _previous(snapshot, route.id, positions, cands)))
    return out


def _block_orders(snapshot: Snapshot, route: Route, members: tuple[InboundRef, ...], cands: tuple[InboundRef, ...],
                  ukeys: np.ndarray, kept: np.ndarray, limit: int) -> list[tuple[int, ...]]:
    """``_backups`` of a block of users who keep candidate ``kept`` (each): each one's failover order as indices into
    the candidates and, past them, the route's other inbounds in rotation (``_failover_sets``)."""
    if limit <= 0:
        return [()] * len(ukeys)
    (refs, keys, share), (others, other_keys, other_share) = _failover_sets(snapshot, route, members, cands, None, None)
    first = _strongest(-scores(ukeys, keys, share), limit + 1).tolist() if refs else [[] for _ in range(len(ukeys))]
    orders = [[i for i in row if i != c] for row, c in zip(first, kept.tolist(), strict=True)]
    short = [row for row, order in enumerate(orders) if len(order) < limit]
    if short and others:
        then = _strongest(-scores(ukeys[short], other_keys, other_share), limit + 1).tolist()
        for row, more in zip(short, then, strict=True):
            orders[row] += [len(refs) + j for j in more]
    return [tuple(order[:limit]) for order in orders]


#: Entries a snapshot keeps for ``decide_block`` (the route, the kept inbound and the failover order name one): as
#: many as there are orders on a small fleet; on a big one the first ones (a user's own order is not worth keeping).
ENTRIES_KEPT = 65536
KEPT_WHY = "kept from the last assignment"  # why an entry is on the inbound the user held (``decide``, ``decide_block``)
EntryKey = tuple[str, int, tuple[int, ...]]  # a route, its kept candidate, the failover order (candidates' indices)
_KEPT_ENTRIES: Slot[dict[EntryKey, Entry]] = Slot("kept entries", dict)


def decide_block(snapshot: Snapshot, positions: np.ndarray) -> tuple[list[list[Entry]], list[tuple[EntryKey, ...] | None]]:
    """``decide`` of the users at these positions (the cluster's order), with no address: the same entries, for a
    block of users at once (the file outlet's 100k users; per user, the failover orders were most of ``decide``'s
    time). Users who keep their assignment on routes without pools, in a fleet with no regional verdict, are decided
    together; any other user is decided alone. Also, per user, a key naming its entries (equal keys, equal entries;
    None: decided alone, or no entries because the user is not served)."""
    cluster, memo = snapshot.cluster, snapshot.memo
    users = cluster.users
    n = len(positions)
    entries: list[list[Entry] | None] = [None] * n
    keys: list[tuple[EntryKey, ...] | None] = [None] * n
    together = np.flatnonzero(snapshot.standings[positions] == ACTIVE) if not snapshot.regional else np.zeros(0, np.int64)
    routes = cluster.effective_routes
    if any(route.pools for route in routes):
        together = together[:0]
    limit = cluster.settings.outputs.failover.members - 1
    per_route = _kept_columns(snapshot, positions[together], routes) if len(together) else []
    if per_route:  # a user placed afresh on some route (best available, a new route, a new user) is decided alone
        alike = np.logical_and.reduce([kept >= 0 for *_, kept in per_route])
        together = together[alike]
        per_route = [(route, members, cands, kept[alike]) for route, members, cands, kept in per_route]
    if len(together) and per_route:
        ukeys = snapshot.user_key_array[positions[together]]
        ordered = [(route, members, cands, kept.tolist(), _block_orders(snapshot, route, members, cands, ukeys, kept, limit))
                   for route, members, cands, kept in per_route]
        made = memo[_KEPT_ENTRIES]
        for row, i in enumerate(together.tolist()):
            mine, names = [], []
            for route, members, cands, kept, orders in ordered:
                key = (route.id, kept[row], orders[row])
                entry = made.get(key)
                if entry is None:
                    sets = _failover_sets(snapshot, route, members, cands, None, None)
                    everyone = sets[0][0] + sets[1][0]
                    entry = _entry(snapshot, route, cands[kept[row]], None, KEPT_WHY, None,
                                   tuple(everyone[o] for o in orders[row]))
                    if len(made) < ENTRIES_KEPT:
                        made[key] = entry
                mine.append(entry)
                names.append(key)
            entries[i], keys[i] = mine, tuple(names)
    elif len(together):  # served, on no route with members: no entries, as ``decide`` says
        for i in together.tolist():
            entries[i], keys[i] = [], ()
    out = [e if e is not None else decide(snapshot, users[int(p)].name) for e, p in zip(entries, positions.tolist(), strict=True)]
    return out, keys


def _order_weights(snapshot: Snapshot, route: Route,
                   refs: tuple[InboundRef, ...]) -> tuple[tuple[InboundRef, ...], np.ndarray, np.ndarray]:
    if not refs:
        return refs, np.zeros(0, np.uint64), np.zeros(0)
    keys = np.array([snapshot.inbound_keys[r.inbound.id] for r in refs], dtype=np.uint64)
    held = _held(snapshot, route.id, tuple(r.inbound.id for r in refs))  # the shares of the route's whole population
    return refs, keys, weights(snapshot, route, refs, max(int(held.sum()), len(snapshot.cluster.users)), held).share


Placement = tuple[Weights, np.ndarray, np.ndarray]  # weights, candidate keys, deficits
FailoverSet = tuple[tuple[InboundRef, ...], np.ndarray, np.ndarray]  # inbounds, their keys, their target shares
CandidateKey = tuple[str, str | None, str | None]  # (route id, pool, rotation region: ``Snapshot.rotation_region``)

# What decisions on one snapshot share, computed once (``SnapshotMemo``): a route's usable members, its pools' health
# per rotation region, the candidates of a (route, pool, region) and the same by inbound id (a kept assignment is
# found in one lookup: a thousand servers' route is not scanned), the weights, keys and deficits for placing a new
# user on a candidate set, the ordering weights of a user's failover members (candidates, then the route's others in
# rotation), the users assigned per (route, inbound), and their demand (what an unmeasured user weighs, None: nobody
# measured; the Mbps assigned per (route, inbound)).
_MEMBERS: Slot[dict[str, tuple[InboundRef, ...]]] = Slot("route members", dict)
_HEALTHY: Slot[dict[tuple[str, str | None], dict[str, bool]]] = Slot("healthy pools", dict)
_CANDIDATES: Slot[dict[CandidateKey, tuple[InboundRef, ...]]] = Slot("candidates", dict)
_CANDIDATE_IDS: Slot[dict[CandidateKey, dict[str, InboundRef]]] = Slot("candidates by id", dict)
_PLACEMENTS: Slot[dict[tuple[str, tuple[str, ...]], Placement]] = Slot("placements", dict)
_FAILOVER: Slot[dict[CandidateKey, tuple[FailoverSet, FailoverSet]]] = Slot("failover weights", dict)
_ASSIGNMENT_COUNTS: Slot[list[dict[tuple[str, str], int]]] = Slot("assignment counts", list)
_ASSIGNMENT_DEMAND: Slot[list[tuple[float | None, dict[tuple[str, str], float]]]] = Slot("assignment demand", list)


def _placement(snapshot: Snapshot, route: Route, cands: tuple[InboundRef, ...]) -> Placement:
    """Weights, candidate keys and deficits for placing a new user; once per snapshot and candidate set."""
    ids = tuple(r.inbound.id for r in cands)
    placements = snapshot.memo[_PLACEMENTS]
    found = placements.get((route.id, ids))
    if found is None:
        held = _held(snapshot, route.id, ids)
        keys = np.array([snapshot.inbound_keys[i] for i in ids], dtype=np.uint64)
        fill, assigned = _assignment_demand(snapshot)
        if fill is not None and route.balance == "least-loaded":  # in demand units, as the batch places
            held_mbps = np.array([assigned.get((route.id, i), 0.0) for i in ids], dtype=np.float64)
            per_user = float(held_mbps.sum() / held.sum()) if held.sum() > 0 else fill
            w = weights(snapshot, route, cands, int(held.sum()) + 1, held_mbps, Demand(held_mbps, per_user))
            if w.by_demand:
                found = placements[(route.id, ids)] = (w, keys, _deficit(w, held_mbps, float(held_mbps.sum()) + fill))
                return found
        w = weights(snapshot, route, cands, int(held.sum()) + 1, held)
        found = placements[(route.id, ids)] = (w, keys, _deficit(w, held, int(held.sum()) + 1))
    return found


def _held(snapshot: Snapshot, route_id: str, inbound_ids: tuple[str, ...]) -> np.ndarray:
    counts = _assignment_counts(snapshot)
    return np.array([counts.get((route_id, i), 0) for i in inbound_ids], dtype=np.float64)


def _assignment_counts(snapshot: Snapshot) -> dict[tuple[str, str], int]:
    """(route, inbound) → users assigned in the snapshot; computed once per snapshot."""
    once = snapshot.memo[_ASSIGNMENT_COUNTS]
    if not once:
        once.append(snapshot.held.counts())
    return once[0]


def _assignment_demand(snapshot: Snapshot) -> tuple[float | None, dict[tuple[str, str], float]]:
    """What an unmeasured user weighs (None: nobody measured) and the Mbps assigned per (route, inbound);
    computed once per snapshot, with the weights ``rebalance`` gives the same users."""
    once = snapshot.memo[_ASSIGNMENT_DEMAND]
    if not once:
        usage, roster = snapshot.usage, snapshot.cluster.roster
        counted = np.ones(len(roster), bool) if isinstance(usage, UsageView) and usage.names == roster.names else \
            np.fromiter((n in usage for n in roster.names), bool, len(roster))
        active = counted & (snapshot.standings == ACTIVE)
        measured = _measured_all(snapshot)
        fill = _fill(snapshot, measured[active])
        assigned: dict[tuple[str, str], float] = {}
        if fill is not None:
            weight = np.where(active, _weigh(measured, fill), fill)
            held = snapshot.held
            for key, col in held.columns.items():
                on = col >= 0
                sums = np.bincount(col[on], weights=weight[on], minlength=len(held.inbounds))
                assigned.update({(key, held.inbounds[t]): float(sums[t]) for t in np.flatnonzero(sums).tolist()})
        once.append((fill, assigned))
    return once[0]


def _fill(snapshot: Snapshot, measured: np.ndarray) -> float | None:
    """What a user without a measurement weighs: the mean of the measured active users, else of everyone
    measured; None when nobody was (balancing then counts users)."""
    if (measured > 0).any():
        return float(measured[measured > 0].mean())
    if not snapshot.usage:
        return None
    fleet = _measured_all(snapshot)
    return float(fleet[fleet > 0].mean()) if (fleet > 0).any() else None


def _weigh(measured: np.ndarray, fill: float) -> np.ndarray:
    """The users' weights in Mbps: measured (at least ``DEMAND_FLOOR`` of the mean), else the mean."""
    weighed: np.ndarray = np.where(measured > 0, np.maximum(measured, DEMAND_FLOOR * fill), fill)
    return weighed


def _deficit(w: Weights, held: np.ndarray, population: float) -> np.ndarray:
    """How many more users (Mbps, by demand) each candidate should take; never zero everywhere."""
    target = w.share * population
    deficit = np.where(w.closed, 0.0, np.maximum(0.0, target - held))
    if deficit.sum() <= 0:
        deficit = np.where(w.closed & ~w.closed.all(), 0.0, w.share)
    return deficit


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _entry(snapshot: Snapshot, route: Route, ref: InboundRef, pool: str | None, why: str, region: str | None,
           backups: tuple[InboundRef, ...] = ()) -> Entry:
    iid = ref.inbound.id
    return Entry(route=route, ref=ref, pool=pool, status=snapshot.status(iid),
                 in_rotation=snapshot.in_rotation(iid, region), why=why, health=snapshot.health_reason(iid), backups=backups)


# --------------------------------------------------------------------------- the batch


def rebalance(snapshot: Snapshot, chunk: int | None = None) -> Assignments:
    """Assign every active user on every route; returns (user, route) → inbound id."""
    cluster = snapshot.cluster
    roster = cluster.roster
    inbound_ids = cluster.inbound_ids
    active = np.flatnonzero(snapshot.standings == ACTIVE)
    columns: dict[str, np.ndarray] = {}
    if not len(active):
        return Assignments(roster.names, inbound_ids, columns, roster.index)
    inbound_at = {t: i for i, t in enumerate(inbound_ids)}
    ukeys = snapshot.user_key_array[active]
    regions = roster.regions[active]
    demand = _user_demand(snapshot, active)
    stick = 1.0 + cluster.settings.balance.stickiness

    def column(key: str) -> np.ndarray:
        col = columns.get(key)
        if col is None:
            col = columns[key] = np.full(len(roster), NONE, np.int32)
        return col

    for route in cluster.effective_routes:
        members = _usable_members(snapshot, route)
        if not members:
            continue
        for pool, idx, region in _pool_groups(snapshot, route, ukeys, regions):
            cands = _candidates(snapshot, members, pool, region)
            if not cands:
                column(route.id)[active[idx]] = inbound_at[snapshot.best_available(members).inbound.id]
                continue
            chosen = _batch(snapshot, route, cands, ukeys[idx], active[idx], stick, chunk,
                            demand=None if demand is None else demand[idx])
            column(route.id)[active[idx]] = np.array([inbound_at[r.inbound.id] for r in cands], np.int32)[chosen]
        if route.pools and route.steering in ADDRESS_STEERED:  # every user's place in every pool an address may choose
            for pool in dict.fromkeys([*route.pools, *([route.fallback_pool] if route.fallback_pool else [])]):
                cands = _candidates(snapshot, members, pool)
                if not cands:
                    continue
                key = pool_key(route.id, pool)
                chosen = _batch(snapshot, route, cands, ukeys, active, stick, chunk, key, demand)
                column(key)[active] = np.array([inbound_at[r.inbound.id] for r in cands], np.int32)[chosen]
    return Assignments(roster.names, inbound_ids, columns, roster.index)


def _user_demand(snapshot: Snapshot, active: np.ndarray) -> np.ndarray | None:
    """The active users' weights in Mbps (``_weigh``), None when no demand was measured (count users).
    ``active``: their positions in the cluster's users."""
    if not snapshot.usage:
        return None
    measured = _measured_all(snapshot)[active]
    fill = _fill(snapshot, measured)
    return None if fill is None else _weigh(measured, fill)


def _measured_all(snapshot: Snapshot) -> np.ndarray:
    """Every user's measured demand in Mbps in the cluster's order; 0 where never measured (or not a sane number)."""
    usage, roster = snapshot.usage, snapshot.cluster.roster
    if isinstance(usage, UsageView) and usage.names == roster.names:
        d = usage.demand_mbps
    else:
        d = np.fromiter((0.0 if (x := usage.get(n)) is None else x.demand_mbps for n in roster.names), np.float64,
                        len(roster))
    sane: np.ndarray = np.where(np.isfinite(d) & (d > 0), d, 0.0)
    return sane


def _pool_groups(snapshot: Snapshot, route: Route, ukeys: np.ndarray,
                 regions: np.ndarray) -> list[tuple[str | None, np.ndarray, str | None]]:
    """The batch's groups of users (positions in ``ukeys``) that share a pool and a rotation: (pool, users, region).
    Users are grouped by region where the route steers by region, or where some verdict is regional (HEALTH-15)."""
    everyone = np.arange(len(ukeys))
    by_region = snapshot.regional or (bool(route.pools) and route.steering in ADDRESS_STEERED)
    groups = [(str(r) or None, np.flatnonzero(regions == r)) for r in np.unique(regions)] if by_region else [(None, everyone)]
    out: list[tuple[str | None, np.ndarray, str | None]] = []
    for region, idx in groups:
        rkey = snapshot.rotation_region(region)
        if not route.pools:
            out.append((None, idx, rkey))
            continue
        healthy = healthy_pools(snapshot, route, rkey)
        if route.steering == "random":
            by_pool: dict[str | None, list[int]] = {}
            for i, key in zip(idx.tolist(), ukeys[idx].tolist(), strict=True):
                by_pool.setdefault(choose_pool(snapshot, route, key, None, healthy)[0], []).append(i)
            out += [(p, np.array(v, dtype=np.int64), rkey) for p, v in by_pool.items()]
        else:  # failover: one pool for everyone; geo and dynamic: the region's
            out.append((choose_pool(snapshot, route, 0, region if route.steering != "failover" else None, healthy)[0], idx, rkey))
    return out


def _previous(snapshot: Snapshot, key: str, users: np.ndarray, cands: tuple[InboundRef, ...]) -> np.ndarray:
    """Which candidate each user (positions in the cluster's users) held on the route key (-1: none of them)."""
    held = snapshot.held
    col = held.column(key)
    if col is None:
        return np.full(len(users), -1, np.int64)
    at = {t: i for i, t in enumerate(held.inbounds)}
    candidate_of = np.full(len(held.inbounds) + 1, -1, np.int64)  # the last: NONE's
    for c, r in enumerate(cands):
        if (t := at.get(r.inbound.id)) is not None:
            candidate_of[t] = c
    prev: np.ndarray = candidate_of[col[users]]
    return prev


def _batch(snapshot: Snapshot, route: Route, cands: tuple[InboundRef, ...], ukeys: np.ndarray, users: np.ndarray,
           stick: float, chunk: int | None, key: str | None = None, demand: np.ndarray | None = None) -> np.ndarray:
    """The candidate (an index into ``cands``) of each user (``users``: positions in the cluster's users)."""
    n, k = len(ukeys), len(cands)
    cand_keys = np.array([snapshot.inbound_keys[r.inbound.id] for r in cands], dtype=np.uint64)
    prev = _previous(snapshot, key or route.id, users, cands)
    sticky = prev >= 0
    if demand is not None and route.balance == "least-loaded":
        held_mbps = np.bincount(prev[sticky], weights=demand[sticky], minlength=k).astype(np.float64)
        w = weights(snapshot, route, cands, n, held_mbps, Demand(held_mbps, float(demand.mean())))
        if w.by_demand:
            return _batch_by_demand(w, ukeys, cand_keys, prev, demand, held_mbps, stick, chunk)
    held = np.bincount(prev[sticky], minlength=k).astype(np.float64)
    w = weights(snapshot, route, cands, n, held)
    target = w.share * n
    chosen = prev.copy()

    # Stickiness: keep everyone whose inbound is still a candidate, except a server's excess beyond
    # (1 + stickiness) x its target; those leave, weakest hash for their inbound first (LB-6).
    for i in np.flatnonzero(held > target * stick):
        members = np.flatnonzero(prev == i)
        excess = int(round(held[i] - target[i]))
        strength = 1.0 / exponentials(ukeys[members], cand_keys[i:i + 1])[:, 0]
        leave = members[np.argsort(strength, kind="stable")[:excess]]
        chosen[leave] = -1
        held[i] -= len(leave)

    # Placement of the free users by rendezvous hashing on the remaining deficits (LB-9).
    free = np.flatnonzero(chosen < 0)
    size = chunk or max(64, min(20000, len(free) // 32 + 1))
    for start in range(0, len(free), size):
        rows = free[start:start + size]
        deficit = _deficit(w, held, n)
        pick = scores(ukeys[rows], cand_keys, deficit).argmax(axis=1)
        chosen[rows] = pick
        held += np.bincount(pick, minlength=k)
    return chosen


def _batch_by_demand(w: Weights, ukeys: np.ndarray, cand_keys: np.ndarray, prev: np.ndarray, demand: np.ndarray,
                     held: np.ndarray, stick: float, chunk: int | None) -> np.ndarray:
    """``_batch`` in demand units (Mbps): targets, stickiness and deficits weigh each user by its demand."""
    k = len(cand_keys)
    total = float(demand.sum())
    target = w.share * total
    chosen = prev.copy()

    # Stickiness: a server leaves its excess demand beyond (1 + stickiness) x its target, weakest hash
    # first, until what left is (to within half the last user's demand) the excess (LB-6).
    for i in np.flatnonzero(held > target * stick):
        members = np.flatnonzero(prev == i)
        strength = 1.0 / exponentials(ukeys[members], cand_keys[i:i + 1])[:, 0]
        members = members[np.argsort(strength, kind="stable")]
        weighs = demand[members]
        leave = members[np.cumsum(weighs) - weighs / 2 < held[i] - target[i]]
        chosen[leave] = -1
        held[i] -= float(demand[leave].sum())

    free = _heaviest_first(np.flatnonzero(chosen < 0), demand)

    # The heaviest, one at a time, where they leave the lowest utilisation (heavy users spread).
    usable = ~w.closed & (target > 0)
    limit = float(target[usable].mean()) / HEAVY if usable.any() else np.inf
    heavy = free[:min(int(np.searchsorted(-demand[free], -limit)), HEAVY_MAX)]
    if heavy.size:
        strength = 1.0 / exponentials(ukeys[heavy], cand_keys)
        share = np.where(usable, target, 1.0)
        for row, u in enumerate(heavy.tolist()):
            after = np.where(usable, (held + demand[u]) / share, np.inf)
            tied = np.flatnonzero(after <= after.min() * (1 + 1e-9))
            c = int(tied[np.argmax(strength[row, tied])])
            chosen[u] = c
            held[c] += demand[u]

    # The rest by rendezvous hashing on the remaining deficits (LB-9), a chunk at a time; who would
    # overshoot its pick's deficit waits for the next chunk (at most a chunk waits; the last places everyone).
    rest = free[len(heavy):]
    size = chunk or max(64, min(20000, len(rest) // 32 + 1))
    carry = rest[:0]
    start = 0
    while start < len(rest) or carry.size:
        rows = np.concatenate([carry, rest[start:start + size]])
        start += size
        deficit = _deficit(w, held, total)
        strengths = scores(ukeys[rows], cand_keys, deficit)
        pick = strengths.argmax(axis=1)
        carry = rows[:0]
        room = np.maximum(0.0, target - held)
        if start < len(rest) and (room > 0).any():
            fits = _fits(strengths[np.arange(len(rows)), pick], pick, demand[rows], room)
            if (~fits).sum() <= size:  # what waits is never more than a chunk: no pile-up when room runs out
                carry, rows, pick = rows[~fits], rows[fits], pick[fits]
        chosen[rows] = pick
        held += np.bincount(pick, weights=demand[rows], minlength=k)
    return chosen


def _heaviest_first(users: np.ndarray, demand: np.ndarray) -> np.ndarray:
    """``users`` by decreasing demand, ties in their order: one sort of unique 64-bit keys, the demand's
    leading bits (a positive float's bits order as it does) above the position (several times faster
    than a stable argsort of 1M floats; demands within a few parts per billion count as equal)."""
    shift = np.uint64(max(1, (len(users) - 1).bit_length()))
    keys = (~demand[users].view(np.uint64) >> shift << shift) | np.arange(len(users), dtype=np.uint64)
    ordered: np.ndarray = users[(np.sort(keys) & ((np.uint64(1) << shift) - np.uint64(1))).astype(np.int64)]
    return ordered


def _fits(strength: np.ndarray, pick: np.ndarray, demand: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Which users of a chunk fit their pick's room: per pick, strongest first, while the demand before a
    user plus half its own stays within the room."""
    order = np.argsort(pick + 0.5 / (1.0 + strength))  # by pick, then strongest first
    picked, weighs = pick[order], demand[order]
    before = np.cumsum(weighs) - weighs
    starts = np.flatnonzero(np.r_[True, picked[1:] != picked[:-1]])
    before -= np.repeat(before[starts], np.diff(np.r_[starts, len(picked)]))
    fits = np.empty(len(pick), dtype=bool)
    fits[order] = before + weighs / 2 <= room[picked]
    return fits
