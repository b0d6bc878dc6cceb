"""Property tests of the verdict engine over arbitrary inputs (HEALTH-11, HEALTH-12)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.health import HealthEngine, Observation, Topology
from reconciler.model.cluster import HealthSettings


def topology_of(draw, servers: int, inbounds_per_server: int) -> Topology:  # type: ignore[no-untyped-def]
    """A random topology: 1..servers servers in three countries, some probers, 0..inbounds_per_server inbounds each."""
    n = draw(st.integers(1, servers))
    countries = tuple(draw(st.sampled_from(["DE", "RU", "US"])) for _ in range(n))
    probers = tuple(draw(st.booleans()) for _ in range(n))
    per_server = [draw(st.integers(0, inbounds_per_server)) for _ in range(n)]
    inbound_server = tuple(i for i, k in enumerate(per_server) for _ in range(k))
    return Topology(servers=tuple(f"s{i}" for i in range(n)), countries=countries, probers=probers,
                    inbounds=tuple(f"in{j}" for j in range(len(inbound_server))), inbound_server=inbound_server)


@st.composite
def fleets(draw):
    topology = topology_of(draw, 7, 2)
    ticks = draw(st.integers(1, 25))
    seed = draw(st.integers(0, 2**32 - 1))
    cfg = HealthSettings(failure_streak=draw(st.integers(1, 4)), prober_streak=draw(st.integers(1, 9)),
                         recovery_streak=draw(st.integers(1, 3)), min_witnesses=draw(st.integers(2, 3)))
    return topology, ticks, seed, cfg


def observations(topology: Topology, ticks: int, seed: int) -> list[Observation]:
    rng = np.random.default_rng(seed)
    n, m = topology.n, topology.m
    out = []
    p_fail, p_silent = rng.random(), rng.random()
    for t in range(ticks):
        out.append(Observation(
            now=60.0 * t + rng.random(),
            reported=rng.random(n) >= p_silent,
            service_ok=rng.random(n) < 0.9,
            listener_ok=rng.random(m) < 0.9,
            probe_present=rng.random((n, m)) < 0.9,
            probe_ok=rng.random((n, m)) >= p_fail,
        ))
    return out


@settings(max_examples=200, deadline=None)
@given(fleets())
def test_any_inputs_keep_a_best_available_order_for_every_route(fleet):
    # spec: HEALTH-11, LB-8: whatever the verdicts, every route's inbounds can be ordered, none dropped
    topology, ticks, seed, cfg = fleet
    engine = HealthEngine(topology, cfg)
    for obs in observations(topology, ticks, seed):
        v = engine.evaluate(obs)
        ids = list(topology.inbounds)
        order = v.best_available(ids)
        assert sorted(order) == sorted(ids)
        if ids and v.in_rotation.any():
            assert v.in_rotation[topology.inbounds.index(order[0])]
        for name in topology.servers:
            sv = v.server(name)
            assert sv.status in ("ok", "no_data", "blocked", "unreachable", "unavailable") and sv.reason
        assert (v.in_rotation == np.isin(v.status, [0, 1])).all()  # HEALTH-10: one place decides rotation


@settings(max_examples=100, deadline=None)
@given(fleets())
def test_same_inputs_and_state_give_the_same_output(fleet):
    topology, ticks, seed, cfg = fleet
    obs = observations(topology, ticks, seed)
    a, b = HealthEngine(topology, cfg), HealthEngine(topology, cfg)
    for o in obs:
        va, vb = a.evaluate(o), b.evaluate(o)
        assert (va.status == vb.status).all() and va.pair_marks == vb.pair_marks
        assert [s.reason for s in va.servers().values()] == [s.reason for s in vb.servers().values()]
