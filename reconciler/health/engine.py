"""The verdict engine (HEALTH-1..12): pure, vectorised, time passed in.

Witnesses are servers (N); targets are inbounds (M). Every evaluation takes one
``Observation`` — who reported, what their self-reports say, and the probe
results each reporting server got against the inbounds its probe plan gave it
(every other server's in the full mesh; ``reconciler.health.probing``) — and
updates a small carried ``HealthState`` (numpy arrays, serialisable). It returns
``Verdicts``: a status per inbound and per server, rotation flags, witness
counts, pair marks and reasons in the operator's words.

The rules, in the order they are applied:

1. **Streaks** (HEALTH-5). Each (witness, target) pair keeps its run of
   consecutive failed probes; a success resets it. A witness that did not
   report keeps its streaks unchanged. A witness whose report has no result
   for a pair does not probe that target now (the bounded probe plan,
   ``reconciler.health.probing``): the pair drops out (streak -1) — it is
   neither a witness of that target nor a vote, and its streak starts afresh
   when the plan brings it back. Every count below is over the pairs in the
   witnesses' latest reports: the full mesh, or the bounded plan.
2. **Background loss.** Each witness's chance of failing a probe at random is
   read as a two-state Markov chain: the hazard *h* (a failure after a
   success) and the continuation *c* (another failure after a failure), so
   bursty loss raises *c* and iid loss keeps *c ≈ h*. A streak of at least *s*
   is then this likely by chance: ``π · E[c^(s-1)]`` with the chain's failure
   share ``π = h / (h + 1 - c)``. The hazard is a weighted mean of recent
   fresh starts. The continuation is learnt from streaks that *ended* (a block
   in progress never passes itself off as bursty loss), as a Beta whose prior
   mean rises with the hazard (failures that start often, none yet seen to
   end, may be long ones; running streaks are no guide: a block's own, and its
   side effects on the way back, would vouch for it as bursty loss). It is
   read as the predictive ``E[c^(s-1)]``, which stays wide while few streaks
   have ended. A continuation estimate that crept up from an
   optimistic prior once let an early long burst pass as a block; this one is
   not fooled that way, at a price: a fleet that has not yet seen failures end
   asks one or two witnesses for longer streaks (a fleet of two servers marks
   after 20-35 intervals at first, 8-10 once it has learnt). The fleet's pooled
   rates stand for any witness whose own are lower; a witness's own count only
   when higher.
3. **Witness reliability** (HEALTH-6, HEALTH-9), read at the level of servers.
   A witness *loses* a server when it votes against any inbound of it. A
   fraction of one to three neighbours says nothing (``MIN_NEIGHBOURS``). An
   ordinary witness that loses at least ``unreliable_ratio`` of its neighbours
   is *heavy*, and *suspect* when that is also at least ``unreliable_margin``
   above the median of all fresh witnesses (judging against the median keeps
   every witness when half the fleet really is down). A heavy witness whose
   failures follow a censor's pattern is *censored*, not broken, and its votes
   count: it still reaches at least half of the servers of its own country (a
   censor blocks foreign addresses), or, with no server of its own country to
   probe, the controller reached it, its self-check passed and the others reach
   most of what it loses. Only a suspect that is not censored is
   **unreliable**: its votes are discarded. A designated prober is judged by
   the rule's own words: it is failing, and blocks no one, when it loses more
   than half of its neighbours. Unreliable witnesses still make pair marks
   (rule 6).
4. **Votes and quorum** (HEALTH-5, HEALTH-7). A reliable witness with fresh
   data votes against a target when its streak reaches ``failure_streak``. A
   target is **unreachable** when, either among all witnesses or among the
   witnesses of one country, (a) at least ``min_witnesses`` vote, (b) they are a
   majority (or the configured share) of that group's reliable witnesses with
   fresh data, and (c) their streaks together are less likely than
   ``evidence`` by chance: the voters' chance probabilities are combined with
   Fisher's method (a χ² test) and multiplied by the number of ways to choose
   that many voters among the group, since the voters are the witnesses that
   happen to have long streaks. The
   country groups are how a country-level block is caught although witnesses
   elsewhere still see the target: witnesses in one country are *not*
   independent of that country's censor, so they are allowed to convict only
   about their own country, and the reason says so; a lone server in a country
   never convicts (``min_witnesses``) — that is what a prober is for. A country's
   conviction is **regional** (HEALTH-15): the verdict carries the country, and
   the inbound leaves rotation for users of that country's region (and for
   users whose region is unknown) while it stays for everyone else. A target
   that the whole fleet, or two countries at once, convict is out everywhere.
5. **Prober** (HEALTH-9). A reliable designated prober whose streak against a
   target reaches ``prober_streak`` — and is less likely than ``evidence`` by
   chance under its background loss — marks it **blocked**. A prober's own
   inbounds are judged like anyone's: a quorum of witnesses that cannot reach
   it makes it unreachable (a prober blocked from everyone leaves rotation),
   while one ordinary server failing to reach it means nothing (no pair mark).
   A prober that is itself failing (rule 3) blocks no one.
6. **Pair marks** (HEALTH-8). Any fresh witness but a prober that blocks —
   unreliable ones included — whose streak against a target reaches
   ``prober_streak`` (one witness's word always needs the long streak, and on a
   lossy network also ``evidence``) without a quorum marks the target's inbound
   ``pair-unreachable``, naming both servers and whether the reverse direction
   fails too. Marks never take anything out of rotation.
7. **Self-reports** (HEALTH-1..3). A fresh report saying the service is not
   running or the inbound's port is not listening makes it **unavailable**; no
   report within the staleness limit makes it **no_data**.
8. **Hysteresis** (HEALTH-12). unreachable and blocked clear after their
   evidence has been gone for ``recovery_streak`` evaluations; each new
   repeated conviction doubles that (flap damping, up to 32×; the memory halves every 100 evaluations).

Status precedence, most severe first: unavailable > unreachable > blocked >
no_data > ok. A fresh "not well" report explains every failed probe, so it
wins; an address nobody can reach is worse than one a censor blocks; silence is
the weakest signal. A server's status is the most severe of its own report and
its inbounds'. In rotation (HEALTH-10): ok and no_data; out: unavailable,
unreachable, blocked.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from reconciler.health.pairs import Pairs
from reconciler.health.pairs import memo as pairs_memo
from reconciler.health.topology import Topology
from reconciler.health.verdicts import BLOCKED, IN_ROTATION, NO_DATA, OK, UNAVAILABLE, UNREACHABLE, Verdicts
from reconciler.model.cluster import HealthSettings

_STREAK_CAP = 30000
# The rates' priors, and what they weigh in samples. The continuation's mean is the usual short bursts, more the
# more often failures start (``StreakOdds``).
_H_PRIOR, _H_PRIOR_N = 0.05, 10.0
_C_PRIOR, _C_PRIOR_N = 0.1, 10.0
_C_PER_HAZARD, _C_COLD_MAX = 8.0, 0.6  # the continuation's prior rises with how often failures start
_H_RANGE, _C_RANGE = (0.001, 0.5), (0.02, 0.95)
_EWMA = 0.02  # per-sample decay of a witness's own background-loss samples (about the last 50 count)
_FLEET_EWMA = 0.002  # per-sample decay of the fleet-wide samples (about the last 500 count)
MIN_NEIGHBOURS = 4  # a witness's failure share over fewer servers says nothing about the witness (HEALTH-6)
_FLAP_DECAY = 0.5 ** (1 / 100)  # flap memory halves every 100 evaluations


@dataclass
class Observation:
    """What arrived for one evaluation. Arrays are indexed like the topology.

    ``reported[w]``: server w's self-report (with its probe results) arrived now.
    ``probe_present[w, t]``/``probe_ok[w, t]``: w's probe of inbound t this time.
    ``probe_rtt_ms[w, t]`` is optional (NaN for failed or missing probes).
    """

    now: float
    reported: np.ndarray  # (N,) bool
    service_ok: np.ndarray  # (N,) bool, meaningful where reported
    listener_ok: np.ndarray  # (M,) bool, meaningful where its server reported
    probe_present: np.ndarray  # (N, M) bool
    probe_ok: np.ndarray  # (N, M) bool
    probe_rtt_ms: np.ndarray | None = None


@dataclass
class HealthState:
    """Everything the engine carries between evaluations (persisted by the loop)."""

    fail: np.ndarray  # (N, M) int16 consecutive failures; -1: not in the witness's latest report (not probing it)
    hazard: np.ndarray  # (N,) float64: the mean of the witness's hazard samples
    cont: np.ndarray  # (N,) float64: the mean of its continuation samples
    fleet: np.ndarray  # (2,) float64: fleet-wide hazard and continuation
    hazard_n: np.ndarray  # (N,) float64: what those means weigh, in (decayed) samples
    cont_n: np.ndarray  # (N,) float64
    fleet_n: np.ndarray  # (2,) float64
    judged: np.ndarray  # (N,) bool: the witnesses the last evaluation judged (unreliable, censored, failing prober)
    last_report: np.ndarray  # (N,) float64, -inf = never
    last_service_ok: np.ndarray  # (N,) bool
    last_listener_ok: np.ndarray  # (M,) bool
    unreach_on: np.ndarray  # (M,) bool
    unreach_clear: np.ndarray  # (M,) int16
    unreach_scope: np.ndarray  # (M,) int16: the country (index of the topology's codes) that convicted; -1 everywhere
    blocked_on: np.ndarray  # (M,) bool
    blocked_clear: np.ndarray  # (M,) int16
    flap: np.ndarray  # (M,) float32
    evaluations: int = 0

    @classmethod
    def initial(cls, topology: Topology) -> HealthState:
        n, m = topology.n, topology.m
        return cls(
            fail=np.zeros((n, m), dtype=np.int16),
            hazard=np.full(n, _H_PRIOR),
            cont=np.full(n, _C_PRIOR),
            fleet=np.array([_H_PRIOR, _C_PRIOR]),
            hazard_n=np.zeros(n),
            cont_n=np.zeros(n),
            fleet_n=np.zeros(2),
            judged=np.zeros(n, dtype=bool),
            last_report=np.full(n, -np.inf),
            last_service_ok=np.ones(n, dtype=bool),
            last_listener_ok=np.ones(m, dtype=bool),
            unreach_on=np.zeros(m, dtype=bool),
            unreach_clear=np.zeros(m, dtype=np.int16),
            unreach_scope=np.full(m, -1, dtype=np.int16),
            blocked_on=np.zeros(m, dtype=bool),
            blocked_clear=np.zeros(m, dtype=np.int16),
            flap=np.zeros(m, dtype=np.float32),
        )

    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        arrays: dict[str, Any] = {k: v for k, v in vars(self).items() if isinstance(v, np.ndarray)}
        np.savez_compressed(buf, evaluations=np.array(self.evaluations), **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, topology: Topology) -> HealthState:
        """Restore a persisted state; a state of another topology starts afresh."""
        with np.load(io.BytesIO(data)) as npz:
            values: dict[str, Any] = {k: npz[k] for k in npz.files}
        return cls.from_arrays(values, topology)

    @classmethod
    def from_arrays(cls, values: dict[str, Any], topology: Topology) -> HealthState:
        """A state from its arrays. An array this version does not know is dropped; one it lacks (a state written
        by an older version) starts as in a fresh state. Arrays of another fleet's shape: a fresh state."""
        state = cls.initial(topology)
        evaluations = values.get("evaluations")
        if evaluations is not None:
            state.evaluations = int(evaluations)
        for name, fresh in vars(state).items():
            value = values.get(name)
            if not isinstance(fresh, np.ndarray) or value is None:
                continue
            value = np.asarray(value)
            if value.shape != fresh.shape:
                return cls.initial(topology)
            setattr(state, name, value.astype(fresh.dtype, copy=False))
        return state

    def copy(self) -> HealthState:
        values: dict[str, Any] = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in vars(self).items()}
        return HealthState(**values)


