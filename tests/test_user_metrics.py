"""The users' Prometheus metrics (issue 16): counts by state and by what operators act on, the users' traffic by
route and by server, per-user series only when the file asks and never more than the cap, no secret or client
address in a label, and a scrape of 100k users that counts rather than labels."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from reconciler.balance import Snapshot
from reconciler.fleet.view import FleetView
from reconciler.metrics import LoopStats, ReconcilerCollector
from reconciler.model import Cluster, UserUsage

NOW = 1_760_000_000.0  # 2025-10-09 UTC
GB = 1_000_000_000
DAY = 86400.0


def day(offset_days: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + offset_days * DAY))


def make_cluster(users: list[dict], **user_settings) -> Cluster:
    servers = [{"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": "DE",
                "inbounds": [{"id": f"s{i}-in", "name": f"Server {i}", "protocol": "vless-tls", "port": 443,
                              "route": "eu" if i == 0 else "us", "tls": {"server_name": "www.lab.test"}}]}
               for i in range(2)]
    return Cluster.model_validate({"servers": servers, "routes": [{"id": "eu", "name": "EU"}, {"id": "us", "name": "US"}],
                                   "users": users, "settings": {"users": user_settings}})


def scrape(view: FleetView) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ReconcilerCollector(lambda: view, LoopStats()))
    return generate_latest(reg).decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(got: dict, name: str, **labels: str) -> float:
    [v] = [v for ls, v in got.get(name, []) if all(ls.get(k) == x for k, x in labels.items())]
    return v


def label_values(got: dict, label: str, names: Iterable[str] | None = None) -> set[str]:
    return {ls[label] for n, rows in got.items() if names is None or n in names for ls, _ in rows if label in ls}


USERS = [
    {"name": "alice", "data_limit": "10GB"},  # 9.5 GB used: near quota
    {"name": "bob", "data_limit": "1GB"},  # 2 GB used: over quota
    {"name": "carol", "enabled": False, "data_limit": "1GB"},  # disabled (its usage counts nowhere else)
    {"name": "dave", "expires": day(-1)},  # expired
    {"name": "erin", "expires": day(1)},  # expiring within warn_expiry (3 days)
    {"name": "frank", "device_limit": 1, "on_device_limit": "refuse"},  # refused: 3 devices
    {"name": "gina", "device_limit": 2},  # reported only: 5 devices
    {"name": "hank", "expires": day(30)},  # connected, not expiring soon
]
USAGE = {
    "alice": UserUsage(up=int(1.5 * GB), down=8 * GB, servers=("s0",)),
    "bob": UserUsage(up=GB, down=GB),
    "carol": UserUsage(down=2 * GB),
    "frank": UserUsage(devices=3, servers=("s0", "s1")),
    "gina": UserUsage(devices=5),
    "hank": UserUsage(up=10, down=20, servers=("s1",)),
}


def view_of(cluster: Cluster, usage: dict[str, UserUsage], **kw) -> FleetView:
    return FleetView(cluster=cluster, snapshot=Snapshot(cluster=cluster, now=NOW, usage=usage), usage=usage, **kw)


def test_users_by_state_and_what_operators_act_on_are_counts():
    c = make_cluster(USERS)
    text = scrape(view_of(c, USAGE, user_bytes_by_route={"eu": (100, 200), "": (5, 6), "gone": (7, 8)},
                          user_bytes_by_server={"s0": (50, 60), "left": (1, 1)}, usage_unavailable={"s1": "no nft"}))
    got = samples(text)
    assert {ls["state"]: v for ls, v in got["reconciler_users"]} == {
        "active": 4.0, "disabled": 1.0, "expired": 1.0, "over_quota": 1.0, "device_limit": 1.0}
    assert value(got, "reconciler_users_near_quota") == 1.0  # alice; bob is over, carol is disabled
    assert value(got, "reconciler_users_expiring") == 1.0  # erin; dave already expired, hank in 30 days
    assert value(got, "reconciler_users_over_device_limit") == 2.0  # frank (refused) and gina (reported)
    assert value(got, "reconciler_users_connected") == 3.0  # alice, frank, hank
    # The users' traffic: every route of the file and "unassigned", every server, both directions, from zero.
    routes = {(ls["route"], ls["direction"]): v for ls, v in got["reconciler_route_user_traffic_bytes_total"]}
    assert routes == {("eu", "up"): 100.0, ("eu", "down"): 200.0, ("us", "up"): 0.0, ("us", "down"): 0.0,
                      ("unassigned", "up"): 5.0, ("unassigned", "down"): 6.0}  # a route that left the file: not exported
    servers = {(ls["server"], ls["direction"]): v for ls, v in got["reconciler_server_user_traffic_bytes_total"]}
    assert servers == {("s0", "up"): 50.0, ("s0", "down"): 60.0, ("s1", "up"): 0.0, ("s1", "down"): 0.0}
    assert re.search(r"^# TYPE reconciler_route_user_traffic_bytes(_total)? counter$", text, re.M)
    assert {ls["server"]: v for ls, v in got["reconciler_server_usage_counting"]} == {"s0": 1.0, "s1": 0.0}
    # Per-user series are off by default: no user label anywhere, no per-user family.
    assert not label_values(got, "user")
    assert not any(n.startswith(("reconciler_user_traffic", "reconciler_user_quota", "reconciler_user_devices",
                                 "reconciler_user_series")) for n in got)
    promtool = shutil.which("promtool")
    if promtool is not None:
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_every_state_is_present_from_the_first_scrape():
    got = samples(scrape(FleetView(cluster=make_cluster([]))))
    assert {ls["state"]: v for ls, v in got["reconciler_users"]} == dict.fromkeys(
        ("active", "disabled", "expired", "over_quota", "device_limit"), 0.0)
    for name in ("near_quota", "expiring", "over_device_limit", "connected"):
        assert value(got, f"reconciler_users_{name}") == 0.0


def test_warn_settings_move_the_thresholds():
    c = make_cluster(USERS, warn_quota=0.99, warn_expiry="40d")
    got = samples(scrape(view_of(c, USAGE)))
    assert value(got, "reconciler_users_near_quota") == 0.0  # 95% < 99%
    assert value(got, "reconciler_users_expiring") == 2.0  # erin and hank


def test_per_user_series_when_asked():
    c = make_cluster(USERS, metrics_per_user=True)
    got = samples(scrape(view_of(c, USAGE)))
    assert value(got, "reconciler_user_traffic_period_bytes", user="alice", direction="up") == 1.5 * GB
    assert value(got, "reconciler_user_traffic_period_bytes", user="alice", direction="down") == 8 * GB
    assert value(got, "reconciler_user_traffic_period_bytes", user="dave", direction="down") == 0.0
    # Only users with a limit have a quota ratio.
    assert {ls["user"]: v for ls, v in got["reconciler_user_quota_ratio"]} == {"alice": 0.95, "bob": 2.0, "carol": 2.0}
    assert value(got, "reconciler_user_devices", user="gina") == 5.0
    # Under the cap nobody is folded: "other" is there from the start, at zero.
    assert value(got, "reconciler_user_traffic_period_bytes", user="other", direction="up") == 0.0
    assert value(got, "reconciler_user_series_dropped") == 0.0
    assert label_values(got, "user") == {u["name"] for u in USERS} | {"other"}


def test_per_user_cardinality_is_bounded_by_the_cap():
    # 5,000 users, cap 100: the 100 heaviest this period get series, the other 4,900 are summed as "other".
    n, cap = 5000, 100
    users = [{"name": f"u{i:04d}", **({"data_limit": "100GB"} if i % 2 else {})} for i in range(n)]
    c = make_cluster(users, metrics_per_user=True, metrics_user_cap=cap)
    usage = {f"u{i:04d}": UserUsage(up=i, down=10 * i, devices=i % 3) for i in range(n)}
    got = samples(scrape(view_of(c, usage)))
    per_user = [k for k in got if k.startswith("reconciler_user_") and k != "reconciler_user_series_dropped"]
    assert sorted(per_user) == ["reconciler_user_devices", "reconciler_user_quota_ratio",
                                "reconciler_user_traffic_period_bytes"]
    users_labelled = label_values(got, "user")
    assert len(users_labelled) <= cap + 1
    heaviest = {f"u{i:04d}" for i in range(n - cap, n)}
    assert users_labelled == heaviest | {"other"}
    # Series counted: traffic (cap + other) × 2 directions, devices cap, quota ratio only the limited half.
    series = sum(len(got[k]) for k in per_user)
    assert len(got["reconciler_user_traffic_period_bytes"]) == 2 * (cap + 1)
    assert len(got["reconciler_user_devices"]) == cap
    assert len(got["reconciler_user_quota_ratio"]) == cap // 2
    assert series == 2 * (cap + 1) + cap + cap // 2
    assert value(got, "reconciler_user_series_dropped") == n - cap
    rest = range(n - cap)
    assert value(got, "reconciler_user_traffic_period_bytes", user="other", direction="up") == sum(rest)
    assert value(got, "reconciler_user_traffic_period_bytes", user="other", direction="down") == 10 * sum(rest)
    # Every user's bytes are in exactly one series.
    total = sum(v for ls, v in got["reconciler_user_traffic_period_bytes"])
    assert total == sum(u.used for u in usage.values())


def test_reserved_label_values_never_make_duplicate_series():
    # A user named "other" is summed into "other"; a route named "unassigned" shares its label with the
    # unattributed bytes: the exposition stays valid (a duplicate series would fail the whole scrape).
    servers = [{"name": "s0", "host": "198.18.0.10", "country": "DE",
                "inbounds": [{"id": "s0-in", "name": "S0", "protocol": "vless-tls", "port": 443, "route": "unassigned",
                              "tls": {"server_name": "www.lab.test"}}]}]
    c = Cluster.model_validate({"servers": servers, "routes": [{"id": "unassigned", "name": "U"}],
                                "users": [{"name": "other"}, {"name": "zed"}],
                                "settings": {"users": {"metrics_per_user": True}}})
    usage = {"other": UserUsage(up=3, down=4), "zed": UserUsage(up=1, down=2)}
    text = scrape(view_of(c, usage, user_bytes_by_route={"unassigned": (1, 1), "": (2, 2)}))
    got = samples(text)
    keys = [(n, tuple(sorted(ls.items()))) for n, rows in got.items() for ls, _ in rows]
    assert len(keys) == len(set(keys))
    assert value(got, "reconciler_user_traffic_period_bytes", user="other", direction="down") == 4.0
    assert value(got, "reconciler_user_series_dropped") == 1.0
    assert value(got, "reconciler_route_user_traffic_bytes_total", route="unassigned", direction="up") == 3.0
    promtool = shutil.which("promtool")
    if promtool is not None:
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_labels_hold_only_the_files_names_and_closed_sets():
    # No credential, token or client address can reach a label: every value is a name from the file or a fixed word.
    c = make_cluster(USERS, metrics_per_user=True)
    got = samples(scrape(view_of(c, USAGE, user_bytes_by_route={"eu": (1, 2)}, user_bytes_by_server={"s0": (1, 2)})))
    allowed = ({u.name for u in c.users} | {s.name for s in c.servers} | {r.id for r in c.effective_routes}
               | {"other", "unassigned", "up", "down", "active", "disabled", "expired", "over_quota", "device_limit"})
    user_families = {n for n in got if n.startswith(("reconciler_user", "reconciler_route_user",
                                                      "reconciler_server_user", "reconciler_server_usage"))}
    for label in ("user", "route", "server", "direction", "state"):
        assert label_values(got, label, user_families) <= allowed, label
    assert {k for n in user_families for ls, _ in got[n] for k in ls} <= {"user", "route", "server", "direction", "state"}


def test_100k_users_without_per_user_series_cost_counts_only():
    n = 100_000
    c = Cluster.model_validate({"users": [{"name": f"u{i}", **({"data_limit": "1GB"} if i % 2 else {})}
                                          for i in range(n)]})
    usage = {f"u{i}": UserUsage(up=i, down=i, devices=1, servers=("s0",) if i % 10 == 0 else ()) for i in range(n)}
    view = view_of(c, usage)
    started = time.perf_counter()
    text = scrape(view)
    took = time.perf_counter() - started
    got = samples(text)
    assert value(got, "reconciler_users", state="active") == n
    assert value(got, "reconciler_users_connected") == n // 10
    assert not label_values(got, "user")
    assert len(text.splitlines()) < 300  # the loop's own families and a few dozen user counts, not 100k series
    assert took < 5.0, took  # ~0.15 s on the reference machine
