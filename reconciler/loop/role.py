"""This controller's role among its peers: it leads alone, or it leads or stands by through an etcd election.

The loop is given a ``Role`` (``role_for`` makes the one the settings ask for) and asks it four things: whether it
may collect, plan and apply now (``leads``), what its applies carry (``fence``), what to do once per election won
before it acts (``take_over``: continue from the last state the previous leader published), and what to do after
a leader's interval (``publish``). A standby serves, read-only, what the leader publishes (``follow``).

``Alone`` leads always and publishes nothing. ``Elected`` (``settings.leader.etcd``) runs the election and the
channel of the learned state (``reconciler.loop.leader``): the leader publishes its state after each interval,
a standby reads it every interval, and a new leader continues from the newest one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from reconciler.credentials import Secret
from reconciler.errors import DatabaseError
from reconciler.fleet.learned import Learned
from reconciler.loop.clock import Clock
from reconciler.model import Cluster
from reconciler.plan.lock import Fence
from reconciler.state.folder import StateFolder

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from reconciler.loop.leader import Election, Published
    from reconciler.model.cluster import LeaderSettings, UserSettings

log = logging.getLogger("reconciler.loop")


class Channel(Protocol):
    """Where the leader's learned state goes and a standby reads it: etcd (``leader.StateChannel``) or the users'
    PostgreSQL (``pgstate.PgStateChannel``)."""

    async def publish(self, guard: list[dict[str, Any]], fence: int, blob: bytes, meta: dict[str, Any]) -> str | None: ...

    async def read(self, known: str | None = None) -> Published | None: ...

    def close(self) -> None: ...


class Led(Protocol):
    """What a role reads and replaces of the loop it serves."""

    cluster: Cluster
    learned: Learned
    facts: dict[str, Any]
    state: StateFolder
    clock: Clock

    def leadership_changed(self, leading: bool) -> None: ...

    def saved_bytes(self) -> bytes | None: ...


class Role(Protocol):
    @property
    def election(self) -> Election | None: ...

    def attach(self, led: Led) -> None: ...

    def leads(self) -> bool: ...

    def publishing(self) -> bool: ...

    def fence(self) -> Fence | None: ...

    async def run(self, stop: asyncio.Event) -> None: ...

    async def take_over(self) -> bool: ...

    async def publish(self) -> None: ...

    async def follow(self) -> bool: ...

    def health(self, interval: float, started: float) -> tuple[bool, str] | None: ...

    def status(self) -> dict[str, Any] | None: ...

    async def close(self) -> None: ...


class Alone:
    """The one controller: it leads, unfenced. With a ``channel`` (the users' PostgreSQL) it also writes its learned
    state there after every interval, so a crash loses at most one interval of it, and at its start it goes on
    from that row when the row is newer than its state folder's (written once every few minutes when big)."""

    election: Election | None = None

    def __init__(self, channel: Channel | None = None) -> None:
        self.channel = channel
        self._led: Led | None = None
        self._pending = channel is not None  # the row is read once, before the first interval
        self._error = ""

    def attach(self, led: Led) -> None:
        self._led = led

    def leads(self) -> bool:
        return True

    def publishing(self) -> bool:
        return self.channel is not None

    def fence(self) -> Fence | None:
        return None

    async def run(self, stop: asyncio.Event) -> None:
        pass

    async def take_over(self) -> bool:
        """Once, at the start: the stored state, when it is further on than the state folder's."""
        if not self._pending or self.channel is None or self._led is None:
            return False
        self._pending = False
        led = self._led
        try:
            got = await self.channel.read(None)
        except (DatabaseError, ValueError) as exc:
            log.warning("cannot read the learned state from the users' database: %s; going on from the state folder's", exc)
            return False
        if got is None or int(got.pointer.get("ticks") or 0) <= led.learned.ticks:
            return False
        learned, _, note = restored(got, led.cluster, "the state in the users' database")
        if learned is None:
            log.warning("%s", note)
            return False
        log.warning("going on from interval %d of the learned state in the users' database (the state folder's was "
                    "at interval %d)", learned.ticks, led.learned.ticks)
        led.learned = learned
        return False  # a start, not a takeover: nothing was told yet anyway

    async def publish(self) -> None:
        if self.channel is None or self._led is None:
            return
        led = self._led
        try:
            blob = await asyncio.to_thread(bundle, led)
            meta = {"by": "alone", "ticks": led.learned.ticks, "last_tick": led.learned.last_tick}
            written = await self.channel.publish([], 0, blob, meta)
        except DatabaseError as exc:
            if str(exc) != self._error:
                log.error("cannot write the learned state to the users' database: %s", exc)
            self._error = str(exc)
            return
        if written is None and self._error != "fenced":
            log.error("the learned state was not written to the users' database: a controller with a fence (an "
                      "elected leader) writes it; run one kind of controller per cluster")
        self._error = "" if written is not None else "fenced"

    async def follow(self) -> bool:
        return False

    def health(self, interval: float, started: float) -> tuple[bool, str] | None:
        return None

    def status(self) -> dict[str, Any] | None:
        return None

    async def close(self) -> None:
        if self.channel is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.publish(), 30)
            self.channel.close()


