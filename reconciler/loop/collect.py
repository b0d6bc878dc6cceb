"""The interval's collection: one agent report per server, and how far each report is believed.

``Collection`` is the first reconciler of an interval (collect → fold → snapshot): ``collect`` asks every server
that is not backing off for its report (one ``Script`` through the loop's ``Runner``, bounded by the interval)
and parses it at the edge; ``trust`` says which users each server may report on (a server is believed only
about the users the last answers sent to it); ``answered`` keeps what that needs of the interval's answers.
It logs what changes between intervals (a server that stops or starts reporting, sessions failing behind
passing handshakes, rows not believed), never a line per interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from reconciler import gcpause
from reconciler.backoff import Backoff, Streaks
from reconciler.balance import Snapshot
from reconciler.balance.decide import failover_servers
from reconciler.credentials import DEVICE_KEY_PERIOD, Redactor, Secret, clash_api_secret, device_fingerprint_key
from reconciler.engine import remote
from reconciler.engine.base import mark_key
from reconciler.engine.capabilities import of_engine
from reconciler.errors import (
    ConnectError,
    HostKeyChanged,
    RemoteCommandError,
    RemoteError,
    ReportError,
    SessionLost,
    is_temporary,
)
from reconciler.fleet.app_probe import AppTarget, probe_targets
from reconciler.fleet.reports import AppProbing, Report, agent_request, asked_probes, parse_report
from reconciler.fleet.usage import Ledger, Trust
from reconciler.loop.clock import Clock
from reconciler.metrics import LoopStats
from reconciler.model import Cluster, Server
from reconciler.ssh import Result, Runner, Target
from reconciler.text import size_text

log = logging.getLogger("reconciler.loop")
#: A server that did not report is asked again next interval, then after 2, 4 … at most 16 intervals more.
SERVER_BACKOFF = Backoff(first=2, cap=16, free=1)


class Collection:
    """Collect every server's report, and say how far each is believed (see the module)."""

    def __init__(self, secret: Secret, clock: Clock, stats: LoopStats) -> None:
        self.secret = secret
        self.clock = clock
        self.stats = stats
        self.backoff: Streaks[str] = Streaks(SERVER_BACKOFF)  # per server, counted in intervals
        self._mark_key = mark_key(secret)  # the users' marks: the counters are read under the same key
        self._device_store_key = secret.derive("device-store")  # what is kept of device fingerprints: ours alone
        self._device_day = 0  # the day of the key this interval's device fingerprints are made with
        self._app_targets: tuple[Cluster, dict[str, AppTarget], dict[str, frozenset[str]]] | None = None
        self._session_failures: dict[tuple[str, str], str] = {}  # (witness, inbound) → how its session fails
        self._local_probe_errors: dict[str, str] = {}  # witness → why its own probe client did not run
        self._reach: Snapshot | None = None  # the last answers: where users' failover orders send them
        self._reach_before: Snapshot | None = None  # the answers before those (apps follow them for a while)
        self._refused: dict[str, int] = {}  # server → rows not believed, as last logged
        #: server → why its last collection gave no report (``silence``): what status views say of a silent server
        self.silent: dict[str, str] = {}
        #: server → why the last interval has no report of it (``silent``, or backing off after it)
        self.unreported: dict[str, str] = {}

    # ------------------------------------------------------------------ collect

    async def collect(self, runner: Runner, cluster: Cluster, index: int,
                      applied: frozenset[str]) -> dict[str, Report | None]:
        """Interval ``index``'s report of every server (None: no report, with the reason logged once);
        ``applied``: the servers with no change left to apply (their configurations hold the probe credential)."""
        interval = cluster.settings.health.report_interval
        probe_timeout = max(0.5, min(3.0, interval / 4))
        budget = max(5.0, min(0.8 * interval, 60.0))

        app = self._app_probing(cluster, probe_timeout, applied)
        self._device_day = int(self.clock.time() // DEVICE_KEY_PERIOD)
        device_key = device_fingerprint_key(self.secret, self._device_day)

        async def one(server: Server) -> tuple[str, Report | None]:
            name = server.name
            if not self.backoff.ready(name, index):
                skipped.add(name)
                return name, None  # backing off: why it is silent stays what it was
            req = agent_request(cluster, name, clash_api_secret(self.secret, name), probe_timeout, device_key,
                                interval=index, app=app)
            answered = False
            try:
                async with asyncio.timeout(budget + 2):  # not wait_for: no task of its own per server and interval
                    res = await _agent(runner, server, req, budget)
                answered = True
                with gcpause.paused():
                    report = parse_report(name, res.stdout, self.clock.time(), asked_probes(req))
            except Exception as exc:  # one server's failure, whatever it is, is that server's no_data
                wait = int(self.backoff.failed(name, index + 1, is_temporary(exc)))  # from the next interval
                self.stats.server_error(name)
                self.silent[name] = silence(exc, answered, budget + 2)
                expected = isinstance(exc, RemoteError | ReportError | OSError | TimeoutError)
                log.log(logging.WARNING if expected else logging.ERROR, "%s: no report this interval: %s%s", name,
                        str(exc) or type(exc).__name__, f"; next try in {wait + 1} interval(s)" if wait else "",
                        exc_info=not expected)
                return name, None
            self.silent.pop(name, None)
            if self.backoff.succeeded(name):
                log.info("%s: reporting again", name)
            return name, report

        skipped: set[str] = set()
        results = dict(await asyncio.gather(*(one(s) for s in cluster.servers)))
        self.unreported = {name: (f"backing off after: {self.silent.get(name, 'a failure')}" if name in skipped
                                  else self.silent.get(name, "no report")) for name, rep in results.items() if rep is None}
        for name in [n for n in self.silent if n not in results]:  # servers that left the file
            del self.silent[name]
        self._tell_sessions(results)
        return results

    def _app_probing(self, cluster: Cluster, probe_timeout: float, applied: frozenset[str]) -> AppProbing:
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
        return AppProbing(targets, applied, lacks, timeout=max(2.0, 2 * probe_timeout))

    # ------------------------------------------------------------------ trust

    def trust(self, cluster: Cluster, start: Snapshot | None = None) -> Trust:
        """How this interval's reports are believed: each server only about the users the last answers sent to it
        (their failover orders as the last two answers give them, so a server that left rotation for an interval,
        an engine's restart, still counts what its users carried; ``start``: the answers after a start, a takeover
        or a reload, as the restored state gives them).

        A user's orders are looked up where the report names it, the last answers first: nothing is kept per user
        beyond the call (a million users' sets of servers were ~0.4 GB an interval)."""
        if start is not None:
            self.answered(start)

        def reach(server: str, names: list[str]) -> np.ndarray:
            answers = [a for a in (self._reach, self._reach_before) if a is not None]
            out = np.zeros(len(names), bool)
            for i, name in enumerate(names):
                out[i] = any(server in failover_servers(a, name) for a in answers)
            return out
        return Trust(self._mark_key, reach, self._device_store_key, device_epoch=self._device_day)

    def needs_start(self, cluster: Cluster) -> bool:
        """Whether the trust has no answers made for ``cluster`` (a start, a takeover or a reload)."""
        return self._reach is None or self._reach.cluster is not cluster

    def answered(self, snap: Snapshot) -> None:
        """The interval's answers: what the next intervals believe servers about."""
        self._reach_before, self._reach = self._reach, snap

    @property
    def last_answers(self) -> Snapshot | None:
        return self._reach

    # ------------------------------------------------------------------ what changes is told once

    def tell_refused(self, ledger: Ledger) -> None:
        """Log a server whose report claims traffic of users the controller never sent to it (once, and when it
        stops): such rows are not counted (a server is believed only about itself)."""
        now = {server: users for server, (users, _nbytes) in ledger.refused.items()}
        for server, users in now.items():
            if server not in self._refused:
                log.warning("%s reports traffic of %d user(s) the controller did not send to it, or no longer serves "
                            "(%s): not counted; a server that does this every interval may be compromised", server,
                            users, size_text(ledger.refused[server][1]))
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


def silence(exc: BaseException, answered: bool, waited: float) -> str:
    """Why a server gave no report, as status views say it: it could not be reached over SSH, its agent did not
    answer (or exited), or its answer was refused."""
    text = " ".join((str(exc) or type(exc).__name__).split())[:240]
    if answered:  # the agent answered: what it said was not a report this controller believes
        return f"report refused: {text}"
    if isinstance(exc, SessionLost):  # connected: the agent's session ended without an answer
        return f"agent silent: {text}"
    if isinstance(exc, ConnectError | HostKeyChanged) or (isinstance(exc, OSError) and not isinstance(exc, TimeoutError)):
        return f"SSH unreachable: {text}"
    if isinstance(exc, TimeoutError):
        return f"agent silent: no answer within {waited:.0f}s"
    if isinstance(exc, RemoteError | ReportError):
        return f"agent silent: {text}"
    return f"collection failed: {type(exc).__name__}"


async def _agent(runner: Runner, server: Server, req: dict[str, Any], budget: float) -> Result:
    """The agent's answer on ``server`` (a ``Script`` like every other: the fake host answers it too)."""
    try:
        return await runner.script(Target.from_server(server), remote.AGENT, req, timeout=budget)
    except RemoteCommandError as exc:
        hint = " (the agent is not installed yet: apply first)" if "No such file" in exc.stderr else ""
        # What a server says is logged: never the secrets it was sent (a broken agent may echo its request).
        said = sent_secrets(req)(exc.stderr.strip()[-300:], structural=True)
        raise ReportError(f"the agent exited {exc.code}{hint}: {said}") from None


def sent_secrets(req: Mapping[str, Any]) -> Redactor:
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
