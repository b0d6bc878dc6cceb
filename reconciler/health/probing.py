"""Who probes whom in one interval (HEALTH-4..9): the probe plan, bounded as the fleet grows. Pure.

The full mesh (every server probes every other server's inbounds) costs N² probes per
interval. Up to ``full_mesh_up_to`` servers that is what the fleet does. Above it, each
target server is probed by a bounded set of witnesses, and every witness of a target
probes all of that target's inbounds (so the verdict engine sees the same witnesses for
every inbound of a server):

1. **Designated probers** probe every other server, every interval (HEALTH-9: a prober
   checks the others for blocking; its streaks must run unbroken to ``prober_streak``).
2. **Its own country**: every other server in the target's country, or, in a country of
   more than ``probe_country + 1`` servers, a fixed ``probe_country`` of them (the next
   ones on a ring of the country's servers). HEALTH-7's country quorum about the
   target's own country forms among them.
3. **Every other country**: ``probe_per_country`` ordinary servers of each country (a
   country quorum, HEALTH-7: the witnesses in a blocking country convict about their
   own country only, so each country needs a few witnesses on every target). Targets
   are dealt to the country's servers round-robin, so each serves about
   ``probe_per_country × (targets / its servers)``. A country too small to cover every
   target within ``probe_limit`` per server covers a window of the targets that moves on
   every rotation period; a lone server without a prober in its country never convicts
   (``min_witnesses``) and is not asked.
4. **A rotating sample elsewhere**: ``probe_sample`` more ordinary servers not already
   probing the target, in ``GROUPS`` groups. Each group keeps its witnesses for a
   rotation period and the groups change at staggered intervals, so at most one group's
   witnesses are new within any ``failure_streak`` intervals: the others' streaks run on,
   and an outage is still convicted within ``failure_streak + 1`` intervals. The
   sample walks a fixed ring by a moving offset, so every (witness, target) pair is
   probed for a whole rotation period at least once every ``⌈N / probe_sample⌉``
   rotation periods (HEALTH-4, HEALTH-8 between any two servers, over time).

Bounds per ordinary witness and interval, in target servers: ``probe_country`` (its own
country) + ``probe_limit`` (the other countries) + the sample's windows
(``witness_bound``); about ``probe_sample`` of the last on average. Probers probe all.

The plan is a function of the topology, the settings and the interval index only: the
loop asks each agent for its row (``reconciler.fleet.reports.agent_request``), the
simulation masks its probe results with it, and the engine reads only what arrived (a
pair that was not probed is not present, never a failure).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from reconciler.health.topology import Topology
from reconciler.model.cluster import HealthSettings

GROUPS = 4  # the rotating sample changes one group at a time
_GOLDEN = 0.6180339887498949  # spreads the small countries' windows evenly over the targets


@dataclass(frozen=True)
class ProbePlan:
    """Which server probes which server's inbounds in one interval."""

    interval: int
    full: bool  # the full mesh
    pairs: npt.NDArray[np.bool_]  # (N, N): witness w probes every inbound of server j (never w == j); read-only

    def targets_of(self, witness: int) -> npt.NDArray[np.intp]:
        """The servers whose inbounds ``witness`` probes."""
        return np.flatnonzero(self.pairs[witness])

    def witnesses_of(self, target: int) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self.pairs[:, target])

    def inbound_mask(self, topology: Topology) -> npt.NDArray[np.bool_]:
        """(N, M): witness w probes inbound t (the engine's ``probe_present`` shape)."""
        return self.pairs[:, topology.server_of]

    def probes_per_server(self, topology: Topology) -> npt.NDArray[np.int_]:
        """(N,): how many inbounds each server probes in this interval."""
        per_server = np.bincount(topology.server_of, minlength=topology.n)
        return self.pairs.astype(np.int32) @ per_server


def rotation_period(settings: HealthSettings) -> int:
    """Intervals a sampled witness keeps its target: at least ``GROUPS × failure_streak``, so that
    within the streak a conviction needs at most one group of new witnesses."""
    return max(settings.probe_rotation, GROUPS * settings.failure_streak)


