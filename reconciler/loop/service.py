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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from prometheus_client import CollectorRegistry

from reconciler import gcpause
from reconciler.apply.acme import CERTIFICATE_BACKOFF, ensure_certificates
from reconciler.apply.run import apply_all
from reconciler.apply.session import Progress, pool_for, remember
from reconciler.backoff import Backoff, Streaks
from reconciler.balance import Snapshot
from reconciler.balance.decide import failover_servers, held_by_server
from reconciler.config.yamlread import load_seconds
from reconciler.credentials import DEVICE_KEY_PERIOD, Redactor, Secret, clash_api_secret, device_fingerprint_key
from reconciler.engine import remote
from reconciler.engine.base import mark_key
from reconciler.engine.capabilities import of_engine
from reconciler.errors import LockHeld, RemoteCommandError, RemoteError, ReportError, SecretError, is_temporary
from reconciler.fleet import snapshot
from reconciler.fleet.app_probe import AppTarget, probe_targets
from reconciler.fleet.learned import Learned
from reconciler.fleet.reality import with_reality_keys
from reconciler.fleet.reports import AppProbing, Report, agent_request, asked_probes, parse_report
from reconciler.fleet.tell import Told, tell
from reconciler.fleet.usage import Trust
from reconciler.health.verdicts import Verdicts
from reconciler.loop.client_address import networks
from reconciler.loop.clock import Clock, SystemClock
from reconciler.loop.http import HttpOutlet, status_document
from reconciler.loop.listener import load_credential
from reconciler.loop.workers import LiveWorkers, worker_count
from reconciler.metrics import FleetView, LoopStats, ReconcilerCollector
from reconciler.model import Cluster, Server
from reconciler.model.types import parse_listen
from reconciler.plan.lock import Fence
from reconciler.plan.observe import Observed, observe
from reconciler.publish import FileOutlet, LiveAnswers, Tokens, cluster_digest
from reconciler.servable import load_servable
from reconciler.ssh import Result, Runner, Target
from reconciler.state.folder import StateFolder
from reconciler.text import size_text, url_for_log, without_url_secrets

if TYPE_CHECKING:
    from aiohttp import web

    from reconciler.apply.run import ServerResult
    from reconciler.loop.leader import Election, StateChannel

log = logging.getLogger("reconciler.loop")
T = TypeVar("T")
#: A server that did not report is asked again next interval, then after 2, 4 … at most 16 intervals more.
SERVER_BACKOFF = Backoff(first=2, cap=16, free=1)
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
LOAD_BUDGET = 30  # seconds a reload may take, and 2 s more a MB of YAML it reads (load_seconds; loading is bounded, this bounds the wait)


