"""``reconciler run``: the long-running loop (HEALTH-1, HEALTH-4, HEALTH-13, GITOPS-5).

Four timers share one event loop and one SSH connection per server:

- **tick** (every ``report_interval``): collect one agent report per server →
  verdicts → snapshot (rebalanced, sticky) → outlets (files, live HTTP answers,
  metrics view, webhook) → learned state saved atomically;
- **plan** (every ``plan_interval``, at start and after every file change):
  observe and plan; with ``self_heal`` apply the plan (drift correction),
  without it report the drift;
- **watch**: the cluster file's folder (watchfiles); a change reloads the file.
  An invalid file is reported with its diagnostics and the loop keeps the last
  good one — nothing is half applied;
- **git pull** (every ``git_pull_interval``, when set): ``git pull --ff-only``.

One server's failure never stops the loop: its collection backs off
exponentially (in intervals) and it shows as no_data. SIGTERM or SIGINT stop
the loop after the current step; the learned state is saved on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry

from reconciler import gcpause
from reconciler.apply.session import pool_for
from reconciler.backoff import Backoff
from reconciler.balance import Snapshot
from reconciler.balance.decide import held_by_server
from reconciler.config.yamlread import load_seconds
from reconciler.credentials import Secret
from reconciler.errors import SecretError
from reconciler.fleet import snapshot
from reconciler.fleet.learned import Learned
from reconciler.fleet.reality import with_reality_keys
from reconciler.fleet.tell import Told, tell
from reconciler.fleet.usage import Trust
from reconciler.fleet.view import FleetView
from reconciler.health.verdicts import Verdicts
from reconciler.loop.client_address import networks
from reconciler.loop.clock import Clock, SystemClock
from reconciler.loop.collect import Collection
from reconciler.loop.heal import Healer
from reconciler.loop.http import HttpOutlet, status_document
from reconciler.loop.listener import load_credential
from reconciler.loop.role import Role, role_for
from reconciler.loop.users import UserChanges
from reconciler.loop.workers import LiveWorkers, worker_count
from reconciler.metrics import LoopStats, ReconcilerCollector
from reconciler.model import Cluster
from reconciler.model.types import parse_listen
from reconciler.publish import FileOutlet, LiveAnswers, Tokens, cluster_digest
from reconciler.publish.digests import changed_users_digest
from reconciler.servable import load_servable
from reconciler.ssh import Runner
from reconciler.state.folder import StateFolder
from reconciler.text import plural, url_for_log, without_url_secrets
from reconciler.userdb import UserDatabase, dsn_of

if TYPE_CHECKING:
    from aiohttp import web


log = logging.getLogger("reconciler.loop")
T = TypeVar("T")
#: A supervised task that failed starts again after 1 s, doubling to a minute.
TASK_BACKOFF = Backoff(first=1.0, cap=60.0)
# A learned state this big is written to the state folder at most every BIG_STATE_EVERY seconds after intervals
# (and always at a stop). A million users' state is ~40 MB: written every minute it cost 1 CPU-s of each interval
# and ~55 GB of disk writes a day. The users' usage is not lost by saving late: the kernel's counters are
# cumulative, so the fold after a restart counts everything since the counters saved (but for a server that
# rebooted in between: what it counted since the save went with its counters). A crash (never a stop) costs at
# most that long of: the peaks', streaks' and EWMAs' updates, new assignments (those users may be placed
# again), and the record of events sent (they may be sent again). Commands that read the state folder
# (`reconciler users`, `status`, an operator's `apply` excluding over-quota users) see it as of the last write.
# A leader writes it every interval: the same bytes as its publish to etcd, serialized once.
BIG_STATE_BYTES = 16 << 20
BIG_STATE_EVERY = 300.0
KEPT_SAID = 20  # users kept as last loaded (their rows bad now) named one by one in the log at a reload; then a count
LOAD_BUDGET = 30  # seconds a reload may take, and 2 s more a MB of YAML it reads (load_seconds; loading is bounded, this bounds the wait)


class Loop:
    def __init__(self, path: str, cluster: Cluster, secret: Secret, *, listen: str | None = None,
                 duration: float | None = None, max_ticks: int | None = None, watch: bool = True,
                 operations_listen: str | None = None, runner: Runner | None = None, clock: Clock | None = None,
                 role: Role | None = None, collection: type[Collection] = Collection):
        self.clock: Clock = clock or SystemClock()  # every time the loop reads or waits for (tests: FakeClock)
        # The servers' runner; by default SSH connections from the state folder's known hosts, made by ``run``.
        self._runner = runner
        if runner is not None:
            self.pool: Runner = runner
        self.path = str(Path(path).resolve())
        self.base_dir = str(Path(self.path).parent)
        self.cluster = cluster
        self.secret = secret
        self.listen = listen or cluster.settings.outputs.listen
        self.operations_listen = operations_listen or cluster.settings.outputs.operations_listen
        self.duration = duration
        self.max_ticks = max_ticks
        self.watch_enabled = watch
        self.state = StateFolder.of(self.path, cluster.settings.outputs.state_dir)
        self.stop = asyncio.Event()
        self.plan_now = asyncio.Event()
        self.stats = LoopStats()
        self.tokens = Tokens(secret)
        self.answers = LiveAnswers(secret, self.tokens)
        self.files = FileOutlet(self._out_dir(cluster), self.state.path, secret)
        self.view: FleetView | None = None
        self.facts = self.state.facts()  # what older versions learnt from servers; derived keys and pins win over it
        self.learned = self.state.load_learned(cluster)
        self._saved = (self.clock.monotonic(), 0)  # when the learned state was last written, and its size
        self._serialized: tuple[Learned, int, bytes] | None = None  # the last bytes written, of which state and tick
        self.collection = collection(secret, self.clock, self.stats)  # collect → fold → snapshot: the reports
        self.healer = Healer(secret, self.state, self.base_dir, self.clock, self.stats)  # plan → heal
        for note in self.state.notes:
            log.warning("%s", note)
        self.state.notes.clear()
        if self.learned.ticks:
            log.info("restored learned state: %d interval(s), last at %s", self.learned.ticks,
                     time.strftime("%H:%M:%S", time.localtime(self.learned.last_tick)))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ReconcilerCollector(lambda: self.view, self.stats))
        self.http = HttpOutlet(self.answers, self.registry, lambda: self.view, self._healthy, self._region_lookup(),
                               networks(cluster.settings.outputs.trusted_proxies))
        self.live: LiveWorkers | None = None  # worker processes answering the public port (settings.outputs.workers > 1)
        self._digest = cluster_digest(cluster)
        self.files.hashed(cluster, self._digest)
        self._told = Told()  # what the intervals told so far (fleet.tell)
        self._tick_index = 0
        self._last_tick_end = 0.0
        self._started = self.clock.time()
        self._failed: dict[str, float] = {}  # supervised task → when it last failed (until it runs cleanly again)
        self._interval_error = ""  # why the last interval failed ("" when it did not)
        self.users = UserChanges(self.clock)  # the users' database followed (settings.users.source: postgres)
        self._loading = asyncio.Lock()  # one load of the file or of users at a time
        self._tasks: list[asyncio.Task[None]] = []
        self._posts: set[asyncio.Task[None]] = set()
        # standby controllers: an election when settings.leader names an etcd; else this one leads alone
        self.role: Role = role or role_for(cluster.settings.leader, self.base_dir, secret, self.registry, cluster.settings.users)
        self.role.attach(self)
        if self.role.election is not None:
            self.http._pages["/status.json"] = self._status_json  # the status document says who leads

    # ------------------------------------------------------------------ lifecycle

    def _out_dir(self, cluster: Cluster) -> Path:
        return Path(self.base_dir) / os.path.expanduser(cluster.settings.outputs.subscriptions_dir)

    def _region_lookup(self) -> Callable[[str], str | None] | None:
        from reconciler.balance.geoip import region_lookup

        return region_lookup(self.base_dir, self.cluster.settings.steering.geoip_database, log.error)

    def _healthy(self) -> tuple[bool, str]:
        interval = self.cluster.settings.health.report_interval
        if self._failed:
            return False, "failed and restarting: " + ", ".join(f"the {name} task" for name in sorted(self._failed))
        if self._interval_error:
            return False, self._interval_error
        standby = self.role.health(interval, self._started)
        if standby is not None:
            return standby
        if self.view is None:
            late = self.clock.time() - self._started > 3 * interval + 60
            return (not late, "starting: the first interval has not finished" + (" (late)" if late else ""))
        age = self.clock.time() - self._last_tick_end
        if age > 3 * interval + 30:
            return False, f"the last interval finished {age:.0f}s ago (interval {interval:g}s)"
        ok, why = self._fleet_health(age)
        if ok and self.users.error is not None:  # subscriptions are still served, from the users last loaded
            return True, f"{why}; but {self.users.error}: serving the {len(self.cluster.users)} user(s) last loaded"
        return ok, why

    def _fleet_health(self, age: float) -> tuple[bool, str]:
        assert self.view is not None
        unreported, servers = self.view.unreported, len(self.view.cluster.servers)
        if unreported:
            first = sorted(unreported.items())[:3]
            said = "; ".join(f"{name}: {why}" for name, why in first) + ("; …" if len(unreported) > 3 else "")
            if len(unreported) == servers:
                return False, f"no server reported in interval {self._tick_index}: {said}"
            return True, (f"ok: interval {self._tick_index} finished {age:.0f}s ago; {len(unreported)} of {servers} "
                          f"server(s) gave no report: {said}")
        return True, f"ok: interval {self._tick_index} finished {age:.0f}s ago"

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self._repair_files()
        if not await self._listen():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            return 1
        self.pool = self._runner or pool_for(self.state)
        try:
            self._start_tasks()
            await self.stop.wait()
        finally:
            await self._shut_down()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        log.info("stopped after %d interval(s); learned state saved", self._tick_index)
        return 0

    async def _repair_files(self) -> None:
        """What an interrupted run left: temporary files removed, users' files cut short written again."""
        removed = self.files.clean_temporaries()
        if removed:
            log.info("removed %d temporary file(s) an interrupted run left behind", removed)
        repaired = await asyncio.to_thread(self.files.verify)
        for note in self.files.notes:
            log.warning("%s", note)
        if repaired:
            log.warning("%d user(s)' subscription files were missing or cut short (a full disk, a crash?): "
                        "they are written again now", repaired)

    async def _listen(self) -> bool:
        """Listen for subscriptions and the operations pages (in worker processes when settings ask); False (logged)
        when an address is not one or cannot be bound."""
        try:
            host, port = parse_listen(self.listen)
            operations = parse_listen(self.operations_listen)
            credential = load_credential(self.cluster.settings.outputs.operations_auth)
        except (ValueError, SecretError) as exc:
            log.error("%s", exc)
            return False
        host, operations = host or "127.0.0.1", (operations[0] or "127.0.0.1", operations[1])
        workers = worker_count(self.cluster.settings.outputs.workers)
        if workers > 1 and operations == (host, port):
            log.warning("settings.outputs.workers asks for %d processes, but operations_listen is listen and the "
                        "operations pages are answered by the loop's own process: one process answers both", workers)
            workers = 1
        try:
            if workers > 1:
                self.live = LiveWorkers(workers, host, port, self.secret, self.state.path, self.base_dir, self._healthy)
                await self.live.start()
            await self.http.start(host, port, operations=operations, credential=credential, public=self.live is None)
        except OSError as exc:
            if self.live is not None:
                await self.live.stop()
                self.live = None
            log.error("cannot listen on %s or %s: %s (set settings.outputs.listen and operations_listen, or --listen "
                      "and --operations-listen)", self.listen, self.operations_listen, exc.strerror)
            return False
        if credential is None and not ipaddress.ip_address(_resolved(operations[0])).is_loopback:
            log.warning("the operations pages on %s name servers and addresses and have no credential: set "
                        "settings.outputs.operations_auth", self.operations_listen)
        log.info("listening on http://%s (subscriptions /sub/<token>, /healthz) and http://%s (operations: /metrics, "
                 "/status.json, the console /, /healthz)", self.listen, self.operations_listen)
        return True

    def _start_tasks(self) -> None:
        self._tasks = [self._supervise("tick", self._ticker), self._supervise("plan", self._planner)]
        if self.watch_enabled:
            self._tasks.append(self._supervise("watch", self._watcher))
        if self.cluster.settings.git_pull_interval:
            self._tasks.append(self._supervise("git", self._git_puller))
        if self.cluster.settings.users.source == "postgres":  # its edits reach the loop by LISTEN/NOTIFY
            self._tasks.append(self._supervise("users", lambda: self.users.run(self.stop, lambda: self.cluster,
                                                                               self.reload_all_users, self.reload_users)))
        if self.role.election is not None:  # lead or stand by
            self._tasks.append(self._supervise("leader", lambda: self.role.run(self.stop)))
        if self.duration is not None:
            self._tasks.append(asyncio.create_task(self._deadline(self.duration), name="deadline"))

    async def _shut_down(self) -> None:
        """Every task stopped, the last state published and saved, the files' record written, listeners closed."""
        tasks = [*self._tasks, *self._posts]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.role.close()  # a leader's last state published, the lease given back
        await asyncio.to_thread(self._save)
        with contextlib.suppress(OSError):  # the files' record: else the next start compares every user
            await asyncio.to_thread(self.files.close)
        await self.http.stop()
        if self.live is not None:
            await self.live.stop()
        await self.pool.close()

    def _on_signal(self, sig: int) -> None:
        log.info("%s: stopping after the current step", signal.Signals(sig).name)
        self.stop.set()

    async def _deadline(self, seconds: float) -> None:
        await self.clock.wait(self.stop, seconds)
        self.stop.set()

    def _save(self, after_interval: bool = False) -> None:
        """Write the learned state to the state folder (``after_interval``: unless it is big and was written less
        than BIG_STATE_EVERY ago, see there). The bytes are kept for the publish that follows a leader's interval."""
        try:
            if (after_interval and self._saved[1] >= BIG_STATE_BYTES and not self.role.publishing()
                    and self.clock.monotonic() - self._saved[0] < BIG_STATE_EVERY):
                return
            data = self.learned.to_bytes()
            self._serialized = (self.learned, self.learned.ticks, data) if self.role.publishing() else None  # ~40 MB
            self.state.save_learned_bytes(data)
            self._saved = (self.clock.monotonic(), len(data))
        except OSError as exc:
            log.error("cannot save the learned state: %s", exc)
        except Exception:  # every exit path saves; a bug here is logged, never the end of shutdown
            log.exception("cannot save the learned state")

    def _supervise(self, name: str, body: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run ``body`` as a task until the loop stops. If it raises, the failure is logged with its
        traceback, counted (``reconciler_task_failures_total``), makes ``/healthz`` unhealthy until
        the task has run a clean round again (``_recovered``), and the task restarts after a backoff."""

        async def supervised() -> None:
            failures = 0
            while not self.stop.is_set():
                try:
                    await body()
                    return
                except Exception:  # supervised: logged, counted, restarted
                    failures += 1
                    log.exception("the %s task failed; restarting it in %.0fs", name, TASK_BACKOFF.wait(failures))
                    self.stats.task_failed(name)
                    self._failed[name] = self.clock.time()
                await self.clock.wait(self.stop, TASK_BACKOFF.wait(failures))

        return asyncio.create_task(supervised(), name=name)

    def _recovered(self, name: str) -> None:
        if self._failed.pop(name, None) is not None:
            log.info("the %s task is running cleanly again", name)

    # ------------------------------------------------------------------ tick: collect → verdicts → outlets

    async def _ticker(self) -> None:
        interval = self.cluster.settings.health.report_interval
        next_at = self.clock.monotonic()
        while not self.stop.is_set():
            if await self._tick_by_role() is not None:
                self._recovered("tick")
            if self.max_ticks is not None and self._tick_index >= self.max_ticks:
                self.stop.set()
                return
            interval = self.cluster.settings.health.report_interval
            next_at += interval if math.isfinite(interval) and interval > 0 else 60.0
            now = self.clock.monotonic()
            if next_at < now:  # an interval that overran: start the next one now, do not catch up in a burst
                next_at = now
            await self.clock.wait(self.stop, next_at - now)

    async def tick(self) -> Verdicts | None:
        cluster = self.cluster
        started = self.clock.monotonic()
        self._tick_index += 1
        try:
            reports = await self.collection.collect(self.pool, cluster, self._tick_index, self.healer.applied())
            with gcpause.paused():  # the interval's CPU work, without the cyclic collector walking the heap
                now = self.clock.time()
                verdicts = self.learned.fold(cluster, reports, now, self._trust(cluster, now), self.collection.silent)
                self.collection.tell_refused(self.learned.ledger)
                snap = snapshot(cluster, self.learned, with_reality_keys(self.facts, cluster, self.secret), now, verdicts)
                self.collection.answered(snap)
                self.learned.assignments = snap.assignments  # stickiness (LB-6): the next interval starts here (immutable)
                # an interval with servers and no report of any is not a collection that worked
                heard = not reports or any(r is not None for r in reports.values())
                self.stats.record("collect", heard, self.clock.monotonic() - started, now)
                self.answers.publish(snap)
                if self.live is not None:  # the worker processes answer from the same snapshot (written in a thread)
                    self.live.publish(snap)
                self.view = self._fleet_view(cluster, verdicts, snap)
                self._tell(verdicts, snap)
        except Exception as exc:  # a bug in one interval must not end the loop; it is logged with its traceback
            log.exception("interval %d failed", self._tick_index)
            self.stats.record("collect", False, self.clock.monotonic() - started, self.clock.time())
            self._interval_error = f"interval {self._tick_index} failed: {type(exc).__name__}: {exc}"[:300]
            return None
        self._interval_error = ""
        self._last_tick_end = self.clock.time()
        out_start = self.clock.monotonic()
        try:
            stats = await asyncio.to_thread(self.files.write, snap)  # it pauses the collector itself
            if stats.written or stats.removed:
                log.info("subscriptions: %d user(s) rewritten, %d unchanged, %d removed (%.2fs)",
                         stats.written, stats.unchanged, stats.removed, stats.seconds)
            self.stats.record("outlets", True, self.clock.monotonic() - out_start, self.clock.time())
        except Exception as exc:  # the files stay as they were (each write is atomic); next interval tries again
            self._interval_error = f"cannot write subscription files: {type(exc).__name__}: {exc}"[:300]
            if isinstance(exc, OSError):
                log.error("cannot write subscription files to %s: %s", self.files.directory, exc)
            else:
                log.exception("cannot write subscription files to %s", self.files.directory)
            self.stats.record("outlets", False, self.clock.monotonic() - out_start, self.clock.time())
        await asyncio.to_thread(_gc_paused, self._save, True)
        return verdicts

    def _trust(self, cluster: Cluster, now: float) -> Trust:
        """How this interval's reports are believed (``Collection.trust``); after a start, a takeover or a reload,
        the answers the restored state gives are made first."""
        start = None
        if self.collection.needs_start(cluster):
            start = snapshot(cluster, self.learned, with_reality_keys(self.facts, cluster, self.secret), now,
                             self.learned.current_verdicts(cluster, now))
        return self.collection.trust(cluster, start)

    def _fleet_view(self, cluster: Cluster, verdicts: Verdicts, snap: Snapshot) -> FleetView:
        loads = snap.loads
        assigned = held_by_server(cluster, snap.assignments)
        rtt = self.learned.rtt_by_region(cluster)
        return FleetView(cluster=cluster, verdicts=verdicts, snapshot=snap,
                         traffic_mbps={k: v.traffic_mbps for k, v in loads.items()},
                         connected={k: v.users for k, v in loads.items()},
                         capacity_mbps={k: v.capacity_mbps for k, v in loads.items()}, assigned=assigned, rtt_ms=rtt,
                         drift=dict(self.healer.drift), cluster_digest=self._digest, traffic_bytes=dict(self.learned.bytes_total),
                         usage=snap.usage, usage_unavailable=dict(self.learned.ledger.unavailable),
                         user_bytes_by_server={k: (v[0], v[1]) for k, v in self.learned.ledger.by_server.items()},
                         user_bytes_by_route={k: (v[0], v[1]) for k, v in self.learned.ledger.by_route.items()},
                         unreported=dict(self.collection.unreported),
                         history={k: tuple(v) for k, v in self.learned.history.changes.items()})

    def _tell(self, verdicts: Verdicts, snap: Snapshot) -> None:
        """What the interval tells (``fleet.tell``, pure), done: the log lines, the webhook's events, a plan now."""
        self._told = replace(self._told, said=self.learned.ledger.said)
        self._told, effects = tell(self._told, verdicts, snap, self._tick_index)
        self.learned.ledger.said = dict(self._told.said)
        for level, line in effects.logs:
            log.log(level, "%s", line)
        for payload in effects.posts:
            self._post(payload)
        if effects.plan_now:
            self.plan_now.set()

    def _post(self, payload: dict[str, Any]) -> None:
        url = self.cluster.settings.outputs.webhook_url
        if not url:
            return
        task = asyncio.create_task(_post(url, payload))
        self._posts.add(task)  # keep a reference until it is done, then forget it
        task.add_done_callback(self._posts.discard)

    # ------------------------------------------------------------------ plan, drift, self-heal

    async def _planner(self) -> None:
        while not self.stop.is_set():
            await self.plan_and_heal()
            self._recovered("plan")
            await self.clock.wait(self.plan_now, self.cluster.settings.plan_interval)
            self.plan_now.clear()

    async def plan_and_heal(self) -> None:
        """One pass of plan → heal (``Healer``): only a leader's, after it took over the state."""
        if not self.role.leads():
            return
        await self._take_over()
        await self.healer.pass_(self.pool, self.cluster, lambda: self.learned.ledger.view(self.cluster, self.clock.time()),
                                self.role.fence())

    # ------------------------------------------------------------------ the file: watch and git pull

    async def reload(self) -> bool:
        """Load the file again, in a thread within ``LOAD_BUDGET`` seconds and 2 a MB (the event loop keeps serving);
        keep the last good cluster when the new one is invalid or takes too long. One load at a time: a file's and
        a user's change never adopt each other's older cluster. True when a changed cluster was adopted."""
        async with self._loading:
            return await self._reload() is True

    async def reload_all_users(self) -> bool:
        """Every user again (``UserChanges``'s catch-up after the database was away): whether they could be read."""
        async with self._loading:
            return await self._reload() is not None

    async def _reload(self) -> bool | None:
        """True: a changed cluster adopted; False: read, and unchanged; None: it could not be read."""
        started = self.clock.monotonic()
        budget = await asyncio.to_thread(load_seconds, self.path, LOAD_BUDGET)  # a million users: 39 MB, 108 s
        try:
            result = await asyncio.wait_for(asyncio.to_thread(load_servable, self.path), budget)
        except TimeoutError:
            log.error("loading the changed file took more than %ds: keeping the last good version", budget)
            self.stats.record("load", False, self.clock.monotonic() - started, self.clock.time())
            return None
        if result.cluster is None or result.errors:
            for d in result.errors:
                log.error("%s", d.render())
            if any(d.code == "database" for d in result.errors):
                log.error("the users cannot be read from their database: keeping the %d user(s) last loaded",
                          len(self.cluster.users))
            else:
                log.error("the changed file is invalid%s: keeping the last good version until it is fixed",
                          "" if result.cluster is None else " (plan and apply refuse it too)")
            self.stats.record("load", False, self.clock.monotonic() - started, self.clock.time())
            return None
        return await self._adopt(await self._keeping(result.cluster, result.bad_users), started, f"reloaded {self.path}")

    async def _keeping(self, cluster: Cluster, bad: list[str]) -> Cluster:
        """``cluster`` with the users whose database rows went bad kept as last loaded, as an edit keeps them (a
        typo in one row does not take a served user away while this controller runs); a bad row of a user never
        loaded stays left out."""
        index = self.cluster.roster.index
        kept = {name: self.cluster.users[i] for name in bad if (i := index.get(name)) is not None}
        for name in list(kept)[:KEPT_SAID]:
            log.warning("the database's user %r is bad now: keeping it as last loaded", name)
        if len(kept) > KEPT_SAID:
            log.warning("… and %d more users whose rows are bad now, kept as last loaded", len(kept) - KEPT_SAID)
        return await asyncio.to_thread(cluster.with_users, kept) if kept else cluster

    async def reload_users(self, names: set[str]) -> bool:
        """Only these users again, from their database (``settings.users.source: postgres``): the others are kept
        as loaded, so one edit costs one row, not a million. A row that went bad keeps its user as last loaded."""
        async with self._loading:
            return await self._reload_users(names)

    async def _reload_users(self, names: set[str]) -> bool:
        started = self.clock.monotonic()
        db = UserDatabase(dsn_of(self.cluster.settings.users))
        fetched = await asyncio.to_thread(db.fetch, names)
        for key, why in fetched.bad:
            log.warning("the %s's user %r is bad now (%s): keeping it as last loaded", db.name, key, why)
        current = self.cluster
        changed = {name: user for name, user in fetched.changed.items()
                   if user != (current.users[i] if (i := current.roster.index.get(name)) is not None else None)}
        if not changed:
            return False
        cluster = await asyncio.to_thread(current.with_users, changed)
        return await self._adopt(cluster, started, f"{plural(len(changed), 'user')} changed in the {db.name}",
                                 changed_users_digest(self._digest, changed))

    async def _adopt(self, cluster: Cluster, started: float, what: str, digest: str | None = None) -> bool:
        """``cluster`` in place of the current one, unless nothing changed; a plan follows at once. ``digest``: the
        new cluster's, when the caller knows it cheaper than hashing every user (``changed_users_digest``)."""
        if digest is None:
            digest = await asyncio.to_thread(cluster_digest, cluster)
        if digest == self._digest:
            return False
        self.cluster = cluster
        self.http.trusted_proxies = networks(cluster.settings.outputs.trusted_proxies)
        self._digest = digest
        self.files.hashed(cluster, digest)
        self.learned = self.learned.adopt(cluster)
        self.files.directory = self._out_dir(cluster)
        self.stats.record("load", True, self.clock.monotonic() - started, self.clock.time())
        log.info("%s: %d server(s), %d inbound(s), %d user(s)", what, len(cluster.servers), len(cluster.inbounds),
                 len(cluster.users))
        self.plan_now.set()
        return True

    async def _watcher(self) -> None:
        from watchfiles import Change, awatch

        # (Prefixes: they skip the folder the outlet's first pass writes into too, whose name starts with its folder's.)
        skip = tuple(str(p) for p in (self.state.path, self.files.directory, Path(self.base_dir) / ".git"))

        def wanted(change: Change, path: str) -> bool:
            return path.endswith((".yaml", ".yml")) and not path.startswith(skip)

        async for _ in awatch(self.base_dir, watch_filter=wanted, stop_event=self.stop, recursive=True):
            await self.reload()

    async def _git_puller(self) -> None:
        every = self.cluster.settings.git_pull_interval or 0
        while not self.stop.is_set():
            await self.clock.wait(self.stop, every)
            if self.stop.is_set():
                return
            started = self.clock.monotonic()
            proc = await asyncio.create_subprocess_exec("git", "-C", self.base_dir, "pull", "--ff-only", "--quiet",
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                _, err = await asyncio.wait_for(proc.communicate(), 120)
            except TimeoutError:
                proc.kill()
                await proc.communicate()
                err = b"timed out after 120s"
            ok = proc.returncode == 0
            self.stats.record("git", ok, self.clock.monotonic() - started, self.clock.time())
            if not ok:
                log.error("git pull failed (%s): %s", proc.returncode, err.decode(errors="replace").strip()[-500:])
            else:
                await self.reload()

    # ------------------------------------------------------------------ standby controllers

    def leadership_changed(self, leading: bool) -> None:
        """The role's news: a new leader plans now (it reconciles whatever its predecessor left half done); one
        that steps down stops the apply in progress."""
        if leading:
            self.plan_now.set()
        else:
            self.healer.stop_applying()

    def saved_bytes(self) -> bytes | None:
        """The bytes the last save wrote, when they are the current learned state's (given once: then forgotten)."""
        kept, self._serialized = self._serialized, None
        return kept[2] if kept is not None and kept[0] is self.learned and kept[1] == self.learned.ticks else None

    async def _status_json(self, request: web.BaseRequest) -> web.Response:
        from aiohttp import web

        doc = status_document(self.view)
        leader = self.role.status()
        if leader is not None:
            doc["leader"] = leader
        return web.json_response(doc, dumps=lambda o: json.dumps(o, ensure_ascii=False))

    async def _take_over(self) -> None:
        """Once per election won, before the new leader's first interval or plan: its first interval tells the
        webhook every server customers miss."""
        if await self.role.take_over():
            self._told = self._told.after_takeover()

    async def _tick_by_role(self) -> Verdicts | None:
        """The leader's interval collects (``tick``) and then publishes its learned state; a standby's follows it."""
        if not self.role.leads():
            return await self._follow_tick()
        await self._take_over()
        verdicts = await self.tick()
        if verdicts is not None:
            await self.role.publish()
        return verdicts

    async def _follow_tick(self) -> Verdicts | None:
        """A standby's interval: the leader's newest published state, served read-only — the live answers, the
        files, the metrics view — from this controller's own checkout of the file; no collection, plan or apply."""
        self._tick_index += 1
        fresh = await self.role.follow()
        cluster, now = self.cluster, self.clock.time()
        try:
            verdicts = self.learned.current_verdicts(cluster, now)
            snap = snapshot(cluster, self.learned, with_reality_keys(self.facts, cluster, self.secret), now, verdicts)
            self.answers.publish(snap)
            if self.live is not None:  # worker processes answering the public port, when there are
                self.live.publish(snap)
            self.view = self._fleet_view(cluster, verdicts, snap)
        except Exception as exc:  # as an interval's: logged, told by /healthz, tried again
            log.exception("standby interval %d failed", self._tick_index)
            self._interval_error = f"standby interval {self._tick_index} failed: {type(exc).__name__}: {exc}"[:300]
            return None
        self._interval_error = ""
        self._last_tick_end = self.clock.time()
        try:
            await asyncio.to_thread(self.files.write, snap)
        except Exception as exc:  # noqa: BLE001 — the files stay as they were; the next interval writes them
            log.error("cannot write subscription files to %s: %s: %s", self.files.directory, type(exc).__name__, exc)
        if fresh:
            await asyncio.to_thread(_gc_paused, self._save, True)
        return verdicts


def _resolved(host: str) -> str:
    """An address for ``host`` (a name is looked up once; one that does not resolve counts as not loopback)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        try:
            return str(socket.getaddrinfo(host, None)[0][4][0])
        except (OSError, IndexError):
            return "0.0.0.0"


async def _post(url: str, payload: dict[str, Any]) -> None:
    """POST one event to ``settings.outputs.webhook_url``. No redirect is followed: the body goes to the address in
    the file or nowhere, and a 3xx answer is a failure, logged. The log shows the URL without the parts that carry
    tokens (``reconciler.text.url_for_log``), also inside an error's text."""
    import aiohttp

    shown = url_for_log(url)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(url, json=payload, allow_redirects=False) as resp:
                if 300 <= resp.status < 400:
                    log.warning("webhook %s answered %d (a redirect): the event was not delivered, since webhooks follow "
                                "no redirects; set settings.outputs.webhook_url to the address it redirects to",
                                shown, resp.status)
                elif resp.status >= 400:
                    log.warning("webhook %s answered %d: the event was not delivered", shown, resp.status)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        log.warning("webhook %s failed: %s", shown, without_url_secrets(str(exc), url) or type(exc).__name__)


async def run_loop(path: str, cluster: Cluster, secret: Secret, **kw: Any) -> int:
    return await Loop(path, cluster, secret, **kw).run()


def _gc_paused(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (in a worker thread) with the cyclic collector paused (``reconciler.gcpause``)."""
    with gcpause.paused():
        return fn(*args)
