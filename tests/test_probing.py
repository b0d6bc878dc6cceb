"""The probe plan (issue 17, item 2): bounded probing that keeps every HEALTH rule, pure and seeded."""

from __future__ import annotations

import numpy as np
import pytest

from reconciler.fleet.reports import agent_request
from reconciler.health import HealthEngine, Observation, Topology
from reconciler.health.probing import GROUPS, probe_plan, rotation_period, uses_full_mesh, witness_bound
from reconciler.health.simulate import Scenario, World, inline_topology
from reconciler.model import Cluster
from reconciler.model.cluster import HealthSettings

SETTINGS = HealthSettings()
F = SETTINGS.failure_streak
K = SETTINGS.probe_sample
COUNTRIES = ["DE", "NL", "US", "FR", "GB", "RU", "JP", "SG", "FI", "PL", "CA", "AU", "TR", "BR", "IN", "SE"]


def topology(n: int, countries: list[str] | None = None, probers: int = 0, inbounds: int = 1) -> Topology:
    """n servers round-robin over `countries` (16 by default); the first `probers` are probers."""
    codes = countries or COUNTRIES
    servers = tuple(f"s{i}" for i in range(n))
    return Topology(servers=servers, countries=tuple(codes[i % len(codes)] for i in range(n)),
                    probers=tuple(i < probers for i in range(n)),
                    inbounds=tuple(f"s{i}-in{k}" for i in range(n) for k in range(inbounds)),
                    inbound_server=tuple(i for i in range(n) for _ in range(inbounds)))


def inline_fleet(n: int, probers: int = 0) -> list[dict[str, object]]:
    servers: list[dict[str, object]] = [{"name": f"s{i}", "country": COUNTRIES[i % 16]} for i in range(n)]
    for i in range(probers):
        servers[i] = {"name": f"p{i}", "country": "RU", "prober": True}
    return servers


