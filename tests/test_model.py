"""The model: regions, defaults, route membership (ROUTE-3..7, STEER-4)."""

from __future__ import annotations

import pycountry
import pytest

from reconciler.config import load_cluster
from reconciler.model import COUNTRY_REGION, REGIONS, Cluster
from reconciler.model.types import parse_duration, parse_size
from tests.conftest import EXAMPLE


def test_every_iso_country_maps_to_one_of_the_13_regions():
    # spec: STEER-4
    assert set(REGIONS) == {"WNAM", "ENAM", "WEU", "EEU", "NSAM", "SSAM", "OC", "ME", "NAF", "SAF", "SAS", "SEAS", "NEAS"}
    assert set(COUNTRY_REGION) == {c.alpha_2 for c in pycountry.countries}
    assert set(COUNTRY_REGION.values()) == set(REGIONS)


@pytest.mark.parametrize("country,region", [("DE", "WEU"), ("RU", "EEU"), ("US", "ENAM"), ("JP", "NEAS"),
                                            ("BR", "NSAM"), ("AR", "SSAM"), ("AU", "OC"), ("AE", "ME"),
                                            ("EG", "NAF"), ("ZA", "SAF"), ("IN", "SAS"), ("SG", "SEAS"), ("MX", "WNAM")])
def test_server_region_is_derived_from_country_unless_given(country, region):
    # spec: STEER-4
    server = {"name": "s", "host": "192.0.2.1", "country": country.lower()}
    c = Cluster.model_validate({"servers": [server]})
    assert c.servers[0].country == country and c.servers[0].region == region
    c = Cluster.model_validate({"servers": [{**server, "region": "SEAS"}]})
    assert c.servers[0].region == "SEAS"


def _one_server(inbounds, routes=None):
    data = {"servers": [{"name": "s", "host": "192.0.2.1", "country": "DE", "inbounds": inbounds}]}
    if routes is not None:
        data["routes"] = routes
    return Cluster.model_validate(data)


def _inbound(i, route=None):
    d = {"id": f"in-{i}", "name": f"In {i}", "protocol": "shadowsocks-2022", "port": 1000 + i}
    if route:
        d["route"] = route
    return d


def test_no_routes_means_an_implicit_default_route_with_the_first_inbound():
    # spec: ROUTE-6
    c = _one_server([_inbound(1), _inbound(2)])
    assert [r.id for r in c.effective_routes] == ["default"]
    assert c.effective_routes[0].implicit
    assert [ref.inbound.id for ref in c.members["default"]] == ["in-1"]
    assert [ref.inbound.id for ref in c.unassigned] == ["in-2"]


def test_membership_lives_on_the_inbound_and_keeps_file_order():
    # spec: ROUTE-3, ROUTE-7
    routes = [{"id": "b", "name": "B"}, {"id": "a", "name": "A"}, {"id": "empty", "name": "E"}]
    c = _one_server([_inbound(1, "a"), _inbound(2, "b"), _inbound(3, "a"), _inbound(4)], routes)
    assert [r.id for r in c.effective_routes] == ["b", "a", "empty"]
    assert [x.inbound.id for x in c.members["a"]] == ["in-1", "in-3"]
    assert c.members["empty"] == ()
    assert [x.inbound.id for x in c.unassigned] == ["in-4"]
    assert c.route_of("in-2") == "b" and c.route_of("in-4") is None


def test_settings_have_documented_defaults():
    s = Cluster().settings
    assert s.health.report_interval == 60 and s.health.staleness == 180
    assert (s.health.failure_streak, s.health.recovery_streak, s.health.prober_streak) == (3, 2, 8)
    assert s.health.quorum == "majority" and s.health.min_witnesses == 2
    assert s.balance.capacity_half_life == 86400 and s.balance.stickiness == 0.2
    assert s.steering.dynamic_warmup == 600
    assert s.secret.env == "RECONCILER_SECRET"


def test_staleness_defaults_to_three_report_intervals():
    c = Cluster.model_validate({"settings": {"health": {"report_interval": "5m"}}})
    assert c.settings.health.staleness == 900


