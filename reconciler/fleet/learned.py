"""What the loop learns between intervals, and how it survives a restart.

``Learned`` carries the verdict engine's state (streaks, loss estimates,
hysteresis), capacity peaks (LB-3), traffic counters, RTT EWMAs per witness and
target (STEER-3), the users' assignments (stickiness, LB-6) and the last
reports. ``fold`` advances it by one interval (pure: time and reports passed
in); ``to_bytes``/``from_bytes`` are its persisted form, which the state
folder (``reconciler.state.folder``) writes atomically and reads back.

A persisted state is untrusted when it is read back (a file, or what a leader published): ``state_arrays``
reads every array's header before its data and refuses an archive or array that would inflate past
``MAX_STATE_BYTES`` or ``MAX_ARRAY_BYTES``, and ``from_bytes`` checks every array's kind, shape and
finiteness against what the state says it holds (``_check``). ``restore`` makes any failure a fresh start
that names the file and what was wrong.

When the cluster file changes which servers or inbounds exist, the state is
carried over by name: a new server starts fresh, the others keep their
streaks and peaks.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zstandard

from reconciler.balance import RTTProfile, ServerLoad
from reconciler.balance.assignments import Assignments
from reconciler.balance.capacity import CapacityEstimator
from reconciler.errors import StateRefused
from reconciler.fleet.history import History
from reconciler.fleet.reports import Counter, Report, observation, traffic_rate
from reconciler.fleet.usage import Ledger, Trust
from reconciler.health.engine import HealthEngine, HealthState
from reconciler.health.topology import Topology
from reconciler.health.verdicts import Verdicts
from reconciler.model import Cluster

FORMAT = 3  # 3: the assignments as one column per route; 2: the users' ledger and the assignments as arrays; 1: as JSON
READS = (1, 2, FORMAT)
# Which axes the engine's arrays run along: s = servers (witnesses), m = inbounds (targets).
_HEALTH_AXES = {"fail": "sm", "hazard": "s", "cont": "s", "hazard_n": "s", "cont_n": "s", "judged": "s", "last_report": "s",
                "last_service_ok": "s", "last_listener_ok": "m", "unreach_on": "m", "unreach_clear": "m",
                "unreach_scope": "m", "blocked_on": "m", "blocked_clear": "m", "flap": "m"}


#: Why a server has no data when the loop never ran with this state (a new checkout, `status` before `run`).
NOT_RUN = "not collected yet: `reconciler run` has not run with this state folder"


@dataclass
class Learned:
    topology: Topology
    health: HealthState
    capacity: CapacityEstimator
    rtt_ewma: np.ndarray  # (N, M) ms, NaN = no sample yet
    rtt_first: np.ndarray  # (N, M) time of the first sample
    rtt_last: np.ndarray  # (N, M) time of the last sample
    counters: dict[str, Counter] = field(default_factory=dict)
    traffic_mbps: dict[str, float] = field(default_factory=dict)
    connected: dict[str, list[str]] = field(default_factory=dict)  # server → users with open connections
    assignments: Mapping[tuple[str, str], str] = field(default_factory=dict)  # an Assignments once balanced
    bytes_total: dict[str, int] = field(default_factory=dict)  # server → bytes the engine carried, across restarts
    ledger: Ledger = field(default_factory=Ledger)  # per-user traffic, devices, demand (reconciler.fleet.usage)
    last_tick: float = 0.0
    ticks: int = 0
    silent: dict[str, str] = field(default_factory=dict)  # server → why the controller had no report from it
    history: History = field(default_factory=History)  # each server's verdict changes, the last week of them

    @classmethod
    def fresh(cls, cluster: Cluster) -> Learned:
        topo = Topology.from_cluster(cluster)
        n, m = topo.n, topo.m
        return cls(topology=topo, health=HealthState.initial(topo),
                   capacity=CapacityEstimator.empty(n, cluster.settings.balance.capacity_half_life),
                   rtt_ewma=np.full((n, m), np.nan), rtt_first=np.full((n, m), np.nan), rtt_last=np.full((n, m), np.nan))

    # ------------------------------------------------------------------ one interval

    def fold(self, cluster: Cluster, reports: dict[str, Report | None], now: float,
             trust: Trust | None = None, silent: Mapping[str, str] | None = None) -> Verdicts:
        """Advance by one interval: verdicts, traffic rates, capacity peaks, RTT EWMAs, and the users' usage (with
        ``trust``: each server believed only about itself, ``reconciler.fleet.usage.Trust``); ``silent``: why
        each server without a report gave none, as the collection saw it (kept: status views say it)."""
        topo = self.topology
        if silent is not None:
            self.silent = {k: v for k, v in silent.items() if k in topo.servers}
        obs = observation(topo, cluster, reports, now)
        engine = HealthEngine(topo, cluster.settings.health, self.health)
        verdicts = engine.evaluate(obs)
        verdicts.silence = self.silent
        self.history.observe(verdicts, now)
        rates = np.zeros(topo.n)
        valid = np.zeros(topo.n, dtype=bool)
        for i, name in enumerate(topo.servers):
            rep = reports.get(name)
            if rep is None:
                continue
            previous = self.counters.get(name)
            rate, counter = traffic_rate(previous, rep.traffic_bytes, rep.received)
            if rate is not None and previous is not None and counter is not None:  # an engine restart adds nothing
                self.bytes_total[name] = self.bytes_total.get(name, 0) + counter.value - previous.value
            if counter is not None:  # an engine whose API did not answer has no counter (yet): keep none
                self.counters[name] = counter
            if rate is not None:
                rates[i], valid[i] = rate, True
                self.traffic_mbps[name] = rate
            self.connected[name] = list(rep.users)
        if trust is not None:  # each server's rows bounded by its capacity as learned before this interval's reports
            cap = self.capacity.estimate(now)
            trust = replace(trust, capacity_mbps={name: float(cap[i]) for i, name in enumerate(topo.servers)})
        self.ledger.fold(cluster, reports, now, self.assignments, trust)
        self.capacity.observe(now, rates, valid)
        self._fold_rtt(obs.probe_rtt_ms, now, cluster.settings.steering.rtt_half_life)
        self.last_tick, self.ticks = now, self.ticks + 1
        return verdicts

    def _fold_rtt(self, rtt: np.ndarray | None, now: float, half_life: float) -> None:
        if rtt is None:
            return
        have = ~np.isnan(rtt)
        dt = np.where(np.isnan(self.rtt_last), np.inf, now - self.rtt_last)
        alpha = 1.0 - np.exp2(-np.maximum(dt, 0.0) / half_life)  # time-based: a gap weighs the new sample more
        first = have & np.isnan(self.rtt_ewma)
        self.rtt_ewma = np.where(first, rtt, np.where(have, self.rtt_ewma + alpha * (rtt - self.rtt_ewma), self.rtt_ewma))
        self.rtt_first = np.where(first, now, self.rtt_first)
        self.rtt_last = np.where(have, now, self.rtt_last)

    def current_verdicts(self, cluster: Cluster, now: float) -> Verdicts:
        """Verdicts as of ``now`` from the persisted state, without new reports (for `status`; state untouched)."""
        obs = observation(self.topology, cluster, {}, now)
        verdicts = HealthEngine(self.topology, cluster.settings.health, self.health.copy()).evaluate(obs)
        verdicts.silence = self.silent if self.ticks else dict.fromkeys(self.topology.servers, NOT_RUN)
        return verdicts

    # ------------------------------------------------------------------ what decisions read

    def loads(self, now: float) -> dict[str, ServerLoad]:
        cap = self.capacity.estimate(now)
        return {name: ServerLoad(traffic_mbps=self.traffic_mbps.get(name, 0.0), users=len(self.connected.get(name, ())),
                                 capacity_mbps=None if np.isnan(cap[i]) else float(cap[i]))
                for i, name in enumerate(self.topology.servers)}

    def witness_regions(self, cluster: Cluster) -> dict[str, list[int]]:
        """Region → indices of the witness servers in it (the rows of the RTT arrays)."""
        regions: dict[str, list[int]] = {}
        for i, name in enumerate(self.topology.servers):
            region = cluster.server(name).region
            if region:
                regions.setdefault(region, []).append(i)
        return regions

    def rtt_by_region(self, cluster: Cluster) -> dict[tuple[str, str], float]:
        """(witness region, inbound) → mean RTT EWMA of that region's witnesses, where any has data (metrics)."""
        out: dict[tuple[str, str], float] = {}
        for region, rows in self.witness_regions(cluster).items():
            block = self.rtt_ewma[rows]
            have = ~np.isnan(block)
            counts = have.sum(axis=0)
            sums = np.where(have, block, 0.0).sum(axis=0)
            for j, t in enumerate(self.topology.inbounds):
                if counts[j]:
                    out[(region, t)] = float(sums[j] / counts[j])
        return out

    def rtt_profiles(self, cluster: Cluster, now: float, stale_after: float) -> dict[tuple[str, str, str], RTTProfile]:
        """Mean RTT EWMA from the witnesses of each region to each (route, pool) (STEER-3)."""
        topo = self.topology
        col = {t: j for j, t in enumerate(topo.inbounds)}
        regions = self.witness_regions(cluster)
        out: dict[tuple[str, str, str], RTTProfile] = {}
        for route in cluster.effective_routes:
            pools: dict[str, list[int]] = {}
            for ref in cluster.members.get(route.id, ()):
                if ref.inbound.pool and ref.inbound.id in col:
                    pools.setdefault(ref.inbound.pool, []).append(col[ref.inbound.id])
            for region, rows in regions.items():
                for pool, cols in pools.items():
                    block = self.rtt_ewma[np.ix_(rows, cols)]
                    if np.isnan(block).all():
                        continue
                    since = np.nanmin(self.rtt_first[np.ix_(rows, cols)])
                    last = np.nanmax(self.rtt_last[np.ix_(rows, cols)])
                    out[(region, route.id, pool)] = RTTProfile(ewma_ms=float(np.nanmean(block)), seconds_of_data=float(now - since),
                                                               fresh=bool(now - last <= stale_after))
        return out

    # ------------------------------------------------------------------ topology changes

    def adopt(self, cluster: Cluster) -> Learned:
        """The same knowledge for a changed cluster: carried over by server and inbound name."""
        new = Learned.fresh(cluster)
        old, topo = self.topology, new.topology
        if old == topo:
            self.capacity.half_life = cluster.settings.balance.capacity_half_life
            self.ledger.adopt(cluster)
            return self
        rows = [(i, old.servers.index(s)) for i, s in enumerate(topo.servers) if s in old.servers]
        cols = [(j, old.inbounds.index(t)) for j, t in enumerate(topo.inbounds) if t in old.inbounds]
        ri, ro = (np.array(x, dtype=np.int64) for x in zip(*rows, strict=True)) if rows else (np.zeros(0, np.int64),) * 2
        ci, co = (np.array(x, dtype=np.int64) for x in zip(*cols, strict=True)) if cols else (np.zeros(0, np.int64),) * 2

        def carry(dst: np.ndarray, src: np.ndarray, axes: str) -> None:
            if axes == "sm":
                dst[np.ix_(ri, ci)] = src[np.ix_(ro, co)]
            elif axes == "s":
                dst[ri] = src[ro]
            else:
                dst[ci] = src[co]

        for name, value in vars(self.health).items():
            if isinstance(value, np.ndarray) and name in _HEALTH_AXES:
                carry(getattr(new.health, name), value, _HEALTH_AXES[name])
        new.health.fleet = self.health.fleet.copy()
        new.health.fleet_n = self.health.fleet_n.copy()
        # A regional verdict's country is an index into the codes of the fleet's countries: by code, not by index.
        codes = {code: k for k, code in enumerate(topo.country_codes)}
        remap = np.array([codes.get(code, -1) for code in old.country_codes] + [-1], dtype=np.int16)
        new.health.unreach_scope = remap[new.health.unreach_scope]
        new.health.evaluations = self.health.evaluations
        new.capacity.peak[ri] = self.capacity.peak[ro]
        new.capacity.peak_time[ri] = self.capacity.peak_time[ro]
        for name in ("rtt_ewma", "rtt_first", "rtt_last"):
            carry(getattr(new, name), getattr(self, name), "sm")
        keep = set(topo.servers)
        new.counters = {k: v for k, v in self.counters.items() if k in keep}
        new.bytes_total = {k: v for k, v in self.bytes_total.items() if k in keep}
        new.traffic_mbps = {k: v for k, v in self.traffic_mbps.items() if k in keep}
        new.connected = {k: v for k, v in self.connected.items() if k in keep}
        inbounds = set(topo.inbounds)
        held = self.assignments
        new.assignments = held.realigned(held.names, topo.inbounds) if isinstance(held, Assignments) else \
            {k: v for k, v in held.items() if v in inbounds}
        new.last_tick, new.ticks = self.last_tick, self.ticks
        new.silent = {k: v for k, v in self.silent.items() if k in keep}
        new.history = self.history.keep(keep)
        new.ledger = self.ledger
        new.ledger.adopt(cluster)
        return new

    # ------------------------------------------------------------------ persistence

    def to_bytes(self) -> bytes:
        ledger_meta, ledger_arrays = self.ledger.pack()
        held = _columns(self.assignments)
        meta = {
            "format": FORMAT, "servers": list(self.topology.servers), "inbounds": list(self.topology.inbounds),
            "countries": list(self.topology.countries), "probers": list(self.topology.probers),
            "regions": list(self.topology.regions),
            "inbound_server": list(self.topology.inbound_server),
            "counters": {k: [c.value, c.at] for k, c in self.counters.items()}, "traffic_mbps": self.traffic_mbps,
            "connected": self.connected, "bytes_total": self.bytes_total,
            "assignment_keys": list(held.columns), "assignment_inbounds": list(held.inbounds),
            "last_tick": self.last_tick, "ticks": self.ticks, "capacity_half_life": self.capacity.half_life,
            "usage": ledger_meta, "silent": self.silent, "history": self.history.to_json(),
        }
        arrays: dict[str, Any] = {f"h_{k}": v for k, v in vars(self.health).items() if isinstance(v, np.ndarray)}
        arrays.update(cap_peak=self.capacity.peak, cap_time=self.capacity.peak_time, rtt_ewma=self.rtt_ewma,
                      rtt_first=self.rtt_first, rtt_last=self.rtt_last,
                      h_evaluations=np.array(self.health.evaluations),
                      a_names=np.frombuffer("\n".join(held.names).encode(), np.uint8),
                      a_columns=np.array(list(held.columns.values()), np.int32).reshape(len(held.columns), len(held.names)),
                      meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        arrays.update({f"l_{k}": v for k, v in ledger_arrays.items()})
        return _npz(arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> Learned:
        values = state_arrays(data)
        text = _text_array(values.pop("meta"), "meta")
        meta = json.loads(text) if text else None
        if not isinstance(meta, dict):
            raise StateRefused("its meta array is not a JSON object")
        if meta.get("format") not in READS:
            raise ValueError(f"state format {meta.get('format')} is not {FORMAT}")
        topo = _topology(meta)
        _check(values, meta, topo)
        health = HealthState.from_arrays({k[2:]: v for k, v in values.items() if k.startswith("h_")}, topo)
        assignments: Mapping[tuple[str, str], str]
        if meta["format"] == 1:
            assignments = {(u, r): i for u, r, i in meta["assignments"]}
            ledger = Ledger.from_json(meta.get("usage"))
        else:
            assignments = _assignments(values, meta) if meta["format"] == 2 else _read_columns(values, meta)
            ledger = Ledger.unpack(meta["usage"], {k[2:]: v for k, v in values.items() if k.startswith("l_")})
        return cls(topology=topo, health=health,
                   capacity=CapacityEstimator(meta["capacity_half_life"], values["cap_peak"], values["cap_time"]),
                   rtt_ewma=values["rtt_ewma"], rtt_first=values["rtt_first"], rtt_last=values["rtt_last"],
                   counters={k: Counter(int(v[0]), float(v[1])) for k, v in meta["counters"].items()},
                   traffic_mbps=meta["traffic_mbps"], connected=meta["connected"],
                   bytes_total={str(k): int(v) for k, v in (meta.get("bytes_total") or {}).items()},
                   assignments=assignments, last_tick=meta["last_tick"], ticks=meta["ticks"], ledger=ledger,
                   silent=_silent(meta.get("silent"), topo), history=History.from_json(meta.get("history"), topo.servers))

    @classmethod
    def restore(cls, data: bytes | None, cluster: Cluster, where: str = "the learned state") -> tuple[Learned, str | None]:
        """The persisted state (``data``; None: none yet) adopted to ``cluster``, or a fresh one and why."""
        if data is None:
            return cls.fresh(cluster), None
        try:
            return cls.from_bytes(data).adopt(cluster), None
        except (ValueError, KeyError, TypeError, IndexError, OSError, EOFError, RecursionError, AttributeError,
                OverflowError, MemoryError) as exc:  # MemoryError: never expected (the sizes are checked first)
            return cls.fresh(cluster), f"ignoring unreadable {where} ({type(exc).__name__}: {exc}); starting afresh"


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_EXPANSION = 64  # a state frame may say it holds at most this many times its size (more: a bomb, refused)
MAX_STATE_BYTES = 512 << 20  # a whole state inflated (a million users' is ~120 MB); more is refused unread
MAX_ARRAY_BYTES = 256 << 20  # one array of it
MAX_ARRAYS = 256  # arrays in a state (it has about 40)
MAX_MESH_CELLS = 1 << 25  # servers × inbounds, servers × servers of the fleet a state declares (1000 × 3000: 3M)
READ_STEP = 1 << 20  # inflated and read in steps of this many bytes




def _npz(arrays: dict[str, Any]) -> bytes:
    """The arrays as an uncompressed ``.npz`` in one zstd frame (level 1): a million users' columns and two million
    counters took 1.3 CPU-s at zlib level 1 every interval, 0.3 s this way, and the file is smaller."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1, write_checksum=True).stream_writer(out, closefd=False) as frame:
        # Streamed: the archive is never whole in memory (at a million users it is ~120 MB). zipfile keeps the
        # archive's offsets from tell(): the uncompressed position, which the compressor's own tell() is not.
        with zipfile.ZipFile(_Counted(frame), "w", zipfile.ZIP_STORED) as zf:  # type: ignore[call-overload]
            for name, value in arrays.items():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)
    return out.getvalue()


class _Counted:
    """A write-only stream that says how many bytes went into it (zipfile's offsets), and cannot seek."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.written = raw, 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        self.raw.write(data)
        return len(data)

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        self.raw.flush()


def state_arrays(data: bytes) -> dict[str, np.ndarray]:
    """A learned state's arrays: a zstd frame of an ``.npz`` (``_npz``), or an ``.npz`` compressed by zip itself
    (states written before). Untrusted: anything malformed, or bigger than a state can be, raises ValueError
    (``StateRefused`` says what was wrong) before it is inflated or allocated."""
    if data[:4] == ZSTD_MAGIC:
        try:
            cap, out = min(MAX_EXPANSION * len(data), MAX_STATE_BYTES), io.BytesIO()
            with zstandard.ZstdDecompressor().stream_reader(data) as frame:  # in 1 MB steps: a bomb stops at cap
                while chunk := frame.read(READ_STEP):
                    out.write(chunk)
                    if out.tell() > cap:
                        raise StateRefused(f"its compressed frame inflates to more than {cap} bytes, more than it "
                                           "can have been written with")
            data = out.getvalue()
        except zstandard.ZstdError as exc:
            raise StateRefused(f"its compressed frame is broken: {exc}") from None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            return _read_archive(zf)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as exc:
        raise StateRefused(f"its archive is broken: {type(exc).__name__}: {exc}") from None


def _read_archive(zf: zipfile.ZipFile) -> dict[str, np.ndarray]:
    """Every ``<name>.npy`` member of a state's archive as an array. Sizes come from the archive's directory and
    each array's header, and are checked before anything is inflated or allocated; the data is then read in
    bounded steps, never past what was declared (a directory or header that lies cannot make it read more)."""
    infos = zf.infolist()
    if len(infos) > MAX_ARRAYS:
        raise StateRefused(f"its archive holds {len(infos)} members, more than the {MAX_ARRAYS} of a state")
    for info in infos:
        if info.file_size > MAX_ARRAY_BYTES:
            raise StateRefused(f"its member {info.filename!r} inflates to {info.file_size} bytes, more than the "
                               f"{MAX_ARRAY_BYTES} one array of a state may hold")
    total = sum(info.file_size for info in infos)
    if total > MAX_STATE_BYTES:
        raise StateRefused(f"its archive inflates to {total} bytes, more than the {MAX_STATE_BYTES} a state may hold")
    out: dict[str, np.ndarray] = {}
    for info in infos:
        name = info.filename.removesuffix(".npy")
        if name == info.filename or name in out or info.is_dir():
            raise StateRefused(f"its member {info.filename!r} is not one array of a state")
        with zf.open(info) as f:
            out[name] = _read_npy(f, info.file_size, name)
    return out


def _read_npy(f: Any, size: int, name: str) -> np.ndarray:
    """One ``.npy`` member of ``size`` bytes: its header first (``numpy.lib.format``), then exactly the data it
    declares, which must be what the member holds after the header."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            raise StateRefused(f"array {name}: .npy version {version} is not one a state is written in")
    except (ValueError, EOFError) as exc:
        raise StateRefused(f"array {name}: not an array's header ({exc})") from None
    if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize > 8:
        raise StateRefused(f"array {name} holds {dtype}, not booleans or numbers")
    if len(shape) > 2 or any(d < 0 for d in shape):
        raise StateRefused(f"array {name} has the shape {shape}; a state's arrays have at most two dimensions")
    nbytes = math.prod(shape) * dtype.itemsize
    held = size - f.tell()
    if nbytes != held:
        raise StateRefused(f"array {name} declares the shape {shape} of {dtype} ({nbytes} bytes) but holds {held} bytes")
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        chunk = f.read(min(READ_STEP, nbytes - got))
        if not chunk:
            raise StateRefused(f"array {name} ends after {got} of its {nbytes} bytes")
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    if f.read(1):
        raise StateRefused(f"array {name} holds more than its {nbytes} bytes")
    flat = np.frombuffer(buf, dtype)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def _text_array(value: np.ndarray, name: str) -> bytes:
    """The bytes of a text array (the meta document, users' names): one dimension of bytes."""
    if value.ndim != 1 or value.dtype != np.uint8:
        raise StateRefused(f"array {name} is not text (one dimension of bytes): {value.dtype}, shape {value.shape}")
    return value.tobytes()


def _topology(meta: dict[str, Any]) -> Topology:
    """The fleet a state was learned on, as its meta document says; refused when it is not lists of names of the
    same lengths, or bigger than ``MAX_MESH_CELLS`` (its (servers, inbounds) and (servers, servers) arrays)."""
    servers, inbounds = meta["servers"], meta["inbounds"]
    lists = (servers, meta["countries"], meta["probers"], inbounds, meta["inbound_server"], meta.get("regions") or [])
    if not all(isinstance(x, list) for x in lists):
        raise StateRefused("its fleet (servers, inbounds, countries) is not lists")
    n, m = len(servers), len(inbounds)
    if max(n, m) * n > MAX_MESH_CELLS:
        raise StateRefused(f"it declares {n} servers and {m} inbounds, more than a state can hold")
    if not all(isinstance(x, str) for x in (*servers, *inbounds, *meta["countries"], *(meta.get("regions") or []))):
        raise StateRefused("its servers, inbounds or countries are not names")
    at = meta["inbound_server"]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in at):
        raise StateRefused("its inbounds name servers it does not have")
    return Topology(servers=tuple(servers), countries=tuple(meta["countries"]), probers=tuple(bool(p) for p in meta["probers"]),
                    inbounds=tuple(inbounds), inbound_server=tuple(at), regions=tuple(meta.get("regions") or ()))


# The non-finite values an array of a state may hold, and what they mean there; every other value of every array
# is finite.
_NAN_MEANS_NONE = frozenset({"rtt_ewma", "rtt_first", "rtt_last", "cap_peak", "l_u_seen"})  # no sample / never
_MINUS_INF_MEANS_NEVER = frozenset({"h_last_report"})
_TEXT = ("a_names", "a_users", "l_u_names")


def _check(values: dict[str, np.ndarray], meta: dict[str, Any], topo: Topology) -> None:
    """Every array of a state read back as what ``to_bytes`` writes for the fleet ``topo``: the engine's, the
    capacities' and the RTTs' of the fleet's shape and kind (``HealthState.initial`` and ``fresh`` decide them),
    texts as bytes, and nothing non-finite where it has no meaning; the meta document's figures finite. Raises
    ``StateRefused`` naming the first array or figure that is not. (The assignments and the users' ledger check
    their own columns' lengths against each other as they are read.)"""
    n, m = topo.n, topo.m
    expected: dict[str, tuple[tuple[int, ...], str]] = {
        f"h_{k}": (v.shape, v.dtype.kind) for k, v in vars(HealthState.initial(topo)).items() if isinstance(v, np.ndarray)}
    expected |= {"h_evaluations": ((), "iu"), "cap_peak": ((n,), "f"), "cap_time": ((n,), "f"),
                 "rtt_ewma": ((n, m), "f"), "rtt_first": ((n, m), "f"), "rtt_last": ((n, m), "f")}
    for name in ("cap_peak", "cap_time", "rtt_ewma", "rtt_first", "rtt_last"):
        if name not in values:
            raise StateRefused(f"array {name} is missing")
    for name, value in values.items():
        shape, kinds = expected.get(name, (None, "biuf"))
        if name in _TEXT:
            _text_array(value, name)
            continue
        if shape is not None and (value.shape != shape or value.dtype.kind not in kinds):
            raise StateRefused(f"array {name} is {value.dtype} of shape {value.shape}; this state's fleet of {n} "
                               f"servers and {m} inbounds needs shape {shape}")
        if value.dtype.kind == "f":
            bad = ~np.isfinite(value)
            if name in _NAN_MEANS_NONE:
                bad &= ~np.isnan(value)
            elif name in _MINUS_INF_MEANS_NEVER:
                bad &= value != -np.inf
            if bad.any():
                raise StateRefused(f"array {name} holds {np.count_nonzero(bad)} values that are not finite numbers")
    scope = values.get("h_unreach_scope")
    if scope is not None and scope.size and not (-1 <= scope.min() and scope.max() < len(topo.country_codes)):
        raise StateRefused("array h_unreach_scope names countries the state's fleet does not have")
    figures = [meta["last_tick"], meta["capacity_half_life"], *dict(meta["traffic_mbps"]).values()]
    figures += [x for pair in dict(meta["counters"]).values() for x in list(pair)]
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in figures) or meta["capacity_half_life"] <= 0:
        raise StateRefused("its last interval, capacity half-life, traffic rates or counters are not finite numbers")


def _silent(value: object, topo: Topology) -> dict[str, str]:
    """Why servers were silent, as a state file says it: only the fleet's servers, short texts (hostile input: a
    state may come from etcd); anything else is left out."""
    if not isinstance(value, dict):
        return {}
    return {k: v[:300] for k, v in value.items() if isinstance(k, str) and k in topo.servers and isinstance(v, str)}


def _assignments(values: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[tuple[str, str], str]:
    text = values["a_users"].astype(np.uint8).tobytes().decode()
    users = text.split("\n") if text else []
    routes, inbounds = [str(r) for r in meta["assignment_routes"]], [str(t) for t in meta["assignment_inbounds"]]
    if any(values[k].ndim != 1 for k in ("a_users", "a_routes", "a_inbounds")):
        raise ValueError("the assignments' columns are not one-dimensional")
    r_at, t_at = values["a_routes"].tolist(), values["a_inbounds"].tolist()
    if not len(users) == len(r_at) == len(t_at) or min(r_at, default=0) < 0 or min(t_at, default=0) < 0:
        raise ValueError("the assignments' columns differ in length")
    return {(u, routes[r]): inbounds[t] for u, r, t in zip(users, r_at, t_at, strict=True)}


def _columns(held: Mapping[tuple[str, str], str]) -> Assignments:
    """Any assignments as columns (a plain mapping: its users in the order they first appear)."""
    if isinstance(held, Assignments):
        return held
    names = tuple(dict.fromkeys(u for u, _r in held))
    return Assignments.of(held, names, tuple(sorted(set(held.values()))))


def _read_columns(values: dict[str, np.ndarray], meta: dict[str, Any]) -> Assignments:
    text = values["a_names"].astype(np.uint8).tobytes().decode()
    names = tuple(text.split("\n")) if text else ()
    keys, inbounds = [str(k) for k in meta["assignment_keys"]], tuple(str(t) for t in meta["assignment_inbounds"])
    table = values["a_columns"]
    if table.ndim != 2 or table.shape != (len(keys), len(names)) or table.dtype != np.int32:
        raise ValueError("the assignments' columns do not fit their users and routes")
    if len(set(names)) != len(names):
        raise ValueError("the assignments' users are not unique")
    return Assignments(names, inbounds, {k: table[i].copy() for i, k in enumerate(keys)})  # checks each column's range