def restored(got: Published, cluster: Cluster, where: str) -> tuple[Learned | None, dict[str, Any], str]:
    """A state read back, unpacked and restored for ``cluster``: (its learned state, what came with it, ""), or
    (None, {}, why it cannot be used)."""
    from reconciler.loop.leader import unpack

    try:
        data, extras = unpack(got.blob)
    except ValueError as exc:
        return None, {}, f"ignoring {where}: {exc}"
    learned, note = Learned.restore(data, cluster, where)
    return (None, {}, note) if note else (learned, extras, "")


def bundle(led: Led) -> bytes:
    """The learned state and what goes with it, as published (the last save's bytes when they are this state's)."""
    from reconciler.loop.leader import pack

    return pack(led.saved_bytes() or led.learned.to_bytes(), {"managed": led.state.managed(), "facts": led.facts})


class Elected:
    """Lead or stand by through an etcd election, the learned state handed over through etcd (see the module)."""

    def __init__(self, election: Election, channel: Channel) -> None:
        self.election = election
        self.channel = channel
        self._led: Led | None = None
        self._generation: str | None = None  # the published state this controller has (read or written)
        self._seen = 0.0  # when (monotonic) a leader's state last arrived here, as a standby
        self._pointer: dict[str, Any] = {}  # that state's pointer: by whom, its fence, ticks, when
        self._error = ""  # the last failure to read or publish it ("" after a success)
        self._takeover_lock = asyncio.Lock()
        self._taken = 0  # the elections won whose takeover is done (``Election.elections`` grows at each win)
        self._main: asyncio.AbstractEventLoop | None = None  # the loop's event loop (the election runs in a thread)

    @property
    def led(self) -> Led:
        assert self._led is not None, "a role serves the loop it is attached to"
        return self._led

    def attach(self, led: Led) -> None:
        self._led = led
        self.election.on_change = self._on_change

    def leads(self) -> bool:
        return self.election.is_leader

    def publishing(self) -> bool:
        return self.election.is_leader

    def fence(self) -> Fence | None:
        election = self.election
        return Fence(election.fence, lambda: election.is_leader)

    async def run(self, stop: asyncio.Event) -> None:
        """The election, in a thread with an event loop of its own: its keepalives go out on time while an interval
        holds this event loop with Python work (a million users' first interval holds it for tens of seconds; a
        lease renewed on this loop ended under it, every interval). One native call that keeps the interpreter
        for longer than the lease's margin can still delay a renewal."""
        self._main = asyncio.get_running_loop()
        quit_ = threading.Event()  # set here, read there: no event loop needed to tell the thread to end

        async def campaign() -> None:
            halt = asyncio.Event()
            running = asyncio.ensure_future(self.election.run(halt))
            while not quit_.is_set() and not running.done():
                await asyncio.wait([running], timeout=0.1)
            halt.set()
            await running

        ended = asyncio.Event()
        failure: list[BaseException] = []

        def body() -> None:
            try:
                asyncio.run(campaign())
            except BaseException as exc:  # noqa: BLE001 — handed to the supervised task below
                failure.append(exc)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop has ended
                    self._main.call_soon_threadsafe(ended.set)  # type: ignore[union-attr]

        thread = threading.Thread(target=body, name="etcd-election", daemon=True)
        thread.start()
        stopped = asyncio.ensure_future(stop.wait())
        waiting = asyncio.ensure_future(ended.wait())
        try:
            await asyncio.wait([stopped, waiting], return_when=asyncio.FIRST_COMPLETED)
        finally:
            quit_.set()  # first, and at once: even a cancelled wait below leaves the thread told to end
            stopped.cancel()
            waiting.cancel()
            await asyncio.to_thread(thread.join, 30)
        if failure:
            raise failure[0]  # a failure of the election's is the supervised task's

    def _on_change(self, leading: bool) -> None:
        """Called where the election runs (its own thread): the loop is told on its own thread. A win's takeover
        is owed by the count of elections (``take_over``), which grows before ``leads`` can say so."""
        main = self._main
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if main is None or main is here:
            self.led.leadership_changed(leading)
            return
        with contextlib.suppress(RuntimeError):  # the loop has ended: nothing left to tell
            main.call_soon_threadsafe(self.led.leadership_changed, leading)

    async def take_over(self) -> bool:
        """Once per election won: continue from the last state the previous leader published (it can publish
        no more: its writes are guarded by the key it lost) — capacities, streaks, assignments, the usage ledger.
        True the first time after a win."""
        async with self._takeover_lock:
            won = self.election.elections
            if won == self._taken:
                return False
            self._taken = won
            fresh = await self.follow()
            pointer = self._pointer
            log.warning("leading from interval %d of the learned state (%s)", self.led.learned.ticks,
                        f"published by {pointer.get('by')} at fence {pointer.get('fence')}" if fresh or pointer
                        else "none published yet: this controller's own")
            return True

    async def follow(self) -> bool:
        """The leader's newest published state, when there is one newer than ours: it becomes ours."""
        from reconciler.loop.leader import EtcdFailure, failure

        led = self.led
        try:
            got = await self.channel.read(self._generation)
        except EtcdFailure as exc:
            self._trouble(f"cannot read the leader's published state: {failure(exc)}")
            return False
        except (DatabaseError, ValueError) as exc:  # the users' database holds it (pgstate): away, or refused
            self._trouble(f"cannot read the leader's published state: {exc}")
            return False
        if got is None:
            return False
        learned, extras, note = restored(got, led.cluster, f"the state {got.pointer.get('by')} published")
        self._generation = got.generation  # not read again, whatever it held; the next one may be good
        if learned is None:
            self._trouble(note)
            return False
        self._error = ""
        led.learned, self._seen, self._pointer = learned, led.clock.monotonic(), got.pointer
        await asyncio.to_thread(self._adopt, extras)
        return True

    def _trouble(self, text: str) -> None:
        if text != self._error:
            log.warning("%s", text)
        self._error = text

    def _adopt(self, extras: dict[str, Any]) -> None:
        """The leader's managed servers and public facts, kept in this controller's state folder: a takeover
        prunes and pins as the leader would have."""
        led = self.led
        try:
            managed, facts = extras.get("managed"), extras.get("facts")
            if isinstance(managed, dict) and managed != led.state.managed():
                led.state.write_managed(managed)
            if isinstance(facts, dict) and facts and facts != led.facts:
                led.facts = led.state.remember_facts({k: v for k, v in facts.items() if isinstance(v, dict)})
        except OSError as exc:
            log.error("cannot keep the leader's managed servers and facts in %s: %s", led.state.path, exc)

    def bundle(self) -> bytes:
        return bundle(self.led)

    async def publish(self) -> None:
        """The leader's learned state after its interval, for a standby to serve from and take over."""
        election, led = self.election, self.led
        if not election.is_leader:
            led.saved_bytes()  # not published after all: the ~40 MB are not kept
            return
        from reconciler.loop.leader import EtcdFailure, failure

        try:
            blob = await asyncio.to_thread(self.bundle)
            meta = {"by": election.identity, "ticks": led.learned.ticks, "last_tick": led.learned.last_tick}
            generation = await self.channel.publish(election.guard(), election.fence, blob, meta)
        except EtcdFailure as exc:
            self._trouble(f"cannot publish the learned state: {failure(exc)}")
            return
        except DatabaseError as exc:
            self._trouble(f"cannot publish the learned state: {exc}")
            return
        if generation is None:
            self._trouble("the learned state was not published: this controller no longer leads")
            return
        self._error = ""
        self._generation, self._pointer = generation, {**meta, "generation": generation, "fence": election.fence}
        self._seen = led.clock.monotonic()  # the newest state is ours: a deposed leader stays healthy as a standby

    def health(self, interval: float, started: float) -> tuple[bool, str] | None:
        """A standby is healthy while the leader's state keeps arriving (it serves from it); None for a leader."""
        if self.election.is_leader:
            return None
        leader = self.election.leader or "none yet"
        led = self.led
        if not self._seen:
            late = led.clock.time() - started > 3 * interval + 60
            return (not late, f"standby (leader: {leader}): no state published yet" + (" (late)" if late else ""))
        age = led.clock.monotonic() - self._seen
        if age > 3 * interval + 30:
            return False, (f"standby (leader: {leader}): the newest published state arrived {age:.0f}s ago "
                           f"(interval {interval:g}s){'; ' + self._error if self._error else ''}")
        return True, (f"ok: standby (leader: {leader}); state of interval {self._pointer.get('ticks')} "
                      f"arrived {age:.0f}s ago")

    def status(self) -> dict[str, Any] | None:
        """Who leads, and the state this controller has (the status document's ``leader``)."""
        return {**self.election.status(), "state": {
            "generation": self._generation, "ticks": self.led.learned.ticks,
            "published_by": self._pointer.get("by"), "error": self._error}}

    async def close(self) -> None:
        """On the way out: a leader publishes its last state and resigns, so a standby leads at its next look."""
        election = self.election
        if election.is_leader:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.publish(), max(5.0, election.ttl))
            await election.resign()
        election.close()
        self.channel.close()