@pytest.mark.parametrize("text,seconds", [(90, 90), ("90s", 90), ("1.5m", 90), ("2h", 7200), ("7d", 604800), ("250ms", 0.25)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text,size", [(5, 5), ("100GB", 100 * 10**9), ("1.5GiB", int(1.5 * 2**30)), ("500 mb", 500 * 10**6)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_example_has_what_the_example_must_show():
    # spec: GITOPS-1
    c = load_cluster(str(EXAMPLE)).cluster
    assert c is not None
    by_country: dict[str, int] = {}
    for s in c.servers:
        by_country[s.country] = by_country.get(s.country, 0) + 1
    assert len(by_country) >= 3 and max(by_country.values()) >= 3
    assert any(s.prober for s in c.servers)
    routes = {r.id: r for r in c.routes}
    assert any(r.balance == "least-loaded" for r in routes.values())
    rr = [r for r in routes.values() if r.balance == "round-robin"]
    assert rr and len({ref.server.coefficient for ref in c.members[rr[0].id]}) > 1
    assert any(r.pools and r.fallback_pool and r.steering == "geo" and r.geo for r in routes.values())
    assert any(not c.members[r] for r in routes)
    assert {i.protocol for s in c.servers for i in s.inbounds} == {
        "vless-reality", "vless-tls", "trojan", "shadowsocks-2022", "hysteria2", "tuic"}


def test_the_example_keeps_no_credentials():
    # spec: GITOPS-6
    text = EXAMPLE.read_text()
    for word in ("uuid", "password", "private_key", "token"):
        assert f"{word}:" not in text


def test_a_user_is_active_while_enabled_and_until_the_end_of_its_expiry_day():
    # The one place that decides "active" for balance, subscriptions and the engine adapter.
    from datetime import UTC, datetime

    from reconciler.model import User

    day_end = datetime(2027, 6, 30, 23, 59, 59, 999999, tzinfo=UTC).timestamp()
    dated = User(name="a", expires="2027-06-30")
    assert dated.expires_at == day_end
    assert dated.active(day_end) and not dated.active(day_end + 1)
    assert User(name="b", expires="2027-06-30T12:00:00").expires_at == datetime(2027, 6, 30, 12, tzinfo=UTC).timestamp()
    assert User(name="c").expires_at is None and User(name="c").active(1e12)
    assert not User(name="d", enabled=False).active(0)


# --------------------------------------------------------------------------- value rules of issue 13 (pure, no I/O)


@pytest.mark.parametrize("value", [".nan", float("nan"), float("inf"), -float("inf"), 1e300, "9" * 70 + "s", True, "soon"])
def test_a_duration_is_finite_positive_and_sane(value):
    with pytest.raises(ValueError):
        parse_duration(value)
    assert parse_duration("3650d") == 3650 * 86400


@pytest.mark.parametrize("value", ["9" * 30 + "PB", 2**63, 0, -5, "1e5GB"])
def test_a_size_fits_in_63_bits(value):
    with pytest.raises(ValueError):
        parse_size(value)
    assert parse_size("8PiB") == 8 * 2**50


@pytest.mark.parametrize("host,ok", [
    ("203.0.113.1", True), ("2001:db8::1", True), ("fra-1.example.net", True), ("fra-1.example.net.", True),
    ("localhost", True), ("a" * 63 + ".com", True), ("a" * 64 + ".com", False), (".".join(["a" * 60] * 5) + ".com", False),
    (".".join(["a" * 60] * 4) + ".com", True),
    ("203.0.113.256", False), ("1.2.3", False), ("-a.com", False), ("a-.com", False), ("a..b", False), ("a_b.com", False),
    ("", False), ("exa mple.com", False), ("2001:db8::1::2", False), ("user@host", False), ("ünï.com", False),
])
def test_hosts_follow_rfc_1123_and_ip_literals(host, ok):
    from reconciler.model.types import check_host

    if ok:
        assert check_host(host) == host
    else:
        with pytest.raises(ValueError):
            check_host(host)


@pytest.mark.parametrize("listen,expected", [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)), ("[::1]:443", ("::1", 443)), (":8080", ("", 8080)),
    ("localhost:1", ("localhost", 1)), ("0.0.0.0:65535", ("0.0.0.0", 65535)),
    ("127.0.0.1:99999", None), ("127.0.0.1:0", None), ("127.0.0.1", None), ("::1:80", None), ("[x]:80", None),
    ("127.0.0.1:+80", None), ("127.0.0.1:٨٠", None), ("host name:80", None),
])
def test_listen_is_host_colon_port(listen, expected):
    from reconciler.model.types import parse_listen

    if expected is None:
        with pytest.raises(ValueError):
            parse_listen(listen)
    else:
        assert parse_listen(listen) == expected


def test_a_host_key_is_an_openssh_key_line_whose_blob_has_its_type():
    import base64

    from reconciler.model.types import host_key_blob

    good = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDYtcy6cneyL++IAPx7JODT/QzUS/j4X+u6/dvN5KXUP root@x"
    assert host_key_blob(good)[0] == "ssh-ed25519"
    blob = base64.b64encode(base64.b64decode(good.split()[1])).decode()
    for bad in ("not a key", "ssh-ed25519", "ssh-ed25519 ####", f"ssh-rsa {blob}", "ssh-ed25519 " + base64.b64encode(b"x").decode(),
                "foo-key " + blob):
        with pytest.raises(ValueError):
            host_key_blob(bad)


def test_no_float_of_the_model_takes_nan_or_inf():
    from pydantic import ValidationError

    for field in ("coefficient",):
        with pytest.raises(ValidationError, match="finite"):
            Cluster.model_validate({"servers": [{"name": "s", "host": "192.0.2.1", "country": "DE", field: float("nan")}]})
    with pytest.raises(ValidationError, match="finite"):
        Cluster.model_validate({"settings": {"balance": {"stickiness": float("inf")}}})
