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
   estimated as two EWMAs: the hazard *h* (a failure after a success) and the
   continuation *c* (another failure after a failure) — a two-state Markov
   chain, so bursty loss raises *c* and iid loss keeps *c ≈ h*. A streak of at
   least *s* is then this likely by chance: ``π · c^(s-1)`` with the chain's
   failure share ``π = h / (h + 1 - c)``.
3. **Unreliable witnesses** (HEALTH-6). A witness voting against at least
   ``unreliable_ratio`` of its targets *and* at least ``unreliable_margin``
   above the median share of all fresh witnesses is unreliable: its votes are
   discarded. Judging against the median keeps every witness when half the
   fleet really is down (all healthy witnesses then fail about half their
   targets, and so does the median), while a broken witness stands out.
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
   never convicts (``min_witnesses``) — that is what a prober is for.
5. **Prober** (HEALTH-9). A reliable designated prober whose streak against a
   target reaches ``prober_streak`` — and is less likely than ``evidence`` by
   chance under its background loss — marks it **blocked**. A prober's own
   inbounds are judged like anyone's: a quorum of witnesses that cannot reach
   it makes it unreachable (a prober blocked from everyone leaves rotation),
   while one ordinary server failing to reach it means nothing (no pair mark).
   A prober that is itself failing (unreliable, HEALTH-6) blocks no one.
6. **Pair marks** (HEALTH-8). A reliable ordinary witness whose streak against
   a target reaches ``prober_streak`` (one witness's word always needs the long
   streak, and on a lossy network also ``evidence``) without any quorum marks the target's inbound ``pair-unreachable``,
   naming both servers and whether the reverse direction fails too. Marks never
   take anything out of rotation.
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

from reconciler.health.topology import Topology
from reconciler.health.verdicts import BLOCKED, IN_ROTATION, NO_DATA, OK, UNAVAILABLE, UNREACHABLE, Verdicts
from reconciler.model.cluster import HealthSettings

_STREAK_CAP = 30000
_H_PRIOR, _C_PRIOR = 0.05, 0.1
_H_RANGE, _C_RANGE = (0.005, 0.5), (0.02, 0.95)
_EWMA = 0.02  # per-sample weight of a witness's own background-loss estimators
_FLEET_EWMA = 0.002  # per-sample weight of the fleet-wide estimators (many samples: fast, yet not swayed by a few)
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
    hazard: np.ndarray  # (N,) float64
    cont: np.ndarray  # (N,) float64
    fleet: np.ndarray  # (2,) float64: fleet-wide hazard and continuation
    last_report: np.ndarray  # (N,) float64, -inf = never
    last_service_ok: np.ndarray  # (N,) bool
    last_listener_ok: np.ndarray  # (M,) bool
    unreach_on: np.ndarray  # (M,) bool
    unreach_clear: np.ndarray  # (M,) int16
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
            last_report=np.full(n, -np.inf),
            last_service_ok=np.ones(n, dtype=bool),
            last_listener_ok=np.ones(m, dtype=bool),
            unreach_on=np.zeros(m, dtype=bool),
            unreach_clear=np.zeros(m, dtype=np.int16),
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
        evaluations = int(values.pop("evaluations"))
        state = cls(**values, evaluations=evaluations)
        if state.fail.shape != (topology.n, topology.m):
            return cls.initial(topology)
        return state

    def copy(self) -> HealthState:
        values: dict[str, Any] = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in vars(self).items()}
        return HealthState(**values)


