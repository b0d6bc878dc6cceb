"""Backoff: how long to wait after failures in a row. The one policy every retry in the reconciler uses.

``Backoff`` is the policy (pure): the wait after the n-th failure in a row, doubling from ``first`` up to ``cap``,
after ``free`` failures that wait nothing, with up to ``jitter`` more at random (so many that failed together do
not all try again at once). ``Streaks`` keeps failures in a row per key (a server, an inbound) and when each may
try again, on any clock: the loop counts in intervals, certificate orders in seconds.

Who uses which policy, each named beside its use: SSH connections (``ssh.pool``), the loop's servers that do
not report and its supervised tasks (``loop.service``), the live workers (``loop.workers``), certificate orders
(``apply.acme``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")


@dataclass(frozen=True)
class Backoff:
    """The wait after ``failures`` in a row: 0 for the first ``free``, then ``first``, doubling, at most ``cap``."""

    first: float
    cap: float
    free: int = 0
    jitter: float = 0.0

    def wait(self, failures: int, random_share: float = 0.0) -> float:
        """``random_share`` in [0, 1) draws the jitter (the caller's random source: this stays pure)."""
        n = failures - self.free
        if n <= 0:
            return 0.0
        return min(self.cap, self.first * 2.0 ** min(n - 1, 64)) * (1.0 + self.jitter * random_share)


@dataclass
class Streaks(Generic[K]):
    """Failures in a row per key under one ``Backoff``, and from when each key may be tried again."""

    policy: Backoff
    failures: dict[K, int] = field(default_factory=dict)
    next_try: dict[K, float] = field(default_factory=dict)

    def ready(self, key: K, now: float) -> bool:
        return now >= self.next_try.get(key, now)

    def failed(self, key: K, now: float, temporary: bool = True) -> float:
        """One more failure of ``key`` at ``now``: it is tried again from ``now`` + the wait, which is returned. A
        failure that is not ``temporary`` (``errors.is_temporary``: trying again soon changes nothing) waits the
        longest at once."""
        n = self.failures.get(key, 0) + 1
        self.failures[key] = n
        wait = self.policy.wait(n) if temporary else self.policy.cap
        self.next_try[key] = now + wait
        return wait

    def succeeded(self, key: K) -> bool:
        """``key`` worked: its streak ends. Whether it had been failing."""
        self.next_try.pop(key, None)
        return self.failures.pop(key, 0) > 0
