"""A cluster's users as columns, and the one rule that decides a user's standing (plain data, no I/O).

A million users are a million objects; what every interval asks of them — who is active, who is over a limit, when
each one's period started — is a few comparisons per user. ``Roster`` holds the file's per-user facts as arrays in the
file's order, built once per loaded cluster (``Cluster.roster``), and ``standings`` answers for all users at once. The
single-user path (``User.standing``) goes through the same function, so there is one rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Literal

import numpy as np

from reconciler.model.usage import BYTES_CAP, UsageView, UserUsage

if TYPE_CHECKING:
    from reconciler.model.cluster import Reset, User

Standing = Literal["active", "disabled", "expired", "over_quota", "device_limit"]
STANDINGS: tuple[Standing, ...] = ("active", "disabled", "expired", "over_quota", "device_limit")  # by code
ACTIVE, DISABLED, EXPIRED, OVER_QUOTA, DEVICE_LIMIT = range(5)
NO_LIMIT = -1  # data_limit, device_limit: none


def standings(enabled: np.ndarray, expires_at: np.ndarray, data_limit: np.ndarray, device_limit: np.ndarray,
              refuse: np.ndarray, now: float, used: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """The one place that decides whether each user gets service at ``now``, and if not, why (a code into
    ``STANDINGS``): disabled, expired (``expires_at``: inf for never), over its ``data_limit`` this period (bytes
    ``used`` in both directions; ``NO_LIMIT``: none), or over its ``device_limit`` when the file says to refuse.
    Earlier reasons win. Arrays of one length; ``used``/``devices`` are what the fleet measured (0: nothing).

    Decides the balance (who is assigned), the subscriptions (who gets a document, and the refusal's words), the
    engine adapters (whose credentials a server accepts), the loop's enforcement and the metrics."""
    code = np.zeros(len(enabled), np.uint8)
    code[refuse & (device_limit != NO_LIMIT) & (devices > device_limit)] = DEVICE_LIMIT
    code[(data_limit != NO_LIMIT) & (used >= data_limit)] = OVER_QUOTA
    code[now > expires_at] = EXPIRED
    code[~enabled] = DISABLED
    return code


@dataclass(frozen=True)
class Notices:
    """Per user (the roster's order): what operators act on (``settings.users.warn_quota``, ``warn_expiry``)."""

    near_quota: np.ndarray  # used at least warn_quota of its data_limit this period, not over it yet
    over_quota: np.ndarray
    expiring: np.ndarray  # expires within warn_expiry
    expired: np.ndarray
    over_devices: np.ndarray  # seen on more devices than its device_limit (refused or only reported)

    def any(self) -> np.ndarray:
        due: np.ndarray = self.near_quota | self.over_quota | self.expiring | self.expired | self.over_devices
        return due


@dataclass(frozen=True, eq=False)
class Roster:
    """The users of one cluster as columns, in the file's order."""

    names: tuple[str, ...]
    enabled: np.ndarray  # bool
    expires_at: np.ndarray  # float64 epoch seconds; inf: never
    data_limit: np.ndarray  # int64 bytes per period; NO_LIMIT
    device_limit: np.ndarray  # int64; NO_LIMIT
    refuse: np.ndarray  # bool: on_device_limit == "refuse"
    regions: np.ndarray  # str: the user's region ("" when none)
    resets: tuple[Reset, ...]  # the distinct reset rules
    reset_of: np.ndarray  # int32: each user's rule (an index into resets)

    @classmethod
    def of(cls, users: Sequence[User]) -> Roster:
        n = len(users)
        resets: dict[Reset, int] = {}
        reset_of = np.fromiter((resets.setdefault(u.reset, len(resets)) for u in users), np.int32, n)
        limit = np.fromiter((NO_LIMIT if u.data_limit is None else u.data_limit for u in users), np.int64, n)
        end = np.fromiter((np.inf if (t := u.expires_at) is None else t for u in users), np.float64, n)
        return cls(names=tuple(u.name for u in users),
                   enabled=np.fromiter((u.enabled for u in users), bool, n), expires_at=end, data_limit=limit,
                   device_limit=np.fromiter((NO_LIMIT if u.device_limit is None else u.device_limit for u in users),
                                            np.int64, n),
                   refuse=np.fromiter((u.on_device_limit == "refuse" for u in users), bool, n),
                   regions=np.array([u.region or "" for u in users], dtype=str) if n else np.zeros(0, str),
                   resets=tuple(resets), reset_of=reset_of)

    def __len__(self) -> int:
        return len(self.names)

    @cached_property
    def index(self) -> dict[str, int]:
        """Name → position."""
        return {n: i for i, n in enumerate(self.names)}

    def standings(self, now: float, usage: Mapping[str, UserUsage] | None = None) -> np.ndarray:
        """Every user's standing code at ``now`` with what the fleet measured (``usage``: by name; a ``UsageView``
        over these names is read as columns)."""
        used, devices = self.measured(usage)
        return standings(self.enabled, self.expires_at, self.data_limit, self.device_limit, self.refuse, now, used,
                         devices)

    def notices(self, now: float, usage: Mapping[str, UserUsage] | None, warn_quota: float,
                warn_expiry: float) -> Notices:
        """Which enabled users operators hear about at ``now`` (the events say it once, the metrics count it)."""
        used, devices = self.measured(usage)
        on, limit, end = self.enabled, self.data_limit, self.expires_at
        quota = on & (limit > 0)
        return Notices(near_quota=quota & (warn_quota * limit <= used) & (used < limit), over_quota=quota & (used >= limit),
                       expiring=on & (now <= end) & (end - now <= warn_expiry), expired=on & (now > end),
                       over_devices=on & (self.device_limit != NO_LIMIT) & (devices > self.device_limit))

    def measured(self, usage: Mapping[str, UserUsage] | None) -> tuple[np.ndarray, np.ndarray]:
        """(bytes used this period, devices) per user, in this roster's order (0 where nothing was measured)."""
        n = len(self.names)
        if isinstance(usage, UsageView) and usage.names == self.names:  # the loop's: same names, same order
            return usage.used, usage.devices
        used, devices = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for name, u in (usage or {}).items():
            i = self.index.get(name)
            if i is not None:
                used[i], devices[i] = min(u.used, BYTES_CAP), u.devices
        return used, devices

    def bounds(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Each user's period at ``now``: its start and the next reset (nan: never), epoch seconds UTC."""
        per = [r.bounds(now) for r in self.resets]
        start = np.array([s for s, _ in per], np.float64)
        nxt = np.array([np.nan if e is None else e for _, e in per], np.float64)
        if not per:
            return np.zeros(0), np.zeros(0)
        return start[self.reset_of], nxt[self.reset_of]
