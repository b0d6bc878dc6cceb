"""Agent reports → typed values → the health engine's ``Observation`` (pure, time passed in).

The agent (``reconciler/engine/agent.py``) stays dumb: it returns raw counters
and probe results. Everything that decides — what a report means, which probe
belongs to which witness/target pair, how counters become rates across engine
restarts — happens here, on the controller, where it is tested.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from reconciler.engine.adapters import adapter_of
from reconciler.engine.base import CLASH_API, USAGE_NFT, USAGE_TABLE
from reconciler.errors import ReportError
from reconciler.fleet.app_probe import AppTarget, app_request, dialable
from reconciler.health.engine import Observation
from reconciler.health.probing import ProbePlan, probe_plan
from reconciler.health.topology import Topology
from reconciler.model import Cluster, InboundRef

# Older nft versions print the numbers of families and transports (NFPROTO_IPV4 2, IPPROTO_TCP 6, ...).
NAMES = {"2": "ipv4", "10": "ipv6", "6": "tcp", "17": "udp"}

# The counters' kinds as numbers (0: a transport that carries no payload of the user's, such as ICMP).
KINDS = (None, ("ipv4", "tcp"), ("ipv6", "tcp"), ("ipv4", "udp"), ("ipv6", "udp"))


def _aliases(name: str) -> tuple[str, ...]:
    return (name, *[number for number, named in NAMES.items() if named == name])


KIND_OF = {(f, t): kind for kind, k in enumerate(KINDS) if k is not None for f in _aliases(k[0]) for t in _aliases(k[1])}


@dataclass(frozen=True)
class Probe:
    ok: bool  # the handshake probe
    rtt_ms: float | None = None
    error: str | None = None
    app: bool | None = None  # the app-like probe (HEALTH-16); None: not run, or the witness's own client failed
    app_bytes: int = 0
    app_error: str | None = None  # why it failed, or why it did not run (the witness's own client)

    @property
    def passed(self) -> bool:
        """What the verdicts count: the handshake, and the app-like probe where it ran."""
        return self.ok and self.app is not False

    @property
    def failure(self) -> str:
        """What failed, in a few words ("" when it passed)."""
        if not self.ok:
            return self.error or "failed"
        return f"handshake ok, then {self.app_error}" if self.app is False else ""


@dataclass(frozen=True)
class CounterRows:
    """Cumulative kernel counters, one row per (mark, IP version and transport as a ``KINDS`` number), as columns
    (a thousand servers' two million rows as tuples held ~600 MB until the fold)."""

    marks: np.ndarray  # int64, 32-bit marks
    kinds: np.ndarray  # int64, an index into KINDS (0: carries no payload of the user's)
    packets: np.ndarray  # int64
    nbytes: np.ndarray  # int64

    @classmethod
    def of(cls, rows: list[tuple[int, str, str, int, int]] | tuple[tuple[int, str, str, int, int], ...]) -> CounterRows:
        """Checked rows ``(mark, family, transport, packets, bytes)`` as columns."""
        n = len(rows)
        marks, families, transports, packets, nbytes = zip(*rows, strict=True) if n else ((),) * 5
        return cls(np.fromiter(marks, np.int64, n),
                   np.fromiter((KIND_OF.get(ft, 0) for ft in zip(families, transports, strict=True)), np.int64, n),
                   np.fromiter(packets, np.int64, n), np.fromiter(nbytes, np.int64, n))

    def __len__(self) -> int:
        return len(self.marks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CounterRows) and all(
            np.array_equal(getattr(self, k), getattr(other, k)) for k in ("marks", "kinds", "packets", "nbytes"))

    __hash__ = None  # type: ignore[assignment]


NO_ROWS = CounterRows.of(())


@dataclass(frozen=True)
class UsageCounters:
    """Cumulative kernel counters per (mark, IP version, transport)."""

    tx: CounterRows = NO_ROWS  # the server sent towards destinations: users' upload
    rx: CounterRows = NO_ROWS  # destinations sent to the server: users' download
    epoch: str = ""  # the boot and the table's identity: when it changes, the counters started again from zero


@dataclass(frozen=True)
class Report:
    server: str
    received: float  # controller clock
    service: str  # systemctl is-active
    listeners: dict[str, bool]  # "443/tcp" → listening
    traffic_bytes: int | None  # cumulative up + down from the engine, None when its API did not answer
    users: tuple[str, ...] = ()
    connections: int = 0
    probes: dict[str, Probe] = field(default_factory=dict)  # inbound id → result
    took_ms: float = 0.0
    usage: UsageCounters | None = None  # the kernel's per-user counters; None: not available (``usage_error``)
    usage_error: str = ""
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # user → client address fingerprints now
    unasked: int = 0  # probe results for inbounds this server was not asked to probe (left out: never votes)

    @property
    def service_ok(self) -> bool:
        return self.service == "active"


# Bounds on what one agent may send: far above a real fleet's reports (a server probes every other
# inbound once and lists the users it serves), far below what would hurt the controller.
MAX_REPORT_BYTES = 32 * 1024 * 1024
MAX_ENTRIES = 1_000_000
MAX_TEXT = 256
MAX_COUNTER = 2**63 - 1


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER:
        raise ReportError(f"`{what}` is not a non-negative integer: {str(value)[:40]!r}")
    return value


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ReportError(f"`{what}` is not a finite non-negative number: {str(value)[:40]!r}")
    return float(value)


def _text(value: object, what: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise ReportError(f"`{what}` is not text")
    return value[:limit]


def _mapping(value: object, what: str) -> dict[str, object]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ReportError(f"`{what}` is not an object")
    if len(value) > MAX_ENTRIES:
        raise ReportError(f"`{what}` has {len(value)} entries (at most {MAX_ENTRIES})")
    return value


def parse_report(server: str, text: str, received: float, asked: frozenset[str] | None = None) -> Report:
    """The agent's report (the last line of its output), checked field by field.

    The output is untrusted (a broken or hostile server can print anything): every field is
    checked for its type and bounds here, once, and anything wrong raises ``ReportError`` naming
    the field — that server then has no report this interval (no_data), and nothing downstream
    ever sees an unchecked value.

    ``asked``: the inbounds the server was asked to probe this interval (its row of the probe plan). Results for
    any other inbound are left out, so a server votes once per target it was asked about, and a rooted server
    cannot vote against the whole fleet (``Report.unasked`` counts them).
    """
    if len(text) > MAX_REPORT_BYTES:
        raise ReportError(f"the agent printed {len(text)} bytes (at most {MAX_REPORT_BYTES})")
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        raise ReportError("the agent printed nothing")
    try:
        raw = json.loads(lines[-1])
    except (ValueError, RecursionError) as exc:
        raise ReportError(f"the agent's output is not JSON: {str(exc)[:200]}") from None
    if not isinstance(raw, dict) or "service" not in raw:
        raise ReportError("the agent's output is not a report")
    traffic = raw.get("traffic")
    total = None  # the engine's API did not answer
    if traffic is not None:
        t = _mapping(traffic, "traffic")
        total = min(MAX_COUNTER, _whole(t.get("up", 0), "traffic.up") + _whole(t.get("down", 0), "traffic.down"))
    probes: dict[str, Probe] = {}
    unasked = 0
    for key, value in _mapping(raw.get("probes"), "probes").items():
        if asked is not None and key not in asked:
            unasked += 1
            continue
        if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
            raise ReportError(f"`probes.{key[:60]}` is not a probe result")
        rtt = value.get("rtt_ms")
        error = value.get("error")
        app, app_bytes, app_error = _app_result(value.get("app"), f"probes.{key[:60]}.app")
        probes[key] = Probe(value["ok"], None if rtt is None else _finite(rtt, f"probes.{key[:60]}.rtt_ms"),
                            None if error is None else _text(error, f"probes.{key[:60]}.error"),
                            app, app_bytes, app_error)
    listeners: dict[str, bool] = {}
    for key, value in _mapping(raw.get("listeners"), "listeners").items():
        if not isinstance(value, bool):
            raise ReportError(f"`listeners.{key[:40]}` is not true or false")
        listeners[key] = value
    users_raw = raw.get("users") or []
    if not isinstance(users_raw, list) or len(users_raw) > MAX_ENTRIES:
        raise ReportError("`users` is not a list of names")
    users = tuple(sorted(_text(u, "users[]") for u in users_raw))
    usage, usage_error = _usage(raw.get("usage"))
    devices: dict[str, tuple[str, ...]] = {}
    for user, fps in _mapping(raw.get("devices"), "devices").items():
        if not isinstance(fps, list) or len(fps) > 4096:
            raise ReportError(f"`devices.{user[:40]}` is not a list of fingerprints")
        devices[_text(user, "devices")] = tuple(_text(fp, f"devices.{user[:40]}[]", 64) for fp in fps)
    return Report(server=server, received=received, service=_text(raw["service"], "service", 64), listeners=listeners,
                  traffic_bytes=total, users=users, connections=_whole(raw.get("connections") or 0, "connections"),
                  probes=probes, took_ms=_finite(raw.get("took_ms") or 0.0, "took_ms"), usage=usage,
                  usage_error=usage_error, devices=devices, unasked=unasked)


def _app_result(raw: object, what: str) -> tuple[bool | None, int, str | None]:
    """An app-like probe's result: (passed, bytes, why); passed None when it did not run or the witness's own
    client failed (``local``: says nothing about the target)."""
    if raw is None:
        return None, 0, None
    app = _mapping(raw, what)
    if "local" in app:
        return None, 0, _text(app["local"], f"{what}.local")
    if not isinstance(app.get("ok"), bool):
        raise ReportError(f"`{what}` is not an app probe's result")
    error = app.get("error")
    return bool(app["ok"]), _whole(app.get("bytes") or 0, f"{what}.bytes"), None if error is None else _text(error, f"{what}.error")


def _usage(raw: object) -> tuple[UsageCounters | None, str]:
    """The per-user counters; a malformed part costs this interval's usage of that server, never its health report."""
    try:
        return _usage_checked(raw)
    except ReportError as exc:
        return None, f"unreadable per-user counters: {exc}"


def _proto(value: object, what: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # nft names the protocols it knows and numbers the others
    return _text(value, what, 16)


def _usage_checked(raw: object) -> tuple[UsageCounters | None, str]:
    if raw is None:
        return None, "the agent did not read per-user counters"
    value = _mapping(raw, "usage")
    if "error" in value:
        return None, _text(value["error"], "usage.error")
    if type(value.get("packed")) is int and value["packed"] == 1:  # agent 2
        return UsageCounters(tx=_packed_rows(value.get("tx"), "tx"), rx=_packed_rows(value.get("rx"), "rx"),
                             epoch=_text(value.get("epoch", ""), "usage.epoch")), ""
    rows: dict[str, CounterRows] = {}
    for side in ("tx", "rx"):
        items = value.get(side)
        if not isinstance(items, list) or len(items) > MAX_ENTRIES:
            raise ReportError(f"`usage.{side}` is not a list of counters")
        fast = _usage_rows_fast(items)
        if fast is not None:
            rows[side] = fast
            continue
        out = []  # the row-by-row check, which names what is wrong
        for row in items:
            if not isinstance(row, list) or len(row) != 5:
                raise ReportError(f"`usage.{side}[]` is not [mark, family, transport, packets, bytes]")
            mark = _whole(row[0], f"usage.{side}[].mark")
            if mark >= 2**32:
                raise ReportError(f"`usage.{side}[].mark` is not a 32-bit mark")
            out.append((mark, _proto(row[1], f"usage.{side}[].family"), _proto(row[2], f"usage.{side}[].transport"),
                        _whole(row[3], f"usage.{side}[].packets"), _whole(row[4], f"usage.{side}[].bytes")))
        rows[side] = CounterRows.of(out)
    return UsageCounters(tx=rows["tx"], rx=rows["rx"], epoch=_text(value.get("epoch", ""), "usage.epoch")), ""


_PACKED_COLUMNS = (("mark", "<u4"), ("kind", "u1"), ("packets", "<u8"), ("bytes", "<u8"))


def _packed_rows(raw: object, side: str) -> CounterRows:
    """Agent 2's packed counters (``reconciler.engine.agent.packed``): the (family, transport) pairs and four
    base64 columns of little-endian numbers, each checked whole (its length, every index and counter in range)."""
    value = _mapping(raw, f"usage.{side}")
    dropped = value.get("dropped", 0)
    if dropped != 0:  # as agent 1's rows would have been: the server's usage is unreadable this interval, and says why
        raise ReportError(f"the agent could not read {_whole(dropped, f'usage.{side}.dropped')} of the kernel's "
                          f"`{side}` counter rows (an nft whose output this agent does not know?)")
    n = value.get("rows")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_ENTRIES:
        raise ReportError(f"`usage.{side}.rows` is not a count of counters")
    pairs = value.get("kinds")
    if not isinstance(pairs, list) or len(pairs) > 255 or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ReportError(f"`usage.{side}.kinds` is not a list of [family, transport]")
    table = np.array([KIND_OF.get((_proto(f, f"usage.{side}.kinds[]"), _proto(t, f"usage.{side}.kinds[]")), 0)
                      for f, t in pairs] or [0], np.int64)
    columns = []
    for name, dtype in _PACKED_COLUMNS:
        text = value.get(name)
        size = n * np.dtype(dtype).itemsize
        if not isinstance(text, str) or len(text) != 4 * -(-size // 3):  # base64's length for that many bytes
            raise ReportError(f"`usage.{side}.{name}` is not {n} packed numbers")
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ReportError(f"`usage.{side}.{name}` is not base64") from None
        if len(data) != size:
            raise ReportError(f"`usage.{side}.{name}` is not {n} packed numbers")
        columns.append(np.frombuffer(data, dtype))
    marks, index, packets, nbytes = columns
    if n and (index.max() >= len(pairs) or packets.max() > MAX_COUNTER or nbytes.max() > MAX_COUNTER):
        raise ReportError(f"`usage.{side}` holds a kind index or a counter out of range")
    return CounterRows(marks.astype(np.int64), table[index], packets.astype(np.int64), nbytes.astype(np.int64))


def _usage_rows_fast(items: list[object]) -> CounterRows | None:
    """The same checks as the row-by-row loop, column by column and in C where it can be (a thousand servers' two
    million counters every interval); None when any row fails them or is not in the common form (names, not
    numbers): the loop then checks again and says which field is wrong."""
    if not items:
        return NO_ROWS
    if set(map(type, items)) != {list} or set(map(len, items)) != {5}:  # type: ignore[arg-type]
        return None
    marks, families, transports, packets, nbytes = zip(*items, strict=True)
    columns = []
    for column, bound in ((marks, 2**32 - 1), (packets, MAX_COUNTER), (nbytes, MAX_COUNTER)):
        if set(map(type, column)) != {int}:  # not bool, float or a number in a string
            return None
        try:
            values = np.fromiter(column, np.int64, len(column))
        except OverflowError:
            return None
        if values.min() < 0 or values.max() > bound:
            return None
        columns.append(values)
    if set(map(type, families)) != {str} or set(map(type, transports)) != {str}:  # numbers: the loop names them
        return None
    pairs = set(zip(families, transports, strict=True))
    if any(len(f) > 16 or len(t) > 16 for f, t in pairs):
        return None
    kind = {p: KIND_OF.get(p, 0) for p in pairs}
    kinds = np.fromiter(map(kind.__getitem__, zip(families, transports, strict=True)), np.int64, len(items))
    return CounterRows(columns[0], kinds, columns[1], columns[2])


def probe_kind(protocol: str) -> str:
    """How a client's first packets look: TLS handshake, bare TCP (Shadowsocks), or QUIC."""
    if protocol in ("hysteria2", "tuic"):
        return "quic"
    if protocol == "shadowsocks-2022":
        return "tcp"
    return "tls"


@dataclass(frozen=True)
class _Probing:
    """A cluster's topology and its inbounds by server, kept for the interval's N requests."""

    cluster: Cluster
    topology: Topology
    index: dict[str, int]  # server name → index
    inbounds_of: tuple[tuple[InboundRef, ...], ...]  # per server index, in file order
    probes_of: tuple[tuple[dict[str, object], ...], ...]  # per server index: the probe entries of its inbounds
    plans: dict[int, ProbePlan] = field(default_factory=dict)  # the last interval's plan (one entry)

    def plan(self, interval: int) -> ProbePlan:
        """This interval's probe plan, made once for the interval's N requests."""
        got = self.plans.get(interval)
        if got is None:
            got = probe_plan(self.topology, interval, self.cluster.settings.health)
            self.plans.clear()
            self.plans[interval] = got
        return got


_probing: list[_Probing] = []  # the last cluster's (one entry): every agent_request of an interval shares it


def _probing_of(cluster: Cluster) -> _Probing:
    if _probing and _probing[0].cluster is cluster:
        return _probing[0]
    topology = Topology.from_cluster(cluster)
    index = {name: i for i, name in enumerate(topology.servers)}
    by_server: list[list[InboundRef]] = [[] for _ in topology.servers]
    for ref in cluster.inbounds:
        by_server[index[ref.server.name]].append(ref)
    entry = _Probing(cluster, topology, index, tuple(tuple(refs) for refs in by_server),
                     tuple(tuple(_probe_entry(ref) for ref in refs) for refs in by_server))
    _probing[:] = [entry]
    return entry


def _probe_entry(ref: InboundRef) -> dict[str, object]:
    """How one inbound is probed (the request's entry; shared by every request that probes it: read only)."""
    ib = ref.inbound
    entry: dict[str, object] = {"id": ib.id, "host": ref.server.host, "port": ib.port, "kind": probe_kind(ib.protocol)}
    if ib.protocol == "vless-reality":
        entry["sni"] = ib.camouflage  # a public site's name: without it the site behind REALITY may refuse
    # Our own TLS inbounds are asked without a server name: the handshake probe tells whether the port and the TLS
    # stack answer, and the app-like probe (HEALTH-16) sends what an app sends. A witness does not announce the name
    # in clear every interval, and a censor that resets on the name shows as "handshake ok, then reset".
    return entry


@dataclass(frozen=True)
class AppProbing:
    """What the app-like probes of one interval need (HEALTH-16, ``reconciler.fleet.app_probe``)."""

    targets: dict[str, AppTarget]  # inbound id → how a client dials it with the probe credential
    applied: frozenset[str] | None = None  # servers whose configuration holds the probe credential; None: all
    lacks: dict[str, frozenset[str]] = field(default_factory=dict)  # engine → capabilities its build lacks
    timeout: float = 6.0


def asked_probes(request: Mapping[str, object]) -> frozenset[str]:
    """The inbounds an ``agent_request`` asks its server to probe (what its report may vote on)."""
    probes = request.get("probes")
    return frozenset(str(p["id"]) for p in probes if isinstance(p, dict)) if isinstance(probes, list) else frozenset()


def agent_request(cluster: Cluster, server_name: str, clash_secret: str, timeout: float,
                  device_salt: str = "", interval: int = 0, app: AppProbing | None = None) -> dict[str, object]:
    """What one server's agent is asked: its own listeners, and the inbounds it probes in interval ``interval``.

    Which servers it probes is the probe plan's row for it (``reconciler.health.probing``, HEALTH-4): every
    other server in a fleet of up to ``full_mesh_up_to``, a bounded, rotating set above. With ``app``, the
    inbounds its engine can dial on servers that hold the probe credential are also probed through a real
    proxy session (HEALTH-16).
    """
    server = cluster.server(server_name)
    listeners = sorted({(ib.port, t) for ib in server.inbounds for t in ib.transports})
    probing = _probing_of(cluster)
    witness = probing.index[server_name]
    targets = probing.plan(interval).targets_of(witness).tolist()
    probes = [entry for target in targets for entry in probing.probes_of[target]]
    layout = adapter_of(cluster, server).layout
    app_part = None
    nbytes = cluster.settings.health.app_probe_bytes
    if app is not None and nbytes > 0:
        lacks = app.lacks.get(layout.name, frozenset())
        dial = [app.targets[ref.inbound.id] for target in targets for ref in probing.inbounds_of[target]
                if (app.applied is None or ref.server.name in app.applied) and ref.inbound.id in app.targets
                and dialable(layout.name, ref.inbound.protocol, lacks)]
        app_part = app_request(layout.name, layout.binary, dial, nbytes, app.timeout)
    return {"service": layout.service, "listeners": [list(x) for x in listeners], "clash_api": CLASH_API,
            "clash_secret": clash_secret, "probes": probes, "timeout": timeout, "device_salt": device_salt,
            "usage_table": USAGE_TABLE, "usage_load": USAGE_NFT, **({"app": app_part} if app_part else {})}


def observation(topology: Topology, cluster: Cluster, reports: dict[str, Report | None], now: float) -> Observation:
    """The arrays the verdict engine reads, from whichever reports arrived this interval. A server speaks for itself
    (its service and listeners) and, as a witness, once per inbound it probed; never about its own inbounds."""
    n, m = topology.n, topology.m
    server_index = {s: i for i, s in enumerate(topology.servers)}
    inbound_index = {t: j for j, t in enumerate(topology.inbounds)}
    reported = np.zeros(n, dtype=bool)
    service_ok = np.ones(n, dtype=bool)
    listener_ok = np.ones(m, dtype=bool)
    present = np.zeros((n, m), dtype=bool)
    ok = np.zeros((n, m), dtype=bool)
    rtt = np.full((n, m), np.nan)
    for name, rep in reports.items():
        w = server_index.get(name)
        if w is None or rep is None:
            continue
        reported[w] = True
        service_ok[w] = rep.service_ok
        for t_id, probe in rep.probes.items():
            t = inbound_index.get(t_id)
            if t is None or topology.inbound_server[t] == w:
                continue
            present[w, t] = True
            ok[w, t] = probe.passed
            if probe.ok and probe.rtt_ms is not None:
                rtt[w, t] = probe.rtt_ms
    for t_id, t in inbound_index.items():
        ref = cluster.inbound(t_id)
        rep = reports.get(topology.servers[topology.inbound_server[t]])
        if ref is None or rep is None:
            continue
        listener_ok[t] = all(rep.listeners.get(f"{ref.inbound.port}/{tr}", False) for tr in ref.inbound.transports)
    return Observation(now=now, reported=reported, service_ok=service_ok, listener_ok=listener_ok,
                       probe_present=present, probe_ok=ok, probe_rtt_ms=rtt)


@dataclass(frozen=True)
class Counter:
    """The last cumulative byte counter seen from a server, and when."""

    value: int
    at: float


def traffic_rate(previous: Counter | None, value: int | None, at: float) -> tuple[float | None, Counter | None]:
    """Mbps since the previous sample, and the new counter to keep.

    A counter that went down means the engine restarted (its counters start at
    zero): that interval has no rate, and counting starts again from the new
    value. No previous sample, or no time between samples: no rate either.
    """
    if value is None:
        return None, previous
    current = Counter(value, at)
    if previous is None or value < previous.value or at <= previous.at:
        return None, current
    return (value - previous.value) * 8 / 1e6 / (at - previous.at), current
