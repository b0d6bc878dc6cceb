"""What the fleet measured of one user, as decisions read it (plain data, no I/O).

``UserUsage`` is produced by ``reconciler.fleet.usage`` (from the servers'
collectors) and read by ``User.standing`` (over quota, device limit), the
subscription headers and page, the metrics and the balancer (each user's own
recent demand, LB-3).
"""

from __future__ import annotations

from typing import NamedTuple


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
