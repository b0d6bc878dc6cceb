"""What an interval tells (pure): the reconciler between a new snapshot and the people and systems who act on it.

One shape, as every reconciler of the loop is meant to have: ``tell(state, inputs, now) -> (state, effects)``. The
state is what was told before (each server's status, the verdict labels the webhook last spoke of, the users
withheld, the ledger's ``said``); the inputs are the interval's verdicts and snapshot; the effects are what the
loop then does: log lines, webhook payloads, and whether the servers must be planned now (a user left or came
back). Nothing here logs, posts or waits, so it runs over thousands of simulated intervals as in the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reconciler.balance import Snapshot
from reconciler.fleet.events import degraded_reason, fleet_event, user_events, verdict_events
from reconciler.health.verdicts import Verdicts
from reconciler.model.roster import ACTIVE, STANDINGS


@dataclass(frozen=True)
class Told:
    """What was told up to now (``None`` withheld: nothing yet, a start)."""

    status: Mapping[str, str] = field(default_factory=dict)  # server → its last status
    labels: Mapping[str, str] = field(default_factory=dict)  # server → the verdict label the webhook last spoke of
    withheld: Mapping[str, str] | None = None  # user → standing, for those the servers refuse
    said: Mapping[str, str] = field(default_factory=dict)  # the ledger's: each user or fleet event, once

    def after_takeover(self) -> Told:
        """A new leader tells the webhook again every server customers miss."""
        return Told(self.status, {}, self.withheld, self.said)


@dataclass(frozen=True)
class Effects:
    logs: tuple[tuple[int, str], ...] = ()  # (level, line)
    posts: tuple[dict[str, Any], ...] = ()  # webhook payloads, in order
    plan_now: bool = False


def tell(state: Told, verdicts: Verdicts, snap: Snapshot, interval: int) -> tuple[Told, Effects]:
    logs: list[tuple[int, str]] = []
    posts: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    status = dict(state.status)
    for name, sv in verdicts.servers().items():
        counts[sv.status] = counts.get(sv.status, 0) + 1
        before = status.get(name)
        if before is not None and before != sv.status:
            level = logging.INFO if sv.status in ("ok", "no_data") else logging.WARNING
            logs.append((level, f"{name}: {before} → {sv.status}: {sv.reason}"))
        status[name] = sv.status
    labels = dict(state.labels)
    for event in verdict_events(verdicts, labels):  # every one on the first interval after a start
        logs.append((logging.WARNING, f"{event.kind}: {event.text}"))
        posts.append(event.payload(verdicts.now))
    logs.append((logging.INFO, f"interval {interval}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))))
    withheld, plan_now, line = _withheld(state.withheld, snap)
    if line:
        logs.append((logging.INFO, line))
    said = dict(state.said)
    events = user_events(snap.cluster, snap.usage, snap.now, said)
    fleet = fleet_event(degraded_reason(snap), said)
    for event in [*events, *([fleet] if fleet else [])]:
        logs.append((logging.WARNING, f"{event.kind}: {event.text}"))
        posts.append(event.payload(snap.now))
    return Told(status, labels, withheld, said), Effects(tuple(logs), tuple(posts), plan_now)


def _withheld(before: Mapping[str, str] | None, snap: Snapshot) -> tuple[dict[str, str], bool, str]:
    """Users who crossed a limit, expired, or came back (a reset, a raised limit, a renewed date) change the servers'
    configurations now, not at the next plan: (who is withheld now, whether to plan now, the line that says so)."""
    names, codes = snap.cluster.roster.names, snap.standings
    withheld = {names[i]: STANDINGS[codes[i]] for i in np.flatnonzero(codes != ACTIVE).tolist()}
    if before is None or withheld == before:
        return withheld, False, ""
    out = sorted(set(withheld) - set(before))
    back = sorted(set(before) - set(withheld))
    line = ("users: " + (f"out: {', '.join(f'{u} ({withheld[u]})' for u in out)}" if out else "")
            + ("; " if out and back else "") + (f"back: {', '.join(back)}" if back else "") + " — applying now")
    return withheld, True, line
