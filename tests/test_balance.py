"""Balancing inside a route (LB-1..9) and what a user's subscription holds (ROUTE-1,2,5,7, HEALTH-10,11,13)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from reconciler.balance import CapacityEstimator, decide, rebalance
from tests.balance_helpers import cluster, snapshot, verdicts

R = [{"id": "r", "name": "R"}]


def shares(assignments: dict, route: str = "r") -> Counter:
    return Counter(v for (u, r), v in assignments.items() if r == route)


def test_least_loaded_prefers_spare_bandwidth_per_user_in_proportion():
    # spec: LB-1, LB-2, LB-9
    c = cluster([{"name": n, "route": "r"} for n in ("a", "b", "c")], R, users=9000)
    snap = snapshot(c, loads={"a": (100, 10, 1000), "b": (100, 10, 2000), "c": (100, 10, 500)})
    got = shares(rebalance(snap))
    # Spare per user after the batch evens out, so shares follow spare capacity (900 : 1900 : 400), no herding.
    total = sum(got.values())
    for name, spare in (("a-in", 900), ("b-in", 1900), ("c-in", 400)):
        assert got[name] / total == pytest.approx(spare / 3200, abs=0.03)


def test_a_weak_saturated_server_gets_no_new_users_even_with_fewer_people():
    # spec: LB-2
    c = cluster([{"name": "weak", "route": "r"}, {"name": "big", "route": "r"}], R, users=2000)
    snap = snapshot(c, loads={"weak": (98, 2, 100), "big": (500, 400, 1000)})
    assert shares(rebalance(snap))["weak-in"] == 0
    entry = decide(snap, "u1")[0]
    assert entry.ref.server.name == "big" and entry.why.startswith("least-loaded")


def test_everyone_saturated_still_serves_by_capacity():
    # spec: LB-2, LB-8
    c = cluster([{"name": "a", "route": "r"}, {"name": "b", "route": "r"}], R, users=3000)
    got = shares(rebalance(snapshot(c, loads={"a": (100, 5, 100), "b": (300, 5, 300)})))
    assert got["b-in"] / 3000 == pytest.approx(0.75, abs=0.04)


def test_capacity_estimates_follow_peaks_and_cool_down():
    # spec: LB-3
    est = CapacityEstimator.empty(2, half_life=3600.0)
    assert np.isnan(est.estimate(0.0)).all()  # no estimate before a real peak
    est.observe(0.0, np.array([0.2, 800.0]), np.array([True, True]))
    e = est.estimate(0.0)
    assert np.isnan(e[0]) and e[1] == 800.0
    assert est.estimate(3600.0)[1] == pytest.approx(400.0)  # one half-life later
    est.observe(3600.0, np.array([0.0, 600.0]), np.array([True, True]))
    assert est.estimate(3600.0)[1] == 600.0  # a new, higher load raises it again
    est.observe(3600.0, np.array([0.0, 5000.0]), np.array([True, False]))
    assert est.estimate(3600.0)[1] == 600.0  # invalid samples are ignored
    assert est.estimate(3600.0 * 40)[1] >= 1.0  # never cools below the floor


def test_round_robin_follows_coefficients():
    # spec: LB-4
    c = cluster([{"name": "one", "route": "r", "coefficient": 1.0}, {"name": "two", "route": "r", "coefficient": 2.0}],
                [{"id": "r", "name": "R", "balance": "round-robin"}], users=6000)
    got = shares(rebalance(snapshot(c)))
    assert got["two-in"] / got["one-in"] == pytest.approx(2.0, rel=0.08)
    assert "round-robin by coefficient" in decide(snapshot(c), "u0")[0].why


def test_a_candidate_without_estimate_makes_the_route_round_robin():
    # spec: LB-5
    c = cluster([{"name": "old", "route": "r"}, {"name": "new", "route": "r"}], R, users=4000)
    snap = snapshot(c, loads={"old": (100, 10, 1000), "new": (0, 0, None)})
    got = shares(rebalance(snap))
    assert got["new-in"] / 4000 == pytest.approx(0.5, abs=0.05)
    assert "no capacity estimate yet for new" in decide(snap, "u1")[0].why


def test_noise_in_metrics_moves_nobody_and_exclusion_moves_only_its_users():
    # spec: LB-6, LB-7, LB-9
    names = [f"s{i}" for i in range(10)]
    c = cluster([{"name": n, "route": "r"} for n in names], R, users=20000)
    rng = np.random.default_rng(1)
    base = {n: (100.0 * (i + 1), 100 + i, 1000.0 + 100 * i) for i, n in enumerate(names)}
    first = rebalance(snapshot(c, loads=base))
    for noise in (0.01, 0.05):
        noisy = {n: (t * (1 + rng.uniform(-noise, noise)), int(u * (1 + rng.uniform(-noise, noise))), cap)
                 for n, (t, u, cap) in base.items()}
        again = rebalance(snapshot(c, loads=noisy, assignments=first))
        assert sum(1 for k in first if first[k] != again[k]) == 0
    v = verdicts(c, down=("s3",))
    after = rebalance(snapshot(c, loads=base, assignments=first, verdicts=v))
    moved = [k for k in first if first[k] != after[k]]
    assert moved and all(first[k] == "s3-in" for k in moved)
    assert "s3-in" not in set(after.values())


def test_decide_agrees_with_the_batch_for_the_same_snapshot():
    # DESIGN: files and the live endpoint give the same answer for the same snapshot
    c = cluster([{"name": n, "route": "r"} for n in ("a", "b", "c")], R, users=500)
    snap = snapshot(c, loads={"a": (10, 1, 100), "b": (10, 1, 200), "c": (10, 1, 300)})
    table = rebalance(snap)
    after = snapshot(c, loads={"a": (10, 1, 100), "b": (10, 1, 200), "c": (10, 1, 300)}, assignments=table)
    for i in range(500):
        assert decide(after, f"u{i}")[0].ref.inbound.id == table[(f"u{i}", "r")]


def test_never_empty_serves_the_best_available():
    # spec: LB-8, HEALTH-11
    c = cluster([{"name": "a", "route": "r"}, {"name": "b", "route": "r"}], R)
    v = verdicts(c, down=("a", "b"))
    entries = decide(snapshot(c, verdicts=v), "u0")
    assert len(entries) == 1 and not entries[0].in_rotation
    assert entries[0].why.startswith("best available")
    assert "unavailable" in entries[0].health  # HEALTH-13: the reason travels with the entry


def test_out_of_rotation_is_excluded_but_silence_is_not():
    # spec: LB-7, HEALTH-10
    c = cluster([{"name": "a", "route": "r"}, {"name": "b", "route": "r"}], R, users=200)
    v = verdicts(c, down=("a",))
    assert {e.ref.server.name for u in range(200) for e in decide(snapshot(c, verdicts=v), f"u{u}")} == {"b"}
    v = verdicts(c, silent=("a",))
    assert {e.ref.server.name for u in range(200) for e in decide(snapshot(c, verdicts=v), f"u{u}")} == {"a", "b"}


def test_pair_marked_inbounds_get_fewer_users_but_some():
    # spec: HEALTH-8, LB-7
    c = cluster([{"name": n, "route": "r"} for n in ("a", "b", "w1", "w2")], R, users=8000)
    v = verdicts(c, pairs=(("w1", "a"),), ticks=24)  # one witness, lossless, from a cold start: a long streak
    assert v.server("a").marks and v.server("a").in_rotation
    got = shares(rebalance(snapshot(c, verdicts=v)))
    assert 0 < got["a-in"] < 0.8 * got["b-in"]


def test_entries_follow_route_order_name_the_inbound_and_hide_empty_routes():
    # spec: ROUTE-1, ROUTE-2, ROUTE-5, ROUTE-7
    routes = [{"id": "z", "name": "Zed"}, {"id": "empty", "name": "Nothing"}, {"id": "a", "name": "Aye"}]
    c = cluster([{"name": "s1", "inbounds": [("s1-z", "z"), ("s1-a", "a")]}, {"name": "s2", "inbounds": [("s2-z", "z")]}],
                routes)
    entries = decide(snapshot(c), "u0")
    assert [e.route.id for e in entries] == ["z", "a"]
    assert all(e.name == e.ref.inbound.name for e in entries)


def test_disabled_expired_and_unknown_users_get_nothing():
    c = cluster([{"name": "s1", "route": "r"}], R,
                users=[{"name": "on"}, {"name": "off", "enabled": False}, {"name": "old", "expires": "2020-01-01"}])
    snap = snapshot(c, now=1.8e9)
    assert decide(snap, "on") and not decide(snap, "off") and not decide(snap, "old") and not decide(snap, "ghost")
    assert {u for u, _ in rebalance(snap)} == {"on"}


def test_a_server_unreachable_from_one_country_leaves_rotation_only_for_that_region():
    # spec: HEALTH-15, STEER-4, LB-7: the RU witnesses cannot reach de-1, everyone else can: users of EEU (and of
    # no known region) get other servers, users elsewhere keep it in their rotation — in the batch and live
    servers = [{"name": n, "country": c, "route": "r"} for n, c in
               (("ru-1", "RU"), ("ru-2", "RU"), ("ru-3", "RU"), ("de-1", "DE"), ("nl-1", "NL"))]
    users = ([{"name": f"e{i}", "region": "EEU"} for i in range(300)] + [{"name": f"w{i}", "region": "WEU"} for i in range(300)]
             + [{"name": f"x{i}"} for i in range(300)])
    c = cluster(servers, R, users=users)
    v = verdicts(c, pairs=(("ru-1", "de-1"), ("ru-2", "de-1"), ("ru-3", "de-1")), ticks=24)
    de1 = v.server("de-1")
    assert de1.status == "unreachable" and de1.unreachable_from == "RU" and de1.out_for == "EEU" and not de1.in_rotation
    snap = snapshot(c, verdicts=v)
    held = rebalance(snap)
    by_region: dict[str, Counter] = {p: Counter() for p in "ewx"}
    for (user, _), inbound in held.items():
        by_region[user[0]][inbound] += 1
    assert by_region["e"]["de-1-in"] == 0 and by_region["x"]["de-1-in"] == 0
    assert by_region["w"]["de-1-in"] > 30  # about a fifth of WEU's users: it stays in their rotation
    live = snapshot(c, verdicts=v, assignments=held)
    assert all(e.ref.inbound.id != "de-1-in" for e in decide(live, "x1", region="EEU"))  # the address says EEU
    got = decide(live, next(u for (u, _), i in held.items() if i == "de-1-in"))
    assert got[0].ref.inbound.id == "de-1-in" and got[0].in_rotation  # a WEU user keeps it (LB-6)
    assert "out of rotation for users in EEU" in got[0].health
