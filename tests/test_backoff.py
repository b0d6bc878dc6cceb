"""The one backoff policy every retry uses: its waits, as each use names them."""

from __future__ import annotations

import random

from reconciler.apply.acme import CERTIFICATE_BACKOFF
from reconciler.backoff import Backoff, Streaks
from reconciler.loop.collect import SERVER_BACKOFF
from reconciler.loop.service import TASK_BACKOFF
from reconciler.loop.workers import RESTART_BACKOFF
from reconciler.ssh.pool import CONNECT_BACKOFF


def test_each_use_waits_as_it_says():
    assert [SERVER_BACKOFF.wait(n) for n in range(1, 8)] == [0, 2, 4, 8, 16, 16, 16]  # intervals
    assert [TASK_BACKOFF.wait(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]  # seconds
    assert [RESTART_BACKOFF.wait(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert [CERTIFICATE_BACKOFF.wait(n) for n in (1, 2, 6, 7)] == [3600, 7200, 86400, 86400]
    assert [CONNECT_BACKOFF.wait(n) for n in (1, 2)] == [0.5, 1.0]


def test_jitter_adds_at_most_its_share_and_a_long_streak_stays_at_the_cap():
    rng = random.Random(7)
    waits = [CONNECT_BACKOFF.wait(2, rng.random()) for _ in range(1000)]
    assert 1.0 <= min(waits) < 1.05 and 1.45 < max(waits) < 1.5
    assert Backoff(first=1, cap=5).wait(10**6) == 5  # no overflow after a year of failures
    assert Backoff(first=1, cap=5).wait(0) == 0


def test_a_streak_per_key_ends_with_a_success():
    s: Streaks[str] = Streaks(Backoff(first=10, cap=40))
    assert s.ready("a", 0) and s.failed("a", 100) == 10 and s.failed("a", 110) == 20
    assert not s.ready("a", 129) and s.ready("a", 130) and s.ready("b", 0)
    assert s.succeeded("a") and not s.succeeded("a") and s.ready("a", 0)


def test_a_failure_retrying_cannot_heal_waits_the_longest_at_once():
    # A changed host key, a bug: trying again next interval changes nothing (errors.is_temporary drives it).
    from reconciler.errors import ConnectError, HostKeyChanged, ReportError, is_temporary

    assert is_temporary(ConnectError("x")) and is_temporary(ReportError("x")) and is_temporary(TimeoutError())
    assert is_temporary(ConnectionResetError()) and not is_temporary(HostKeyChanged("x")) and not is_temporary(KeyError())
    s: Streaks[str] = Streaks(SERVER_BACKOFF)
    assert s.failed("a", 1, temporary=is_temporary(HostKeyChanged("x"))) == SERVER_BACKOFF.cap
    assert s.failed("b", 1, temporary=is_temporary(ConnectError("x"))) == 0
