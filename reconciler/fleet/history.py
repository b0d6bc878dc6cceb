"""Each server's verdict history: when its verdict changed, to what, and why (pure: time and verdicts passed in).

"When was fra-1 blocked, and for how long" is answered from here: the learned state keeps, per server, every change
of its verdict over the last ``KEEP_SECONDS`` (and at least the latest, however old), at most ``KEEP_CHANGES`` of
them: a flapping server cannot grow the state without bound. It is saved with the learned state, so it survives a
restart, and handed to a standby with it, so it survives a takeover.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from reconciler.health.verdicts import STATUS_NAMES, Verdicts

KEEP_SECONDS = 7 * 86400.0
KEEP_CHANGES = 500
REASON_CHARS = 300


@dataclass(frozen=True)
class Change:
    at: float  # when the verdict became this (wall clock)
    status: str  # one of STATUS_NAMES
    reason: str


@dataclass
class History:
    changes: dict[str, list[Change]] = field(default_factory=dict)

    def observe(self, verdicts: Verdicts, now: float) -> None:
        """The interval's verdicts: a server whose status differs from its last change gets a new one."""
        codes = verdicts.server_status
        for i, name in enumerate(verdicts.topology.servers):
            status = STATUS_NAMES[int(codes[i])]
            seen = self.changes.get(name)
            if seen and seen[-1].status == status:
                continue
            change = Change(now, status, verdicts.server(name).reason[:REASON_CHARS])
            self.changes[name] = _bounded([*(seen or ()), change], now)

    def of(self, server: str, now: float) -> list[tuple[Change, float]]:
        """``server``'s changes of the last week, oldest first, each with how long it lasted (to ``now`` for the last)."""
        seen = self.changes.get(server, [])
        if not seen:
            return []
        ends = [c.at for c in seen[1:]] + [now]
        return [(c, max(0.0, end - c.at)) for c, end in zip(seen, ends, strict=True)]

    def keep(self, servers: set[str]) -> History:
        """Only these servers' history (the others left the file)."""
        return History({k: v for k, v in self.changes.items() if k in servers})

    def to_json(self) -> dict[str, list[list[object]]]:
        return {name: [[c.at, c.status, c.reason] for c in seen] for name, seen in self.changes.items()}

    @classmethod
    def from_json(cls, value: object, servers: tuple[str, ...]) -> History:
        """A state file's history (hostile input: from disk or etcd): only the fleet's servers, well-formed changes
        in time order, bounded; anything else is left out."""
        if not isinstance(value, dict):
            return cls()
        known = set(servers)
        out: dict[str, list[Change]] = {}
        for name, seen in value.items():
            if name not in known or not isinstance(seen, list):
                continue
            changes: list[Change] = []
            for item in seen[-KEEP_CHANGES:]:
                if (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int | float)
                        and math.isfinite(item[0]) and item[1] in STATUS_NAMES and isinstance(item[2], str)
                        and (not changes or changes[-1].at <= item[0])):
                    changes.append(Change(float(item[0]), item[1], item[2][:REASON_CHARS]))
            if changes:
                out[name] = changes
        return cls(out)


def _bounded(changes: list[Change], now: float) -> list[Change]:
    """The last ``KEEP_CHANGES``, none older than ``KEEP_SECONDS`` but the one in force at the window's start."""
    changes = changes[-KEEP_CHANGES:]
    start = now - KEEP_SECONDS
    first = next((i for i, c in enumerate(changes) if c.at >= start), len(changes))
    return changes[max(0, first - 1):]
