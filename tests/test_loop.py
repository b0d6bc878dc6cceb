"""The loop's pure parts: reports, rates, observations, learned state, file outlet, metrics, HTTP outlet.

The lab tests (tests/lab/test_loop.py) run the same code against real hosts; these drive it with
thousands of simulated intervals and check every branch cheaply.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import pickle
import random
import shutil
import subprocess
import sys

import aiohttp
import numpy as np
import pytest

from reconciler.balance import Snapshot
from reconciler.credentials import Secret, user_credentials
from reconciler.errors import ReportError
from reconciler.fleet import snapshot
from reconciler.fleet.learned import Learned
from reconciler.fleet.reports import Counter, Probe, Report, agent_request, observation, parse_report, traffic_rate
from reconciler.fleet.view import FleetView
from reconciler.health.topology import Topology
from reconciler.metrics import LoopStats, ReconcilerCollector
from reconciler.model import Cluster, UserUsage
from reconciler.publish import FileOutlet, LiveAnswers, PublishedTable, Tokens, WriteStats
from reconciler.state.folder import StateFolder
from reconciler.subscriptions import FORMATS

SECRET = Secret(b"loop-test-secret-0123456789abcdef")


def cluster(n_servers: int = 5, users: int = 40, countries=("DE", "DE", "DE", "NL", "RU"), prober: int | None = 4,
            protocol: str = "vless-tls", interval: str = "10s") -> Cluster:
    servers = []
    for i in range(n_servers):
        ib = {"id": f"s{i}-in", "name": f"Server {i}", "protocol": protocol, "port": 443 if protocol != "shadowsocks-2022" else 8388,
              "route": "r"}
        if protocol != "shadowsocks-2022":
            ib["tls"] = {"server_name": "www.lab.test"}
        servers.append({"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": countries[i % len(countries)],
                        "prober": i == prober, "inbounds": [ib]})
    return Cluster.model_validate({"servers": servers, "routes": [{"id": "r", "name": "R"}],
                                   "users": [{"name": f"u{j}"} for j in range(users)],
                                   "settings": {"health": {"report_interval": interval}}})


def agent_json(service="active", listeners=None, traffic=(10, 20), users=(), probes=None) -> str:
    return json.dumps({"agent": 1, "service": service, "listeners": listeners or {"443/tcp": True},
                       "traffic": None if traffic is None else {"up": traffic[0], "down": traffic[1]}, "users": list(users),
                       "connections": len(users), "probes": probes or {}, "took_ms": 5})


def report(server: str, c: Cluster, at: float, failing: set[str] = frozenset(), traffic: int = 0, **kw) -> Report:
    probes = {r.inbound.id: ({"ok": False, "error": "timeout"} if r.inbound.id in failing else {"ok": True, "rtt_ms": 5.0 + r.server.host.count("1")})
              for r in c.inbounds if r.server.name != server}
    return parse_report(server, agent_json(probes=probes, traffic=(0, traffic), **kw), at)


# --------------------------------------------------------------------------- reports


def test_parse_report_reads_the_agent_and_rejects_garbage():
    # spec: HEALTH-1
    probes = {"s1-in": {"ok": True, "rtt_ms": 3.5}, "s2-in": {"ok": False, "error": "timeout"}}
    r = parse_report("s0", "warning: something on stderr\n" + agent_json(users=("bob", "alice"), probes=probes), 100.0)
    assert r.service_ok and r.traffic_bytes == 30 and r.users == ("alice", "bob")
    assert r.probes == {"s1-in": Probe(True, 3.5, None), "s2-in": Probe(False, None, "timeout")}
    assert parse_report("s0", agent_json(traffic=None), 1).traffic_bytes is None
    assert not parse_report("s0", agent_json(service="failed"), 1).service_ok
    for bad in ("", "not json", "[1, 2]", '{"x": 1}'):
        with pytest.raises(ReportError):
            parse_report("s0", bad, 1.0)
    # One bad field makes the whole report unreadable (that server is no_data this interval, with the reason).
    for probes in ({"a": {"ok": True, "rtt_ms": "fast"}}, {"b": "nope"}, {"c": {"ok": True, "rtt_ms": -1}}):
        with pytest.raises(ReportError, match="probes"):
            parse_report("s0", agent_json(probes=probes), 1)


def test_traffic_rate_handles_first_sample_resets_and_missing_api():
    # spec: HEALTH-1 — counters become rates; an engine restart (counter went down) gives no rate that interval
    rate, c = traffic_rate(None, 1_000_000, 10.0)
    assert rate is None and c == Counter(1_000_000, 10.0)
    rate, c2 = traffic_rate(c, 3_500_000, 20.0)
    assert rate == pytest.approx(2.0)  # 2.5 MB in 10 s = 2 Mbit/s
    rate, c3 = traffic_rate(c2, 400, 30.0)  # reset
    assert rate is None and c3 == Counter(400, 30.0)
    rate, c4 = traffic_rate(c3, None, 40.0)  # the API did not answer: keep the old sample
    assert rate is None and c4 == c3
    rate, _ = traffic_rate(c3, 1_250_400, 50.0)
    assert rate == pytest.approx(0.5)
    assert traffic_rate(c3, 500, 30.0)[0] is None  # no time passed


def test_agent_request_probes_every_other_inbound_the_way_a_client_would():
    c = Cluster.model_validate({
        "servers": [{"name": "a", "host": "198.18.0.10", "country": "DE", "inbounds": [
            {"id": "a-tls", "name": "A", "protocol": "vless-tls", "port": 443, "tls": {"server_name": "x.test"}, "route": "r"},
            {"id": "a-ss", "name": "A2", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"}]},
            {"name": "b", "host": "198.18.0.11", "country": "DE", "inbounds": [
                {"id": "b-hy", "name": "B", "protocol": "hysteria2", "port": 443, "tls": {"server_name": "y.test"}, "route": "r"},
                {"id": "b-re", "name": "B2", "protocol": "vless-reality", "port": 8443, "camouflage": "www.example.com", "route": "r"}]}],
        "routes": [{"id": "r", "name": "R"}], "users": [{"name": "u"}]})
    req = agent_request(c, "a", "sekrit", 2.0)
    assert req["listeners"] == [[443, "tcp"], [8388, "tcp"], [8388, "udp"]]
    # The handshake probe names only REALITY's public camouflage; what an app sends is the app-like probe's (HEALTH-16)
    assert {p["id"]: (p["kind"], p.get("sni")) for p in req["probes"]} == {"b-hy": ("quic", None), "b-re": ("tls", "www.example.com")}
    req_b = agent_request(c, "b", "sekrit", 2.0)
    assert {p["id"]: (p["kind"], p.get("sni")) for p in req_b["probes"]} == {"a-tls": ("tls", None), "a-ss": ("tcp", None)}
    assert "app" not in req  # nothing asked of the app-like probe without its inputs


def test_the_app_like_probe_dials_what_the_witness_engine_can_with_the_probe_credential_only():
    # spec: HEALTH-16 — the witness's own engine as a client: every probed inbound its build can dial, on servers
    # whose configuration holds the probe credential; no user's credential in the request
    from reconciler.credentials import Secret, probe_credentials, user_credentials
    from reconciler.fleet.app_probe import BASE_PORT, probe_targets
    from reconciler.fleet.reports import AppProbing

    secret = Secret(b"app-probe-request-secret-0123456789")
    c = Cluster.model_validate({
        "servers": [{"name": "a", "host": "198.18.0.10", "country": "DE", "inbounds": [
            {"id": "a-tls", "name": "A", "protocol": "vless-tls", "port": 443, "tls": {"server_name": "x.test"}, "route": "r"}]},
            {"name": "b", "host": "198.18.0.11", "country": "DE", "inbounds": [
                {"id": "b-hy", "name": "B", "protocol": "hysteria2", "port": 443, "tls": {"server_name": "y.test"}, "route": "r"},
                {"id": "b-re", "name": "B2", "protocol": "vless-reality", "port": 8443, "camouflage": "www.example.com", "route": "r"}]},
            {"name": "c", "host": "198.18.0.12", "country": "DE", "inbounds": [
                {"id": "c-tr", "name": "C", "protocol": "trojan", "port": 443, "tls": {"server_name": "z.test"}, "route": "r"}]}],
        "routes": [{"id": "r", "name": "R"}], "users": [{"name": "u"}]})
    app = AppProbing(probe_targets(c, secret), applied=frozenset({"b"}), lacks={"sing-box": frozenset({"reality"})})
    req = agent_request(c, "a", "sekrit", 2.0, app=app)
    part = req["app"]
    assert part["argv"] == ["/usr/local/bin/sing-box", "run", "-c", "{config}"]
    assert part["ports"] == {"b-hy": BASE_PORT}  # not REALITY (no uTLS), not c (changes not applied yet)
    assert part["bytes"] == 65536 and part["path"] == "/pad/65536" and part["responder"] == ["127.0.0.1", 9097]
    config = json.loads(part["config"])
    [out] = [o for o in config["outbounds"] if o["type"] == "hysteria2"]
    assert out["password"] == probe_credentials(secret).password != user_credentials(secret, "u").password
    assert out["server"] == "198.18.0.11" and out["tls"]["insecure"]
    assert config["inbounds"] == [{"type": "socks", "tag": "p0", "listen": "127.0.0.1", "listen_port": BASE_PORT}]
    everyone = AppProbing(probe_targets(c, secret))
    assert set(agent_request(c, "a", "sekrit", 2.0, app=everyone)["app"]["ports"]) == {"b-hy", "b-re", "c-tr"}
    off = c.model_copy(update={"settings": c.settings.model_copy(update={"health": c.settings.health.model_copy(
        update={"app_probe_bytes": 0})})})
    assert "app" not in agent_request(off, "a", "sekrit", 2.0, app=everyone)


def test_observation_maps_probes_and_listeners():
    # spec: HEALTH-2, HEALTH-3 — Shadowsocks needs both its TCP and UDP listener
    c = cluster(3, protocol="shadowsocks-2022")
    topo = Topology.from_cluster(c)
    reports = {"s0": report("s0", c, 1.0, failing={"s2-in"}), "s1": None,
               "s2": parse_report("s2", agent_json(listeners={"8388/tcp": True, "8388/udp": False}), 1.0)}
    obs = observation(topo, c, reports, 1.0)
    assert obs.reported.tolist() == [True, False, True]
    assert obs.probe_present[0].tolist() == [False, True, True]
    assert obs.probe_ok[0].tolist() == [False, True, False]
    assert not np.isnan(obs.probe_rtt_ms[0, 1]) and np.isnan(obs.probe_rtt_ms[0, 2])
    assert obs.listener_ok.tolist() == [False, True, False]  # s0's report has no 8388/udp; s1 silent keeps True


# --------------------------------------------------------------------------- learned state over thousands of intervals


def run_intervals(c: Cluster, learned: Learned, ticks: int, start: float, blocked: dict[str, set[str]] | None = None,
                  silent: set[str] = frozenset(), rng=None, loss: float = 0.0, every_listener: bool = False):
    """Fold simulated reports; ``blocked``: witness → targets it cannot reach; ``every_listener``: each server reports
    every inbound's port listening (else 443/tcp only). Returns the server statuses per tick."""
    interval = c.settings.health.report_interval
    history = []
    for k in range(ticks):
        now = start + k * interval
        reports = {}
        for s in c.servers:
            if s.name in silent:
                reports[s.name] = None
                continue
            failing = set((blocked or {}).get(s.name, set()))
            if rng is not None and loss:
                failing |= {r.inbound.id for r in c.inbounds if rng.random() < loss}
            listeners = {f"{ib.port}/{t}": True for ib in s.inbounds for t in ib.transports} if every_listener else None
            reports[s.name] = report(s.name, c, now, failing=failing, traffic=int(now * 1000), listeners=listeners)
        v = learned.fold(c, reports, now)
        history.append({name: sv.status for name, sv in v.servers().items()})
    return history