@dataclass(frozen=True)
class Witnesses:
    """How one evaluation judged each witness (HEALTH-6, HEALTH-9). Arrays by server (N)."""

    unreliable: np.ndarray  # bool: its votes are discarded
    censored: np.ndarray  # bool: an ordinary witness that loses many, in a censor's pattern: its votes count
    prober_failing: np.ndarray  # bool: a prober that loses more than half of its neighbours: it blocks no one

    @property
    def judged(self) -> np.ndarray:
        """Its failures are not background loss: unreliable, censored or a failing prober."""
        judged: np.ndarray = self.unreliable | self.censored | self.prober_failing
        return judged


@dataclass(frozen=True)
class StreakOdds:
    """How likely a witness's streak of failures is by chance, from the background loss learnt so far (2).

    ``P(streak >= s) = π · E[c^(s-1)]``: the witness's failure share, times the chance of s-1 continuations, the
    larger of the fleet's predictive one (a Beta over the ended streaks: it stays high while few have ended) and
    the witness's own continuation to the power s-1 (where its own link is burstier than the fleet's).

    The Beta's prior (``_C_PRIOR_N`` samples) has the mean ``_C_PRIOR + _C_PER_HAZARD · h`` (at most
    ``_C_COLD_MAX``), h the fleet's hazard: failures that start often, none yet seen to end, may be long ones.
    """

    log_pi: np.ndarray  # (N,) float32
    log_c: np.ndarray  # (N,) float32: the witness's continuation, at least the fleet's mean
    ended: tuple[float, float]  # the fleet's ended streaks: (continued, steps)
    hazard: float  # the fleet's hazard: how often a failure starts

    def log_chance(self, fail: np.ndarray, witness: np.ndarray) -> np.ndarray:
        """log P(a streak at least this long by chance), per pair: its streak ``fail`` (>= 1) and its witness.
        float32, as the engine has always judged streaks.

        The fleet's continuation is a Beta: the ended streaks, plus the prior of the class docstring.
        """
        k = fail.astype(np.float64) - 1.0
        prior = min(_C_PRIOR + _C_PER_HAZARD * self.hazard, _C_COLD_MAX)
        a = self.ended[0] + prior * _C_PRIOR_N
        b = self.ended[1] - self.ended[0] + (1.0 - prior) * _C_PRIOR_N
        predictive = _lgamma(a + k) - math.lgamma(a) + math.lgamma(a + b) - _lgamma(a + b + k)
        out: np.ndarray = (self.log_pi[witness] + np.maximum(predictive, k * self.log_c[witness])).astype(np.float32)
        return out