def role_for(settings: LeaderSettings, base_dir: str, secret: Secret, registry: CollectorRegistry,
             users: UserSettings | None = None) -> Role:
    """The role the settings ask for: ``Elected`` with ``settings.leader.etcd``, else ``Alone``. With the users in
    PostgreSQL (``users.source``) the learned state goes through that database, etcd keeping the election."""
    if not settings.etcd:
        if users is not None and users.source == "postgres":
            from reconciler.loop.pgstate import PgStateChannel
            from reconciler.userdb import UserDatabase, dsn_of

            return Alone(PgStateChannel(UserDatabase(dsn_of(users)), secret))
        return Alone()
    from reconciler.loop.leader import Election, Etcd, LeaderCollector, StateChannel

    calls = max(0.5, min(5.0, settings.lease / 4))  # an etcd request of the election never outlasts a round
    election = Election(Etcd.from_settings(settings, base_dir, calls), settings.prefix, settings.lease)
    channel: Channel
    if users is not None and users.source == "postgres":
        from reconciler.loop.pgstate import PgStateChannel
        from reconciler.userdb import UserDatabase, dsn_of

        channel = PgStateChannel(UserDatabase(dsn_of(users)), secret)
    else:
        channel = StateChannel(Etcd.from_settings(settings, base_dir, 30.0), settings.prefix, secret)
    registry.register(LeaderCollector(election))
    log.info("standby controllers: etcd %s, lease %gs, keys under %s; this one is %s", ", ".join(settings.etcd),
             settings.lease, settings.prefix, election.identity)
    return Elected(election, channel)