def test_thousands_of_lossy_intervals_give_no_false_verdict():
    # spec: HEALTH-5, HEALTH-6 — 10% independent probe loss on every pair for 3,000 intervals
    c = cluster(5)
    learned = Learned.fresh(c)
    history = run_intervals(c, learned, 3000, 1e9, rng=np.random.default_rng(7), loss=0.10)
    assert {st for h in history for st in h.values()} == {"ok"}
    assert learned.ticks == 3000 and learned.capacity.peak.shape == (5,)


def test_a_country_block_is_caught_within_the_failure_streak_and_heals():
    # spec: HEALTH-5, HEALTH-7, HEALTH-12 — the DE witnesses of s0 lose it; NL and the RU prober still reach it
    c = cluster(5)
    learned = Learned.fresh(c)
    # Twenty minutes of ordinary probe loss (1%) first: the engine learns how failures end before it judges two
    # witnesses' word (HEALTH-5; a fleet that never saw a failure end asks two witnesses for one interval more).
    run_intervals(c, learned, 120, 1e9, rng=np.random.default_rng(0), loss=0.01)
    F = c.settings.health.failure_streak
    history = run_intervals(c, learned, 10, 1e9 + 1200, blocked={"s1": {"s0-in"}, "s2": {"s0-in"}})
    first = next(i for i, h in enumerate(history) if h["s0"] == "unreachable")
    assert first <= F  # the F-th failing interval (index F-1) or the next one
    assert all(h["s0"] == "unreachable" for h in history[first:])
    healed = run_intervals(c, learned, 6, 1e9 + 1300)
    assert healed[-1]["s0"] == "ok"