class Loop:
    def __init__(self, path: str, cluster: Cluster, secret: Secret, *, listen: str | None = None,
                 duration: float | None = None, max_ticks: int | None = None, watch: bool = True,
                 operations_listen: str | None = None, runner: Runner | None = None, clock: Clock | None = None):
        self.clock: Clock = clock or SystemClock()  # every time the loop reads or waits for (tests: FakeClock)
        self._runner = runner  # the servers' runner; default: SSH connections from the state folder's known hosts
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
        self.backoff: Streaks[str] = Streaks(SERVER_BACKOFF)  # per server, counted in intervals
        self.tokens = Tokens(secret)
        self.answers = LiveAnswers(secret, self.tokens)
        self.files = FileOutlet(self._out_dir(cluster), self.state.path, secret)
        self.view: FleetView | None = None
        self.drift: dict[str, int] = {}
        self.facts = self.state.facts()  # what older versions learnt from servers; derived keys and pins win over it
        self.learned = self.state.load_learned(cluster)
        self._saved = (self.clock.monotonic(), 0)  # when the learned state was last written, and its size
        self._serialized: tuple[Learned, int, bytes] | None = None  # the last bytes written, of which state and tick
        self._app_targets: tuple[Cluster, dict[str, AppTarget], dict[str, frozenset[str]]] | None = None
        self._session_failures: dict[tuple[str, str], str] = {}  # (witness, inbound) → how its session fails
        self._local_probe_errors: dict[str, str] = {}  # witness → why its own probe client did not run
        self._mark_key = mark_key(secret)  # the users' marks: the counters are read under the same key
        self._device_store_key = secret.derive("device-store")  # what is kept of device fingerprints: ours alone
        self._device_day = 0  # the day of the key this interval's device fingerprints are made with
        self._reach: Snapshot | None = None  # the last answers: where users' failover orders send them
        self._reach_before: Snapshot | None = None  # the answers before those (apps follow them for a while)
        self._refused: dict[str, int] = {}  # server → rows not believed, as last logged
        self.acme_backoff: Streaks[str] = Streaks(CERTIFICATE_BACKOFF)  # failed orders wait longer each time
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
        self._told = Told()  # what the intervals told so far (fleet.tell)
        self._tick_index = 0
        self._last_tick_end = 0.0
        self._started = self.clock.time()
        self._failed: dict[str, float] = {}  # supervised task → when it last failed (until it runs cleanly again)
        self._interval_error = ""  # why the last interval failed ("" when it did not)
        self._busy = asyncio.Lock()  # one plan/apply at a time; ticks never wait for it
        self._tasks: list[asyncio.Task[None]] = []
        self._posts: set[asyncio.Task[None]] = set()
        self._leader_init()  # standby controllers: the election, when settings.leader names an etcd

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
        if self.election is not None and not self.election.is_leader:
            return self._standby_health()
        if self.view is None:
            late = self.clock.time() - self._started > 3 * interval + 60
            return (not late, "starting: the first interval has not finished" + (" (late)" if late else ""))
        age = self.clock.time() - self._last_tick_end
        if age > 3 * interval + 30:
            return False, f"the last interval finished {age:.0f}s ago (interval {interval:g}s)"
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
                 "/status.json, status page /, /healthz)", self.listen, self.operations_listen)
        return True

    def _start_tasks(self) -> None:
        self._tasks = [self._supervise("tick", self._ticker), self._supervise("plan", self._planner)]
        if self.watch_enabled:
            self._tasks.append(self._supervise("watch", self._watcher))
        if self.cluster.settings.git_pull_interval:
            self._tasks.append(self._supervise("git", self._git_puller))
        if self.election is not None:  # lead or stand by
            self._tasks.append(self._supervise("leader", self._elect))
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
        await self._leader_stop()  # the last state published, the lease given back
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
            if (after_interval and self._saved[1] >= BIG_STATE_BYTES and not self._publishing()
                    and self.clock.monotonic() - self._saved[0] < BIG_STATE_EVERY):
                return
            data = self.learned.to_bytes()
            self._serialized = (self.learned, self.learned.ticks, data) if self._publishing() else None  # ~40 MB
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
            reports = await self.collect(cluster)
            with gcpause.paused():  # the interval's CPU work, without the cyclic collector walking the heap
                now = self.clock.time()
                verdicts = self.learned.fold(cluster, reports, now, self._trust(cluster))
                self._tell_refused()
                snap = snapshot(cluster, self.learned, with_reality_keys(self.facts, cluster, self.secret), now, verdicts)
                self._reach_before, self._reach = self._reach, snap
                self.learned.assignments = snap.assignments  # stickiness (LB-6): the next interval starts here (immutable)
                self.stats.record("collect", True, self.clock.monotonic() - started, now)
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
            stats = await asyncio.to_thread(_gc_paused, self.files.write, snap)
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

    def _publishing(self) -> bool:
        """Whether this interval's learned state is published to a standby (a leader's)."""
        return self.election is not None and self.channel is not None and self.election.is_leader

    async def collect(self, cluster: Cluster) -> dict[str, Report | None]:
        interval = cluster.settings.health.report_interval
        probe_timeout = max(0.5, min(3.0, interval / 4))
        budget = max(5.0, min(0.8 * interval, 60.0))

        app = self._app_probing(cluster, probe_timeout)
        self._device_day = int(self.clock.time() // DEVICE_KEY_PERIOD)
        device_key = device_fingerprint_key(self.secret, self._device_day)

        async def one(server: Server) -> tuple[str, Report | None]:
            name = server.name
            if not self.backoff.ready(name, self._tick_index):
                return name, None
            req = agent_request(cluster, name, clash_api_secret(self.secret, name), probe_timeout, device_key,
                                interval=self._tick_index, app=app)
            try:
                async with asyncio.timeout(budget + 2):  # not wait_for: no task of its own per server and interval
                    res = await self._agent(server, req, budget)
                with gcpause.paused():
                    report = parse_report(name, res.stdout, self.clock.time(), asked_probes(req))
            except Exception as exc:  # one server's failure, whatever it is, is that server's no_data
                wait = int(self.backoff.failed(name, self._tick_index + 1, is_temporary(exc)))  # from the next interval
                self.stats.server_error(name)
                expected = isinstance(exc, RemoteError | ReportError | OSError | TimeoutError)
                log.log(logging.WARNING if expected else logging.ERROR, "%s: no report this interval: %s%s", name,
                        str(exc) or type(exc).__name__, f"; next try in {wait + 1} interval(s)" if wait else "",
                        exc_info=not expected)
                return name, None
            if self.backoff.succeeded(name):
                log.info("%s: reporting again", name)
            return name, report

        results = dict(await asyncio.gather(*(one(s) for s in cluster.servers)))
        self._tell_sessions(results)
        return results

    async def _agent(self, server: Server, req: dict[str, Any], budget: float) -> Result:
        """The agent's answer on ``server`` (a ``Script`` like every other: the fake host answers it too)."""
        try:
            return await self.pool.script(Target.from_server(server), remote.AGENT, req, timeout=budget)
        except RemoteCommandError as exc:
            hint = " (the agent is not installed yet: apply first)" if "No such file" in exc.stderr else ""
            # What a server says is logged: never the secrets it was sent (a broken agent may echo its request).
            said = _sent_secrets(req)(exc.stderr.strip()[-300:], structural=True)
            raise ReportError(f"the agent exited {exc.code}{hint}: {said}") from None

    def _trust(self, cluster: Cluster) -> Trust:
        """How this interval's reports are believed: each server only about the users the last answers sent to it
        (their failover orders as the last two snapshots give them, so a server that left rotation for an interval,
        an engine's restart, still counts what its users carried; after a start or a takeover, as the restored
        state gives them), each user's orders decided at most once per interval."""
        orders: dict[str, frozenset[str]] = {}

        def reach(server: str, names: list[str]) -> np.ndarray:
            if self._reach is None or self._reach.cluster is not cluster:  # a start, a takeover or a reload
                now = self.clock.time()
                made = snapshot(cluster, self.learned, with_reality_keys(self.facts, cluster, self.secret), now,
                                self.learned.current_verdicts(cluster, now))
                self._reach_before, self._reach = self._reach, made
            answers = [a for a in (self._reach, self._reach_before) if a is not None]
            out = np.zeros(len(names), bool)
            for i, name in enumerate(names):
                found = orders.get(name)
                if found is None:
                    found = orders[name] = frozenset().union(*(failover_servers(a, name) for a in answers))
                out[i] = server in found
            return out
        return Trust(self._mark_key, reach, self._device_store_key, device_epoch=self._device_day)

    def _tell_refused(self) -> None:
        """Log a server whose report claims traffic of users the controller never sent to it (once, and when it
        stops): such rows are not counted (a server is believed only about itself)."""
        now = {server: users for server, (users, _nbytes) in self.learned.ledger.refused.items()}
        for server, users in now.items():
            if server not in self._refused:
                log.warning("%s reports traffic of %d user(s) the controller did not send to it, or no longer serves "
                            "(%s): not counted; a server that does this every interval may be compromised", server,
                            users, size_text(self.learned.ledger.refused[server][1]))
        for server in [s for s in self._refused if s not in now]:
            log.info("%s reports only its own users' traffic again", server)
        self._refused = now

    def _tell_sessions(self, reports: dict[str, Report | None]) -> None:
        """Log, when it starts and when it ends, each pair whose handshake passes while its proxy session fails
        (HEALTH-16): what kind of censor is at work (a stall, a reset on the server name) is in these lines."""
        now: dict[tuple[str, str], str] = {}
        for witness, rep in reports.items():
            if rep is None:
                continue
            local = ""
            for inbound, result in rep.probes.items():
                if result.ok and result.app is False:
                    now[(witness, inbound)] = result.failure
                elif result.app is None and result.app_error:
                    local = result.app_error
            if local and self._local_probe_errors.get(witness) != local:  # its own client: no session was tried
                log.warning("%s: no app-like probes this interval: %s", witness, local)
            if local:
                self._local_probe_errors[witness] = local
            else:
                self._local_probe_errors.pop(witness, None)
        for (witness, inbound), text in now.items():
            if self._session_failures.get((witness, inbound)) is None:
                log.info("%s cannot carry a session through %s: %s", witness, inbound, text)
        for key in [k for k in self._session_failures if k not in now]:
            rep = reports.get(key[0])
            probe = rep.probes.get(key[1]) if rep is not None else None
            if probe is None:
                continue  # not probed this interval (the plan rotates), or no report: nothing new is known
            if probe.passed:
                log.info("%s carries sessions through %s again", *key)
            del self._session_failures[key]
        self._session_failures.update(now)

    def _app_probing(self, cluster: Cluster, probe_timeout: float) -> AppProbing:
        """The app-like probes' inputs (HEALTH-16): the probe credential's outbounds (once per cluster), the targets
        whose configuration holds it (no change left to apply: older configurations lack it, and a probe refused
        there says nothing of a censor), and what each engine's build cannot dial."""
        if self._app_targets is None or self._app_targets[0] is not cluster:
            lacks: dict[str, frozenset[str]] = {}
            for name in {cluster.engine_of(s).name for s in cluster.servers}:
                caps = of_engine(cluster, name)
                lacks[name] = frozenset() if caps is None else frozenset(c for c in ("reality", "quic") if c not in caps)
            self._app_targets = (cluster, probe_targets(cluster, self.secret), lacks)
        _, targets, lacks = self._app_targets
        applied = frozenset(name for name, pending in self.drift.items() if pending == 0)
        return AppProbing(targets, applied, lacks, timeout=max(2.0, 2 * probe_timeout))

    def _fleet_view(self, cluster: Cluster, verdicts: Verdicts, snap: Snapshot) -> FleetView:
        loads = snap.loads
        assigned = held_by_server(cluster, snap.assignments)
        rtt = self.learned.rtt_by_region(cluster)
        return FleetView(cluster=cluster, verdicts=verdicts, snapshot=snap,
                         traffic_mbps={k: v.traffic_mbps for k, v in loads.items()},
                         connected={k: v.users for k, v in loads.items()},
                         capacity_mbps={k: v.capacity_mbps for k, v in loads.items()}, assigned=assigned, rtt_ms=rtt,
                         drift=dict(self.drift), cluster_digest=self._digest, traffic_bytes=dict(self.learned.bytes_total),
                         usage=snap.usage, usage_unavailable=dict(self.learned.ledger.unavailable),
                         user_bytes_by_server={k: (v[0], v[1]) for k, v in self.learned.ledger.by_server.items()},
                         user_bytes_by_route={k: (v[0], v[1]) for k, v in self.learned.ledger.by_route.items()})

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
        if self.election is not None:  # only the leader plans and applies; a new one first takes over the state
            if not self.election.is_leader:
                return
            await self._complete_takeover()
        async with self._busy:
            cluster = self.cluster
            observed = await self._observe_all(cluster)
            if observed is None:
                return
            pending = [o for o in observed if o.plan.changes and not (o.plan.error or o.plan.problems)]
            if not pending:
                return
            what = ", ".join(f"{o.plan.server} ({len(o.plan.actions)})" for o in pending)
            if not cluster.settings.self_heal:
                log.warning("drift: %s; self_heal is off — run `reconciler plan` and `reconciler apply`", what)
                return
            log.info("applying: %s", what)
            await self._heal(cluster, pending)

    async def _observe_all(self, cluster: Cluster) -> list[Observed] | None:
        """Every server observed and planned (due ACME certificates ordered first); None (logged) when it failed."""
        started = self.clock.monotonic()
        try:
            if cluster.settings.self_heal:  # ACME certificates due for renewal are renewed before the plan
                failed = await ensure_certificates(cluster, self.pool, self.base_dir, backoff=self.acme_backoff)
                for inbound, why in failed.items():
                    log.warning("no certificate for inbound %s: %s", inbound, why)
            # GITOPS-7: a server that left the file is removed like in `apply` (`retired:` keeps one)
            managed = await asyncio.to_thread(self.state.managed) if cluster.settings.self_heal else {}
            usage = self.learned.ledger.view(cluster, self.clock.time())  # over-quota users stay out
            observed = await observe(cluster, self.secret, self.pool, self.base_dir, True, managed, usage=usage)
        except Exception:  # logged with traceback; the next plan tries again
            log.exception("plan failed")
            self.stats.record("plan", False, self.clock.monotonic() - started, self.clock.time())
            return None
        errors = [o.plan for o in observed if o.plan.error or o.plan.problems]
        for p in errors:
            log.warning("plan: %s: %s", p.server, p.error or "; ".join(p.problems))
        self.stats.record("plan", not errors, self.clock.monotonic() - started, self.clock.time())
        self.drift = {o.plan.server: len(o.plan.actions) for o in observed}
        return observed

    async def _heal(self, cluster: Cluster, pending: list[Observed]) -> None:
        """Apply what drifted, under the state folder's lock and the leader's fence; results recorded and told."""
        started = self.clock.monotonic()
        progress = Progress([o.plan.server for o in pending], log=lambda line: log.info("apply %s", line))
        try:
            with self.state.lock("run (self-heal)"):  # not while an `apply` from this folder runs
                # the leader's fence goes with it; stepping down cancels what is left of it
                self._applying: asyncio.Future[list[ServerResult]] | None = asyncio.ensure_future(
                    apply_all(pending, self.pool, progress, fence=self._fence()))
                try:
                    results = await self._applying  # adds generated public keys to `pending`
                finally:
                    self._applying = None
                await asyncio.to_thread(remember, self.state, cluster, pending, results)
        except LockHeld as exc:
            log.warning("self-heal waits for the next plan: %s", exc)
            return
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the loop stops
            log.warning("apply stopped: this controller is no longer the leader (servers finish or roll back a "
                        "started commit on their own)")
            self.stats.record("apply", False, self.clock.monotonic() - started, self.clock.time())
            return
        except Exception:
            log.exception("apply failed")
            self.stats.record("apply", False, self.clock.monotonic() - started, self.clock.time())
            return
        finally:
            progress.close()
        for r in results:
            (log.info if r.ok else log.error)("apply %s: %s", r.server, r.message)
        self.stats.record("apply", all(r.ok for r in results), self.clock.monotonic() - started, self.clock.time())
        for r in results:
            if r.ok:
                self.drift[r.server] = 0

    # ------------------------------------------------------------------ the file: watch and git pull

    async def reload(self) -> bool:
        """Load the file again, in a thread within ``LOAD_BUDGET`` seconds and 2 a MB (the event loop keeps serving);
        keep the last good cluster when the new one is invalid or takes too long."""
        started = self.clock.monotonic()
        budget = await asyncio.to_thread(load_seconds, self.path, LOAD_BUDGET)  # a million users: 39 MB, 108 s
        try:
            result = await asyncio.wait_for(asyncio.to_thread(load_servable, self.path), budget)
        except TimeoutError:
            log.error("loading the changed file took more than %ds: keeping the last good version", budget)
            self.stats.record("load", False, self.clock.monotonic() - started, self.clock.time())
            return False
        if result.cluster is None or result.errors:
            for d in result.errors:
                log.error("%s", d.render())
            log.error("the changed file is invalid%s: keeping the last good version until it is fixed",
                      "" if result.cluster is None else " (plan and apply refuse it too)")
            self.stats.record("load", False, self.clock.monotonic() - started, self.clock.time())
            return False
        digest = cluster_digest(result.cluster)
        if digest == self._digest:
            return False
        self.cluster = result.cluster
        self.http.trusted_proxies = networks(result.cluster.settings.outputs.trusted_proxies)
        self._digest = digest
        self.learned = self.learned.adopt(result.cluster)
        self.files.directory = self._out_dir(result.cluster)
        self.stats.record("load", True, self.clock.monotonic() - started, self.clock.time())
        log.info("reloaded %s: %d server(s), %d inbound(s), %d user(s)", self.path, len(result.cluster.servers),
                 len(result.cluster.inbounds), len(result.cluster.users))
        self.plan_now.set()
        return True

    async def _watcher(self) -> None:
        from watchfiles import Change, awatch

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

    def _leader_init(self) -> None:
        """With ``settings.leader.etcd``: this controller's election and the channel of the learned state
        (``reconciler.loop.leader``), started by ``run``; without, none — it leads alone, as before."""
        self.election: Election | None = None
        self.channel: StateChannel | None = None
        self._state_generation: str | None = None  # the published state this controller has (read or written)
        self._state_seen = 0.0  # when (monotonic) a leader's state last arrived here, as a standby
        self._state_pointer: dict[str, Any] = {}  # that state's pointer: by whom, its fence, ticks, when
        self._state_error = ""  # the last failure to read or publish it ("" after a success)
        self._takeover_lock = asyncio.Lock()
        self._takeover_pending = False
        self._applying = None  # the apply in progress (plan_and_heal), cancelled when this controller steps down
        settings = self.cluster.settings.leader
        if not settings.etcd:
            return
        from reconciler.loop.leader import Election, Etcd, LeaderCollector, StateChannel

        calls = max(0.5, min(5.0, settings.lease / 4))  # an etcd request of the election never outlasts a round
        self.election = Election(Etcd.from_settings(settings, self.base_dir, calls), settings.prefix, settings.lease,
                                 on_change=self._on_leadership)
        self.channel = StateChannel(Etcd.from_settings(settings, self.base_dir, 30.0), settings.prefix, self.secret)
        self.registry.register(LeaderCollector(self.election))
        self.http._pages["/status.json"] = self._status_json  # the status document says who leads
        log.info("standby controllers: etcd %s, lease %gs, keys under %s; this one is %s", ", ".join(settings.etcd),
                 settings.lease, settings.prefix, self.election.identity)

    async def _status_json(self, request: web.BaseRequest) -> web.Response:
        from aiohttp import web

        doc = status_document(self.view)
        if self.election is not None:
            doc["leader"] = {**self.election.status(), "state": {
                "generation": self._state_generation, "ticks": self.learned.ticks,
                "published_by": self._state_pointer.get("by"), "error": self._state_error}}
        return web.json_response(doc, dumps=lambda o: json.dumps(o, ensure_ascii=False))

    async def _elect(self) -> None:
        assert self.election is not None
        await self.election.run(self.stop)

    def _on_leadership(self, leading: bool) -> None:
        if leading:  # the state it continues from is read before its first interval or plan (_complete_takeover)
            self._takeover_pending = True
            self.plan_now.set()  # plan now: the new leader reconciles whatever its predecessor left half done
            return
        if self._applying is not None and not self._applying.done():
            log.warning("stopping the apply in progress: its next steps are not this controller's to take")
            self._applying.cancel()

    def _fence(self) -> Fence | None:
        """What this leader's applies carry (none without an election: not fenced, as before)."""
        election = self.election
        if election is None:
            return None
        return Fence(election.fence, lambda: election.is_leader)

    async def _tick_by_role(self) -> Verdicts | None:
        """The leader's interval collects (``tick``) and then publishes its learned state; a standby's follows it."""
        if self.election is None:
            return await self.tick()
        if not self.election.is_leader:
            return await self._follow_tick()
        await self._complete_takeover()
        verdicts = await self.tick()
        if verdicts is not None:
            await self._publish_state()
        return verdicts

    async def _complete_takeover(self) -> None:
        """Once per election won: continue from the last state the previous leader published (it can publish
        no more: its writes are guarded by the key it lost) — capacities, streaks, assignments, the usage ledger."""
        async with self._takeover_lock:
            if not self._takeover_pending:
                return
            self._takeover_pending = False
            self._told = self._told.after_takeover()  # its first interval tells the webhook every server customers miss
            fresh = await self._read_state()
            pointer = self._state_pointer
            log.warning("leading from interval %d of the learned state (%s)", self.learned.ticks,
                        f"published by {pointer.get('by')} at fence {pointer.get('fence')}" if fresh or pointer
                        else "none published yet: this controller's own")

    async def _read_state(self) -> bool:
        """The leader's newest published state, when there is one newer than ours: it becomes ours."""
        assert self.channel is not None
        from reconciler.loop.leader import EtcdFailure, failure, unpack

        try:
            got = await self.channel.read(self._state_generation)
        except EtcdFailure as exc:
            self._state_trouble(f"cannot read the leader's published state: {failure(exc)}")
            return False
        if got is None:
            return False
        where = f"the state {got.pointer.get('by')} published"
        try:
            data, extras = unpack(got.blob)
        except ValueError as exc:
            self._state_generation = got.generation  # not read again; the next one may be good
            self._state_trouble(f"ignoring {where}: {exc}")
            return False
        learned, note = Learned.restore(data, self.cluster, where)
        self._state_generation = got.generation
        if note:
            self._state_trouble(note)
            return False
        self._state_error = ""
        self.learned, self._state_seen, self._state_pointer = learned, self.clock.monotonic(), got.pointer
        await asyncio.to_thread(self._adopt_published, extras)
        return True

    def _state_trouble(self, text: str) -> None:
        if text != self._state_error:
            log.warning("%s", text)
        self._state_error = text

    def _adopt_published(self, extras: dict[str, Any]) -> None:
        """The leader's managed servers and public facts, kept in this controller's state folder: a takeover
        prunes and pins as the leader would have."""
        try:
            managed, facts = extras.get("managed"), extras.get("facts")
            if isinstance(managed, dict) and managed != self.state.managed():
                self.state.write_managed(managed)
            if isinstance(facts, dict) and facts and facts != self.facts:
                self.facts = self.state.remember_facts({k: v for k, v in facts.items() if isinstance(v, dict)})
        except OSError as exc:
            log.error("cannot keep the leader's managed servers and facts in %s: %s", self.state.path, exc)

    def _bundle(self) -> bytes:
        from reconciler.loop.leader import pack

        kept, self._serialized = self._serialized, None
        data = kept[2] if kept is not None and kept[0] is self.learned and kept[1] == self.learned.ticks else None
        return pack(data or self.learned.to_bytes(), {"managed": self.state.managed(), "facts": self.facts})

    async def _publish_state(self) -> None:
        """The leader's learned state after its interval, for a standby to serve from and take over."""
        election, channel = self.election, self.channel
        if election is None or channel is None or not election.is_leader:
            self._serialized = None  # not published after all: the ~40 MB are not kept
            return
        from reconciler.loop.leader import EtcdFailure, failure

        try:
            blob = await asyncio.to_thread(self._bundle)
            meta = {"by": election.identity, "ticks": self.learned.ticks, "last_tick": self.learned.last_tick}
            generation = await channel.publish(election.guard(), election.fence, blob, meta)
        except EtcdFailure as exc:
            self._state_trouble(f"cannot publish the learned state: {failure(exc)}")
            return
        if generation is None:
            self._state_trouble("the learned state was not published: this controller no longer leads")
            return
        self._state_error = ""
        self._state_generation, self._state_pointer = generation, {**meta, "generation": generation, "fence": election.fence}
        self._state_seen = self.clock.monotonic()  # the newest state is ours: a deposed leader stays healthy as long as a standby

    async def _follow_tick(self) -> Verdicts | None:
        """A standby's interval: the leader's newest published state, served read-only — the live answers, the
        files, the metrics view — from this controller's own checkout of the file; no collection, plan or apply."""
        self._tick_index += 1
        fresh = await self._read_state()
        cluster, now = self.cluster, self.clock.time()
        try:
            verdicts = self.learned.current_verdicts(cluster, now)
            snap = snapshot(cluster, self.learned, with_reality_keys(self.facts, cluster, self.secret), now, verdicts)
            self.answers.publish(snap)
            live = getattr(self, "live", None)  # worker processes answering the public port, when there are
            if live is not None:
                live.publish(snap)
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

    def _standby_health(self) -> tuple[bool, str]:
        """A standby is healthy while the leader's state keeps arriving (it serves from it)."""
        assert self.election is not None
        interval = self.cluster.settings.health.report_interval
        leader = self.election.leader or "none yet"
        if not self._state_seen:
            late = self.clock.time() - self._started > 3 * interval + 60
            return (not late, f"standby (leader: {leader}): no state published yet" + (" (late)" if late else ""))
        age = self.clock.monotonic() - self._state_seen
        if age > 3 * interval + 30:
            return False, (f"standby (leader: {leader}): the newest published state arrived {age:.0f}s ago "
                           f"(interval {interval:g}s){'; ' + self._state_error if self._state_error else ''}")
        return True, (f"ok: standby (leader: {leader}); state of interval {self._state_pointer.get('ticks')} "
                      f"arrived {age:.0f}s ago")

    async def _leader_stop(self) -> None:
        """On the way out: a leader publishes its last state and resigns, so a standby leads at its next look."""
        election, channel = self.election, self.channel
        if election is None or channel is None:
            return
        if election.is_leader:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._publish_state(), max(5.0, election.ttl))
            await election.resign()
        election.close()
        channel.close()


def _sent_secrets(req: Mapping[str, Any]) -> Redactor:
    """A redactor of the secrets an agent request carries: the clash API's, the device salt, and every string of
    the app probes' client configuration (the probe credential)."""
    found = [str(req.get("clash_secret") or ""), str(req.get("device_salt") or "")]

    def strings(value: object) -> None:
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, Mapping):
            for v in value.values():
                strings(v)
        elif isinstance(value, list | tuple):
            for v in value:
                strings(v)

    strings(req.get("app"))
    return Redactor.of(v for v in found if len(v) >= 8)


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