class HealthEngine:
    """Carries the state and evaluates one observation at a time. Deterministic."""

    def __init__(self, topology: Topology, settings: HealthSettings, state: HealthState | None = None):
        self.topology = topology
        self.settings = settings
        self.state = state if state is not None else HealthState.initial(topology)

    def evaluate(self, obs: Observation) -> Verdicts:
        topo, cfg, st = self.topology, self.settings, self.state
        n, m = topo.n, topo.m
        own = topo.own
        F = cfg.failure_streak
        long_streak = cfg.prober_streak

        # 1. Streaks, and the background-loss samples they give. -1: the pair is not in the witness's latest report.
        present = obs.probe_present & obs.reported[:, None] & ~own
        failed = present & ~obs.probe_ok
        prev = np.maximum(st.fail, 0)
        # Background loss is learnt from targets not already convicted, and not failed by at least half (and 3)
        # of the witnesses at once: random loss is uncorrelated across witnesses, an outage is not.
        n_present = present.sum(axis=0)
        n_failed = failed.sum(axis=0)
        correlated = (n_failed >= 3) & (2 * n_failed >= n_present)
        background = present & ~(st.unreach_on | st.blocked_on | correlated)[None, :]
        fresh_start = background & (prev == 0)
        in_run = background & (prev > 0) & (prev < F)
        h_n, h_f = fresh_start.sum(axis=1), (fresh_start & failed).sum(axis=1)
        c_n, c_f = in_run.sum(axis=1), (in_run & failed).sum(axis=1)
        _update_rate(st.hazard, h_n, h_f, _H_RANGE)
        _update_rate(st.cont, c_n, c_f, _C_RANGE)
        for k, (cnt, fails, bounds) in enumerate(((h_n.sum(), h_f.sum(), _H_RANGE), (c_n.sum(), c_f.sum(), _C_RANGE))):
            if cnt:
                weight = 1.0 - (1.0 - _FLEET_EWMA) ** cnt
                st.fleet[k] = np.clip(st.fleet[k] + weight * (fails / cnt - st.fleet[k]), *bounds)
        held = np.where(obs.reported[:, None], np.int16(-1), st.fail)
        st.fail = np.where(present, np.where(failed, np.minimum(prev + 1, _STREAK_CAP), 0), held).astype(np.int16)
        fail = st.fail
        probing = (fail >= 0) & ~own  # the witness's latest report has this pair

        # Self-reports (HEALTH-1..3).
        st.last_report = np.where(obs.reported, obs.now, st.last_report)
        st.last_service_ok = np.where(obs.reported, obs.service_ok, st.last_service_ok)
        reported_t = obs.reported[topo.server_of]
        st.last_listener_ok = np.where(reported_t, obs.listener_ok, st.last_listener_ok)
        fresh = (obs.now - st.last_report) <= cfg.staleness

        # 2-3. Votes of fresh witnesses; unreliable ones discarded (HEALTH-6). A prober's own inbounds are judged
        # like anyone's (HEALTH-9): one server failing to reach it means nothing (no pair mark, below), but a
        # quorum that cannot reach it takes it out of rotation like any other server.
        vote = (fail >= F) & fresh[:, None] & ~own
        share = vote.sum(axis=1) / np.maximum(1, probing.sum(axis=1))
        median = float(np.median(share[fresh])) if fresh.any() else 0.0
        unreliable = fresh & (share >= cfg.unreliable_ratio) & (share >= median + cfg.unreliable_margin)
        reliable = fresh & ~unreliable
        V = vote & reliable[:, None]

        # 4. Quorum: globally and per country, with the evidence test (HEALTH-5, HEALTH-7).
        # A witness's chance of a streak: from the larger of its own and the fleet's loss (the cautious choice).
        h = np.maximum(st.hazard, st.fleet[0])
        c = np.maximum(st.cont, st.fleet[1])
        log_pi = np.log(h / (h + 1.0 - c)).astype(np.float32)
        log_c = np.log(c).astype(np.float32)
        # -log P(streak >= s by chance), summed over the voters (Fisher's statistic / 2).
        surprise = np.where(V, -(log_pi[:, None] + (fail.astype(np.float32) - 1) * log_c[:, None]), np.float32(0))
        eligible = (reliable[:, None] & probing).astype(np.int32)
        votes = V.sum(axis=0, dtype=np.int32)
        witnesses = eligible.sum(axis=0, dtype=np.int32)
        log_evidence = math.log(cfg.evidence)
        global_conv = self._quorum(votes, witnesses, surprise.sum(axis=0), log_evidence)

        local_country = np.full(m, -1, dtype=np.int32)
        if len(topo.country_codes) > 1 and n:
            order, starts = topo.country_order, topo.country_starts
            votes_c = np.add.reduceat(V[order].astype(np.int32), starts, axis=0)
            wit_c = np.add.reduceat(eligible[order], starts, axis=0)
            ev_c = np.add.reduceat(surprise[order], starts, axis=0)
            conv_c = self._quorum(votes_c, wit_c, ev_c, log_evidence)
            any_c = conv_c.any(axis=0)
            local_country = np.where(any_c & ~global_conv, np.argmax(conv_c, axis=0), -1).astype(np.int32)
            unreach_now = global_conv | any_c
        else:
            unreach_now = global_conv

        # 5. Probers (HEALTH-9): the long streak, and (on lossy networks) the evidence of one witness.
        probers = np.flatnonzero(topo.prober_mask & reliable)
        blocked_by = np.full(m, -1, dtype=np.int32)
        if probers.size:
            f = fail[probers]
            p_chance = log_pi[probers, None] + (f.astype(np.float32) - 1) * log_c[probers, None]
            hits = (f >= long_streak) & probing[probers] & (p_chance <= log_evidence)
            any_hit = hits.any(axis=0)
            blocked_by = np.where(any_hit, probers[np.argmax(hits, axis=0)], -1).astype(np.int32)
        else:
            any_hit = np.zeros(m, dtype=bool)

        # A fresh "not well" report explains every failed probe: it replaces, not adds to, a conviction.
        report_fresh_t = fresh[topo.server_of]
        unavailable_t = report_fresh_t & (~st.last_service_ok[topo.server_of] | ~st.last_listener_ok)
        unreach_now &= ~unavailable_t
        any_hit &= ~unavailable_t
        for on, clear in ((st.unreach_on, st.unreach_clear), (st.blocked_on, st.blocked_clear)):
            on[unavailable_t] = False
            clear[unavailable_t] = 0

        # 8. Hysteresis with flap damping (HEALTH-12).
        st.flap *= _FLAP_DECAY
        required = (cfg.recovery_streak * np.exp2(np.clip(np.floor(st.flap) - 1, 0, 5))).astype(np.int16)
        _hysteresis(st.unreach_on, st.unreach_clear, unreach_now, required, st.flap)
        _hysteresis(st.blocked_on, st.blocked_clear, any_hit, required, st.flap)

        # 7. Statuses by precedence.
        status = np.where(
            unavailable_t, UNAVAILABLE,
            np.where(st.unreach_on, UNREACHABLE,
                     np.where(st.blocked_on, BLOCKED, np.where(report_fresh_t, OK, NO_DATA))),
        ).astype(np.int8)

        report_status = np.where(fresh, np.where(st.last_service_ok, OK, UNAVAILABLE), NO_DATA).astype(np.int8)
        listeners_all_down = np.ones(n, dtype=bool)
        np.logical_and.at(listeners_all_down, topo.server_of, ~st.last_listener_ok)
        has_inbounds = np.bincount(topo.server_of, minlength=n) > 0
        report_status = np.where(fresh & has_inbounds & listeners_all_down, UNAVAILABLE, report_status).astype(np.int8)
        server_status = report_status.copy()
        if m:
            np.maximum.at(server_status, topo.server_of, status)

        # 6. Pair marks (HEALTH-8): sparse, long streaks of ordinary reliable witnesses, no quorum.
        marks: list[tuple[int, int, bool]] = []
        ordinary = reliable & ~topo.prober_mask
        candidates = (fail >= long_streak) & ordinary[:, None] & ~own
        if candidates.any():
            candidates &= (log_pi[:, None] + (fail.astype(np.float32) - 1) * log_c[:, None]) <= log_evidence
        if candidates.any():
            ws, ts = np.nonzero(candidates & ~st.unreach_on[None, :] & ~topo.prober_target[None, :])
            for w, t in zip(ws.tolist(), ts.tolist(), strict=True):
                back = fail[topo.server_of[t]][topo.server_of == w]
                both = bool(back.size and (back >= long_streak).any() and fresh[topo.server_of[t]])
                marks.append((w, t, both))

        st.evaluations += 1
        return Verdicts(
            topology=topo, now=obs.now, status=status, in_rotation=IN_ROTATION[status],
            votes=votes, witnesses=witnesses, local_country=local_country, blocked_by=blocked_by,
            server_status=server_status, server_report_status=report_status, unreliable=unreliable,
            last_report=st.last_report.copy(), service_ok=st.last_service_ok.copy(), settings=cfg,
            vote_matrix=V, fail=fail, pair_marks=marks,
        )

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


def _update_rate(rate: np.ndarray, samples: np.ndarray, failures: np.ndarray, bounds: tuple[float, float]) -> None:
    """EWMA of a failure probability, weighted by how many samples arrived (in place)."""
    has = samples > 0
    if not has.any():
        return
    weight = 1.0 - (1.0 - _EWMA) ** samples[has]
    rate[has] += weight * (failures[has] / samples[has] - rate[has])
    np.clip(rate, *bounds, out=rate)


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
