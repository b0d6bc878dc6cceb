"""Least-loaded balancing that sees users: each user weighs its own measured demand (issue 16, item 6).

Pure simulations with seeded RNGs: the servers' metrics are fed back from the users' demand every tick.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from reconciler.balance import ServerLoad, Snapshot, decide, rebalance
from reconciler.balance.decide import pool_key
from reconciler.model import UserUsage
from tests.balance_helpers import cluster, snapshot

R = [{"id": "r", "name": "R"}]


def usage_of(demand: dict[str, float]) -> dict[str, UserUsage]:
    return {name: UserUsage(demand_mbps=float(d)) for name, d in demand.items()}


def fleet(capacities: list[float], users: int, balance: str = "least-loaded"):
    servers = [{"name": f"s{i}", "route": "r"} for i in range(len(capacities))]
    return cluster(servers, [{"id": "r", "name": "R", "balance": balance}], users=users)


def server_demand(table: dict, demand: dict[str, float], n_servers: int, route: str = "r") -> np.ndarray:
    out = np.zeros(n_servers)
    for (user, r), inbound in table.items():
        if r == route:
            out[int(inbound[1:].split("-")[0])] += demand[user]
    return out


def loads(table: dict, demand: dict[str, float], capacities: list[float], noise: float = 0.0,
          rng: np.random.Generator | None = None) -> dict[str, ServerLoad]:
    traffic = server_demand(table, demand, len(capacities))
    users = Counter(v for (_, r), v in table.items() if r == "r")
    if noise and rng is not None:
        traffic = traffic * (1 + rng.uniform(-noise, noise, len(traffic)))
    return {f"s{i}": ServerLoad(float(traffic[i]), users[f"s{i}-in"], c) for i, c in enumerate(capacities)}


def lognormal_demand(users: int, capacities: list[float], rng: np.random.Generator) -> dict[str, float]:
    d = rng.lognormal(0.0, 1.0, users)
    d *= 0.6 * sum(capacities) / d.sum()  # the fleet at 60% of its capacity
    return {f"u{i}": float(x) for i, x in enumerate(d)}


def converge(c, capacities: list[float], demand: dict[str, float], ticks: int = 6) -> dict:
    """Place from empty metrics, then feed the servers' traffic back for a few report intervals."""
    usage = usage_of(demand)
    empty = {f"s{i}": ServerLoad(0.0, 0, cap) for i, cap in enumerate(capacities)}
    table = rebalance(Snapshot(cluster=c, now=0.0, loads=empty, usage=usage))
    for t in range(1, ticks):
        table = rebalance(Snapshot(cluster=c, now=60.0 * t, loads=loads(table, demand, capacities),
                                   assignments=table, usage=usage))
    return table


def imbalance(table: dict, demand: dict[str, float], capacities: list[float]) -> float:
    util = server_demand(table, demand, len(capacities)) / np.array(capacities)
    return float(util.max() / util.mean())


def test_heavy_users_are_spread_one_per_server():
    # spec: LB-2, LB-9 — the heaviest users land on different servers, not two on one while another has none
    capacities = [1000.0] * 4
    for seed in range(20):
        rng = np.random.default_rng(seed)
        c = fleet(capacities, 40)
        demand = {f"u{i}": float(rng.uniform(0.5, 2.0)) for i in range(40)}
        heavy = [f"u{i}" for i in rng.choice(40, size=4, replace=False)]
        for name in heavy:
            demand[name] = float(rng.uniform(20.0, 40.0))
        table = converge(c, capacities, demand, ticks=3)
        per_server = Counter(table[(u, "r")] for u in heavy)
        assert sorted(per_server.values()) == [1, 1, 1, 1], (seed, per_server)


def test_heavy_users_spread_over_unequal_servers_in_proportion():
    # spec: LB-2, LB-3 — a server's share of demand follows its capacity, heavy users included
    capacities = [500.0, 1000.0, 2000.0]
    rng = np.random.default_rng(7)
    c = fleet(capacities, 3000)
    demand = lognormal_demand(3000, capacities, rng)
    table = converge(c, capacities, demand)
    share = server_demand(table, demand, 3) / sum(demand.values())
    assert share == pytest.approx(np.array(capacities) / sum(capacities), abs=0.01)


@pytest.mark.parametrize("n_servers,n_users,seed", [(6, 3000, 1), (12, 6000, 2), (30, 9000, 3)])
def test_realised_imbalance_in_demand_units_is_within_five_percent(n_servers, n_users, seed):
    # spec: LB-2, LB-3 — lognormal demand (sigma 1), capacities 100-2,500 Mbps, max/mean utilisation
    rng = np.random.default_rng(seed)
    capacities = [float(x) for x in rng.uniform(100, 2500, n_servers)]
    c = fleet(capacities, n_users)
    demand = lognormal_demand(n_users, capacities, rng)
    assert imbalance(converge(c, capacities, demand), demand, capacities) <= 1.05


