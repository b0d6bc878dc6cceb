"""The loop's clock: the real one waits real time; the fake one moves only when told, so a test drives the loop."""

from __future__ import annotations

import asyncio
import time

from reconciler.loop.clock import FakeClock, SystemClock


def test_the_fake_clock_moves_only_when_told_and_wakes_a_wait_past_its_deadline():
    async def scenario() -> list[str]:
        clock, stop, seen = FakeClock(start=1000.0), asyncio.Event(), []

        async def waiter() -> None:
            set_ = await clock.wait(stop, 30)
            seen.append(f"woke at {clock.monotonic():.0f} set={set_}")

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.05)
        assert not task.done() and clock.time() == 1000.0  # real time passed; the clock's did not
        clock.advance(20)
        await asyncio.sleep(0.05)
        assert not task.done()
        clock.advance(10)
        await asyncio.wait_for(task, 5)
        stop.set()
        assert await clock.wait(stop, 1e9) is True  # a set event returns at once
        return seen

    assert asyncio.run(scenario()) == ["woke at 30 set=False"]


def test_the_system_clock_waits_for_the_event_or_the_time():
    async def scenario() -> tuple[bool, float, bool]:
        clock, stop = SystemClock(), asyncio.Event()
        started = time.monotonic()
        timed_out = await clock.wait(stop, 0.05)
        asyncio.get_running_loop().call_later(0.01, stop.set)
        return timed_out, time.monotonic() - started, await clock.wait(stop, 30)

    timed_out, took, woke = asyncio.run(scenario())
    assert timed_out is False and took >= 0.05 and woke is True