# --------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("shape", ["16 countries", "countries of 4", "one country"])
def test_probes_per_server_stay_bounded_as_the_fleet_grows(shape):
    # spec: HEALTH-4 — the full mesh is N² probes; the bounded plan keeps each ordinary server's share bounded
    bound = witness_bound(SETTINGS)
    worst = []
    for n in (100, 1000, 3000):
        countries = {"16 countries": None, "countries of 4": [f"C{i}" for i in range(n // 4)], "one country": ["DE"]}[shape]
        topo = topology(n, countries, probers=n // 50, inbounds=2)
        most = 0
        for interval in (0, 5, 17, 123):
            plan = probe_plan(topo, interval, SETTINGS)
            assert not plan.full
            targets = plan.pairs.sum(axis=1)
            probes = plan.probes_per_server(topo)
            ordinary = ~topo.prober_mask
            assert targets[ordinary].max() <= bound  # target servers per ordinary witness
            assert probes[ordinary].max() <= 2 * bound  # two inbounds per server
            assert (targets[topo.prober_mask] == n - 1).all()  # HEALTH-9: probers check everyone
            most = max(most, int(targets[ordinary].max()))
        worst.append(most)
    assert worst[2] <= worst[1] + 8, worst  # N x 3, the load does not grow
    assert worst[1] < (1000 - 1) / 8


def test_every_target_is_covered_every_interval_by_its_country_the_probers_and_k_others():
    # spec: HEALTH-7, HEALTH-9 — same-country witnesses and probers always probe; a country quorum can form
    # among every other country's servers; and at least probe_sample others besides
    n = 1000
    topo = topology(n, probers=20)
    country = np.asarray(topo.country_idx)
    for interval in range(0, 40, 3):
        pairs = probe_plan(topo, interval, SETTINGS).pairs
        for j in range(0, n, 7):
            witnesses = pairs[:, j]
            same = country == country[j]
            same[j] = False
            assert witnesses[topo.prober_mask & (np.arange(n) != j)].all()
            expected_same = min(int(same.sum()), SETTINGS.probe_country)
            assert int((witnesses & same).sum()) >= expected_same
            others = witnesses & ~same & ~topo.prober_mask
            others[j] = False
            assert int(others.sum()) >= K
            for x in range(len(topo.country_codes)):
                if x == country[j]:
                    continue
                ordinary_x = (country == x) & ~topo.prober_mask
                assert int((witnesses & ordinary_x).sum()) >= min(SETTINGS.probe_per_country, int(ordinary_x.sum()))


def test_a_small_country_is_witnessed_by_all_its_servers():
    # spec: HEALTH-7 — "all servers in its country": a country of up to probe_country + 1 servers probes each other
    topo = topology(200, countries=["DE"] * 9 + ["NL"] * 191)
    pairs = probe_plan(topo, 3, SETTINGS).pairs
    de = np.flatnonzero(np.asarray(topo.countries) == "DE")
    assert pairs[np.ix_(de, de)].sum() == len(de) * (len(de) - 1)


def test_the_rotation_reaches_every_pair_over_time_one_group_at_a_time():
    # spec: HEALTH-4, HEALTH-8 — over time every server probes every other; the sample changes a group at a time
    n = 100
    topo = topology(n, probers=2)
    period = rotation_period(SETTINGS)
    seen = np.zeros((n, n), dtype=bool)
    previous = None
    changed_most = 0
    for interval in range(period * (n // K + 3)):
        pairs = probe_plan(topo, interval, SETTINGS).pairs
        seen |= pairs
        if previous is not None:
            changed_most = max(changed_most, int((pairs & ~previous).sum(axis=0).max()))
        previous = pairs
    assert (seen | np.eye(n, dtype=bool)).all()
    assert changed_most <= -(-K // GROUPS) + 1  # new witnesses of one target in one interval: about one group
    # Within any failure streak, at most one group of a target's witnesses is new.
    for start in range(0, 3 * period, 5):
        before = probe_plan(topo, start, SETTINGS).pairs
        after = probe_plan(topo, start + F - 1, SETTINGS).pairs
        assert int((after & ~before).sum(axis=0).max()) <= -(-K // GROUPS) + 1


def test_the_plan_is_deterministic_and_rotates():
    topo = topology(500, probers=3)
    a, b = probe_plan(topo, 40, SETTINGS), probe_plan(topo, 40, SETTINGS)
    assert (a.pairs == b.pairs).all()
    later = probe_plan(topo, 40 + rotation_period(SETTINGS), SETTINGS)
    assert (later.pairs != a.pairs).any()
    assert not a.pairs.diagonal().any()


def test_small_fleets_get_the_full_mesh():
    # spec: HEALTH-4 — up to full_mesh_up_to servers nothing changes: everyone probes everyone
    for n in (1, 2, 10, SETTINGS.full_mesh_up_to):
        topo = topology(n, probers=1)
        plan = probe_plan(topo, 7, SETTINGS)
        assert plan.full and (plan.pairs == ~np.eye(n, dtype=bool)).all()
    big = topology(300)
    assert not uses_full_mesh(big, SETTINGS)
    always = SETTINGS.model_copy(update={"full_mesh_up_to": 10**6})
    assert probe_plan(big, 7, always).full


# --------------------------------------------------------------------------- the engine reads only what arrived


def test_a_pair_not_probed_is_not_present_rather_than_a_failure():
    # spec: HEALTH-5 — a pair outside the witness's plan has no streak, no vote and does not count as a witness
    topo = topology(4, countries=["DE"])
    engine = HealthEngine(topo, SETTINGS)
    n, m = topo.n, topo.m
    ok = np.ones((n, m), dtype=bool)
    ok[:, 3] = False  # nobody reaches s3 ...
    present = np.ones((n, m), dtype=bool)
    # Two witnesses in a fleet that has learnt nothing of its loss yet need a streak a little longer than
    # failure_streak (HEALTH-5: until streaks have ended, a long one is judged cautiously).
    for t in range(F + 3):
        if t >= 1:
            present[0, 3] = False  # ... but s0 stopped probing it
        v = engine.evaluate(Observation(now=60.0 * t, reported=np.ones(n, dtype=bool), service_ok=np.ones(n, dtype=bool),
                                        listener_ok=np.ones(m, dtype=bool), probe_present=present, probe_ok=ok))
    assert engine.state.fail[0, 3] == -1 and not v.vote_matrix[0, 3]
    assert v.witnesses[3] == 2 and v.votes[3] == 2 and v.status[3] == 3  # s1 and s2 convict; s0 is not counted
    # s0 probes it again: its streak starts afresh, not from where it left off.
    present[0, 3] = True
    engine.evaluate(Observation(now=60.0 * (F + 3), reported=np.ones(n, dtype=bool), service_ok=np.ones(n, dtype=bool),
                                listener_ok=np.ones(m, dtype=bool), probe_present=present, probe_ok=ok))
    assert engine.state.fail[0, 3] == 1


def test_a_silent_witness_keeps_its_streaks_while_its_report_is_fresh():
    # spec: HEALTH-3, HEALTH-5 — no report is not a plan change: the streaks are held, as before
    topo = topology(4, countries=["DE"])
    engine = HealthEngine(topo, SETTINGS)
    n, m = topo.n, topo.m
    ok = np.ones((n, m), dtype=bool)
    ok[:, 3] = False
    reported = np.ones(n, dtype=bool)
    for t in range(F + 1):
        reported[0] = t < F
        engine.evaluate(Observation(now=60.0 * t, reported=reported.copy(), service_ok=np.ones(n, dtype=bool),
                                    listener_ok=np.ones(m, dtype=bool), probe_present=np.ones((n, m), dtype=bool),
                                    probe_ok=ok))
    assert engine.state.fail[0, 3] == F


# --------------------------------------------------------------------------- the verdicts at N = 1,000


def run_world(servers, events, ticks, loss, settings=SETTINGS, seed=5):
    sc = Scenario.model_validate({"servers": servers, "ticks": ticks, "seed": seed, "loss": loss, "events": events})
    topo = inline_topology(sc.servers)
    world, engine = World(sc, topo, settings.report_interval, settings), HealthEngine(topo, settings)
    return topo, [engine.evaluate(world.observe(t)) for t in range(ticks)]


def test_a_country_block_is_detected_within_the_streak_at_n1000_with_the_bounded_plan():
    # spec: HEALTH-7, HEALTH-5 — all same-country witnesses of a target fail (the censor there), 5% loss elsewhere;
    # also the witnesses of another country (a censor abroad); at several phases of the rotation
    servers = inline_fleet(1000, probers=20)
    target = "s997"  # FI
    target_country = "FI"
    same = [s["name"] for s in servers if s["country"] == target_country and s["name"] != target]
    abroad = [s["name"] for s in servers if s["country"] == "NL"]
    for at, blockers, country in ((9, same, "FI"), (10, abroad, "NL"), (14, same, "FI")):
        topo, verdicts = run_world(servers, [{"at": at, "block": {"from": blockers, "to": target}}], ticks=at + F + 1,
                                   loss=0.05)
        i = topo.servers.index(target)
        hit = next((t for t, v in enumerate(verdicts) if v.server_status[i] == 3), None)
        assert hit is not None and at <= hit <= at + F, (at, country, hit)  # within failure_streak + 1 checks
        sv = verdicts[hit].server(target)
        assert f"servers in {country}" in sv.reason and "servers elsewhere still reach it" in sv.reason
        assert sum(int((v.status == 3).sum()) for v in verdicts) == len(verdicts) - hit  # nobody else convicted


def test_an_outage_is_detected_within_the_streak_at_every_phase_of_the_rotation():
    # spec: HEALTH-5 — the sample changes a group at a time, so new witnesses never stall a conviction
    servers = inline_fleet(300)
    period = rotation_period(SETTINGS)
    for at in range(8, 8 + period, 3):
        topo, verdicts = run_world(servers, [{"at": at, "outage": "s150"}], ticks=at + F + 1, loss=0.05, seed=at)
        i = topo.servers.index("s150")
        hit = next((t for t, v in enumerate(verdicts) if v.server_status[i] == 3), None)
        assert hit is not None and hit <= at + F, (at, hit)


@pytest.mark.parametrize("loss", [0.05, 0.2])
def test_random_loss_gives_no_false_verdict_over_hundreds_of_intervals(loss):
    # spec: HEALTH-5, HEALTH-6, HEALTH-9 — a healthy fleet probed with the bounded plan: nobody leaves rotation
    servers = inline_fleet(300, probers=6)
    topo, verdicts = run_world(servers, [], ticks=400, loss=loss, seed=17)
    assert not uses_full_mesh(topo, SETTINGS)
    assert all(v.in_rotation.all() for v in verdicts)
    assert all((v.status == 0).all() for v in verdicts)


# --------------------------------------------------------------------------- the agents are asked their row


def cluster(n: int) -> Cluster:
    servers = []
    for i in range(n):
        inbounds = [{"id": f"s{i}-a", "name": f"S{i}", "protocol": "vless-tls", "port": 443, "tls": {"server_name": "x.test"},
                     "route": "r"},
                    {"id": f"s{i}-b", "name": f"S{i}b", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"}]
        servers.append({"name": f"s{i}", "host": f"198.18.{i // 200}.{10 + i % 200}", "country": COUNTRIES[i % 4],
                        "prober": i == 0, "inbounds": inbounds})
    return Cluster.model_validate({"servers": servers, "routes": [{"id": "r", "name": "R"}], "users": [{"name": "u"}]})


def test_agent_request_asks_each_server_for_its_row_of_the_plan():
    # spec: HEALTH-4, HEALTH-9
    c = cluster(120)
    topo = Topology.from_cluster(c)
    settings = c.settings.health
    for interval in (0, 1, 50):
        plan = probe_plan(topo, interval, settings)
        for name in ("s0", "s7", "s119"):
            w = topo.servers.index(name)
            req = agent_request(c, name, "sekrit", 2.0, interval=interval)
            ids = [p["id"] for p in req["probes"]]
            expected = [topo.inbounds[t] for t in np.flatnonzero(plan.inbound_mask(topo)[w])]
            assert ids == expected  # every inbound of a planned server, in file order
            if name == "s0":
                assert len(ids) == 2 * 119  # the prober probes everyone
            else:
                assert len(ids) <= 2 * witness_bound(settings) and len(ids) < 2 * 119
    rows = {tuple(p["id"] for p in agent_request(c, "s7", "sekrit", 2.0, interval=i)["probes"]) for i in range(0, 200, 16)}
    assert len(rows) > 1  # the sample rotates


def test_agent_request_of_a_small_fleet_is_the_full_mesh_at_any_interval():
    c = cluster(12)
    for interval in (0, 99):
        req = agent_request(c, "s3", "sekrit", 2.0, interval=interval)
        assert [p["id"] for p in req["probes"]] == [r.inbound.id for r in c.inbounds if r.server.name != "s3"]