def _group_sizes(settings: HealthSettings) -> list[int]:
    k = settings.probe_sample
    return [k // GROUPS + (1 if g < k % GROUPS else 0) for g in range(GROUPS)]


def _window(k: int) -> int:
    """How far along the ring a group looks for its ``k`` witnesses (skipping those already probing)."""
    return 3 * k + 4 if k else 0


def witness_bound(settings: HealthSettings) -> int:
    """The most target servers an ordinary (non-prober) witness probes in one interval of the bounded plan."""
    return settings.probe_country + settings.probe_limit + sum(_window(k) for k in _group_sizes(settings))


def uses_full_mesh(topology: Topology, settings: HealthSettings) -> bool:
    return topology.n <= settings.full_mesh_up_to


def probe_plan(topology: Topology, interval: int, settings: HealthSettings) -> ProbePlan:
    """The plan for interval ``interval`` (the loop's tick index). Deterministic; cached per phase."""
    if uses_full_mesh(topology, settings):
        return ProbePlan(interval, True, _full_mesh(topology.n))
    period = rotation_period(settings)
    window = interval // period
    epochs = tuple((interval + g * period // GROUPS) // period for g in range(GROUPS))
    return ProbePlan(interval, False, _bounded(topology, settings, window, epochs))


@lru_cache(maxsize=4)
def _full_mesh(n: int) -> npt.NDArray[np.bool_]:
    pairs = ~np.eye(n, dtype=bool)
    pairs.flags.writeable = False
    return pairs


@lru_cache(maxsize=8)
def _ring(servers: tuple[str, ...]) -> npt.NDArray[np.intp]:
    """A fixed pseudo-random order of the servers (by a hash of their names): stable when servers come and go."""
    keys = [hashlib.blake2b(name.encode(), digest_size=8, person=b"probe-ring").digest() for name in servers]
    order = np.array(sorted(range(len(servers)), key=lambda i: keys[i]), dtype=np.intp)
    order.flags.writeable = False
    return order


@lru_cache(maxsize=4)
def _static(topology: Topology, settings: HealthSettings) -> npt.NDArray[np.bool_]:
    """Probers and the own-country witnesses: the part of the plan that never rotates."""
    n = topology.n
    pairs = np.zeros((n, n), dtype=bool)
    pairs[topology.prober_mask] = True
    ring = _ring(topology.servers)
    country_of_ring = topology.country_idx[ring]
    c = settings.probe_country
    for x in range(len(topology.country_codes)):
        members = ring[country_of_ring == x]  # the country's servers in ring order
        size = members.size
        if size - 1 <= c:
            pairs[np.ix_(members, members)] = True
        else:
            offsets = np.arange(1, c + 1)
            witnesses = members[(np.arange(size)[:, None] + offsets[None, :]) % size]  # (size, c)
            pairs[witnesses, members[:, None]] = True
    np.fill_diagonal(pairs, False)
    pairs.flags.writeable = False
    return pairs


@lru_cache(maxsize=4)
def _strata(topology: Topology, settings: HealthSettings, window: int) -> npt.NDArray[np.bool_]:
    """Static part plus ``probe_per_country`` witnesses of every other country on each target."""
    pairs = _static(topology, settings).copy()
    s_max = settings.probe_per_country
    if s_max == 0:
        return pairs
    ring = _ring(topology.servers)
    country_of_ring = topology.country_idx[ring]
    ordinary_ring = ~topology.prober_mask[ring]
    for x in range(len(topology.country_codes)):
        in_x = country_of_ring == x
        members = ring[in_x & ordinary_ring]
        size = members.size
        probers_here = int((in_x & ~ordinary_ring).sum())
        if size == 0 or size + probers_here < settings.min_witnesses:
            continue  # a lone server never convicts; its probers probe everyone anyway
        targets = ring[~in_x]
        if targets.size == 0:
            continue
        s = min(s_max, size)
        covered = (size * settings.probe_limit) // s  # targets the country can serve within the limit
        if covered >= targets.size:
            slots = np.arange(targets.size)
            chosen = targets
        else:  # a window of the targets, moving on every rotation period; countries' windows spread apart
            start = (int(targets.size * ((x * _GOLDEN) % 1.0)) + window * covered) % targets.size
            slots = np.arange(covered)
            chosen = targets[(start + slots) % targets.size]
        witnesses = members[(slots[:, None] * s + np.arange(s)[None, :]) % size]  # (targets, s), distinct per row
        pairs[witnesses, chosen[:, None]] = True
    pairs.flags.writeable = False
    return pairs


@lru_cache(maxsize=4)
def _bounded(topology: Topology, settings: HealthSettings, window: int,
             epochs: tuple[int, ...]) -> npt.NDArray[np.bool_]:
    pairs = _strata(topology, settings, window).copy()
    n = topology.n
    ring = _ring(topology.servers)
    position = np.empty(n, dtype=np.intp)
    position[ring] = np.arange(n)
    ordinary = ~topology.prober_mask
    sizes = _group_sizes(settings)
    step = max(sizes) if sizes else 0
    targets = np.arange(n)
    for g, (k, epoch) in enumerate(zip(sizes, epochs, strict=True)):
        if k == 0:
            continue
        width = min(_window(k), n - 1)
        base = (epoch * GROUPS + g) * step
        offsets = 1 + (base + np.arange(width)) % (n - 1)  # never 0: a server does not probe itself
        candidates = ring[(position[:, None] + offsets[None, :]) % n]  # (N targets, width) witnesses
        eligible = ordinary[candidates] & ~pairs[candidates, targets[:, None]]
        take = eligible & (np.cumsum(eligible, axis=1) <= k)
        rows, cols = np.nonzero(take)
        pairs[candidates[rows, cols], rows] = True
    pairs.flags.writeable = False
    return pairs