def test_silence_is_no_data_never_down():
    # spec: HEALTH-3, HEALTH-4
    c = cluster(5)
    learned = Learned.fresh(c)
    run_intervals(c, learned, 20, 1e9)
    history = run_intervals(c, learned, 10, 1e9 + 200, silent={"s3"})
    assert history[0]["s3"] == "ok" and history[-1]["s3"] == "no_data"
    assert all(h[s] == "ok" for h in history for s in ("s0", "s1", "s2", "s4"))


def test_learned_state_round_trips_and_survives_a_changed_file():
    c = cluster(5)
    learned = Learned.fresh(c)
    run_intervals(c, learned, 20, 1e9, blocked={"s1": {"s0-in"}, "s2": {"s0-in"}})
    snap = snapshot(c, learned, {}, 1e9 + 200)
    learned.assignments = dict(snap.assignments)
    assert snap.assignments and learned.assignments
    again = Learned.from_bytes(learned.to_bytes())
    for name in ("rtt_ewma", "rtt_first", "rtt_last"):
        np.testing.assert_array_equal(getattr(again, name), getattr(learned, name))
    for name, value in vars(learned.health).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(getattr(again.health, name), value)
    assert again.assignments == learned.assignments and again.counters == learned.counters and again.ticks == 20
    assert again.current_verdicts(c, 1e9 + 200).server("s0").status == "unreachable"

    # A new server at the front: everything else is carried over by name (one inbound per server: N == M).
    grown = Cluster.model_validate({**c.model_dump(mode="json", exclude_none=True),
                                    "servers": [{"name": "new", "host": "198.18.0.99", "country": "DE",
                                                 "inbounds": [{"id": "new-in", "name": "New", "protocol": "shadowsocks-2022",
                                                               "port": 8388, "route": "r"}]}]
                                    + c.model_dump(mode="json", exclude_none=True)["servers"]})
    adopted = again.adopt(grown)
    assert adopted.topology.servers[0] == "new"
    assert adopted.health.fail[0].sum() == 0 and adopted.health.fail[:, 0].sum() == 0
    np.testing.assert_array_equal(adopted.health.fail[1:, 1:], again.health.fail)
    assert adopted.health.unreach_on.tolist() == [False, *again.health.unreach_on.tolist()]
    np.testing.assert_array_equal(adopted.rtt_ewma[1:, 1:], again.rtt_ewma)
    assert adopted.current_verdicts(grown, 1e9 + 200).server("s0").status == "unreachable"


def test_unreadable_state_starts_afresh_with_a_note(tmp_path):
    c = cluster(3)
    state = StateFolder(tmp_path)
    assert state.load_learned(c).ticks == 0 and state.notes == []  # none yet: fresh, nothing to say
    (tmp_path / "learned.npz").write_bytes(b"garbage")
    learned = state.load_learned(c)
    assert learned.ticks == 0 and "starting afresh" in state.notes[0] and "learned.npz" in state.notes[0]


def test_learned_state_saved_through_the_state_folder_is_restored(tmp_path):
    c = cluster(3)
    learned = Learned.fresh(c)
    run_intervals(c, learned, 5, 1e9)
    StateFolder(tmp_path).save_learned(learned)
    assert oct((tmp_path / "learned.npz").stat().st_mode & 0o777) == "0o600"
    again = StateFolder(tmp_path).load_learned(c)
    assert again.ticks == 5 and again.counters == learned.counters


# --------------------------------------------------------------------------- file outlet and live answers


def snapshot_after(c: Cluster, learned: Learned, blocked=None, ticks=15, start=1e9) -> Snapshot:
    run_intervals(c, learned, ticks, start, blocked=blocked)
    now = start + ticks * c.settings.health.report_interval
    snap = snapshot(c, learned, {}, now)
    learned.assignments = dict(snap.assignments)
    return snap


