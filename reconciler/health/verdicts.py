"""Verdicts: what one evaluation concluded, and how to say it to an operator.

``Verdicts`` holds the engine's arrays; its methods give per-server and
per-inbound views with reasons (HEALTH-13) and the *best available* order of a
set of inbounds (HEALTH-11, LB-8): in rotation first, then the least severe
status, then the fewest marks and votes — so a route can always serve
something, and what it serves is the least bad choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from reconciler.health.topology import Topology
from reconciler.model.cluster import HealthSettings

OK, NO_DATA, BLOCKED, UNREACHABLE, UNAVAILABLE = 0, 1, 2, 3, 4
STATUS_NAMES = ("ok", "no_data", "blocked", "unreachable", "unavailable")
IN_ROTATION = np.array([True, True, False, False, False])
# Best-available preference among statuses: a blocked address still works outside the censor's
# country, an unreachable one works nowhere we can see, an unavailable service works for nobody.
_AVAILABILITY_RANK = {OK: 0, NO_DATA: 1, BLOCKED: 2, UNREACHABLE: 3, UNAVAILABLE: 4}


@dataclass(frozen=True)
class Mark:
    kind: str  # "pair-unreachable"
    witness: str  # the server that cannot reach
    server: str  # the server it cannot reach
    inbound: str
    both_directions: bool
    witness_country: str = ""  # where the witness stands: where users may not reach the server either

    @property
    def text(self) -> str:
        direction = "both directions" if self.both_directions else "one direction"
        return f"{self.witness} cannot reach {self.server} ({direction})"

    def as_json(self) -> dict[str, object]:
        return {"kind": self.kind, "witness": self.witness, "server": self.server, "inbound": self.inbound,
                "both_directions": self.both_directions, "witness_country": self.witness_country, "text": self.text}


@dataclass(frozen=True)
class InboundVerdict:
    id: str
    server: str
    status: str
    in_rotation: bool
    marks: tuple[Mark, ...]
    votes: int
    witnesses: int
    reason: str
    out_for: str | None = None  # out of rotation only for users of this region (HEALTH-15); None: for everyone, or not out
    unreachable_from: str | None = None  # the country whose witnesses cannot reach it (a regional verdict)

    @property
    def label(self) -> str:
        return _label(self.status, self.unreachable_from, bool(self.marks))

    @property
    def rotation(self) -> str:
        return _rotation(self.in_rotation, self.out_for)


def _label(status: str, unreachable_from: str | None, marked: bool) -> str:
    if unreachable_from is not None and status == "unreachable":
        return f"unreachable from {unreachable_from}"
    return "pair-unreachable" if status == "ok" and marked else status


def _rotation(in_rotation: bool, out_for: str | None) -> str:
    if in_rotation:
        return "yes"
    return f"not for {out_for}" if out_for else "no"


@dataclass(frozen=True)
class ServerVerdict:
    name: str
    status: str
    in_rotation: bool
    marks: tuple[Mark, ...]
    votes: int
    witnesses: int
    reason: str
    unreliable_witness: bool
    seconds_since_report: float | None
    out_for: str | None = None  # out of rotation only for users of this region (HEALTH-15)
    unreachable_from: str | None = None  # the country whose witnesses cannot reach it (a regional verdict)
    censored_witness: bool = False  # it loses many servers in a censor's pattern; its votes count (HEALTH-6)
    sees: str = ""  # what it sees as a witness: the servers it cannot reach, and whether others reach them

    @property
    def label(self) -> str:
        """The status as views show it: ``unreachable from RU`` for a regional verdict, ``pair-unreachable`` for an
        ok server that carries marks (HEALTH-8, HEALTH-15)."""
        return _label(self.status, self.unreachable_from, bool(self.marks))

    @property
    def rotation(self) -> str:
        """``yes``, ``no``, or ``not for EEU`` (out of rotation for one region's users only, HEALTH-15)."""
        return _rotation(self.in_rotation, self.out_for)

    def as_json(self) -> dict[str, object]:
        return {"status": self.status, "in_rotation": self.in_rotation, "marks": [m.as_json() for m in self.marks],
                "votes": self.votes, "witnesses": self.witnesses, "reason": self.reason,
                "unreliable_witness": self.unreliable_witness, "censored_witness": self.censored_witness,
                "out_for": self.out_for, "unreachable_from": self.unreachable_from, "sees": self.sees}


def _names(names: list[str], limit: int = 5) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f" and {len(names) - limit} more"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


@dataclass
class Verdicts:
    """The result of one evaluation. Arrays by inbound (M) and by server (N)."""

    topology: Topology
    now: float
    status: np.ndarray  # (M,) int8
    in_rotation: np.ndarray  # (M,) bool
    votes: np.ndarray  # (M,) int32 global votes
    witnesses: np.ndarray  # (M,) int32 reliable fresh witnesses
    local_country: np.ndarray  # (M,) int32 country index that convicted, -1 none
    blocked_by: np.ndarray  # (M,) int32 prober index, -1 none
    server_status: np.ndarray  # (N,) int8
    server_report_status: np.ndarray  # (N,) int8: from the self-report alone
    unreliable: np.ndarray  # (N,) bool
    last_report: np.ndarray  # (N,) float64
    service_ok: np.ndarray  # (N,) bool: the last report's service state
    settings: HealthSettings
    vote_matrix: np.ndarray  # (N, M) bool: which reliable witness votes against which inbound
    fail: np.ndarray  # (N, M) int16 streaks; -1: the pair is not in the witness's latest report (not probing it)
    pair_marks: list[tuple[int, int, bool]] = field(default_factory=list)  # (witness, inbound, both)
    regional: np.ndarray | None = None  # (M,) int32: out of rotation only for this country's region; -1 not so
    censored: np.ndarray | None = None  # (N,) bool: a witness losing many servers in a censor's pattern
    prober_failing: np.ndarray | None = None  # (N,) bool: a prober losing more than half of its neighbours
    fresh: np.ndarray | None = None  # (N,) bool: its report is within the staleness limit
    silence: Mapping[str, str] = field(default_factory=dict)  # server → why the controller has no report from it

    def __post_init__(self) -> None:
        n, m = self.topology.n, self.topology.m
        if self.regional is None:
            self.regional = np.full(m, -1, dtype=np.int32)
        for name in ("censored", "prober_failing"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(n, dtype=bool))
        if self.fresh is None:
            self.fresh = (self.now - self.last_report) <= self.settings.staleness

    # ------------------------------------------------------------------ lookups

    @cached_property
    def _server_index(self) -> dict[str, int]:
        return {s: i for i, s in enumerate(self.topology.servers)}

    @cached_property
    def _inbound_index(self) -> dict[str, int]:
        return {s: i for i, s in enumerate(self.topology.inbounds)}

    @cached_property
    def _marks_by_inbound(self) -> dict[int, list[Mark]]:
        topo = self.topology
        out: dict[int, list[Mark]] = {}
        for w, t, both in self.pair_marks:
            mark = Mark("pair-unreachable", topo.servers[w], topo.servers[topo.server_of[t]], topo.inbounds[t], both,
                        topo.countries[w])
            out.setdefault(t, []).append(mark)
        return out

    def marks_of_inbound(self, t: int) -> tuple[Mark, ...]:
        return tuple(self._marks_by_inbound.get(t, ()))

    def marks(self) -> list[Mark]:
        """Every pair mark of this evaluation (HEALTH-8)."""
        return [m for found in self._marks_by_inbound.values() for m in found]

    # ------------------------------------------------------------------ rotation by region (HEALTH-15)

    def region_out(self, t: int) -> str | None:
        """The region for whose users alone inbound ``t`` is out of rotation; None when it is not regional."""
        assert self.regional is not None
        c = int(self.regional[t])
        return self.topology.country_region[c] if c >= 0 else None

    def in_rotation_for(self, t: int, region: str | None) -> bool:
        """Inbound ``t`` is in rotation for a user of ``region`` (None: unknown, the global rule)."""
        if self.in_rotation[t]:
            return True
        out = self.region_out(t)
        return out is not None and bool(region) and region != out

    def server_in_rotation_for(self, name: str, region: str | None) -> bool:
        """Some inbound of server ``name`` is in rotation for a user of ``region`` (a server without inbounds: its
        own status decides)."""
        i = self._server_index[name]
        inbounds = np.flatnonzero(self.topology.server_of == i)
        if not inbounds.size:
            return bool(IN_ROTATION[int(self.server_status[i])])
        return any(self.in_rotation_for(int(t), region) for t in inbounds)

    @cached_property
    def any_regional(self) -> bool:
        """Some inbound is out of rotation for one region only (then rotation depends on the user's region)."""
        assert self.regional is not None
        return bool((self.regional >= 0).any())

    # ------------------------------------------------------------------ views

    def inbound(self, inbound_id: str) -> InboundVerdict:
        t = self._inbound_index[inbound_id]
        topo = self.topology
        return InboundVerdict(
            id=inbound_id,
            server=topo.servers[topo.server_of[t]],
            status=STATUS_NAMES[int(self.status[t])],
            in_rotation=bool(self.in_rotation[t]),
            marks=self.marks_of_inbound(t),
            votes=int(self.votes[t]),
            witnesses=int(self.witnesses[t]),
            reason=self._inbound_reason(t),
            out_for=self.region_out(t),
            unreachable_from=self._unreachable_from(t),
        )

    def _unreachable_from(self, t: int) -> str | None:
        assert self.regional is not None
        c = int(self.regional[t])
        return self.topology.country_codes[c] if c >= 0 else None

    def server(self, name: str) -> ServerVerdict:
        i = self._server_index[name]
        topo = self.topology
        inbounds = np.flatnonzero(topo.server_of == i)
        marks = tuple(m for t in inbounds for m in self.marks_of_inbound(int(t)))
        status = int(self.server_status[i])
        if inbounds.size:
            worst = int(inbounds[np.argmax(self.votes[inbounds])])
            votes, witnesses = int(self.votes[worst]), int(self.witnesses[worst])
            in_rotation = bool(self.in_rotation[inbounds].any())
        else:
            votes = witnesses = 0
            in_rotation = bool(IN_ROTATION[status])
        since = self.now - float(self.last_report[i]) if np.isfinite(self.last_report[i]) else None
        regional = [int(t) for t in inbounds if not self.in_rotation[t] and self.region_out(int(t)) is not None]
        out_for = unreachable_from = None
        if regional and not in_rotation and len(regional) == int(inbounds.size):
            out_for, unreachable_from = self.region_out(regional[0]), self._unreachable_from(regional[0])
        assert self.censored is not None
        return ServerVerdict(
            name=name, status=STATUS_NAMES[status], in_rotation=in_rotation, marks=marks, votes=votes,
            witnesses=witnesses, reason=self._server_reason(i, inbounds, marks), unreliable_witness=bool(self.unreliable[i]),
            seconds_since_report=since, out_for=out_for, unreachable_from=unreachable_from,
            censored_witness=bool(self.censored[i]), sees=self.sees(i),
        )

    def servers(self) -> dict[str, ServerVerdict]:
        return {name: self.server(name) for name in self.topology.servers}

    def labels(self) -> dict[str, str]:
        """Every server's and inbound's ``label`` (keyed by server name and inbound id): what pictures show."""
        out = {name: v.label for name, v in self.servers().items()}
        out.update({t: self.inbound(t).label for t in self.topology.inbounds})
        return out

    # ------------------------------------------------------------------ best available (HEALTH-11, LB-8)

    def rank(self, inbound_id: str) -> tuple[int, int, int, int]:
        """Sort key: smaller is better. In rotation first, then status, marks, votes."""
        t = self._inbound_index[inbound_id]
        return (
            0 if self.in_rotation[t] else 1,
            _AVAILABILITY_RANK[int(self.status[t])],
            len(self._marks_by_inbound.get(t, ())),
            int(self.votes[t]),
        )

    def best_available(self, inbound_ids: list[str]) -> list[str]:
        """The inbounds ordered best first; never drops one, so a route never goes empty."""
        return sorted(inbound_ids, key=lambda i: (self.rank(i), inbound_ids.index(i)))

    # ------------------------------------------------------------------ reasons (HEALTH-13)

    def _witness_names(self, t: int) -> list[str]:
        topo = self.topology
        return [topo.servers[w] for w in np.flatnonzero(self.vote_matrix[:, t])]

    def _reaching(self, t: int) -> list[int]:
        """The reliable fresh witnesses that probe inbound ``t`` and do not vote against it."""
        assert self.fresh is not None
        rows = self.fresh & ~self.unreliable & (self.fail[:, t] >= 0) & ~self.vote_matrix[:, t]
        rows[int(self.topology.server_of[t])] = False
        return [int(w) for w in np.flatnonzero(rows)]

    def _inbound_reason(self, t: int) -> str:
        topo = self.topology
        status = int(self.status[t])
        server = int(topo.server_of[t])
        if status == UNAVAILABLE:
            if self.server_report_status[server] == UNAVAILABLE and not _listener_only(self, server):
                return "server unavailable: the proxy service is not running"
            return f"server unavailable: nothing listening for inbound {topo.inbounds[t]}"
        if status == UNREACHABLE:
            names = self._witness_names(t)
            country = int(self.local_country[t])
            region = self.region_out(t)
            if country >= 0:
                code = topo.country_codes[country]
                local = [n for n in names if topo.countries[topo.servers.index(n)] == code]
                # The country's servers probing it: all of them in the full mesh, the plan's share of them when bounded.
                total = sum(1 for w in range(topo.n) if topo.countries[w] == code and w != server and self.fail[w, t] >= 0)
                text = (f"unreachable from {len(local)} of your {total} servers in {code}: {_names(local)} "
                        f"(likely blocked in {code}; servers elsewhere still reach it)")
                return text + (f" — {_only_for(region)}" if region is not None else "")
            if region is not None:  # a regional verdict waiting to clear
                return (f"unreachable from {self._unreachable_from(t)} (recovering: waiting for the evidence to stay "
                        f"gone) — {_only_for(region)}")
            if names:
                text = f"unreachable from {len(names)} of your {int(self.witnesses[t])} servers: {_names(names)}"
                countries = {topo.countries[topo.servers.index(n)] for n in names}
                reaching = {topo.countries[w] for w in self._reaching(t)}
                if len(countries) == 1 and len(names) < int(self.witnesses[t]):
                    code = countries.pop()
                    text += f" — all in {code}; servers elsewhere still reach it (likely blocked in {code})"
                elif len(reaching) == 1:
                    code = reaching.pop()
                    text += f" — only servers in {code} still reach it (likely an allow-list in {code}, or its own uplink)"
                return text
            return "unreachable (recovering: waiting for the evidence to stay gone)"
        if status == BLOCKED:
            prober = int(self.blocked_by[t])
            if prober >= 0:
                streak = int(self.fail[prober, t])
                return (f"blocked: prober {topo.servers[prober]} has not reached it for {streak} checks "
                        f"— change its IP")
            return "blocked (recovering: the prober reaches it again)"
        if status == NO_DATA:
            return self._no_data_reason(server)
        marks = self.marks_of_inbound(t)
        if marks:
            return "; ".join(m.text for m in marks)
        return "ok"

    def _no_data_reason(self, server: int) -> str:
        """Why there is no data, as the controller saw it (SSH unreachable, agent silent, report refused), and since
        when; without its word (a standby, an older state): the agent did not answer."""
        last = float(self.last_report[server])
        cause = self.silence.get(self.topology.servers[server]) or "agent not answering"
        if not np.isfinite(last):
            return f"no data — {cause} (never reported)"
        return f"no data — {cause} (last report {_ago(self.now - last)} ago; metrics are stale)"

    def _server_reason(self, i: int, inbounds: np.ndarray, marks: tuple[Mark, ...]) -> str:
        status = int(self.server_status[i])
        report = int(self.server_report_status[i])
        if status == report and status in (NO_DATA, UNAVAILABLE):
            if status == NO_DATA:
                return self._no_data_reason(i)
            if not _listener_only(self, i):
                return "server unavailable: the proxy service is not running"
        worst = [int(t) for t in inbounds if int(self.status[t]) == status]
        if status != OK and worst:
            reason = self._inbound_reason(worst[0])
            if 0 < len(worst) < inbounds.size:
                reason += f" (inbound {self.topology.inbounds[worst[0]]}; others differ)"
            if sees := self.sees(i):
                reason += f"; {sees}"
            return reason
        notes = [m.text for m in marks]
        if sees := self.sees(i):
            notes.append(sees)
        return "; ".join(notes) if notes else STATUS_NAMES[status]

    # ------------------------------------------------------------------ what a witness sees (HEALTH-6)

    def lost_servers(self, w: int) -> list[int]:
        """The servers witness ``w`` votes against (any of their inbounds), in the fleet's order."""
        assert self.fresh is not None
        if not self.fresh[w]:
            return []
        topo = self.topology
        hits = (self.fail[w] >= self.settings.failure_streak) & (topo.server_of != w)
        return sorted({int(topo.server_of[t]) for t in np.flatnonzero(hits)})

    def _reaches(self, v: int, s: int) -> bool | None:
        """Whether witness ``v`` reaches server ``s`` now (None: it does not probe it, or has no fresh report)."""
        assert self.fresh is not None
        if not self.fresh[v] or v == s:
            return None
        row = self.fail[v][self.topology.server_of == s]
        row = row[row >= 0]
        if not row.size:
            return None
        return bool((row < self.settings.failure_streak).all())

    @cached_property
    def _marking(self) -> dict[int, list[int]]:
        """Witness → the servers it marks (HEALTH-8), in the fleet's order."""
        out: dict[int, set[int]] = {}
        for w, t, _ in self.pair_marks:
            out.setdefault(w, set()).add(int(self.topology.server_of[t]))
        return {w: sorted(v) for w, v in out.items()}

    def sees(self, w: int) -> str:
        """What witness ``w`` sees, in the operator's words: whom it cannot reach, whether the others reach them,
        and what that says about the witness (HEALTH-6). Empty unless it is worth an operator's attention: the
        witness was judged (unreliable, censored, a failing prober) or its long streaks mark servers; a short streak
        under ordinary loss is not news."""
        assert self.censored is not None and self.prober_failing is not None
        judged = bool(self.unreliable[w] or self.censored[w] or self.prober_failing[w])
        lost = self.lost_servers(w) if judged else self._marking.get(w, [])
        if not lost:
            return ""
        topo = self.topology
        names = [topo.servers[s] for s in lost]
        text = f"{topo.servers[w]} cannot reach {_names(names)}"
        among = [self._reaches(a, b) for a in lost for b in lost if a != b]
        among = [x for x in among if x is not None]
        others = [self._reaches(v, s) for s in lost for v in range(topo.n) if v != w and v not in lost]
        if len(lost) > 1 and among and all(among):
            text += "; they reach each other"
        elif any(others):
            text += "; others reach " + ("it" if len(lost) == 1 else "them")
        code = topo.countries[w]
        if self.prober_failing[w]:
            text += (" — a prober that cannot reach most of the fleet blocks no one (HEALTH-9): its own network, "
                     f"or a censor in {code} that cuts off most foreign servers")
        elif self.unreliable[w]:
            text += (f" — not even servers in {code}: its own network looks broken, and its votes are ignored "
                     "(check its outbound network)" if self._home_lost(w, lost) else
                     " — its own network looks broken, and its votes are ignored (check its outbound network)")
        elif self.censored[w]:
            home = any(topo.countries[s] == code for s in range(topo.n) if s != w and self._reaches(w, s) is not None)
            why = f"it still reaches servers in {code}" if home else "the controller reaches it and its self-check passes"
            text += f" — likely censored in {code} ({why}); its votes count"
        return text

    def _home_lost(self, w: int, lost: list[int]) -> bool:
        code = self.topology.countries[w]
        return any(self.topology.countries[s] == code for s in lost)


def _only_for(region: str) -> str:
    return f"out of rotation for users in {region} (and users of unknown region) only"


def _listener_only(v: Verdicts, server: int) -> bool:
    """True when the server reports its service running but its listeners down."""
    return bool(v.server_report_status[server] == UNAVAILABLE and v.service_ok[server])
