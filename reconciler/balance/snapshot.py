"""The immutable snapshot every decision is made from.

A snapshot is (cluster model, health verdicts, per-server load and capacity,
RTT profiles per region, the previous assignments, facts such as REALITY
public keys, time). The file outlet and the live HTTP endpoint both answer
from the same snapshot with the same pure function, so they always agree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Generic, TypeVar, cast

import numpy as np

from reconciler.balance.assignments import Assignments
from reconciler.balance.hashing import keys64, name_keys
from reconciler.health.verdicts import Verdicts
from reconciler.model import Cluster, InboundRef, User, UserUsage
from reconciler.model.roster import STANDINGS, Standing

T = TypeVar("T")


@dataclass(frozen=True)
class ServerLoad:
    """What a server reported about its load (HEALTH-1 metrics) and its capacity estimate (LB-3)."""

    traffic_mbps: float = 0.0
    users: int = 0
    capacity_mbps: float | None = None


@dataclass(frozen=True)
class RTTProfile:
    """The EWMA of mesh RTTs from one region to one pool, and how long data has been collected (STEER-3)."""

    ewma_ms: float
    seconds_of_data: float
    fresh: bool = True


class Slot(Generic[T]):
    """A consumer's place in a snapshot's memo: it names what it keeps and makes it empty (``make``). The consumer
    defines its slots beside its code; the memo knows none of them."""

    __slots__ = ("make", "name")

    def __init__(self, name: str, make: Callable[[], T]):
        self.name, self.make = name, make

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class SnapshotMemo:
    """The snapshot's per-snapshot cache: what every request on one snapshot shares, computed once.

    A snapshot is immutable, so anything derived from it stays true for its lifetime; this object is the
    one mutable part, owned by the snapshot (a new snapshot, also one made by ``dataclasses.replace``,
    starts empty) and never compared or shown. Each consumer keeps what it derives in its own ``Slot``
    (``balance.decide`` its members, candidates and placements; ``subscriptions.document`` its headers and
    templates): ``memo[slot]`` is that slot's container for this snapshot, made empty on first use.
    """

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[Slot[Any], Any] = {}

    def __getitem__(self, slot: Slot[T]) -> T:
        found = self._slots.get(slot)
        if found is None:  # (setdefault: two threads asking at once get the same container)
            found = self._slots.setdefault(slot, slot.make())
        return cast(T, found)

    def __reduce__(self) -> tuple[type[SnapshotMemo], tuple[()]]:
        """Pickled (a pass's snapshot for its worker processes), it goes empty: its slots are keyed by the consumers'
        ``Slot`` objects, which an unpickled copy could never find again."""
        return SnapshotMemo, ()


@dataclass(frozen=True)
class Snapshot:
    cluster: Cluster
    now: float
    verdicts: Verdicts | None = None
    loads: Mapping[str, ServerLoad] = field(default_factory=dict)
    rtt: Mapping[tuple[str, str, str], RTTProfile] = field(default_factory=dict)  # (region, route, pool) → profile
    assignments: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (user, route) → inbound id
    public_keys: Mapping[str, str] = field(default_factory=dict)  # inbound id → REALITY public key (a fact)
    tls_pins: Mapping[str, str] = field(default_factory=dict)  # inbound id → base64 SHA-256 of a self-signed cert's key
    usage: Mapping[str, UserUsage] = field(default_factory=dict)  # user → traffic this period, devices, demand
    memo: SnapshotMemo = field(default_factory=SnapshotMemo, init=False, compare=False, repr=False)

    def with_fresh_memo(self) -> Snapshot:
        """The same snapshot with an empty memo: what it derived once for all its users (its cached properties: the
        standings, the users' keys, the held assignments) goes along; what consumers keep in the memo (templates,
        placements) starts again. (``dataclasses.replace`` derived all of it again: ~2 ms at 100k users, for each
        stretch of a pass's users.)"""
        out = copy.copy(self)
        object.__setattr__(out, "memo", SnapshotMemo())
        return out

    # ------------------------------------------------------------------ users

    def standing(self, user: User) -> Standing:
        """The user's standing at this snapshot's time with what the fleet measured (``roster.standings`` decides)."""
        i = self.cluster.roster.index.get(user.name)
        if i is not None and self.cluster.users[i] is user:
            return STANDINGS[int(self.standings[i])]
        return user.standing(self.now, self.usage.get(user.name))  # a user this snapshot's cluster does not hold

    @cached_property
    def standings(self) -> np.ndarray:
        """Every user's standing code (``STANDINGS``), in the cluster's order: decided once per snapshot, for all
        users at once (the balancer, the outlets, the enforcement, the events and the metrics each ask for all)."""
        return self.cluster.roster.standings(self.now, self.usage)

    def active(self, user: User) -> bool:
        return self.standing(user) == "active"

    # ------------------------------------------------------------------ health views

    def status(self, inbound_id: str) -> str:
        if self.verdicts is None:
            return "ok"
        return self.verdicts.inbound(inbound_id).status

    def in_rotation(self, inbound_id: str, region: str | None = None) -> bool:
        """The inbound is handed out to a user of ``region`` (None: of unknown region; HEALTH-10, HEALTH-15)."""
        if self.verdicts is None:
            return True
        t = self._inbound_index[inbound_id]
        if region is None or not self.regional:
            return bool(self.verdicts.in_rotation[t])
        return self.verdicts.in_rotation_for(t, region)

    @property
    def regional(self) -> bool:
        """Some inbound is out of rotation for one region's users only (HEALTH-15): rotation depends on the region."""
        return self.verdicts is not None and self.verdicts.any_regional

    def rotation_region(self, region: str | None) -> str | None:
        """The region rotation depends on for a user of ``region``: that region while some verdict is regional
        (HEALTH-15), else None, so that every user shares one set of candidates."""
        return (region or None) if self.regional else None

    def marked(self, inbound_id: str) -> bool:
        if self.verdicts is None:
            return False
        return bool(self.verdicts.marks_of_inbound(self._inbound_index[inbound_id]))

    def health_reason(self, inbound_id: str) -> str:
        if self.verdicts is None:
            return "no health data yet"
        return self.verdicts.inbound(inbound_id).reason

    def best_available(self, refs: tuple[InboundRef, ...]) -> InboundRef:
        """The least bad inbound when none is in rotation (HEALTH-11, LB-8)."""
        if self.verdicts is None:
            return refs[0]
        order = self.verdicts.best_available([r.inbound.id for r in refs])
        return next(r for r in refs if r.inbound.id == order[0])

    def usable(self, ref: InboundRef) -> bool:
        """A REALITY inbound whose public key is not known yet cannot be handed out."""
        return ref.inbound.protocol != "vless-reality" or ref.inbound.id in self.public_keys

    @cached_property
    def _inbound_index(self) -> dict[str, int]:
        if self.verdicts is None:
            return {}
        return {name: i for i, name in enumerate(self.verdicts.topology.inbounds)}

    # ------------------------------------------------------------------ users

    @cached_property
    def user_key_array(self) -> np.ndarray:
        """The users' balancing keys in the cluster's order (``name_keys``: computed once per set of names; kept here
        too, since finding them there hashes the tuple of every name, 0.5 ms at 100k users)."""
        return name_keys(self.cluster.roster.names)

    @cached_property
    def held(self) -> Assignments:
        """``assignments`` as columns over this cluster's users and inbounds (the balancer's own result already is
        one: then this is it), made once per snapshot for the batch, the counts and the outlets."""
        roster = self.cluster.roster
        return Assignments.of(self.assignments, roster.names, self.cluster.inbound_ids, roster.index)

    @cached_property
    def inbound_keys(self) -> dict[str, int]:
        ids = [r.inbound.id for r in self.cluster.inbounds]
        return dict(zip(ids, keys64(ids).tolist(), strict=True))

    def load(self, server: str) -> ServerLoad:
        return self.loads.get(server, ServerLoad())


def key_array(keys: list[int]) -> np.ndarray:
    return np.array(keys, dtype=np.uint64)