class HealthEngine:
    """Carries the state and evaluates one observation at a time. Deterministic.

    It reads and writes only the (witness, inbound) pairs in some report (``reconciler.health.pairs``): arrays
    by pair, reduced with ``np.bincount``. The N × M arrays it keeps (the streaks, the votes of ``Verdicts``)
    are written at those pairs, never scanned.
    """

    def __init__(self, topology: Topology, settings: HealthSettings, state: HealthState | None = None):
        self.topology = topology
        self.settings = settings
        self.state = state if state is not None else HealthState.initial(topology)

    def evaluate(self, obs: Observation) -> Verdicts:
        topo, cfg, st = self.topology, self.settings, self.state
        n, m = topo.n, topo.m
        F = cfg.failure_streak
        long_streak = cfg.prober_streak

        # 1-2. Streaks, and the background-loss samples they give. -1: the pair is not in the witness's latest report.
        present, failed, prev, probing, f, fail = self._streaks(obs)

        # Self-reports (HEALTH-1..3).
        st.last_report = np.where(obs.reported, obs.now, st.last_report)
        st.last_service_ok = np.where(obs.reported, obs.service_ok, st.last_service_ok)
        reported_t = obs.reported[topo.server_of]
        st.last_listener_ok = np.where(reported_t, obs.listener_ok, st.last_listener_ok)
        fresh = (obs.now - st.last_report) <= cfg.staleness

        # 3. Votes of fresh witnesses, and who among them is unreliable (HEALTH-6) or a failing prober (HEALTH-9).
        # A prober's own inbounds are judged like anyone's (HEALTH-9): one server failing to reach it means nothing
        # (no pair mark, below), but a quorum that cannot reach it takes it out of rotation like any other server.
        # Votes need a streak of at least F, and so do blocks and marks (their evidence test takes a shorter streak
        # for no evidence at all), so from here on the pairs that matter are those: few, unless something is down.
        long = np.flatnonzero(f >= F)  # indices into ``probing``, in its order
        w_long, t_long, f_long = probing.w[long], probing.t[long], f[long]
        voting = fresh[w_long]
        witness = self._witnesses(probing, long[voting], fresh)
        self._learn_loss(present, failed, prev, witness.judged)
        unreliable = witness.unreliable
        reliable = fresh & ~unreliable
        V = voting & reliable[w_long]  # by pair of ``long``

        # 4. Quorum: globally and per country, with the evidence test (HEALTH-5, HEALTH-7).
        log_chance = self._odds().log_chance(f_long, w_long)  # log P(a streak this long by chance)
        log_evidence = math.log(cfg.evidence)
        voters = long[V]
        votes, witnesses, unreach_now, local_country, scope_now = self._convictions(
            probing, voters, -log_chance[V], probing.of_witnesses(reliable), log_evidence)

        # 5. Probers (HEALTH-9): the long streak, and (on lossy networks) the evidence of one witness.
        evident = (f_long >= long_streak) & (log_chance <= log_evidence)
        hits = evident & (topo.prober_mask & fresh & ~witness.prober_failing)[w_long]
        blocked_by = _first_witness(t_long[hits], w_long[hits], m)  # the first prober in the fleet's order
        any_hit = blocked_by >= 0

        # A fresh "not well" report explains every failed probe: it replaces, not adds to, a conviction.
        report_fresh_t = fresh[topo.server_of]
        unavailable_t = report_fresh_t & (~st.last_service_ok[topo.server_of] | ~st.last_listener_ok)
        unreach_now &= ~unavailable_t
        any_hit &= ~unavailable_t
        for on, clear in ((st.unreach_on, st.unreach_clear), (st.blocked_on, st.blocked_clear)):
            on[unavailable_t] = False
            clear[unavailable_t] = 0

        # 8. Hysteresis with flap damping (HEALTH-12). A verdict waiting to clear keeps the scope it had.
        st.flap *= _FLAP_DECAY
        required = (cfg.recovery_streak * np.exp2(np.clip(np.floor(st.flap) - 1, 0, 5))).astype(np.int16)
        _hysteresis(st.unreach_on, st.unreach_clear, unreach_now, required, st.flap)
        _hysteresis(st.blocked_on, st.blocked_clear, any_hit, required, st.flap)
        st.unreach_scope = np.where(unreach_now, scope_now, np.where(st.unreach_on, st.unreach_scope, -1)).astype(np.int16)

        # 7. Statuses by precedence.
        status = np.where(
            unavailable_t, UNAVAILABLE,
            np.where(st.unreach_on, UNREACHABLE,
                     np.where(st.blocked_on, BLOCKED, np.where(report_fresh_t, OK, NO_DATA))),
        ).astype(np.int8)
        # Out of rotation for one region only: unreachable from one country's witnesses, and nothing else (HEALTH-15).
        regional = np.where((status == UNREACHABLE) & ~st.blocked_on, st.unreach_scope, -1).astype(np.int32)

        report_status = np.where(fresh, np.where(st.last_service_ok, OK, UNAVAILABLE), NO_DATA).astype(np.int8)
        listeners_all_down = np.ones(n, dtype=bool)
        np.logical_and.at(listeners_all_down, topo.server_of, ~st.last_listener_ok)
        has_inbounds = np.bincount(topo.server_of, minlength=n) > 0
        report_status = np.where(fresh & has_inbounds & listeners_all_down, UNAVAILABLE, report_status).astype(np.int8)
        server_status = report_status.copy()
        if m:
            np.maximum.at(server_status, topo.server_of, status)

        # 6. Pair marks (HEALTH-8): sparse, long streaks of any fresh witness but a prober that blocks, no quorum.
        marks: list[tuple[int, int, bool]] = []
        marking = fresh & ~(topo.prober_mask & ~witness.prober_failing)
        candidates = evident & marking[w_long] & ~(st.unreach_on | topo.prober_target)[t_long]
        for w, t in zip(w_long[candidates].tolist(), t_long[candidates].tolist(), strict=True):
            back = fail[topo.server_of[t]][topo.server_of == w]
            both = bool(back.size and (back >= long_streak).any() and fresh[topo.server_of[t]])
            marks.append((w, t, both))

        vote_matrix = np.zeros((n, m), dtype=bool)
        vote_matrix.reshape(-1)[probing.flat[voters]] = True
        st.evaluations += 1
        return Verdicts(
            topology=topo, now=obs.now, status=status, in_rotation=IN_ROTATION[status],
            votes=votes, witnesses=witnesses, local_country=local_country, blocked_by=blocked_by,
            server_status=server_status, server_report_status=report_status, unreliable=unreliable,
            last_report=st.last_report.copy(), service_ok=st.last_service_ok.copy(), settings=cfg,
            vote_matrix=vote_matrix, fail=fail, pair_marks=marks, regional=regional, censored=witness.censored,
            prober_failing=witness.prober_failing, fresh=fresh,
        )

    def _streaks(self, obs: Observation) -> tuple[Pairs, np.ndarray, np.ndarray, Pairs, np.ndarray, np.ndarray]:
        """Advance the streaks by one observation (1). Returns the pairs present now (the reporting witnesses'
        probes, each witness's own inbounds left out), which of them failed and their streaks before (at least 0);
        the pairs in the witnesses' latest reports (streak >= 0) and their streaks; and the new (N, M) streaks,
        now the state's.

        A reporting witness's pair that is not present drops out (-1); a witness that did not report keeps its
        streaks. So only two sets of entries change: the pairs present, and the reporting witnesses' entries that
        were not -1 — both known without a scan of the mesh (``reconciler.health.pairs``).
        """
        st = self.state
        memo = pairs_memo(self.topology)
        reported = np.asarray(obs.reported, dtype=bool)
        present = memo.present(obs.probe_present).of_witnesses(reported)
        failed = ~np.ravel(obs.probe_ok)[present.flat].astype(bool, copy=False)
        prev = np.maximum(np.ravel(st.fail)[present.flat], 0)
        now = np.where(failed, np.minimum(prev + 1, _STREAK_CAP), 0)
        live = memo.live(st.fail)
        fail = np.array(st.fail, dtype=np.int16, order="C")  # a new array: the last Verdicts keep the old one
        streaks = fail.reshape(-1)
        dropped = live.of_witnesses(reported)
        if dropped is not present:  # the same pairs as last time (the same plan, all reported): all overwritten
            streaks[dropped.flat] = -1
        streaks[present.flat] = now
        held = live.of_witnesses(~reported)
        if len(held):
            live = held.union(present)
            values = streaks[live.flat]
            probing = live.subset((values >= 0) & ~live.own)
        else:
            live, values = present, now
            probing = present.subset(now >= 0)  # all but a streak that wrapped around in an odd saved state
        memo.wrote(fail, live)
        st.fail = fail
        return present, failed, prev, probing, values if probing is live else streaks[probing.flat], fail

    def _learn_loss(self, present: Pairs, failed: np.ndarray, prev: np.ndarray, judged: np.ndarray) -> None:
        """Fold this evaluation's background-loss samples into the witnesses' and the fleet's rates (in place).
        ``failed`` and ``prev`` (the streak before, at least 0) are by pair of ``present``."""
        st, F = self.state, self.settings.failure_streak
        n, m = self.topology.n, self.topology.m
        w, t = present.w, present.t
        # Background loss is learnt from targets not already convicted, and not failed by at least half (and 3)
        # of the witnesses at once: random loss is uncorrelated across witnesses, an outage is not. Likewise not
        # from a witness failing half (and 3) of its targets at once (its own network, or a censor), nor from one
        # ``judged`` unreliable, censored or a failing prober.
        lost = np.flatnonzero(failed)  # few: the probes that failed now
        n_present, n_failed = present.per_inbound, np.bincount(t[lost], minlength=m)
        correlated = (n_failed >= 3) & (2 * n_failed >= n_present)
        w_present, w_failed = present.per_witness, np.bincount(w[lost], minlength=n)
        # Judged now or in the previous evaluation: the streaks of a witness cut off end all at once when it is
        # reconnected, and would teach that failures last.
        rows = ~(judged | st.judged | ((w_failed >= 3) & (2 * w_failed >= w_present)))
        st.judged = judged.copy()
        targets = ~(st.unreach_on | st.blocked_on | correlated)
        # A fresh start is a background pair whose streak was 0: nearly every pair, so counted as all of a
        # witness's pairs but those that are not (few: streaks running, targets not sampled).
        other = prev > 0
        if not targets.all():
            other |= ~targets[t]
        other_at = np.flatnonzero(other)
        h_n = np.where(rows, w_present - np.bincount(w[other_at], minlength=n), 0)
        started = lost[(prev[lost] == 0) & targets[t[lost]]]
        h_f = np.where(rows, np.bincount(w[started], minlength=n), 0)
        # Continuation is learnt from streaks that ended: a streak of L failures made min(L-1, F-1) continuations
        # among the steps 1..F-1, then (when L < F) a success among them. A streak still running says nothing yet:
        # counted while it runs, a real block's own failures would pass for bursty loss and slow its detection.
        ended = other_at[(prev[other_at] > 0) & ~failed[other_at] & targets[t[other_at]] & rows[w[other_at]]]
        ws = w[ended]
        length = prev[ended].astype(np.int64)
        continued = np.minimum(length - 1, F - 1)
        c_f = np.bincount(ws, weights=continued, minlength=n)
        c_n = c_f + np.bincount(ws, weights=length < F, minlength=n)
        _learn(st.hazard, st.hazard_n, h_n, h_f, _EWMA)
        _learn(st.cont, st.cont_n, c_n, c_f, _EWMA)
        for k, (cnt, fails) in enumerate(((h_n.sum(), h_f.sum()), (c_n.sum(), c_f.sum()))):
            _learn(st.fleet[k:k + 1], st.fleet_n[k:k + 1], np.array([cnt]), np.array([fails]), _FLEET_EWMA)

    def _odds(self) -> StreakOdds:
        """How likely each witness's streaks are by chance (2)."""
        st = self.state
        h_fleet = _estimate(st.fleet[:1], st.fleet_n[:1], _H_PRIOR, _H_PRIOR_N)
        weight = float(st.fleet_n[1])
        failures = float(st.fleet[1]) * weight
        # The failure share π from the ended streaks alone: a block in progress must not count its own failures as
        # the background it is judged against. A witness's own samples start from the fleet's estimate: they count
        # only where they say worse.
        c_fleet = (failures + _C_PRIOR * _C_PRIOR_N) / (weight + _C_PRIOR_N)
        h = np.clip(np.maximum(_estimate(st.hazard, st.hazard_n, h_fleet, _H_PRIOR_N), h_fleet), *_H_RANGE)
        c = np.clip(np.maximum(_estimate(st.cont, st.cont_n, np.array([c_fleet]), _C_PRIOR_N), c_fleet), *_C_RANGE)
        return StreakOdds(log_pi=np.log(h / (h + 1.0 - c)).astype(np.float32), log_c=np.log(c).astype(np.float32),
                          ended=(failures, weight), hazard=float(h_fleet[0]))

    def _witnesses(self, probing: Pairs, voting: np.ndarray, fresh: np.ndarray) -> Witnesses:
        """Who is an unreliable witness, a censored one, and a failing prober, read per server (3). ``voting``: the
        pairs of ``probing`` (indices) whose witness votes against the inbound."""
        topo, cfg, st = self.topology, self.settings, self.state
        n = topo.n
        # By (witness, server) pair: w probes server s, and loses it when it votes against an inbound of s.
        w, s, index = probing.by_server
        lost_at = np.unique(index[voting])
        neighbours = probing.servers_per_witness
        lost_n = np.bincount(w[lost_at], minlength=n)
        share = lost_n / np.maximum(1, neighbours)
        meaningful = fresh & (neighbours >= MIN_NEIGHBOURS)
        median = float(np.median(share[fresh])) if fresh.any() else 0.0
        heavy = meaningful & (share >= cfg.unreliable_ratio)
        suspect = heavy & (share >= median + cfg.unreliable_margin)
        ordinary = ~topo.prober_mask
        censored = np.zeros(n, dtype=bool)
        if (heavy & ordinary).any():  # the pattern is read only for the witnesses it could clear
            h = np.flatnonzero(heavy & ordinary)
            lost = np.zeros(w.size, dtype=bool)
            lost[lost_at] = True
            of_h = (heavy & ordinary)[w]
            # The censor's pattern (a): it still reaches at least half of its own country's servers.
            home = of_h & (topo.country_idx[w] == topo.country_idx[s])
            home_n = np.bincount(w[home], minlength=n)[h]
            home_reached = np.bincount(w[home & ~lost], minlength=n)[h]
            # (b), with no server of its own country to probe: the controller reached it, its self-check passed,
            # and most of what it loses the others reach (the loss is its own, not the targets').
            by_fresh = fresh[w]
            reached_by = np.bincount(s[by_fresh & ~lost], minlength=n)
            probed_by = np.bincount(s[by_fresh], minlength=n)
            fine_elsewhere = 2 * reached_by > probed_by  # (N,) by target server
            lost_fine = np.bincount(w[of_h & lost & fine_elsewhere[s]], minlength=n)[h]
            alone = st.last_service_ok[h] & (2 * lost_fine >= np.maximum(lost_n[h], 1))
            censored[h] = np.where(home_n > 0, (home_reached > 0) & (2 * home_reached >= home_n), alone)
        prober_failing = topo.prober_mask & meaningful & (2 * lost_n > neighbours)
        unreliable = np.where(ordinary, suspect & ~censored, prober_failing)
        return Witnesses(unreliable=unreliable, censored=censored, prober_failing=prober_failing)

    def _convictions(self, probing: Pairs, voters: np.ndarray, surprise: np.ndarray, eligible: Pairs,
                     log_evidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Quorums globally and per country (4). ``voters``: the pairs of ``probing`` (indices, in its order) that
        vote; ``surprise``: their -log P(streak by chance); ``eligible``: the pairs of reliable fresh witnesses.
        Returns votes and witnesses by inbound, which inbounds are unreachable now, the country that convicted
        (or -1), and the scope of a regional conviction (or -1)."""
        topo = self.topology
        n, m = topo.n, topo.m
        t_voters = probing.t[voters]
        votes = _count(t_voters, m)
        witnesses = eligible.per_inbound.astype(np.int32)
        # Fisher's statistic / 2, summed over the voters (``_sum32``: in float32, in the witnesses' order).
        global_conv = self._quorum(votes, witnesses, _sum32(t_voters, surprise, m), log_evidence)
        local_country = np.full(m, -1, dtype=np.int32)
        scope_now = np.full(m, -1, dtype=np.int16)
        if len(topo.country_codes) <= 1 or not n:
            return votes, witnesses, global_conv, local_country, scope_now
        c = len(topo.country_codes)
        key = probing.country_key[voters]
        votes_c = _count(key, c * m).reshape(c, m)
        wit_c = eligible.per_country_inbound.astype(np.int32)
        ev_c = _sum32(key, surprise, c * m).reshape(c, m)
        conv_c = self._quorum(votes_c, wit_c, ev_c, log_evidence)
        any_c = conv_c.any(axis=0)
        # A fleet-wide quorum whose voters all stand in one country, while witnesses elsewhere reach the target,
        # is that country's block too: its witnesses are not independent of its censor (HEALTH-7).
        voter_country = np.argmax(votes_c, axis=0)
        reach_c = wit_c - votes_c
        elsewhere = reach_c.sum(axis=0) - reach_c[voter_country, np.arange(m)]
        one_country = global_conv & ((votes_c > 0).sum(axis=0) == 1) & (elsewhere > 0)
        local_country = np.where(any_c & ~global_conv, np.argmax(conv_c, axis=0),
                                 np.where(one_country, voter_country, -1)).astype(np.int32)
        # One country alone convicts for its region (HEALTH-15); the fleet, or two countries at once: everywhere.
        alone = (conv_c.sum(axis=0) == 1) & ~global_conv
        scope_now = np.where(alone | one_country, local_country, -1).astype(np.int16)
        return votes, witnesses, global_conv | any_c, local_country, scope_now

    def _quorum(self, votes: np.ndarray, witnesses: np.ndarray, surprise: np.ndarray, log_evidence: float) -> np.ndarray:
        cfg = self.settings
        if cfg.quorum == "majority":
            enough = votes * 2 > witnesses
        else:
            enough = votes >= np.ceil(float(cfg.quorum) * witnesses)
        enough &= votes >= cfg.min_witnesses
        return enough & (_log_group_chance(votes, witnesses, surprise, self.topology.lgamma) <= log_evidence)


def _log_group_chance(k: np.ndarray, w: np.ndarray, y: np.ndarray, lgamma: np.ndarray) -> np.ndarray:
    """log P(k of w witnesses show streaks this unlikely by chance), elementwise.

    ``y`` is the voters' summed surprise -Σ log pᵢ. Fisher: P(χ²₂ₖ ≥ 2y) = e^{-y} Σ_{j<k} y^j/j!,
    bounded above (so the test stays cautious) by its last term over 1 - (k-1)/y; then a
    Bonferroni factor C(w, k) for which k of the w witnesses happen to be the voters.
    """
    k = np.maximum(k, 1)
    km1 = (k - 1).astype(np.float64)
    yy = y.astype(np.float64)
    tail = yy > km1 + 1e-9
    ys = np.where(tail, yy, 1.0)
    log_sf = -ys + km1 * np.log(ys) - lgamma[k] - np.log1p(-km1 / ys)
    log_sf = np.where(tail, np.minimum(log_sf, 0.0), 0.0)
    w = np.maximum(w, k)
    result: np.ndarray = log_sf + lgamma[w + 1] - lgamma[k + 1] - lgamma[w - k + 1]
    return result


def _count(index: np.ndarray, size: int) -> np.ndarray:
    """How often each of 0..size-1 occurs in ``index``, as int32 (the verdicts' counts)."""
    counts: np.ndarray = np.bincount(index, minlength=size).astype(np.int32)
    return counts


def _sum32(index: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """The float32 ``values`` summed into 0..size-1 by ``index``, in float32 and in their order (pairs by witness):
    the sums the engine has always made, bit for bit, so that no verdict near the evidence threshold flips
    (``np.bincount`` would add in float64)."""
    out = np.zeros(size, dtype=np.float32)
    np.add.at(out, index, values)
    return out


def _first_witness(t: np.ndarray, w: np.ndarray, m: int) -> np.ndarray:
    """(M,) int32: for each inbound, the first of the witnesses ``w`` (pairs sorted by witness) that hold it; -1."""
    out = np.full(m, -1, dtype=np.int32)
    found, first = np.unique(t, return_index=True)
    out[found] = w[first]
    return out


def _learn(mean: np.ndarray, weight: np.ndarray, samples: np.ndarray, failures: np.ndarray, decay: float) -> None:
    """Fold new samples into a decayed mean of a failure probability and what it weighs (in place): the old samples
    each lose ``decay`` of their weight per new sample, so the mean is the recent samples' share of failures."""
    has = samples > 0
    if not has.any():
        return
    kept = weight[has] * (1.0 - decay) ** samples[has]
    weight[has] = kept + samples[has]
    mean[has] = (mean[has] * kept + failures[has]) / weight[has]


def _estimate(mean: np.ndarray, weight: np.ndarray, prior: float | np.ndarray, prior_weight: float) -> np.ndarray:
    """The rate's estimate: its samples' mean with the prior counted as ``prior_weight`` more samples."""
    estimate: np.ndarray = (mean * weight + prior * prior_weight) / (weight + prior_weight)
    return estimate


def _lgamma(x: np.ndarray) -> np.ndarray:
    """log Γ(x) for x > 0, elementwise (to about 1e-10): Stirling's series at x + 8, shifted back by the recurrence."""
    z = x + 8.0
    shift = np.log(x * (x + 1) * (x + 2) * (x + 3) * (x + 4) * (x + 5) * (x + 6) * (x + 7))
    series = 1.0 / (12.0 * z) - 1.0 / (360.0 * z**3) + 1.0 / (1260.0 * z**5)
    result: np.ndarray = (z - 0.5) * np.log(z) - z + 0.5 * math.log(2.0 * math.pi) + series - shift
    return result


def _hysteresis(on: np.ndarray, clear: np.ndarray, now: np.ndarray, required: np.ndarray, flap: np.ndarray) -> None:
    """Set at once on evidence; clear after `required` evaluations without it (in place)."""
    # Every return of the evidence counts as a flap, also while a verdict waits to clear (route-flap damping).
    newly = now & (~on | (clear > 0))
    flap[newly] += 1.0
    clear[now] = 0
    waiting = on & ~now
    clear[waiting] += 1
    release = waiting & (clear >= required)
    on[:] = (on | now) & ~release
    clear[release] = 0