def test_files_are_written_once_rewritten_only_where_changed_and_match_the_live_answers(tmp_path):
    # spec: LB-6, HEALTH-10 — one pure render for both outlets; only moved users are rewritten
    c = cluster(5, users=60)
    learned = Learned.fresh(c)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    snap = snapshot_after(c, learned)
    first = out.write(snap)
    assert first.written == 60 and first.unchanged == 0
    token = user_credentials(SECRET, "u0", 0).token
    files = sorted(p.name for p in (tmp_path / "subs" / token).iterdir())
    assert files == ["clash.yaml", "headers.json", "links.txt", "sing-box.json"]
    assert out.write(snap).skipped_all
    # Restart: a new outlet reads its manifest and rewrites nothing.
    out2 = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    assert out2.write(snap).skipped_all
    # Block s0 from its DE witnesses: only the users who were on s0 move.
    on_s0 = {u for (u, _), i in snap.assignments.items() if i == "s0-in"}
    assert on_s0
    blocked = snapshot_after(c, learned, blocked={"s1": {"s0-in"}, "s2": {"s0-in"}}, start=2e9)
    assert blocked.verdicts.server("s0").status == "unreachable"
    stats = out2.write(blocked)
    moved = {u for (u, _), i in blocked.assignments.items() if snap.assignments.get((u, "r")) != i}
    assert moved >= on_s0 and stats.written == len(moved) and stats.unchanged == 60 - len(moved)
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(blocked)
    for u in ("u0", "u1", sorted(on_s0)[0]):
        tok = user_credentials(SECRET, u, 0).token
        assert answers.user_of(tok) == u
        for fmt, name in (("links", "links.txt"), ("sing-box", "sing-box.json"), ("clash", "clash.yaml")):
            doc = answers.answer(u, fmt)
            assert (tmp_path / "subs" / tok / name).read_bytes() == doc.body
            assert json.loads((tmp_path / "subs" / tok / "headers.json").read_text())[fmt] == doc.headers
        links = base64.b64decode((tmp_path / "subs" / tok / "links.txt").read_bytes()).decode()
        assert "198.18.0.10:" not in links  # nobody is sent to the unreachable server


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("parallel_min", [20_000, 3])  # in this process; split with a worker process
def test_between_file_changes_only_users_whose_inputs_changed_are_looked_at(tmp_path, monkeypatch, parallel_min):
    # spec: LB-6 — a million users' fingerprints each interval would be the interval's whole work: a pass looks at
    # the users whose standing, usage step or inbound changed, and writes exactly what a pass over everyone writes.
    data = cluster(5, users=60).model_dump(mode="json", exclude_none=True)
    data["users"][3] |= {"data_limit": "1GB"}
    c = Cluster.model_validate(data)
    learned = Learned.fresh(c)
    snap = snapshot_after(c, learned)
    monkeypatch.setattr(FileOutlet, "PARALLEL_MIN", parallel_min)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=2)
    assert out.write(snap).written == 60
    manifest = (tmp_path / "state" / "subscription-files.json").read_bytes()

    def write_beside_a_full_pass(s: Snapshot, label: str) -> WriteStats:
        """The outlet's write, and what an outlet restarted from the same folders (comparing every user) writes."""
        for part in ("subs", "state"):
            shutil.copytree(tmp_path / part, tmp_path / label / part)
        stats = out.write(s)
        ref = FileOutlet(tmp_path / label / "subs", tmp_path / label / "state", SECRET)
        ref.write(s)
        assert tree(tmp_path / "subs") == tree(tmp_path / label / "subs") and out.published == ref.published
        return stats

    # u1 crosses a usage step (its subscription-userinfo changes); u3 goes over its limit (refused); u7's few bytes
    # stay within its step (its files follow usage in steps, the live endpoint exactly).
    usage = {"u1": UserUsage(up=250_000_000), "u3": UserUsage(down=1_500_000_000), "u7": UserUsage(up=10)}
    changed = dataclasses.replace(snap, usage=usage)
    stats = write_beside_a_full_pass(changed, "ref1")
    assert (stats.written, stats.unchanged, stats.skipped_all) == (2, 58, False)
    # Within MANIFEST_EVERY the manifest is not rewritten for two users; a restart with it rewrites what it missed.
    assert (tmp_path / "state" / "subscription-files.json").read_bytes() == manifest
    again = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    assert again.write(changed).written == 2
    # Users moved off a blocked server: only they are looked at, by the same outlet.
    blocked = snapshot_after(c, learned, blocked={"s1": {"s0-in"}, "s2": {"s0-in"}}, start=2e9)
    blocked = dataclasses.replace(blocked, usage=usage)
    moved = {u for (u, _), i in blocked.assignments.items()
             if changed.assignments.get((u, "r")) != i and blocked.active(c.user(u))}  # u3 is refused wherever it is
    stats = write_beside_a_full_pass(blocked, "ref2")
    assert moved and (stats.written, stats.written + stats.unchanged) == (len(moved), 60)
    # The folder removed behind its back: everyone is written again.
    shutil.rmtree(tmp_path / "subs")
    assert out.write(dataclasses.replace(blocked, usage={})).written == 60


def test_a_usage_step_rewrites_headers_from_the_file_and_a_file_not_ours_from_the_render(tmp_path, monkeypatch):
    # Users who only crossed a usage step get their headers.json's figures replaced in place (no bodies rendered,
    # no keys derived); one whose headers.json is not what the outlet wrote is rendered whole. Either way, the
    # same bytes as an outlet comparing everyone.
    import reconciler.publish.userfiles as userfiles

    c = cluster(5, users=12)
    snap = snapshot_after(c, Learned.fresh(c))
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=1)
    assert out.write(snap).written == 12
    folder = {u: tmp_path / "subs" / user_credentials(SECRET, u, 0).token for u in ("u1", "u2", "u3", "u4", "u5", "u6")}
    (folder["u2"] / "headers.json").write_text("{")
    (folder["u3"] / "headers.json").write_text('{"links": {"etag": "x"}}')
    (folder["u4"] / "headers.json").unlink()
    (folder["u5"] / "headers.json").write_text("{}")  # no format at all: not what the outlet wrote either
    (folder["u6"] / "headers.json").write_text("[" * 100_000)  # nested past the parser's depth
    rendered, decided = [], []
    real, real_decide = userfiles.render_formats, userfiles.decide
    monkeypatch.setattr(userfiles, "render_formats", lambda s, user, *a, **k: rendered.append(user) or real(s, user, *a, **k))
    monkeypatch.setattr(userfiles, "decide", lambda s, user, *a, **k: decided.append(user) or real_decide(s, user, *a, **k))
    usage = {u: UserUsage(up=250_000_000, down=7) for u in folder}
    changed = dataclasses.replace(snap, usage=usage)
    stats = out.write(changed)
    assert (stats.written, sorted(rendered)) == (6, ["u2", "u3", "u4", "u5", "u6"])
    assert sorted(decided) == ["u2", "u3", "u4", "u5", "u6"]  # u1's entries did not move: its step alone is stamped
    ref = FileOutlet(tmp_path / "ref" / "subs", tmp_path / "ref" / "state", SECRET, workers=1)
    ref.write(changed)
    assert tree(tmp_path / "subs") == tree(tmp_path / "ref" / "subs") and out.published == ref.published
    assert json.loads((folder["u1"] / "headers.json").read_text())["clash"]["subscription-userinfo"].startswith(
        "upload=250000000; download=7;")


