"""The one snapshot every consumer answers from (pure: time and inputs passed in).

``snapshot(cluster, learned, facts, now)`` is called by the loop at every interval and by
the commands that answer for a user (``subscription``, ``status``); the live endpoint and
the file outlet serve what the loop built. So all of them read the same verdicts, loads, RTT
profiles (dynamic steering, STEER-3), public keys and sticky assignments (LB-6), and give the
same bytes for the same user.

Assignments are rebalanced from the learned ones (stickiness); the caller keeps the result
(``Learned.assignments = snap.assignments``, immutable) when it owns the learned state.
"""

from __future__ import annotations

from collections.abc import Mapping

from reconciler.balance import Snapshot, rebalance
from reconciler.balance.assignments import Assignments
from reconciler.fleet.learned import Learned
from reconciler.health.verdicts import Verdicts
from reconciler.model import Cluster


def snapshot(cluster: Cluster, learned: Learned, facts: Mapping[str, Mapping[str, str]], now: float,
             verdicts: Verdicts | None = None) -> Snapshot:
    """The snapshot as of ``now``. ``verdicts``: this interval's (the loop); by default the learned
    state's verdicts as of ``now`` without new reports, or none before the first interval."""
    if verdicts is None and learned.ticks:
        verdicts = learned.current_verdicts(cluster, now)
    loads = learned.loads(now)
    rtt = learned.rtt_profiles(cluster, now, cluster.settings.health.staleness)
    keys, pins = dict(facts.get("public_keys", {})), dict(facts.get("tls_pins", {}))
    usage = learned.ledger.view(cluster, now)
    roster = cluster.roster
    held = Assignments.of(learned.assignments, roster.names, cluster.inbound_ids, roster.index)
    before = Snapshot(cluster=cluster, now=now, verdicts=verdicts, loads=loads, rtt=rtt, assignments=held,
                      public_keys=keys, tls_pins=pins, usage=usage)
    # A new snapshot, not a copy: whatever ``before`` memoised was computed from the old assignments.
    return Snapshot(cluster=cluster, now=now, verdicts=verdicts, loads=loads, rtt=rtt, assignments=rebalance(before),
                    public_keys=keys, tls_pins=pins, usage=usage)
