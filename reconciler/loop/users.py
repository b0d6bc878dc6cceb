"""The users' database as the loop follows it (``settings.users.source: postgres``).

It listens (LISTEN/NOTIFY) for the names of users changed in the database and asks for a reload with each batch, so
an edit reaches the servers within the next plan, not the next restart. While the database cannot be reached it
keeps trying under one backoff policy, the users last loaded stay served, and ``error`` says why (``/healthz``);
once it can listen again it asks for one reload to catch up on what changed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from reconciler.backoff import Backoff
from reconciler.errors import DatabaseError, InvalidInput
from reconciler.loop.clock import Clock
from reconciler.model import Cluster
from reconciler.userdb import UserDatabase, dsn_of

log = logging.getLogger("reconciler.loop")

#: Waits between attempts to listen again after the database went away.
LISTEN_BACKOFF = Backoff(first=1.0, cap=30.0)


class UserChanges:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.error: str | None = None  # why the database cannot be followed now (None: it is)
        self.batches = 0  # batches of changes heard (a test's and an operator's evidence that it listens)
        self.listening = False  # LISTEN is in place: a change from now on is heard

    async def run(self, stop: asyncio.Event, cluster: Callable[[], Cluster], reload: Callable[[], Awaitable[bool]],
                  reload_users: Callable[[set[str]], Awaitable[bool]]) -> None:
        """Until ``stop``: ``reload_users`` with each batch of changed names; ``reload`` (every user, True when they
        could be read) once LISTEN is in place, for what changed before: since the start's load, or while the
        database was away."""
        failures = 0
        caught_up = False
        while not stop.is_set():
            try:
                db = UserDatabase(dsn_of(cluster().settings.users))
                async for names in _until(stop, db.changes()):
                    if not names:  # listening (again)
                        self.listening = True
                        if not caught_up:
                            if self.error is not None:
                                log.info("the users' %s answers again: loading its users to catch up", db.name)
                            if not await reload():
                                raise DatabaseError(f"the users' {db.name} listens, but its users could not be read")
                        caught_up, failures, self.error = True, 0, None
                        continue
                    self.batches += 1
                    log.info("%d user(s) changed in the %s: loading them", len(names), db.name)
                    await reload_users(names)
                return
            except (DatabaseError, InvalidInput) as exc:
                self.listening = False
                failures += 1
                if self.error is None:
                    log.error("%s: serving the %d user(s) last loaded until it answers", exc, len(cluster().users))
                self.error, caught_up = str(exc), False
                await self.clock.wait(stop, LISTEN_BACKOFF.wait(failures))


async def _until(stop: asyncio.Event, source: AsyncGenerator[set[str], None]) -> AsyncIterator[set[str]]:
    """``source``'s items until ``stop`` is set (a LISTEN waits for ever otherwise)."""
    stopping = asyncio.ensure_future(stop.wait())
    item: asyncio.Future[set[str]] | None = None
    try:
        while True:
            item = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({item, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return
            yield item.result()
            item = None
    finally:  # stopped, cancelled, or the consumer failed: the LISTEN connection is closed either way
        stopping.cancel()
        if item is not None and not item.done():
            item.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, DatabaseError):
                await item
        await source.aclose()
