"""Replay a scenario tick by tick through the verdict engine (``reconciler simulate``).

A scenario names a fleet (a cluster file, or inline servers with one inbound
each), a number of report intervals, a seed, iid or bursty probe loss, and
events that are active from ``at`` until ``until`` (exclusive). The same seed
and scenario always give the same timeline. Pure: the caller loads files.
Servers probe what the settings' probe plan asks of them each tick (the full
mesh up to ``full_mesh_up_to`` servers, bounded above).

Event kinds (one per event):
- ``block: {from: [a, b] | "*", to: c}`` — probes from those servers to c fail;
- ``down: s`` — s's service is not running: it reports so, and probes to it fail;
- ``listener_down: s`` — nothing listens on s's ports: reported, and probes fail;
- ``silent: s`` — no self-report from s (and so none of its probe results);
- ``outage: s`` — s is gone: silent, and probes to it fail;
- ``isolate: s`` — every probe s makes fails (a broken witness);
- ``loss: {p: 0.2, burst: 3}`` — extra probe loss on every pair, bursty when
  ``burst`` (mean burst length in ticks, Gilbert-Elliott) is given;
- ``reports_missing: {p: 0.5}`` — each server's report goes missing with probability p;
- ``flap: {server: s, period: 10, kind: unreachable}`` — s alternates unreachable (or, with
  ``kind: down``, service down) and fine every ``period`` ticks.

A scenario may also say what must come out (``expect``): at one tick (``at``) or at every tick
of a range (``during: [from, until)``), a server's (or every server's, ``server: "*"``) status,
rotation (for everyone, or ``in_rotation_for`` users of a region, HEALTH-15), marks (the exact
texts), words its reason must or must not contain, and how it was judged as a witness
(``unreliable``, ``censored``). ``expectations`` checks them; ``simulate`` reports them and
fails when one is not met, so a scenario file is a test of the rules it names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from reconciler.health.engine import HealthEngine, Observation
from reconciler.health.probing import probe_plan, uses_full_mesh
from reconciler.health.topology import Topology
from reconciler.health.verdicts import Verdicts
from reconciler.model.cluster import HealthSettings
from reconciler.model.regions import COUNTRY_REGION
from reconciler.model.types import Name


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class InlineServer(_M):
    name: Name
    country: str
    prober: bool = False

    @model_validator(mode="after")
    def _country(self) -> InlineServer:
        if self.country.upper() not in COUNTRY_REGION:
            raise ValueError(f"{self.country!r} is not an ISO 3166-1 alpha-2 country code")
        return self


class Block(_M):
    from_: list[Name] | Literal["*"] = Field(..., alias="from")
    to: Name | list[Name]


class Loss(_M):
    p: float = Field(..., ge=0, le=1)
    burst: float | None = Field(None, ge=1, description="Mean burst length in ticks (Gilbert-Elliott).")


class Missing(_M):
    p: float = Field(..., ge=0, le=1)


class Flap(_M):
    server: Name
    period: int = Field(..., ge=1)
    kind: Literal["unreachable", "down"] = Field("unreachable", description="What flaps: reachability or the service.")


class Event(_M):
    at: int = Field(0, ge=0)
    until: int | None = Field(None, ge=0)
    block: Block | None = None
    down: Name | None = None
    listener_down: Name | None = None
    silent: Name | None = None
    outage: Name | None = None
    isolate: Name | None = None
    loss: Loss | None = None
    reports_missing: Missing | None = None
    flap: Flap | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Event:
        kinds = [k for k in _KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"an event needs exactly one of: {', '.join(_KINDS)} (got {', '.join(kinds) or 'none'})")
        if self.until is not None and self.until <= self.at:
            raise ValueError("`until` must be after `at`")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)

    def active(self, tick: int) -> bool:
        return self.at <= tick and (self.until is None or tick < self.until)


_KINDS = ("block", "down", "listener_down", "silent", "outage", "isolate", "loss", "reports_missing", "flap")
Status = Literal["ok", "no_data", "blocked", "unreachable", "unavailable"]


class Expect(_M):
    """What one server (or ``*``: every server) must show at a tick, or at every tick of a range."""

    at: int | None = Field(None, ge=0)
    during: tuple[int, int] | None = Field(None, description="Every tick from the first up to (not including) the second.")
    server: Name | Literal["*"]
    status: Status | list[Status] | None = Field(None, description="The status, or one of these.")
    in_rotation: bool | None = None
    in_rotation_for: dict[str, bool] | None = Field(None, description="Region → in rotation for users of that region.")
    unreachable_from: str | None = Field(None, description="The country whose witnesses cannot reach it (regional).")
    marks: list[str] | None = Field(None, description="The texts of its marks, exactly (in any order).")
    reason: list[str] | None = Field(None, description="Words its reason contains.")
    not_in_reason: list[str] | None = Field(None, description="Words its reason must not contain.")
    unreliable: bool | None = None
    censored: bool | None = None

    @model_validator(mode="after")
    def _when(self) -> Expect:
        if (self.at is None) == (self.during is None):
            raise ValueError("an expectation needs exactly one of `at` (a tick) or `during` ([from, until))")
        if self.during is not None and not 0 <= self.during[0] < self.during[1]:
            raise ValueError("`during` is [from, until) with 0 <= from < until")
        return self

    def ticks(self) -> range:
        if self.during is not None:
            return range(*self.during)
        assert self.at is not None
        return range(self.at, self.at + 1)


class Scenario(_M):
    cluster: str | None = Field(None, description="Cluster file, relative to the scenario file.")
    servers: list[InlineServer] | None = None
    health: HealthSettings | None = Field(None, description="Thresholds; default: the cluster's, else the defaults.")
    ticks: int = Field(60, ge=1, le=1_000_000)
    seed: int = 0
    loss: float = Field(0.0, ge=0, le=1)
    events: list[Event] = []
    expect: list[Expect] = []

    @model_validator(mode="after")
    def _fleet(self) -> Scenario:
        if (self.cluster is None) == (self.servers is None):
            raise ValueError("give either `cluster:` (a file) or inline `servers:`, not both or neither")
        return self


def inline_topology(servers: list[InlineServer]) -> Topology:
    return Topology(
        servers=tuple(s.name for s in servers),
        countries=tuple(s.country.upper() for s in servers),
        probers=tuple(s.prober for s in servers),
        inbounds=tuple(f"{s.name}-in" for s in servers),
        inbound_server=tuple(range(len(servers))),
    )


def check_names(scenario: Scenario, topology: Topology) -> list[tuple[int, str]]:
    """(event index, message) for each name in the events that the fleet does not have."""
    known = set(topology.servers)
    problems = []
    for i, ev in enumerate(scenario.events):
        names: list[str] = []
        if ev.block is not None:
            names += [] if ev.block.from_ == "*" else list(ev.block.from_)
            names += [ev.block.to] if isinstance(ev.block.to, str) else list(ev.block.to)
        for k in ("down", "listener_down", "silent", "outage", "isolate"):
            if getattr(ev, k):
                names.append(getattr(ev, k))
        if ev.flap is not None:
            names.append(ev.flap.server)
        problems += [(i, f"{ev.kind}: unknown server {n!r}") for n in names if n not in known]
    return problems


def check_expectations(scenario: Scenario, topology: Topology) -> list[tuple[int, str]]:
    """(expectation index, message) for each ``expect`` entry whose server is unknown or whose tick is past the end."""
    known = set(topology.servers)
    problems = []
    for i, ex in enumerate(scenario.expect):
        if ex.server != "*" and ex.server not in known:
            problems.append((i, f"unknown server {ex.server!r}"))
        if ex.ticks().stop > scenario.ticks:
            problems.append((i, f"tick {ex.ticks().stop - 1} is past the scenario's last ({scenario.ticks - 1})"))
    return problems


def expectations(scenario: Scenario, topology: Topology, settings: HealthSettings) -> list[tuple[int, str]]:
    """Replay the scenario and check its ``expect`` entries: (index, what was wrong at which tick), the first
    miss of each entry; empty when every one holds."""
    wanted: dict[int, list[int]] = {}
    for i, ex in enumerate(scenario.expect):
        for tick in ex.ticks():
            wanted.setdefault(tick, []).append(i)
    failed: dict[int, str] = {}
    if not wanted:
        return []
    last = max(wanted)
    for tick, verdicts in run(scenario, topology, settings):
        for i in wanted.get(tick, ()):
            if i not in failed and (miss := _miss(scenario.expect[i], verdicts)):
                failed[i] = f"tick {tick}: {miss}"
        if tick >= last:
            break
    return sorted(failed.items())


def _miss(ex: Expect, verdicts: Verdicts) -> str:
    """What of ``ex`` does not hold in ``verdicts`` (empty: all of it holds)."""
    names = verdicts.topology.servers if ex.server == "*" else (ex.server,)
    for name in names:
        v = verdicts.server(name)
        got: list[str] = []
        statuses = [ex.status] if isinstance(ex.status, str) else ex.status
        if statuses is not None and v.status not in statuses:
            got.append(f"status {v.status}, expected {' or '.join(statuses)}")
        if ex.in_rotation is not None and v.in_rotation != ex.in_rotation:
            got.append(f"in rotation: {v.in_rotation}, expected {ex.in_rotation}")
        for region, want in (ex.in_rotation_for or {}).items():
            if verdicts.server_in_rotation_for(name, region) != want:
                got.append(f"in rotation for {region}: {not want}, expected {want}")
        if ex.unreachable_from is not None and v.unreachable_from != ex.unreachable_from:
            got.append(f"unreachable from {v.unreachable_from}, expected {ex.unreachable_from}")
        if ex.marks is not None and sorted(m.text for m in v.marks) != sorted(ex.marks):
            got.append(f"marks {[m.text for m in v.marks]}, expected {ex.marks}")
        got += [f"reason lacks {w!r}" for w in ex.reason or () if w not in v.reason]
        got += [f"reason has {w!r}" for w in ex.not_in_reason or () if w in v.reason]
        if ex.unreliable is not None and v.unreliable_witness != ex.unreliable:
            got.append(f"unreliable witness: {v.unreliable_witness}, expected {ex.unreliable}")
        if ex.censored is not None and v.censored_witness != ex.censored:
            got.append(f"censored witness: {v.censored_witness}, expected {ex.censored}")
        if got:
            return f"{name}: " + "; ".join(got) + f" (reason: {v.reason})"
    return ""


@dataclass
class World:
    """Generates observations for a scenario, tick by tick, from one seeded RNG.

    With ``settings``, each reporting server has results only for the pairs of that tick's
    probe plan (``reconciler.health.probing``: the full mesh for small fleets, bounded above
    ``full_mesh_up_to``); without, the full mesh. The random draws are the same either way,
    so two plans can be compared on the same probe outcomes.
    """

    scenario: Scenario
    topology: Topology
    interval: float
    settings: HealthSettings | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.scenario.seed)
        n, m = self.topology.n, self.topology.m
        self.index = {s: i for i, s in enumerate(self.topology.servers)}
        self.bad = np.zeros((n, m), dtype=bool)  # Gilbert-Elliott state per pair
        self.server_of = np.asarray(self.topology.inbound_server, dtype=np.int32)

    def observe(self, tick: int) -> Observation:
        sc, topo, rng = self.scenario, self.topology, self.rng
        n, m = topo.n, topo.m
        reported = np.ones(n, dtype=bool)
        service_ok = np.ones(n, dtype=bool)
        server_listening = np.ones(n, dtype=bool)
        reachable = np.ones(n, dtype=bool)  # probes to the server's inbounds can succeed
        fail = np.zeros((n, m), dtype=bool)
        if sc.loss > 0:
            fail |= rng.random((n, m)) < sc.loss
        for ev in sc.events:
            if not ev.active(tick):
                continue
            # Exactly one kind is set (Event._one_kind): test each for None, so every branch is typed.
            if ev.block is not None:
                fail |= self._blocked(ev.block)
            elif ev.down is not None:
                service_ok[self.index[ev.down]] = False
                reachable[self.index[ev.down]] = False
            elif ev.listener_down is not None:
                server_listening[self.index[ev.listener_down]] = False
                reachable[self.index[ev.listener_down]] = False
            elif ev.silent is not None:
                reported[self.index[ev.silent]] = False
            elif ev.outage is not None:
                reported[self.index[ev.outage]] = False
                reachable[self.index[ev.outage]] = False
            elif ev.isolate is not None:
                fail[self.index[ev.isolate], :] = True
            elif ev.loss is not None:
                fail |= self._loss(ev.loss)
            elif ev.reports_missing is not None:
                reported &= rng.random(n) >= ev.reports_missing.p
            elif ev.flap is not None:
                self._flap(ev.flap, tick - ev.at, service_ok, reachable)
        fail |= ~reachable[self.server_of][None, :]
        return Observation(
            now=tick * self.interval,
            reported=reported,
            service_ok=service_ok,
            listener_ok=server_listening[self.server_of],
            probe_present=self._present(tick, reported),
            probe_ok=~fail,
        )

    def _blocked(self, block: Block) -> np.ndarray:
        """The (witness, inbound) pairs a block makes fail: from its sources to the destinations' inbounds."""
        n = self.topology.n
        dests = [block.to] if isinstance(block.to, str) else block.to
        cols = np.isin(self.server_of, [self.index[d] for d in dests])
        if isinstance(block.from_, list):
            sources = _mask(self.index, block.from_, n)
        else:  # "*": everyone but the destinations
            sources = ~np.isin(np.arange(n), [self.index[d] for d in dests])
        return sources[:, None] & cols[None, :]

    def _flap(self, flap: Flap, since: int, service_ok: np.ndarray, reachable: np.ndarray) -> None:
        """A flap ``since`` ticks after it began: in its first ``period`` ticks, and every other ``period`` after,
        the server is unreachable (and, with ``kind: down``, its service down); fine in between."""
        if (since // flap.period) % 2 == 0:
            if flap.kind == "down":
                service_ok[self.index[flap.server]] = False
            reachable[self.index[flap.server]] = False

    def _present(self, tick: int, reported: np.ndarray) -> np.ndarray:
        n, m = self.topology.n, self.topology.m
        if self.settings is None or uses_full_mesh(self.topology, self.settings):
            return np.broadcast_to(reported[:, None], (n, m))
        return reported[:, None] & probe_plan(self.topology, tick, self.settings).inbound_mask(self.topology)

    def _loss(self, loss: Loss) -> np.ndarray:
        shape = self.bad.shape
        if loss.burst is None:
            return self.rng.random(shape) < loss.p
        # Gilbert-Elliott: Bad fails every probe; mean stay in Bad = burst; long-run share of Bad = p.
        leave = 1.0 / loss.burst
        enter = 0.0 if loss.p >= 1 else min(1.0, loss.p * leave / (1.0 - loss.p))
        r = self.rng.random(shape)
        self.bad = np.where(self.bad, r >= leave, r < enter)
        return self.bad.copy()


def _mask(index: dict[str, int], names: list[str], n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[[index[x] for x in names]] = True
    return out


def run(scenario: Scenario, topology: Topology, settings: HealthSettings) -> Iterator[tuple[int, Verdicts]]:
    """Yield (tick, verdicts) for every tick of the scenario. Deterministic for a seed."""
    world = World(scenario, topology, settings.report_interval, settings)
    engine = HealthEngine(topology, settings)
    for tick in range(scenario.ticks):
        yield tick, engine.evaluate(world.observe(tick))
