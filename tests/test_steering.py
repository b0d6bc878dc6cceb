"""Steering across a route's pools (STEER-1..5)."""

from __future__ import annotations

from collections import Counter

from reconciler.balance import RTTProfile, decide, rebalance
from tests.balance_helpers import cluster, snapshot, verdicts


def pooled(steering: str, **extra):
    servers = [{"name": "eu1", "route": "r", "pool": "eu"}, {"name": "eu2", "route": "r", "pool": "eu"},
               {"name": "us1", "route": "r", "pool": "us"}, {"name": "fb1", "route": "r", "pool": "fb"}]
    route = {"id": "r", "name": "R", "pools": ["eu", "us", "fb"], "fallback_pool": "fb", "steering": steering, **extra}
    users = [{"name": f"u{i}", "region": ["WEU", "ENAM", "SEAS", None][i % 4]} for i in range(400)]
    return cluster(servers, [route], users=[{k: v for k, v in u.items() if v} for u in users])


def pools_of(snap, users=range(400)) -> Counter:
    return Counter(decide(snap, f"u{i}")[0].pool for i in users)


def test_failover_takes_the_highest_priority_healthy_pool_and_fallback_last():
    # spec: STEER-1
    c = pooled("failover")
    assert pools_of(snapshot(c)) == Counter({"eu": 400})
    assert pools_of(snapshot(c, verdicts=verdicts(c, down=("eu1", "eu2")))) == Counter({"us": 400})
    only_fb = snapshot(c, verdicts=verdicts(c, down=("eu1", "eu2", "us1")))
    assert pools_of(only_fb) == Counter({"fb": 400})
    assert "fallback pool" in decide(only_fb, "u0")[0].why


def test_random_spreads_users_fixed_per_user_with_the_fallback_taking_part():
    # spec: STEER-2
    c = pooled("random")
    snap = snapshot(c)
    first = pools_of(snap)
    assert set(first) == {"eu", "us", "fb"} and min(first.values()) > 80
    assert [decide(snap, f"u{i}")[0].pool for i in range(50)] == [decide(snap, f"u{i}")[0].pool for i in range(50)]
    # Unhealthy pools drop out; the others keep their users.
    without_us = snapshot(c, verdicts=verdicts(c, down=("us1",)))
    for i in range(400):
        before, after = decide(snap, f"u{i}")[0].pool, decide(without_us, f"u{i}")[0].pool
        assert after != "us" and (before == "us" or before == after)


def test_dynamic_uses_the_lowest_rtt_from_the_users_region_after_warm_up():
    # spec: STEER-3
    c = pooled("dynamic")
    warm = c.settings.steering.dynamic_warmup
    rtt = {("WEU", "r", "eu"): RTTProfile(90.0, warm), ("WEU", "r", "us"): RTTProfile(40.0, warm),
           ("ENAM", "r", "us"): RTTProfile(30.0, warm / 2)}  # ENAM is still warming up
    snap = snapshot(c, rtt=rtt)
    weu = decide(snap, "u0")[0]
    assert weu.pool == "us" and "lowest RTT from WEU (40 ms)" in weu.why
    enam = decide(snap, "u1")[0]
    assert enam.pool == "eu" and "no RTT profile from ENAM yet" in enam.why  # failover order until warm
    stale = {k: RTTProfile(v.ewma_ms, v.seconds_of_data, fresh=False) for k, v in rtt.items()}
    assert decide(snapshot(c, rtt=stale), "u0")[0].pool == "eu"
    # The fallback pool takes part when healthy.
    fast_fb = {**rtt, ("WEU", "r", "fb"): RTTProfile(10.0, warm)}
    assert decide(snapshot(c, rtt=fast_fb), "u0")[0].pool == "fb"


def test_geo_maps_regions_to_pools_and_unmapped_regions_fail_over():
    # spec: STEER-4
    c = pooled("geo", geo={"ENAM": ["us", "eu"], "SEAS": ["fb"]})
    snap = snapshot(c)
    assert decide(snap, "u1")[0].pool == "us"  # ENAM user
    assert decide(snap, "u2")[0].pool == "fb"  # SEAS → the fallback pool takes part when mapped and healthy
    assert decide(snap, "u0")[0].pool == "eu"  # WEU: no mapping → failover order
    assert decide(snap, "u3")[0].pool == "eu"  # no region at all → failover order
    assert decide(snap, "u3", region="ENAM")[0].pool == "us"  # a live request's region wins
    down_us = snapshot(c, verdicts=verdicts(c, down=("us1",)))
    assert decide(down_us, "u1")[0].pool == "eu"  # the region's list in order


def test_pool_health_needs_minimum_healthy_and_never_overrides_lb8():
    # spec: STEER-5, LB-8
    c = pooled("failover", minimum_healthy=2)
    assert pools_of(snapshot(c), range(40)) == Counter({"eu": 40})  # eu has 2 in rotation
    one_eu_down = snapshot(c, verdicts=verdicts(c, down=("eu1",)))
    # eu has one inbound in rotation < 2; us and fb have one inbound each, never healthy at 2: no pool is
    # healthy, so the route balances over all its inbounds in rotation instead of going empty.
    entries = [decide(one_eu_down, f"u{i}")[0] for i in range(60)]
    assert all(e.pool is None and e.in_rotation for e in entries)
    assert {e.ref.server.name for e in entries} == {"eu2", "us1", "fb1"}
    everything_down = snapshot(c, verdicts=verdicts(c, down=("eu1", "eu2", "us1", "fb1")))
    entries = [decide(everything_down, f"u{i}") for i in range(20)]
    assert all(len(e) == 1 and e[0].why.startswith("best available") for e in entries)


def test_the_batch_steers_like_the_request_path():
    # spec: STEER-1..4 in rebalance()
    for steering, extra in (("failover", {}), ("random", {}), ("geo", {"geo": {"ENAM": ["us"]}})):
        c = pooled(steering, **extra)
        snap = snapshot(c)
        table = rebalance(snap)
        for i in range(0, 400, 7):
            assert decide(snap, f"u{i}")[0].pool == next(r.inbound.pool for r in c.members["r"]
                                                         if r.inbound.id == table[(f"u{i}", "r")])


def test_geo_region_of_a_live_request_comes_from_a_maxmind_database(tmp_path):
    # spec: STEER-4: "from the client address" through an operator-supplied MaxMind-format database
    from mmdb_writer import MMDBWriter
    from netaddr import IPSet

    from reconciler.balance.geoip import GeoIP

    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    writer.insert_network(IPSet(["203.0.113.0/24"]), {"country": {"iso_code": "US"}})
    writer.insert_network(IPSet(["198.51.100.0/24"]), {"registered_country": {"iso_code": "de"}})
    path = tmp_path / "country.mmdb"
    writer.to_db_file(str(path))
    geo = GeoIP(str(path))
    assert geo.region("203.0.113.7") == "ENAM" and geo.country("198.51.100.9") == "DE"
    assert geo.region("192.0.2.1") is None and geo.region("not an address") is None
    c = pooled("geo", geo={"ENAM": ["us", "eu"]})
    assert decide(snapshot(c), "u3", region=geo.region("203.0.113.7"))[0].pool == "us"
    assert decide(snapshot(c), "u3", region=geo.region("192.0.2.1"))[0].pool == "eu"  # unknown → failover order
    geo.close()