def test_no_churn_under_one_percent_demand_noise_over_hundreds_of_rebalances():
    # spec: LB-6 — the hysteresis in demand units: nobody moves on metric noise
    rng = np.random.default_rng(11)
    capacities = [float(x) for x in rng.uniform(100, 2500, 6)]
    c = fleet(capacities, 1500)
    demand = lognormal_demand(1500, capacities, rng)
    table = converge(c, capacities, demand)
    base = np.array(list(demand.values()))
    moved = 0
    for t in range(300):
        noisy = dict(zip(demand, (base * (1 + rng.uniform(-0.01, 0.01, len(base)))).tolist(), strict=True))
        nxt = rebalance(Snapshot(cluster=c, now=1e4 + 60.0 * t, assignments=table, usage=usage_of(noisy),
                                 loads=loads(table, noisy, capacities, 0.01, rng)))
        moved += sum(nxt[k] != v for k, v in table.items())
        table = nxt
    assert moved == 0


def test_an_overloaded_server_sheds_only_its_excess_demand():
    # spec: LB-6 — beyond the stickiness margin, only the excess (in Mbps) leaves, and the rest stays
    capacities = [1000.0, 1000.0]
    rng = np.random.default_rng(5)
    c = fleet(capacities, 400)
    demand = {u: d / 3 for u, d in lognormal_demand(400, capacities, rng).items()}  # s0 at 40%: not saturated
    everyone_on_s0 = {(f"u{i}", "r"): "s0-in" for i in range(400)}
    table = rebalance(Snapshot(cluster=c, now=0.0, assignments=everyone_on_s0, usage=usage_of(demand),
                               loads=loads(everyone_on_s0, demand, capacities)))
    moved = [u for (u, _), v in table.items() if v != "s0-in"]
    total = sum(demand.values())
    assert sum(demand[u] for u in moved) == pytest.approx(total / 2, rel=0.05)
    assert imbalance(table, demand, capacities) <= 1.05


def test_unmeasured_users_weigh_the_mean_of_the_measured_active_users():
    # spec: LB-2 — a new (never measured) user counts as the mean demand; a disabled user's demand is not in it
    users = [{"name": f"u{i}"} for i in range(600)] + [{"name": "gone", "enabled": False}]
    c = cluster([{"name": f"s{i}", "route": "r"} for i in range(3)], R, users=users)
    rng = np.random.default_rng(3)
    measured = {f"u{i}": float(rng.lognormal(0.0, 1.0)) for i in range(0, 600, 2)}  # half of them measured
    mean = float(np.mean(np.array(list(measured.values()))))
    explicit = {f"u{i}": measured.get(f"u{i}", mean) for i in range(600)}
    caps = {f"s{i}": (0.0, 0, cap) for i, cap in enumerate((300.0, 600.0, 900.0))}
    missing = rebalance(snapshot(c, loads=caps, usage=usage_of({**measured, "gone": 1e6})))
    filled = rebalance(snapshot(c, loads=caps, usage=usage_of(explicit)))
    assert missing == filled
    share = server_demand(filled, explicit, 3) / sum(explicit.values())
    assert share == pytest.approx([1 / 6, 2 / 6, 3 / 6], abs=0.01)


def test_without_measured_demand_users_are_counted_as_before():
    # spec: LB-2, LB-6 — no usage (or usage without a demand) gives the very same assignments as before
    rng = np.random.default_rng(9)
    capacities = [float(x) for x in rng.uniform(100, 2500, 5)]
    c = fleet(capacities, 2000)
    demand = lognormal_demand(2000, capacities, rng)
    counters = {u: UserUsage(up=1000, down=5000) for u in demand}  # traffic counted, no demand measured yet
    table = rebalance(snapshot(c, loads={f"s{i}": (0.0, 0, cap) for i, cap in enumerate(capacities)}))
    for t in range(4):
        metrics = {k: (v.traffic_mbps, v.users, v.capacity_mbps) for k, v in loads(table, demand, capacities).items()}
        plain = rebalance(snapshot(c, now=1e9 + t, loads=metrics, assignments=table))
        assert rebalance(snapshot(c, now=1e9 + t, loads=metrics, assignments=table, usage=counters)) == plain
        table = plain


