"""Steering across a route's pools (STEER-1..5)."""

from __future__ import annotations

from collections import Counter

import pytest

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


def _geo_cluster(users: int = 3000):
    from reconciler.model import Cluster

    servers = [{"name": f"de{i}", "host": f"192.0.2.{i}", "country": "DE", "inbounds": [
        {"id": f"de{i}-in", "name": f"DE {i}", "protocol": "shadowsocks-2022", "port": 8388, "route": "r", "pool": "eu"}]}
        for i in range(1, 4)]
    servers.append({"name": "us1", "host": "192.0.2.9", "country": "US", "inbounds": [
        {"id": "us1-in", "name": "US", "protocol": "shadowsocks-2022", "port": 8388, "route": "r", "pool": "us"}]})
    return Cluster.model_validate({
        "servers": servers,
        "routes": [{"id": "r", "name": "R", "pools": ["us", "eu"], "steering": "geo", "geo": {"WEU": ["eu"], "ENAM": ["us"]}}],
        "users": [{"name": f"u{i}", **({"region": "WEU"} if i % 3 == 0 else {})} for i in range(users)]})


def test_live_answers_steered_by_address_spread_by_policy_and_stick():
    # spec: LB-9, LB-6, STEER-4 (issue 15): the address chooses the pool; the server within it comes from the same
    # sticky, policy-weighted placement as the files — no herding onto one server, the same server next time.
    from collections import Counter

    from reconciler.balance import Snapshot
    from reconciler.balance.decide import decide, rebalance

    c = _geo_cluster()
    first = Snapshot(cluster=c, now=1.8e9, assignments=rebalance(Snapshot(cluster=c, now=1.8e9)))
    live = {f"u{i}": decide(first, f"u{i}", "WEU")[0].ref.inbound.id for i in range(3000)}
    counts = Counter(live.values())
    assert set(counts) == {"de1-in", "de2-in", "de3-in"} and min(counts.values()) >= 900, counts  # thirds, not 2039/961/0
    assert all(decide(first, u, "WEU")[0].ref.inbound.id == i for u, i in list(live.items())[:300])  # per request
    later = Snapshot(cluster=c, now=1.8e9 + 60, assignments=rebalance(first))
    moved = sum(decide(later, u, "WEU")[0].ref.inbound.id != i for u, i in live.items())
    assert moved == 0  # kept across batches (LB-6)
    # Where the address changes nothing, live and files give the same answer
    for i in range(0, 3000, 7):
        home = "WEU" if i % 3 == 0 else "ENAM"
        assert decide(first, f"u{i}", home)[0].ref.inbound.id == decide(first, f"u{i}")[0].ref.inbound.id


TRUSTED = ("10.0.0.0/8", "2001:db8::/32")


@pytest.mark.parametrize("peer,headers,expected", [
    ("203.0.113.7", {"X-Forwarded-For": "198.51.100.1"}, "203.0.113.7"),  # an untrusted peer's headers mean nothing
    ("10.0.0.2", {}, "10.0.0.2"),
    ("10.0.0.2", {"X-Forwarded-For": "198.51.100.1"}, "198.51.100.1"),
    ("10.0.0.2", {"X-Forwarded-For": "1.2.3.4, 198.51.100.1, 10.0.0.9"}, "198.51.100.1"),  # the left is the client's word
    ("10.0.0.2", {"X-Forwarded-For": "10.0.0.8, 10.0.0.9"}, "10.0.0.8"),  # all trusted: the farthest known
    ("10.0.0.2", {"X-Forwarded-For": "198.51.100.1, garbage"}, "10.0.0.2"),  # a garbled nearest hop: stop there
    ("10.0.0.2", {"Forwarded": 'for=192.0.2.60;proto=http, for="[2001:db8:cafe::17]:4711"'}, "192.0.2.60"),
    ("10.0.0.2", {"Forwarded": "for=unknown"}, "10.0.0.2"),
    ("10.0.0.2", {"CF-Connecting-IP": "198.51.100.7", "X-Forwarded-For": "1.1.1.1"}, "198.51.100.7"),
    ("10.0.0.2", {"CF-Connecting-IP": "not-an-ip"}, "10.0.0.2"),
    ("2001:db8::1", {"X-Forwarded-For": "198.51.100.1"}, "198.51.100.1"),
    ("not an address", {"X-Forwarded-For": "198.51.100.1"}, "not an address"),
])
def test_the_client_address_is_read_from_forwarding_headers_only_behind_trusted_proxies(peer, headers, expected):
    # spec: STEER-4 (issue 15): behind a proxy every request looked local; now only trusted proxies are believed
    from reconciler.loop.client_address import client_address, networks

    assert client_address(peer, headers, networks(TRUSTED)) == expected
    assert client_address(peer, headers, ()) == peer  # none configured: the peer, always


def test_the_live_endpoint_steers_by_the_forwarded_address(tmp_path):
    # The outlet passes the forwarded address (not the proxy's) to the region lookup, and only from a trusted peer.
    from multidict import CIMultiDict
    from prometheus_client import CollectorRegistry

    from reconciler.loop.client_address import networks
    from reconciler.loop.http import HttpOutlet

    asked: list[str] = []

    class Answers:
        snapshot = object()  # started: a snapshot is published

        def user_of(self, token):
            return "u1"

        def answer(self, user, fmt, region):
            raise LookupError("the stand-in answer ends the request")

    outlet = HttpOutlet(Answers(), CollectorRegistry(), lambda: None, lambda: (True, "ok"),
                        lambda address: asked.append(address) or None, networks(TRUSTED))

    def sub(peer: str) -> None:
        with pytest.raises(LookupError):
            outlet.side.answer("GET", "/sub/t/links", {}, CIMultiDict({"x-forwarded-for": "198.51.100.1"}), peer, False)

    sub("10.0.0.2")
    sub("203.0.113.7")
    assert asked == ["198.51.100.1", "203.0.113.7"]
