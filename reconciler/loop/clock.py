"""The loop's clock: wall time for what it records, a monotonic clock for cadences and durations, and waiting.

The loop reads time only through a ``Clock`` given to it (``Loop(clock=...)``), so a test drives the real loop
under ``FakeClock`` — time moves when the test says — instead of patching ``time.time`` for the whole process.

- ``SystemClock``: the process's clocks; ``wait`` returns when the event is set or the seconds have passed;
- ``FakeClock``: time stands still until ``advance``; a ``wait`` returns when its event is set or ``advance`` moved
  the clock past its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch (what is recorded and shown)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (cadences, durations)."""
        ...

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Until ``event`` is set or ``seconds`` have passed; whether the event was set."""
        ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, seconds))
        return event.is_set()


class FakeClock:
    """Time that moves only when told (``advance``), from ``start`` (wall) and 0 (monotonic)."""

    def __init__(self, start: float = 1_800_000_000.0):
        self._wall0 = start
        self._now = 0.0
        self._moved = asyncio.Event()

    def time(self) -> float:
        return self._wall0 + self._now

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        deadline = self._now + seconds
        while not event.is_set() and self._now < deadline:
            moved = asyncio.ensure_future(self._moved.wait())
            setting = asyncio.ensure_future(event.wait())
            try:
                await asyncio.wait({moved, setting}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                moved.cancel()
                setting.cancel()
        return event.is_set()