def test_round_robin_routes_ignore_demand():
    # spec: LB-4 — round-robin counts users by coefficient whatever they weigh
    servers = [{"name": "a", "route": "r", "coefficient": 1.0}, {"name": "b", "route": "r", "coefficient": 2.0}]
    c = cluster(servers, [{"id": "r", "name": "R", "balance": "round-robin"}], users=900)
    rng = np.random.default_rng(4)
    usage = usage_of({f"u{i}": float(rng.lognormal(0.0, 1.0)) for i in range(900)})
    plain = rebalance(snapshot(c))
    assert rebalance(snapshot(c, usage=usage)) == plain
    assert Counter(plain.values())["b-in"] == pytest.approx(600, abs=30)


def test_disabled_and_over_quota_users_are_never_assigned():
    # spec: LB-2 (issue 16) — only active users are balanced, however heavy the others were
    users = [{"name": f"u{i}"} for i in range(50)] + [
        {"name": "off", "enabled": False}, {"name": "quota", "data_limit": "1 GB"}]
    c = cluster([{"name": f"s{i}", "route": "r"} for i in range(3)], R, users=users)
    rng = np.random.default_rng(2)
    usage = usage_of({f"u{i}": float(rng.lognormal(0.0, 1.0)) for i in range(50)})
    usage["off"] = UserUsage(demand_mbps=500.0)
    usage["quota"] = UserUsage(up=10**9, down=10**9, demand_mbps=500.0)
    snap = snapshot(c, loads={f"s{i}": (10.0, 5, 1000.0) for i in range(3)}, usage=usage)
    table = rebalance(snap)
    assert {u for u, _ in table} == {f"u{i}" for i in range(50)}
    assert decide(snap, "off") == [] and decide(snap, "quota") == []
    # Only inactive users were measured: the active ones weigh the fleet's mean, and still nobody inactive is placed
    only_inactive = snapshot(c, loads={f"s{i}": (10.0, 5, 1000.0) for i in range(3)},
                             usage={"off": usage["off"], "quota": usage["quota"]})
    assert {u for u, _ in rebalance(only_inactive)} == {f"u{i}" for i in range(50)}


def test_live_answers_agree_with_the_batch_and_place_new_users_on_the_deficits():
    # spec: LB-6, LB-9 — decide keeps the batch's choice; a new user goes where demand is missing
    capacities = [1000.0, 1000.0]
    rng = np.random.default_rng(8)
    c = fleet(capacities, 501)
    demand = lognormal_demand(500, capacities, rng)
    table = converge(fleet(capacities, 500), capacities, demand)  # u500 is not placed yet
    snap = Snapshot(cluster=c, now=1e4, assignments=table, usage=usage_of(demand),
                    loads=loads(table, demand, capacities))
    assert all(decide(snap, u)[0].ref.inbound.id == table[(u, "r")] for u in list(demand)[:100])
    # Take every heavy user off s1: a newcomer (u500, never measured) should go to s1
    skewed = {k: ("s0-in" if demand[k[0]] > 1.0 else "s1-in") for k in table}
    lopsided = Snapshot(cluster=c, now=1e4, assignments=skewed, usage=usage_of(demand),
                        loads=loads(skewed, demand, capacities))
    assert decide(lopsided, "u500")[0].ref.inbound.id == "s1-in"


def test_geo_routes_place_each_pool_by_demand():
    # spec: STEER-4, LB-9 — every user's place in every pool an address may choose, weighted by demand
    servers = [{"name": f"de{i}", "route": "r", "pool": "eu"} for i in range(3)] + \
              [{"name": f"us{i}", "route": "r", "pool": "us"} for i in range(2)]
    route = {"id": "r", "name": "R", "pools": ["eu", "us"], "steering": "geo", "geo": {"WEU": ["eu"], "ENAM": ["us"]}}
    users = [{"name": f"u{i}", "region": "WEU" if i % 2 else "ENAM"} for i in range(2000)]
    c = cluster(servers, [route], users=users)
    rng = np.random.default_rng(6)
    demand = {f"u{i}": float(rng.lognormal(0.0, 1.0)) for i in range(2000)}
    caps = {s["name"]: (0.0, 0, 1000.0) for s in servers}
    snap = snapshot(c, loads=caps, usage=usage_of(demand))
    table = rebalance(snap)
    for pool, members in (("eu", ["de0-in", "de1-in", "de2-in"]), ("us", ["us0-in", "us1-in"])):
        held = Counter()
        for (u, r), inbound in table.items():
            if r == pool_key("r", pool):
                held[inbound] += demand[u]
        assert set(held) == set(members)
        assert max(held.values()) / (sum(held.values()) / len(members)) <= 1.05
    later = snapshot(c, loads=caps, usage=usage_of(demand), assignments=table)
    assert decide(later, "u2", region="WEU")[0].ref.inbound.id == table[("u2", pool_key("r", "eu"))]
    assert rebalance(later) == table  # sticky