def test_headers_are_restamped_in_place_exactly_as_a_json_round_trip_would_or_not_at_all():
    # headers_json_restamped replaces the figures in the bytes. Over the outlet's own files and thousands of
    # mutations of them (cut, doubled, keys and values changed, formats reordered, a header's text that quotes
    # the header's name), it gives exactly what reading the JSON and writing it back gives, or None (then the
    # user is rendered whole); never other bytes.
    from reconciler.subscriptions.document import headers_json, headers_json_restamped, render_formats

    def by_json(data: bytes, formats: tuple[str, ...], info: str) -> bytes | None:
        try:
            table = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if (not isinstance(table, dict) or list(table) != list(formats)
                or not all(isinstance(h, dict) and "subscription-userinfo" in h for h in table.values())):
            return None
        for h in table.values():
            h["subscription-userinfo"] = info
        return json.dumps(table, ensure_ascii=False).encode()

    data = cluster(3, users=2).model_dump(mode="json", exclude_none=True)
    data["settings"]["outputs"] = {"profile_title": 'Ünïcode "subscription-userinfo": "x", "etag": {'}
    c = Cluster.model_validate(data)
    snap = snapshot_after(c, Learned.fresh(c))
    formats = tuple(FORMATS)
    files = []
    for user in ("u0", "u1"):
        docs = render_formats(snap, user, formats, SECRET)
        files.append(headers_json(snap, docs))
    rng = random.Random(5)
    info = "upload=1; download=2; total=0; expire=0"
    accepted = 0
    for k in range(4000):
        raw = bytearray(rng.choice(files))
        for _ in range(0 if k < 50 else rng.randrange(1, 4)):  # the first 50: the files as written
            cut = rng.randrange(len(raw) + 1)
            what = rng.randrange(5)
            if what == 0:
                del raw[cut:cut + rng.randrange(1, 40)]
            elif what == 1:
                raw[cut:cut] = rng.choice([b'"', b"}", b"{", b", ", b'"subscription-userinfo": "y"', b"\\", b"\x00"])
            elif what == 2:
                raw = raw.replace(rng.choice([f'"{f}"'.encode() for f in formats]), b'"other"', 1)
            elif what == 3:
                raw = raw[:cut] + raw[cut:] * 2
            else:
                raw = raw.replace(b"subscription-userinfo", b"subscription-userinfO", 1)
        got, want = headers_json_restamped(snap, bytes(raw), formats, info), by_json(bytes(raw), formats, info)
        if got is not None:
            accepted += 1
            assert got == want, bytes(raw)
    assert 50 <= accepted < 4000  # the outlet's own files are taken, mutated ones mostly not
    assert headers_json_restamped(snap, files[0], formats, 'upload=1"') is None  # not a figure userinfo writes


def test_a_pass_that_fails_midway_and_a_folder_removed_behind_the_outlets_back_are_repaired(tmp_path, monkeypatch):
    import reconciler.publish.userfiles as userfiles

    data = cluster(5, users=60).model_dump(mode="json", exclude_none=True)
    data["users"][2] |= {"device_limit": 1, "on_device_limit": "refuse"}
    c = Cluster.model_validate(data)
    learned = Learned.fresh(c)
    snap = snapshot_after(c, learned)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=1)
    out.write(snap)
    # u2 is refused (too many devices) and the disk fills up right after its files were written.
    refused = dataclasses.replace(snap, usage={"u2": UserUsage(devices=3), "u9": UserUsage(up=300_000_000)})
    real, rewrite, calls = userfiles._write_user, userfiles._restamp_userinfo, []

    def recording(*args, **kw):
        calls.append(args[4].name)
        return real(*args, **kw)

    def full_disk(snapshot, directory, formats, token, user, size):  # u9 crossed a usage step: its headers only
        calls.append(user.name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(userfiles, "_write_user", recording)
    monkeypatch.setattr(userfiles, "_restamp_userinfo", full_disk)
    with pytest.raises(OSError):
        out.write(refused)
    monkeypatch.setattr(userfiles, "_write_user", real)
    monkeypatch.setattr(userfiles, "_restamp_userinfo", rewrite)
    assert calls == ["u2", "u9"]
    # u2 is back under its limit, and only its usage step moved since the last pass that ended well: its refusal
    # body must not stay beside new headers. The next pass compares everyone.
    back = dataclasses.replace(snap, usage={"u2": UserUsage(up=200_000_000)})
    out.write(back)
    for part in ("subs", "state"):
        shutil.copytree(tmp_path / part, tmp_path / "ref" / part)
    reference = FileOutlet(tmp_path / "ref" / "subs", tmp_path / "ref" / "state", SECRET, workers=1)
    reference.published = PublishedTable((), {})  # writes every user from scratch
    shutil.rmtree(tmp_path / "ref" / "subs")
    reference.write(back)
    assert tree(tmp_path / "subs") == tree(tmp_path / "ref" / "subs")
    # A folder removed behind the outlet's back comes back within SWEEP passes over changed users.
    monkeypatch.setattr(FileOutlet, "SWEEP", 4)
    victim = user_credentials(SECRET, "u40", 0).token
    shutil.rmtree(tmp_path / "subs" / victim)
    for k in range(4):
        out.write(dataclasses.replace(snap, usage={"u2": UserUsage(up=(3 + k) * 100_000_000)}))
    assert (tmp_path / "subs" / victim / "links.txt").read_bytes() == (tmp_path / "ref" / "subs" / victim / "links.txt").read_bytes()
    # A stop records the manifest the last passes left behind.
    before = (tmp_path / "state" / "subscription-files.json").read_bytes()
    out.close()
    after = json.loads((tmp_path / "state" / "subscription-files.json").read_bytes())
    assert after["users"] == {k: list(v) for k, v in out.published.items()} and json.dumps(after).encode() != before


def test_a_big_write_in_worker_processes_gives_the_same_files(tmp_path, monkeypatch, worker_takes_part):
    # The workers read the snapshot from an anonymous file they inherit (without the secret): nothing in any folder.
    import reconciler.publish.files as files
    from reconciler.publish.parallel import Spill

    c = cluster(5, users=300)
    learned = Learned.fresh(c)
    snap = snapshot_after(c, learned)
    one = FileOutlet(tmp_path / "a", tmp_path / "sa", SECRET, workers=1)
    one.write(snap)
    monkeypatch.setattr(FileOutlet, "PARALLEL_MIN", 10)
    two = FileOutlet(tmp_path / "b", tmp_path / "sb", SECRET, workers=2)
    (tmp_path / "sb").mkdir()
    seen: list[tuple[list[str], bytes]] = []
    spills: list[Spill] = []
    real, made = files.write_users, files.Spill

    def looking(*args, **kw):  # this process's slice runs while the workers have the snapshot
        seen.append((sorted(os.listdir(tmp_path / "sb")), os.pread(spills[0].fd, spills[0].size, 0)))
        return real(*args, **kw)

    def spill():
        spills.append(made())
        return spills[-1]

    monkeypatch.setattr(files, "write_users", looking)
    monkeypatch.setattr(files, "Spill", spill)
    stats = two.write(snap)
    assert stats.written == 300 and worker_takes_part[0][1] > 0  # the worker wrote some of them
    assert len(seen) == 1 and seen[0][0] == [] and len(seen[0][1]) == spills[0].size > 1000
    assert SECRET.value not in seen[0][1]
    with pytest.raises(OSError):  # closed with the pass
        os.fstat(spills[0].fd)
    other = made()
    with pytest.raises(TypeError, match="as they start"):  # its descriptor goes nowhere but to a starting worker
        pickle.dumps(other)
    other.close()
    assert two.published == one.published
    for token in (p.token for p in one.published.values()):
        for name in ("links.txt", "sing-box.json", "clash.yaml", "headers.json"):
            assert (tmp_path / "a" / token / name).read_bytes() == (tmp_path / "b" / token / name).read_bytes()
    assert two.write(snap).skipped_all


def test_the_outlet_takes_the_clusters_digest_from_its_loader(tmp_path, monkeypatch):
    # The loop hashes every cluster it loads (a million users: ~0.8 s); the outlet's pass on it does not again.
    import reconciler.publish.files as files

    c = cluster(3, users=20)
    other = cluster(3, users=21)
    snap = snapshot_after(c, Learned.fresh(c))
    told = files.cluster_digest(c)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    out.hashed(other, "not this cluster's")  # told of another cluster: this one's is computed
    hashed = []
    monkeypatch.setattr(files, "cluster_digest", lambda cl: hashed.append(cl) or told)
    assert out.write(snap).written == 20 and hashed == [c]
    ref = FileOutlet(tmp_path / "ref", tmp_path / "ref-state", SECRET)
    ref.hashed(c, told)
    assert ref.write(snap).written == 20 and hashed == [c]  # told: not hashed again
    assert ref.digest == out.digest and ref.published == out.published


def test_a_version_that_writes_other_files_for_the_same_inputs_looks_at_every_user_after_an_upgrade(tmp_path, monkeypatch):
    # The snapshot digest holds the documents' version (``files.DOCUMENTS``): with the same cluster and snapshot, a
    # restarted outlet of a version that makes other files (ETags, say) does not skip the pass on the old digest.
    import reconciler.publish.files as files

    c = cluster(3, users=4, countries=("DE",), prober=None)
    snap = Snapshot(cluster=c, now=1e9)
    FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET).write(snap)
    assert FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET).write(snap).skipped_all  # (the same version)
    monkeypatch.setattr(files, "DOCUMENTS", files.DOCUMENTS + 1)
    stats = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET).write(snap)
    assert not stats.skipped_all and stats.unchanged == 4  # looked at, each found as it was (fingerprints alike)


