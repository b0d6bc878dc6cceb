"""What the fleet measured of one user, as decisions read it (plain data, no I/O).

``UserUsage`` is produced by ``reconciler.fleet.usage`` (from the servers'
collectors) and read by ``User.standing`` (over quota, device limit), the
subscription headers and page, the metrics and the balancer (each user's own
recent demand, LB-3).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

BYTES_CAP = 2**63 - 1  # a user's bytes saturate here (64-bit integers in the columns and the state)


def saturated_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b`` for non-negative int64 columns, saturating at ``BYTES_CAP`` instead of wrapping."""
    total: np.ndarray = np.where(a > BYTES_CAP - b, BYTES_CAP, a + b)
    return total


class UserUsage(NamedTuple):
    """Immutable; a tuple (not a frozen dataclass) because a million of them are made every interval, five times
    faster."""

    up: int = 0  # bytes the user sent this period (client → server), over every server
    down: int = 0  # bytes the user received this period
    total: int = 0  # both directions since the controller first counted this user (across periods)
    period_start: float = 0.0  # when this period began (epoch seconds, UTC)
    next_reset: float | None = None  # when it ends; None: never resets
    devices: int = 0  # distinct client addresses seen within the device window, over every server
    last_seen: float | None = None  # last time any server saw a connection or bytes of this user
    servers: tuple[str, ...] = ()  # servers where the user has open connections now
    demand_mbps: float = 0.0  # recent demand (EWMA over report intervals), for balancing

    @property
    def used(self) -> int:
        """Bytes that count against ``data_limit``: both directions this period."""
        return self.up + self.down


@dataclass(frozen=True, eq=False)
class UsageView(Mapping[str, UserUsage]):
    """Every user's usage as columns in the order of ``names`` (a cluster's ``Roster.names``), read as a mapping of
    name → ``UserUsage`` (each made when asked: a million of them every interval took seconds). Consumers that ask
    about every user read the columns; the standing of all users at once is ``Roster.standings(now, view)``.
    """

    names: tuple[str, ...]
    up: np.ndarray  # int64
    down: np.ndarray  # int64
    total: np.ndarray  # int64
    period_start: np.ndarray  # float64
    next_reset: np.ndarray  # float64, nan: never
    devices: np.ndarray  # int64
    last_seen: np.ndarray  # float64, nan: never
    demand_mbps: np.ndarray  # float64
    servers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # only users with open connections
    position: Mapping[str, int] | None = None  # names → index (the roster's, when the caller has it)

    @cached_property
    def _at(self) -> Mapping[str, int]:
        return self.position if self.position is not None else {n: i for i, n in enumerate(self.names)}

    @cached_property
    def used(self) -> np.ndarray:
        """Bytes that count against ``data_limit``, per user."""
        return saturated_sum(self.up, self.down)

    def __getitem__(self, name: str) -> UserUsage:
        i = self._at[name]
        nxt, seen = float(self.next_reset[i]), float(self.last_seen[i])
        return UserUsage(int(self.up[i]), int(self.down[i]), int(self.total[i]), float(self.period_start[i]),
                         None if nxt != nxt else nxt, int(self.devices[i]), None if seen != seen else seen,
                         self.servers.get(name, ()), float(self.demand_mbps[i]))

    def __contains__(self, name: object) -> bool:
        return name in self._at

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
