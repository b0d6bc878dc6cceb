"""The fleet core is the one place that builds a snapshot: the CLI, the files and the live endpoint
give the same bytes for every user, on every steering mode (dynamic included).

The loop here is the real ``Loop`` (its ``tick``: fold, snapshot, publish, write files, save the
learned state) with only its SSH collection replaced by generated agent reports, and its clock
moved one interval per tick so that dynamic steering has minutes of RTT data; the live endpoint
is its real aiohttp server on loopback; the CLI is ``reconciler subscription`` reading the state
folder the loop saved.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from reconciler.config import load_cluster
from reconciler.credentials import Secret, user_credentials
from reconciler.fleet import Learned, parse_report, snapshot
from reconciler.lab.demo import free_port
from reconciler.loop.clock import FakeClock
from reconciler.loop.service import Loop
from reconciler.model import Cluster
from reconciler.ssh.fake import FakeRunner
from reconciler.state.folder import StateFolder
from reconciler.subscriptions.document import EXTENSIONS
from tests.fake_agents import install_agent, probing

SECRET = "fleet-core-test-secret-0123456789abcdef"
STEERING = ("failover", "random", "dynamic", "geo")
# Two servers per pool, countries in two regions (WEU: DE/NL, EEU: PL/RO), so each region has witnesses.
SERVERS = [("de-1", "DE"), ("de-2", "DE"), ("nl-1", "NL"), ("pl-1", "PL"), ("pl-2", "PL"), ("ro-1", "RO")]
POOL_OF = {"de-1": "west", "de-2": "west", "nl-1": "west", "pl-1": "east", "pl-2": "east", "ro-1": "east"}
REGIONS = ["WEU", "EEU", None]


def cluster_text(interval: float, listen: str) -> str:
    lines = ["settings:",
             f"  health: {{report_interval: {interval:g}s}}",
             "  steering: {dynamic_warmup: 60s, rtt_half_life: 60s}",
             f"  outputs: {{state_dir: state, subscriptions_dir: subs, listen: \"{listen}\"}}",
             "servers:"]
    for i, (name, country) in enumerate(SERVERS):
        lines += [f"  - name: {name}", f"    host: 198.18.0.{20 + i}", f"    country: {country}", "    inbounds:"]
        for mode in STEERING:
            protocol = "trojan" if mode in ("random", "geo") else "shadowsocks-2022"
            port = 443 if protocol == "trojan" else 8388
            extra = ", tls: {server_name: www.lab.test}" if protocol == "trojan" else ""
            lines.append(f"      - {{id: {name}-{mode}, name: \"{name} {mode}\", protocol: {protocol}, port: {port + STEERING.index(mode)},"
                         f" route: {mode}, pool: {POOL_OF[name]}{extra}}}")
    lines.append("routes:")
    for mode in STEERING:
        geo = ", geo: {WEU: [west, east], EEU: [east, west]}" if mode == "geo" else ""
        lines.append(f"  - {{id: {mode}, name: {mode.title()}, pools: [west, east], steering: {mode}{geo}}}")
    lines.append("users:")
    for j in range(24):
        region = REGIONS[j % 3]
        lines.append(f"  - {{name: u{j}" + (f", region: {region}" if region else "") + "}")
    return "\n".join(lines) + "\n"


def reports(cluster: Cluster, at: float, tick: int) -> dict[str, object]:
    """Every server reports; its probes' RTTs depend on regions, so dynamic steering has a clear answer."""
    region = {s.name: s.region for s in cluster.servers}
    out = {}
    for s in cluster.servers:
        probes = {}
        for ref in cluster.inbounds:
            if ref.server.name == s.name:
                continue
            near = region[ref.server.name] == region[s.name]
            probes[ref.inbound.id] = {"ok": True, "rtt_ms": (12.0 if near else 45.0) + (tick % 3)}
        listeners = {f"{ib.port}/{t}": True for ib in s.inbounds for t in ib.transports}
        raw = {"agent": 1, "service": "active", "listeners": listeners, "traffic": {"up": 1000 * tick, "down": 5000 * tick},
               "users": [], "connections": 0, "probes": probes, "took_ms": 3}
        out[s.name] = parse_report(s.name, json.dumps(raw), at)
    return out