def test_rotated_and_removed_users_lose_their_old_files(tmp_path):
    c = cluster(3, users=3, countries=("DE",), prober=None)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    out.write(Snapshot(cluster=c, now=1e9))
    old = user_credentials(SECRET, "u1", 0).token
    data = c.model_dump(mode="json", exclude_none=True)
    data["users"] = [{"name": "u0"}, {"name": "u1", "rotate": 1}]
    stats = out.write(Snapshot(cluster=Cluster.model_validate(data), now=1e9))
    assert stats.removed == 2 and stats.written == 1
    assert not (tmp_path / "subs" / old).exists()
    assert (tmp_path / "subs" / user_credentials(SECRET, "u1", 1).token).is_dir()
    assert sorted(p.name for p in (tmp_path / "subs").iterdir()) == sorted(
        [user_credentials(SECRET, "u0", 0).token, user_credentials(SECRET, "u1", 1).token])


def test_temporaries_of_a_killed_writer_are_cleaned(tmp_path):
    c = cluster(3, users=2, countries=("DE",), prober=None)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    out.write(Snapshot(cluster=c, now=1e9))
    folder = next((tmp_path / "subs").iterdir())
    (folder / ".links.txt.123.tmp").write_bytes(b"half a docu")
    (tmp_path / "state" / ".outlet-snapshot.123.abcd.pickle").write_bytes(b"a killed pass's snapshot")
    (tmp_path / "subs.123-0badcafe.tmp" / "a-token").mkdir(parents=True)  # a first pass's folder (``_tree``)
    (tmp_path / "subs.backup.tmp").mkdir()  # the operator's: not a name the outlet gives
    assert out.clean_temporaries() == 3
    assert not list((tmp_path / "subs").glob("*/.*.tmp")) and not list((tmp_path / "state").glob(".outlet-snapshot.*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state", "subs", "subs.backup.tmp"]


def _files_of(folder) -> dict[str, bytes]:
    return {f"{p.parent.name}/{p.name}": p.read_bytes() for p in folder.glob("*/*")}


def test_a_first_pass_shows_every_users_folder_at_once_and_nothing_when_it_fails(tmp_path, monkeypatch):
    # spec: LB-6 — with nothing at the folder yet (a first start, a new subscriptions_dir, the folder removed), every
    # user's folder is written as it is into a folder beside it, renamed into place when all are there: readers see
    # all of them or none (and the same bytes as a pass into an existing folder, which stages user by user).
    import reconciler.publish.files as files
    from reconciler.publish import userfiles

    c = cluster(3, users=6, countries=("DE",), prober=None)
    snap = Snapshot(cluster=c, now=1e9)
    ref = FileOutlet(tmp_path / "ref" / "subs", tmp_path / "ref" / "state", SECRET, workers=1)
    (tmp_path / "ref" / "subs").mkdir(parents=True)
    assert ref.write(snap).written == 6

    seen = []
    publish = files.FileOutlet._publish_tree

    def publishing(self, tree):
        seen.append((tree, self.directory.exists(), sorted(p.name for p in tree.iterdir())))
        publish(self, tree)

    monkeypatch.setattr(files.FileOutlet, "_publish_tree", publishing)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=1)
    assert out.write(snap).written == 6
    ((tree, there, names),) = seen
    assert not there and tree.parent == tmp_path
    assert str(tree).startswith(str(out.directory))  # what skips the folder skips it too (the loop's watch)
    assert names == sorted(p.token for p in out.published.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "state", "subs"]
    assert _files_of(out.directory) == _files_of(ref.directory) and out.published == ref.published

    # A pass that fails (a full disk at the fourth user): nothing at the folder, nothing beside it; the next one writes all.
    written = []
    real = userfiles._write_folder

    def filling(folder, names, data):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        written.append(folder)
        real(folder, names, data)

    monkeypatch.setattr(userfiles, "_write_folder", filling)
    again = FileOutlet(tmp_path / "again", tmp_path / "again-state", SECRET, workers=1)
    with pytest.raises(OSError, match="No space"):
        again.write(snap)
    assert len(written) == 3 and not [p for p in tmp_path.iterdir() if p.name.startswith("again") and p.name != "again-state"]
    monkeypatch.setattr(userfiles, "_write_folder", real)
    assert again.write(snap).written == 6 and _files_of(again.directory) == _files_of(ref.directory)


