"""The verdict engine works on the probed pairs only (``reconciler.health.pairs``): what it keeps across
evaluations must never change a verdict."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.health import HealthEngine, HealthState, Observation, Topology
from reconciler.health import pairs as health_pairs
from reconciler.health.engine import _STREAK_CAP
from reconciler.health.simulate import Scenario, World, inline_topology
from reconciler.model.cluster import HealthSettings
from tests.test_health_properties import topology_of


@st.composite
def fleets(draw):
    topology = topology_of(draw, 9, 3)
    cfg = HealthSettings(failure_streak=draw(st.integers(1, 4)), prober_streak=draw(st.integers(1, 9)),
                         recovery_streak=draw(st.integers(1, 3)), min_witnesses=draw(st.integers(2, 3)),
                         evidence=draw(st.sampled_from([1e-7, 1e-2, 0.5])))
    return topology, draw(st.integers(1, 30)), draw(st.integers(0, 2**32 - 1)), cfg


def observations(topology: Topology, ticks: int, seed: int) -> list[Observation]:
    """Probe patterns that change now and then (a plan rotating), witnesses that go silent, blocks that come and go."""
    rng = np.random.default_rng(seed)
    n, m = topology.n, topology.m
    p_fail, p_silent = rng.random() * 0.7, rng.random() * 0.5
    pattern = rng.random((n, m)) < 0.7
    blocked = rng.random((n, m)) < 0.2
    out = []
    for t in range(ticks):
        if rng.random() < 0.3:
            pattern = rng.random((n, m)) < 0.7
        out.append(Observation(
            now=60.0 * t + rng.random(), reported=rng.random(n) >= p_silent, service_ok=rng.random(n) < 0.9,
            listener_ok=rng.random(m) < 0.9, probe_present=pattern.copy(),
            probe_ok=(rng.random((n, m)) >= p_fail) & ~(blocked & (t % 10 < 6))))
    return out


def same_verdicts(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        elif f.name not in ("topology", "settings"):
            assert x == y, f.name
    assert [s.as_json() for s in a.servers().values()] == [s.as_json() for s in b.servers().values()]


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_what_is_kept_across_evaluations_never_changes_a_verdict(fleet):
    # One engine for the whole run (everything remembered), against a new engine on a loaded copy of the state
    # with nothing remembered at every tick (every pair found by a scan of the mesh).
    topology, ticks, seed, cfg = fleet
    warm = HealthEngine(topology, cfg)
    state = HealthState.initial(topology)
    for obs in observations(topology, ticks, seed):
        a = warm.evaluate(obs)
        kept = health_pairs._MEMOS.pop(topology, None)  # the cold engine starts with nothing; the warm one keeps its own
        cold = HealthEngine(topology, cfg, HealthState.from_bytes(state.to_bytes(), topology))
        b = cold.evaluate(obs)
        health_pairs._MEMOS.pop(topology, None)
        if kept is not None:
            health_pairs._MEMOS[topology] = kept
        state = cold.state
        same_verdicts(a, b)
        for name, value in vars(warm.state).items():
            assert np.array_equal(value, getattr(cold.state, name)), name


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_streaks_follow_the_reports_pair_by_pair(fleet):
    # spec: HEALTH-5 — the rule of the streaks, written over the whole mesh: a present probe extends or resets its
    # streak, a reporting witness's pair not present drops out (-1), a silent witness keeps its streaks
    topology, ticks, seed, cfg = fleet
    engine = HealthEngine(topology, cfg)
    own = np.asarray(topology.own)
    fail = engine.state.fail.copy()
    for obs in observations(topology, ticks, seed):
        present = obs.probe_present & obs.reported[:, None] & ~own
        prev = np.maximum(fail, 0)
        grown = np.where(present & ~obs.probe_ok, np.minimum(prev + 1, _STREAK_CAP), 0)
        fail = np.where(present, grown, np.where(obs.reported[:, None], -1, fail)).astype(np.int16)
        v = engine.evaluate(obs)
        assert np.array_equal(engine.state.fail, fail) and v.fail is engine.state.fail
        assert not (v.vote_matrix & (fail < cfg.failure_streak)).any()


def test_a_loop_that_makes_an_engine_per_tick_sees_what_one_engine_sees():
    # The loop makes a new HealthEngine on its state every tick; old verdicts keep what they said.
    servers = [{"name": f"s{i}", "country": ["DE", "NL", "US", "RU"][i % 4]} for i in range(60)]
    servers[0] = {"name": "p0", "country": "RU", "prober": True}
    sc = Scenario.model_validate({"servers": servers, "ticks": 40, "seed": 3, "loss": 0.05, "events": [
        {"at": 5, "until": 25, "outage": "s59"}, {"at": 8, "block": {"from": ["p0"], "to": "s30"}},
        {"at": 0, "reports_missing": {"p": 0.1}}]})
    topo = inline_topology(sc.servers)
    cfg = HealthSettings(full_mesh_up_to=10)  # the bounded plan, rotating
    world = World(sc, topo, 60.0, cfg)
    observed = [world.observe(t) for t in range(sc.ticks)]
    one = HealthEngine(topo, cfg)
    state = HealthState.initial(topo)
    kept = []
    for obs in observed:
        a = one.evaluate(obs)
        b = HealthEngine(topo, cfg, state).evaluate(obs)
        same_verdicts(a, b)
        kept.append((a, a.fail.copy(), a.vote_matrix.copy()))
    assert any(v.status[topo.inbounds.index("s59-in")] == 3 for v, _, _ in kept)
    assert kept[-1][0].status[topo.inbounds.index("s30-in")] == 2
    for v, fail, votes in kept:
        assert np.array_equal(v.fail, fail) and np.array_equal(v.vote_matrix, votes)


def test_the_streaks_the_engine_wrote_are_read_only():
    # Their identity says which pairs they hold (``reconciler.health.pairs``): an edit in place is refused, and a
    # state edited as a copy is read afresh.
    topo = Topology(servers=("a", "b", "c"), countries=("DE", "NL", "US"), probers=(False,) * 3,
                    inbounds=("a-in", "b-in", "c-in"), inbound_server=(0, 1, 2))
    engine = HealthEngine(topo, HealthSettings())
    obs = Observation(now=0.0, reported=np.ones(3, dtype=bool), service_ok=np.ones(3, dtype=bool),
                      listener_ok=np.ones(3, dtype=bool), probe_present=np.ones((3, 3), dtype=bool),
                      probe_ok=np.ones((3, 3), dtype=bool))
    engine.evaluate(obs)
    with pytest.raises(ValueError):
        engine.state.fail[0, 1] = 5
    engine.state = engine.state.copy()
    engine.state.fail[0, 1] = 5
    engine.state.fail[1, 0] = -1
    obs.reported[:] = [False, False, True]
    v = engine.evaluate(obs)
    assert v.fail[0, 1] == 5 and v.fail[1, 0] == -1 and v.fail[2, 0] == 0


def test_sums_of_evidence_are_the_float32_sums_down_the_mesh():
    # Fisher's statistic is summed per inbound in float32 in the witnesses' order: bit for bit the sum down the
    # columns of the N × M mesh, so a verdict on the edge of the evidence test does not depend on the summation.
    from reconciler.health.engine import _sum32

    rng = np.random.default_rng(7)
    n, m = 300, 40
    dense = np.where(rng.random((n, m)) < 0.3, (rng.random((n, m)) * 40).astype(np.float32), np.float32(0))
    w, t = np.nonzero(dense)
    assert np.array_equal(_sum32(t, dense[w, t], m).view(np.int32), dense.sum(axis=0).view(np.int32))