async def _drive(path: Path, listen: str, ticks: int, interval: float, users: list[tuple[str, str]]) -> dict[tuple[str, str], bytes]:
    cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    # The real collection: each fake host's agent answers as reports() says (its probes' RTTs by region).
    runner = FakeRunner(path.parent / "hosts")
    region = {s.name: s.region for s in cluster.servers}
    for s in cluster.servers:
        install_agent(runner, s.name, probing({ref.inbound.id: 12.0 if region[ref.server.name] == region[s.name] else 45.0
                                              for ref in cluster.inbounds if ref.server.name != s.name}))
    clock = FakeClock(start=time.time() - ticks * interval)
    loop = Loop(str(path), cluster, Secret(SECRET.encode()), listen=listen, watch=False, runner=runner, clock=clock)
    for _ in range(ticks + 1):
        assert await loop.tick() is not None
        clock.advance(interval)
    host, port = listen.rsplit(":", 1)
    await loop.http.start(host, int(port))
    try:
        got = {}
        async with aiohttp.ClientSession() as http:
            for token, fmt in users:
                async with http.get(f"http://{listen}/sub/{token}/{fmt}") as resp:
                    assert resp.status == 200, (token, fmt, resp.status)
                    got[(token, fmt)] = await resp.read()
        return got
    finally:
        await loop.http.stop()


@pytest.mark.parametrize("fmt", ["links", "sing-box", "clash"])
def test_cli_files_and_live_endpoint_give_the_same_bytes_on_every_steering_mode(tmp_path, monkeypatch, cli, fmt):
    # spec: STEER-1, STEER-2, STEER-3, STEER-4, LB-6 — one snapshot for every outlet
    monkeypatch.setenv("RECONCILER_SECRET", SECRET)
    listen = f"127.0.0.1:{free_port()}"
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_text(10.0, listen))
    cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    secret = Secret(SECRET.encode())
    tokens = {u.name: user_credentials(secret, u.name, u.rotate).token for u in cluster.users}
    live = asyncio.run(_drive(path, listen, 30, 10.0, [(t, fmt) for t in tokens.values()]))

    # Every steering mode really steered: dynamic picked by RTT (each region its near pool), geo by region.
    state = StateFolder(tmp_path / "state")
    learned = state.load_learned(cluster)
    snap = snapshot(cluster, learned, state.facts(), time.time())
    pools = {(u, r): next(ref.inbound.pool for ref in cluster.inbounds if ref.inbound.id == i) for (u, r), i in snap.assignments.items()}
    for u in cluster.users:
        if u.region:
            near = "west" if u.region == "WEU" else "east"
            assert pools[(u.name, "dynamic")] == near and pools[(u.name, "geo")] == near, u
        assert pools[(u.name, "failover")] == "west"
    assert {pools[(u.name, "random")] for u in cluster.users} == {"west", "east"}

    ext = EXTENSIONS[fmt]
    for name, token in tokens.items():
        from_file = (tmp_path / "subs" / token / f"{fmt}.{ext}").read_bytes()
        run = cli("subscription", name, "--format", fmt, "-f", str(path))
        assert run.rc == 0, run.err
        assert run.out.encode() == from_file == live[(token, fmt)], name


def test_the_cli_answers_from_the_saved_learned_state_not_a_fresh_one(tmp_path, monkeypatch, cli):
    # spec: HEALTH-13 — `status` tells what the loop decided, so it reads the learned state
    monkeypatch.setenv("RECONCILER_SECRET", SECRET)
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_text(10.0, "127.0.0.1:1"))
    cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    learned = Learned.fresh(cluster)
    now = time.time() - 300
    for i in range(30):
        learned.fold(cluster, reports(cluster, now + 10 * i, i), now + 10 * i)
    StateFolder(tmp_path / "state").save_learned(learned)
    run = cli("status", "u0", "--json", "-f", str(path))
    assert run.rc == 0, run.err
    entries = {e["route"]: e for e in json.loads(run.out)["entries"]}
    assert entries["dynamic"]["pool"] == "west"  # u0 is in WEU: the near pool by measured RTT
    assert "no health data" not in entries["dynamic"]["health"]


def test_a_server_whose_engine_api_is_down_is_folded_and_saved(tmp_path):
    # spec: HEALTH-3 — a report without traffic (the engine's API did not answer) is still a report;
    # it used to leave a None counter behind, and saving the learned state then raised.
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_text(10.0, "127.0.0.1:1"))
    cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    learned = Learned.fresh(cluster)
    got = reports(cluster, 1e9, 1)
    raw = json.loads(json.dumps({"agent": 1, "service": "active", "listeners": {}, "traffic": None, "users": [], "probes": {}}))
    got["de-1"] = parse_report("de-1", json.dumps(raw), 1e9)
    learned.fold(cluster, got, 1e9)
    assert "de-1" not in learned.counters and "de-2" in learned.counters
    StateFolder(tmp_path / "state").save_learned(learned)
    assert StateFolder(tmp_path / "state").load_learned(cluster).ticks == 1