def test_a_folder_that_appears_during_a_first_pass_gets_each_users_folder_moved_in(tmp_path, monkeypatch):
    # Another writer (or the operator) made the folder while the pass wrote: it is not replaced; each user's folder
    # goes into it, a stale one of the same user has its files replaced, and what else is there stays.
    import reconciler.publish.files as files

    c = cluster(3, users=5, countries=("DE",), prober=None)
    snap = Snapshot(cluster=c, now=1e9)
    ref = FileOutlet(tmp_path / "ref" / "subs", tmp_path / "ref" / "state", SECRET, workers=1)
    ref.write(snap)
    stale = user_credentials(SECRET, "u0", 0).token
    publish = files.FileOutlet._publish_tree

    def appearing(self, tree):
        (self.directory / stale).mkdir(parents=True)
        (self.directory / stale / "links.txt").write_bytes(b"stale")
        (self.directory / "not-ours").mkdir()
        publish(self, tree)

    monkeypatch.setattr(files.FileOutlet, "_publish_tree", appearing)
    out = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=1)
    assert out.write(snap).written == 5
    assert (out.directory / "not-ours").is_dir()
    assert _files_of(out.directory) == _files_of(ref.directory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "state", "subs"]


# --------------------------------------------------------------------------- metrics


def collector_text(view: FleetView | None, stats: LoopStats) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry(auto_describe=False)
    reg.register(ReconcilerCollector(lambda: view, stats))
    return generate_latest(reg).decode()


def test_metrics_are_pre_zeroed_bounded_and_lint_clean():
    # spec: HEALTH-13
    c = cluster(5)
    learned = Learned.fresh(c)
    snap = snapshot_after(c, learned, blocked={"s1": {"s0-in"}, "s2": {"s0-in"}})
    stats = LoopStats()
    stats.record("collect", True, 0.3, 1e9)
    stats.record("plan", False, 2.0, 1e9)
    view = FleetView(cluster=c, verdicts=snap.verdicts, snapshot=snap, traffic_mbps={"s1": 12.5}, capacity_mbps={"s1": 100.0},
                     rtt_ms={("WEU", "s0-in"): 12.0})
    text = collector_text(view, stats)
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    status = [ln for ln in lines if ln.startswith("reconciler_server_status{")]
    assert len(status) == 5 * 5  # every server × every status, from the first scrape
    assert 'reconciler_server_status{country="DE",server="s0",status="unreachable"} 1.0' in lines
    assert 'reconciler_server_status_code{server="s0"} 3.0' in lines
    assert 'reconciler_inbound_in_rotation{inbound="s0-in",route="r",server="s0"} 0.0' in lines
    assert 'reconciler_server_traffic_bytes_per_second{server="s1"} 1.5625e+06' in lines
    assert 'reconciler_reconcile_total{kind="plan",result="error"} 1.0' in lines
    assert 'reconciler_reconcile_duration_seconds_bucket{kind="collect",le="0.5"} 1.0' in lines
    assert 'reconciler_route_best_available_only{route="r"} 0.0' in lines
    assert len(lines) < 400
    # Before the first interval: only the loop's own metrics, still valid.
    assert "reconciler_info" in collector_text(None, LoopStats())
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (`make setup` installs prometheus)")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


# --------------------------------------------------------------------------- HTTP outlet


def test_http_outlet_serves_subscriptions_metrics_health_and_status():
    # spec: ROUTE-8, HEALTH-13 — GET/HEAD, formats by path and User-Agent, ETag/304, 404 for unknown tokens
    from prometheus_client import CollectorRegistry

    from reconciler.lab.demo import free_port
    from reconciler.loop.http import HttpOutlet

    c = cluster(5, users=5)
    learned = Learned.fresh(c)
    snap = snapshot_after(c, learned, blocked={"s1": {"s0-in"}, "s2": {"s0-in"}})
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snap)
    stats = LoopStats()
    view = FleetView(cluster=c, verdicts=snap.verdicts, snapshot=snap)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ReconcilerCollector(lambda: view, stats))
    outlet = HttpOutlet(answers, reg, lambda: view, lambda: (True, "ok: fine"))
    port = free_port()
    token = user_credentials(SECRET, "u1", 0).token

    async def go():
        await outlet.start("127.0.0.1", port)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{base}/sub/{token}") as r:
                    assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
                    body, etag = await r.read(), r.headers["etag"]
                    assert body == answers.answer("u1", "links").body
                    assert r.headers["subscription-userinfo"].startswith("upload=0; download=0")
                    assert "profile-update-interval" in r.headers and "content-disposition" in r.headers
                async with s.get(f"{base}/sub/{token}", headers={"If-None-Match": etag}) as r:
                    assert r.status == 304
                async with s.head(f"{base}/sub/{token}/sing-box") as r:
                    assert r.status == 200 and r.headers["content-type"].startswith("application/json")
                    assert await r.read() == b""
                async with s.get(f"{base}/sub/{token}", headers={"User-Agent": "ClashMeta/1.18"}) as r:
                    assert r.headers["content-type"].startswith("text/yaml")
                async with s.get(f"{base}/sub/{token}?format=sing-box") as r:
                    json.loads(await r.read())
                async with s.get(f"{base}/sub/not-a-token") as r:
                    assert r.status == 404 and "u1" not in await r.text()
                async with s.get(f"{base}/sub/{token}/pdf") as r:
                    assert r.status == 404
                async with s.post(f"{base}/sub/{token}") as r:
                    assert r.status == 405
                async with s.get(f"{base}/nothing-here") as r:
                    assert r.status == 404
                async with s.get(f"{base}/healthz") as r:
                    assert r.status == 200
                async with s.get(f"{base}/metrics") as r:
                    assert "reconciler_server_status" in await r.text()
                async with s.get(f"{base}/routes") as r:  # the console's routes and topology
                    page = await r.text()
                    # Only the DE witnesses lose s0 (HEALTH-15): the page says from where, and for whom it is out.
                    assert "<svg" in page and 'data-server="s0" data-status="unreachable from DE"' in page
                    assert ">s0-in</a> — In rotation: not for WEU" in page
                async with s.get(f"{base}/status.json") as r:
                    st = await r.json()
                    assert st["servers"]["s0"]["status"] == "unreachable" and st["routes"]["r"]["active"]
                    assert st["servers"]["s0"]["unreachable_from"] == "DE" and st["servers"]["s0"]["out_for"] == "WEU"
                    assert {v["unreliable_witness"] for v in st["servers"].values()} == {False}  # HEALTH-6, per witness
                    assert all(isinstance(v["censored_witness"], bool) for v in st["servers"].values())
        finally:
            await outlet.stop()

    asyncio.run(go())


def test_agent_probes_tcp_and_reports_failures_locally(tmp_path):
    # The agent is stdlib-only and runs on the servers; here it probes a real local listener and a closed port.
    import socket

    from reconciler.engine import base as singbox

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port_closed = closed.getsockname()[1]
    closed.close()
    req = {"service": "no-such-unit.service", "listeners": [[listener.getsockname()[1], "tcp"]], "probes": [
        {"id": "open", "host": "127.0.0.1", "port": listener.getsockname()[1], "kind": "tcp"},
        {"id": "closed", "host": "127.0.0.1", "port": port_closed, "kind": "tcp"},
        {"id": "quic", "host": "127.0.0.1", "port": port_closed, "kind": "quic"}], "timeout": 0.6}
    agent = tmp_path / "agent.py"
    agent.write_bytes(singbox.AGENT_SOURCE)
    try:
        out = subprocess.run([sys.executable, "-I", str(agent)], input=json.dumps(req), capture_output=True, text=True, timeout=30)
    finally:
        listener.close()
    rep = parse_report("local", out.stdout, 1.0)
    assert rep.probes["open"].ok and rep.probes["open"].rtt_ms is not None
    assert not rep.probes["closed"].ok and not rep.probes["quic"].ok
    assert rep.traffic_bytes is None and rep.service != "active"


def test_traffic_is_a_counter_across_engine_restarts_and_streaks_are_exported():
    # issue 15 / HEALTH-14: bytes as a _total counter (engine restarts add nothing, never go back), the failure
    # streaks and pair marks behind the verdicts, and no -1 sentinel for a server that never reported
    from reconciler.fleet.learned import Learned

    c = cluster(3)
    learned = Learned.fresh(c)
    totals = []
    for tick, engine_bytes in enumerate([1000, 5000, 200, 900]):  # the engine restarted before the third report
        at = 1000.0 + 60 * tick
        reports = {s.name: report(s.name, c, at, failing={"s2-in"} if s.name == "s0" else set(), traffic=engine_bytes)
                   for s in c.servers}
        verdicts = learned.fold(c, reports, at)
        totals.append(learned.bytes_total.get("s0", 0))
    assert totals == [0, 4000, 4000, 4700]
    text = collector_text(FleetView(cluster=c, verdicts=verdicts, traffic_bytes=dict(learned.bytes_total)), LoopStats())
    assert 'reconciler_server_traffic_bytes_total{server="s0"} 4700.0' in text
    assert 'reconciler_probe_failure_streak{inbound="s2-in",witness="s0"} 4.0' in text
    assert f"reconciler_report_interval_seconds {c.settings.health.report_interval}" in text
    assert not [line for line in text.splitlines() if not line.startswith("#") and line.endswith(" -1.0")]
    fresh = collector_text(FleetView(cluster=c), LoopStats())
    assert "reconciler_server_last_report_timestamp_seconds{" not in fresh  # never reported: no sample, no sentinel


def test_the_loop_tells_when_a_session_fails_after_its_handshake_and_when_it_carries_again(caplog):
    # spec: HEALTH-16 — what kind of censor is at work is in the log: once when it starts, once when it ends
    import logging

    from reconciler.credentials import Secret
    from reconciler.fleet.reports import Probe, Report
    from reconciler.loop.clock import FakeClock
    from reconciler.loop.collect import Collection
    from reconciler.metrics import LoopStats

    def report(probes: dict[str, Probe]) -> Report:
        return Report(server="w", received=0.0, service="active", listeners={}, traffic_bytes=None, probes=probes)

    collection = Collection(Secret(b"sessions-test-secret-0123456789abcdef"), FakeClock(), LoopStats())
    stalled = Probe(True, 1.0, None, False, 14480, "stalled after 14480 bytes")
    with caplog.at_level(logging.INFO, logger="reconciler"):
        for _ in range(3):
            collection._tell_sessions({"w": report({"t-in": stalled}), "x": None})
        collection._tell_sessions({"w": report({})})  # not probed this interval: nothing new
        collection._tell_sessions({"w": report({"t-in": Probe(True, 1.0, app=True, app_bytes=65600)})})
        for _ in range(2):  # the witness's own client failing is told once, and blames no one
            collection._tell_sessions({"w": report({"t-in": Probe(True, 1.0, app_error="the probe client exited")})})
    lines = [r.getMessage() for r in caplog.records if "session" in r.getMessage() or "app-like" in r.getMessage()]
    assert lines == ["w cannot carry a session through t-in: handshake ok, then stalled after 14480 bytes",
                     "w carries sessions through t-in again",
                     "w: no app-like probes this interval: the probe client exited"]
