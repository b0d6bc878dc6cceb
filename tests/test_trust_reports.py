"""A server is believed only about itself: hostile reports from one rooted server (its own users' traffic inflated,
other servers' users claimed, epochs reset every interval, votes against the fleet) cannot push a user it does not
serve over a limit, nor take another server out of rotation. Each attack here was reproduced against the code
before these checks (the ledger counted every row of every user; a new epoch added whole counters).

See docs/security.md, "A rooted server"."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from pathlib import Path

import numpy as np
import pydantic
import pytest

from reconciler.config import load_cluster
from reconciler.credentials import Secret, device_fingerprint_key, fingerprint, reality_short_id
from reconciler.engine.base import mark_key, usage_marks
from reconciler.fleet import Learned, parse_report
from reconciler.fleet.reports import agent_request, asked_probes
from reconciler.fleet.usage import LINK_FLOOR_MBPS, Ledger, Trust, device_count, link_bytes
from reconciler.loop.clock import FakeClock
from reconciler.model import Cluster
from reconciler.ssh.fake import FakeRunner
from tests.fake_agents import answering, install_agent
from tests.test_users_usage import MB, Kernel, cluster, ts

SECRET = Secret(b"trust-boundary-test-secret-0123456789")
KEY = mark_key(SECRET)
TiB = 1 << 40


def fleet(servers: int = 3, users: tuple[str, ...] = ("alice", "bob", "carol")) -> Cluster:
    return cluster([{"name": n, "data_limit": "10GB", "device_limit": 2} for n in users], servers=servers)


def assigned(c: Cluster, where: dict[str, int]) -> dict[tuple[str, str], str]:
    """Each user's assignment on the route: the inbound of server index ``where[user]``."""
    return {(u, "r"): c.servers[i].inbounds[0].id for u, i in where.items()}


def report(c: Cluster, server: str, kernel: Kernel, at: float, devices: dict[str, list[str]] | None = None) -> object:
    return kernel.report(server, at, devices)


def healthy_answer(kernel: Kernel) -> dict[str, object]:
    """What a well server's agent answers (its listeners up), carrying ``kernel``'s counters."""
    rows: dict[str, list[list[object]]] = {"tx": [], "rx": []}
    for (side, mark, family, transport), (pkts, nbytes) in kernel.counters.items():
        rows["tx" if side == 0 else "rx"].append([mark, family, transport, pkts, nbytes])
    return {"service": "active", "listeners": {"8388/tcp": True, "8388/udp": True}, "traffic": None, "probes": {},
            "usage": {**rows, "epoch": kernel.epoch}}


def healthy(kernel: Kernel, server: str, at: float) -> object:
    """A well server's report (its listeners up) carrying ``kernel``'s counters."""
    return parse_report(server, json.dumps(healthy_answer(kernel)), at)


def test_a_server_claims_traffic_only_for_users_the_controller_sent_to_it():
    # Attack: s1, rooted, reports alice's mark (she is assigned to s0) with a terabyte: before, alice went over
    # her quota from s1's word alone. Her own server's traffic still counts, as does bob's on s1.
    c = fleet()
    marks = usage_marks(c, KEY)
    trust = Trust(KEY)
    ledger = Ledger()
    where = assigned(c, {"alice": 0, "bob": 1, "carol": 2})
    k0, k1 = Kernel(), Kernel()
    t = ts(2026, 12, 1)
    ledger.fold(c, {"s0": k0.report("s0", t), "s1": k1.report("s1", t)}, t, where, trust)  # baselines
    k0.counters[(1, marks["alice"], "ipv4", "tcp")] = [1000, 5 * MB + 52 * 1000]
    k1.counters[(1, marks["alice"], "ipv4", "tcp")] = [10**6, TiB]  # not hers to report
    k1.counters[(1, marks["bob"], "ipv4", "tcp")] = [100, 1 * MB + 52 * 100]
    ledger.fold(c, {"s0": k0.report("s0", t + 60), "s1": k1.report("s1", t + 60)}, t + 60, where, trust)
    assert ledger.book("alice").down == 5 * MB
    assert ledger.book("bob").down == 1 * MB
    assert ledger.refused["s1"] == (1, pytest.approx(link_bytes(float("nan"), 60), rel=0.01))  # one user's bytes
    view = ledger.view(c, t + 60)
    assert view["alice"].used < 10 * 10**9  # under her 10 GB


def test_a_server_in_the_users_failover_order_is_believed_and_one_outside_it_is_not():
    # The app may leave its assigned server for the next in its failover order: that server's rows count.
    c = fleet()
    marks = usage_marks(c, KEY)
    where = assigned(c, {"alice": 0})
    placed = {"s2": {"alice"}}  # the last answers put alice's failover order on s2, not on s1

    def reach(server: str, names: list[str]) -> np.ndarray:
        return np.array([n in placed.get(server, set()) for n in names], bool)

    trust = Trust(KEY, reach)
    ledger = Ledger()
    ks = {s.name: Kernel() for s in c.servers}
    t = ts(2026, 12, 1)
    ledger.fold(c, {n: k.report(n, t) for n, k in ks.items()}, t, where, trust)
    for n in ("s1", "s2"):
        ks[n].counters[(0, marks["alice"], "ipv4", "tcp")] = [10, 2 * MB + 520]
    ledger.fold(c, {n: k.report(n, t + 60) for n, k in ks.items()}, t + 60, where, trust)
    assert ledger.book("alice").up == 2 * MB  # s2's, not s1's
    assert set(ledger.refused) == {"s1"}


def test_a_new_epoch_every_interval_adds_nothing():
    # Attack: a server claims a reboot every interval with huge counters: before, every row counted whole (up to
    # a terabyte per row per interval). A new epoch is a new baseline.
    c = fleet()
    marks = usage_marks(c, KEY)
    where = assigned(c, {"alice": 0})
    ledger, k = Ledger(), Kernel()
    t = ts(2026, 12, 1)
    for i in range(20):
        k.counters[(1, marks["alice"], "ipv4", "tcp")] = [10**9, TiB]
        k.epoch = f"boot-{i}"
        ledger.fold(c, {"s0": k.report("s0", t + 60 * i)}, t + 60 * i, where, Trust(KEY))
    assert ledger.book("alice").total == 0


def test_a_counter_that_goes_back_is_a_baseline_not_a_whole_counter():
    # Attack: the counter drops to a small value then leaps: before, a lower counter counted all it held.
    c = fleet()
    marks = usage_marks(c, KEY)
    where = assigned(c, {"alice": 0})
    ledger, k = Ledger(), Kernel()
    t = ts(2026, 12, 1)
    row = (1, marks["alice"], "ipv4", "tcp")
    for i, value in enumerate([TiB, 1_000, TiB // 2]):
        k.counters[row] = [1, value]
        ledger.fold(c, {"s0": k.report("s0", t + 60 * i)}, t + 60 * i, where, Trust(KEY))
    assert ledger.book("alice").total <= link_bytes(float("nan"), 60)


def test_each_row_adds_at_most_what_the_servers_link_could_carry():
    # Attack: one interval's row claims a terabyte for a user the server serves: bounded by the learned capacity
    # with headroom (here not learned yet: the floor), so 10 GB of quota is not gone in one report.
    c = fleet()
    marks = usage_marks(c, KEY)
    where = assigned(c, {"alice": 0})
    ledger, k = Ledger(), Kernel()
    t = ts(2026, 12, 1)
    ledger.fold(c, {"s0": k.report("s0", t)}, t, where, Trust(KEY, capacity_mbps={"s0": 100.0}))
    k.counters[(1, marks["alice"], "ipv4", "tcp")] = [1, TiB]
    ledger.fold(c, {"s0": k.report("s0", t + 60)}, t + 60, where, Trust(KEY, capacity_mbps={"s0": 100.0}))
    got = ledger.book("alice").down
    assert 0 < got <= link_bytes(100.0, 60) <= max(LINK_FLOOR_MBPS, 400.0) * 1e6 / 8 * 60
    assert got < 10 * 10**9


def test_honest_traffic_under_the_bounds_is_counted_exactly():
    # The bounds cost honest servers nothing: 500 intervals of traffic on assigned servers, exact to the byte.
    rng = np.random.default_rng(28)
    c = fleet(servers=2, users=tuple(f"u{i}" for i in range(20)))
    marks = usage_marks(c, KEY)
    where = assigned(c, {f"u{i}": i % 2 for i in range(20)})
    ledger = Ledger()
    ks = {s.name: Kernel() for s in c.servers}
    truth = dict.fromkeys(c.roster.names, 0)
    t = ts(2026, 12, 1)
    ledger.fold(c, {n: k.report(n, t) for n, k in ks.items()}, t, where, Trust(KEY))
    import random
    r = random.Random(28)
    for i in range(1, 500):
        for _ in range(int(rng.integers(0, 6))):
            u = int(rng.integers(0, 20))
            payload = int(rng.integers(0, 4 * MB))
            ks[f"s{u % 2}"].carry(r, marks[f"u{u}"], 1, payload)
            truth[f"u{u}"] += payload
        ledger.fold(c, {n: k.report(n, t + 60 * i) for n, k in ks.items()}, t + 60 * i, where, Trust(KEY))
    assert {n: ledger.book(n).down for n in truth} == truth
    assert not ledger.refused


def test_device_lists_count_only_for_users_the_server_serves():
    # Attack: s1 lists ten devices for bob, who is assigned to s0 with a limit of 2: before, bob was refused.
    c = fleet()
    where = assigned(c, {"alice": 1, "bob": 0})
    ledger = Ledger()
    t = ts(2026, 12, 1)
    rep = Kernel().report("s1", t, devices={"bob": [f"{i:016x}" for i in range(10)], "alice": ["a" * 16]})
    ledger.fold(c, {"s1": rep}, t, where, Trust(KEY))
    view = ledger.view(c, t)
    assert view["bob"].devices == 0 and view["alice"].devices == 1


def test_a_device_seen_under_two_days_keys_counts_once():
    # The device key changes every day: for a moment one device shows under both keys; it is one device.
    fps = {"d7:aaaa": 100.0, "d8:bbbb": 110.0, "d8:cccc": 110.0}
    assert device_count(fps, 120.0, 120.0) == 2
    assert device_fingerprint_key(SECRET, 7) != device_fingerprint_key(SECRET, 8)


def test_device_fingerprints_give_no_address_back_without_the_secret():
    # Attack: before, a fingerprint was sha256(fixed salt + address), the salt sent to every server: a /16 is
    # searched in well under a second. Now an HMAC under a key of the day derived from the master secret.
    from reconciler.engine import agent

    day = 20_000
    key = device_fingerprint_key(SECRET, day)
    address = "203.0.113.77"  # never dialled: only hashed
    fp = hmac.new(key.encode(), f"alice\n{address}".encode(), "sha256").hexdigest()[:16]
    stored = agent_fp = _agent_fingerprint(agent, key, "alice", address)
    assert agent_fp == fp
    # Without the key: the old scheme's search over the /24 finds nothing, whatever salt it guesses from the file.
    salts = ["", hashlib.sha256(b"device-fingerprint").hexdigest()[:32]]
    for salt in salts:
        found = [a for i in range(256) if hashlib.sha256((salt + (a := f"203.0.113.{i}")).encode()).hexdigest()[:16] == stored]
        assert found == []


def _agent_fingerprint(agent: object, key: str, user: str, address: str) -> str:
    """The agent's own fingerprint of a connection (its clash_connections, fed one connection)."""
    import http.server
    import threading

    body = json.dumps({"connections": [{"chains": [f"u-{user}"], "metadata": {"sourceIP": address}}],
                       "uploadTotal": 0, "downloadTotal": 0}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        _traffic, _users, _n, devices = agent.clash_connections(f"127.0.0.1:{server.server_port}", "x", 5, key)  # type: ignore[attr-defined]
    finally:
        thread.join(10)
        server.server_close()
    return devices[user][0]


def test_probe_results_for_inbounds_a_server_was_not_asked_about_never_vote():
    # Attack: a rooted server answers for every inbound of the fleet (and its own), every interval. Only what its
    # row of the probe plan asked counts; never its own inbounds.
    c = fleet(servers=3)
    req = agent_request(c, "s2", "x", 1.0, interval=1)
    asked = asked_probes(req)
    assert "s2-in" not in asked
    raw = {"service": "active", "probes": {f"s{i}-in": {"ok": False, "error": "refused"} for i in range(3)}}
    rep = parse_report("s2", json.dumps(raw), 1.0, asked | {"s2-in"} if False else asked)
    assert set(rep.probes) == asked and rep.unasked == 3 - len(asked)
    flood = {"service": "active", "probes": {f"x{i}": {"ok": False} for i in range(1000)}}
    assert parse_report("s2", json.dumps(flood), 1.0, asked).unasked == 1000


def test_one_ordinary_server_voting_against_the_fleet_takes_no_one_out_of_rotation():
    # Attack: s2 of three reports every other server unreachable, interval after interval.
    c = fleet(servers=3)
    learned = Learned.fresh(c)
    t = ts(2026, 12, 1)
    for i in range(60):
        reports = {}
        for s in c.servers:
            others = {f"{o.name}-in": {"ok": s.name != "s2", "rtt_ms": 5.0} if s.name != "s2"
                      else {"ok": False, "error": "timed out"} for o in c.servers if o is not s}
            raw = {"service": "active", "listeners": {"8443/tcp": True}, "probes": others}
            reports[s.name] = parse_report(s.name, json.dumps(raw), t + 60 * i,
                                           asked_probes(agent_request(c, s.name, "x", 1.0, interval=i)))
        verdicts = learned.fold(c, reports, t + 60 * i, Trust(KEY))
    for ref in c.inbounds:
        assert verdicts.inbound(ref.inbound.id).in_rotation, verdicts.inbound(ref.inbound.id)


def test_a_quorum_of_one_is_refused():
    # A setting that let one server's word convict is refused with the reason.
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 2"):
        Cluster.model_validate({"settings": {"health": {"min_witnesses": 1}}, "servers": [], "users": []})


def test_a_plan_fingerprint_gives_no_short_value_back_without_the_secret():
    # Attack: a plan shows a fingerprint of a REALITY short id; before it was sha256(value)[:12], and a search of
    # every 4-hex-digit value found it at once. Now the fingerprint is keyed with the master secret.
    value = reality_short_id(SECRET, "in-1")[:4]
    shown = fingerprint(value)
    prefix, _, rest = shown.partition(":")
    digits = rest.rstrip("…")
    candidates = (f"{i:04x}" for i in range(1 << 16))
    assert not any(hashlib.sha256(v.encode()).hexdigest()[:len(digits)] == digits for v in candidates)
    assert prefix != "sha256"


def test_the_loop_believes_a_rooted_server_only_about_its_own_users(tmp_path: Path):
    # End to end through the loop's own interval: s2 claims a terabyte more for every user each interval. Users whose
    # subscriptions never send them to s2 stay at zero; the others gain at most s2's link per interval.
    from reconciler.balance.decide import failover_servers
    from reconciler.loop.service import Loop

    path = tmp_path / "c.yaml"
    servers = "".join(f"  - {{name: s{i}, host: 198.18.0.{10 + i}, country: DE, inbounds: [{{id: s{i}-in, name: S{i}, "
                      f"protocol: shadowsocks-2022, port: 8388, route: r}}]}}\n" for i in range(6))
    users = "".join(f"  - {{name: u{i}}}\n" for i in range(30))
    path.write_text("settings:\n  health: {report_interval: 60s}\n  outputs: {failover: {members: 2}}\n"
                    f"routes: [{{id: r, name: R}}]\nservers:\n{servers}users:\n{users}")
    c = load_cluster(str(path)).cluster
    assert c is not None
    # The real collection: each fake host's agent answers its kernel's counters; s2's claims more every interval.
    runner, clock = FakeRunner(tmp_path / "hosts"), FakeClock(start=ts(2026, 12, 1))
    loop = Loop(str(path), c, SECRET, watch=False, runner=runner, clock=clock)
    marks = usage_marks(c, mark_key(SECRET))
    hostile = Kernel()
    for s in c.servers:
        install_agent(runner, s.name, answering(healthy_answer(Kernel())))

    async def run() -> None:
        for _ in range(5):
            clock.advance(60)
            for name in c.roster.names:
                row = hostile.counters.setdefault((1, marks[name], "ipv4", "tcp"), [0, 0])
                row[0], row[1] = row[0] + 1, row[1] + TiB
            install_agent(runner, "s2", answering(healthy_answer(hostile)))
            await loop.tick()

    asyncio.run(run())
    assert loop.collection.last_answers is not None
    view = loop.learned.ledger.view(c, clock.time())
    sent = {n for n in c.roster.names if "s2" in failover_servers(loop.collection.last_answers, n)}
    assert sent and len(sent) < len(c.roster.names)
    assert all(view[n].used == 0 for n in c.roster.names if n not in sent)
    assert all(view[n].used <= 4 * link_bytes(float("nan"), 60) for n in sent)
    assert "s2" in loop.learned.ledger.refused


def test_all_of_a_servers_rows_together_add_at_most_its_link():
    # Attack: a server claims a terabyte for each of its users at once: each row is bounded, and so is their sum.
    c = fleet()
    marks = usage_marks(c, KEY)
    where = assigned(c, {"alice": 0, "bob": 0, "carol": 0})
    ledger, k = Ledger(), Kernel()
    t = ts(2026, 12, 1)
    ledger.fold(c, {"s0": k.report("s0", t)}, t, where, Trust(KEY))
    for name in ("alice", "bob", "carol"):
        for family, transport in (("ipv4", "tcp"), ("ipv6", "tcp"), ("ipv4", "udp"), ("ipv6", "udp")):
            k.counters[(1, marks[name], family, transport)] = [1, TiB]
    ledger.fold(c, {"s0": k.report("s0", t + 60)}, t + 60, where, Trust(KEY))
    assert sum(ledger.book(n).down for n in ("alice", "bob", "carol")) <= link_bytes(float("nan"), 60)


def test_each_user_off_its_assignment_is_looked_up_once_and_counted_whole():
    # A user on a failover member has several counter rows (IPv4 and IPv6, TCP and UDP) and open connections:
    # its failover order is asked once, and every row counts.
    c = fleet()
    marks = usage_marks(c, KEY)
    where = assigned(c, {"alice": 0})
    asked: list[list[str]] = []

    def reach(server: str, names: list[str]) -> np.ndarray:
        asked.append(names)
        return np.array([n == "alice" for n in names], bool)

    ledger, k = Ledger(), Kernel()
    t = ts(2026, 12, 1)
    ledger.fold(c, {"s1": k.report("s1", t)}, t, where, Trust(KEY, reach))
    for family, transport in (("ipv4", "tcp"), ("ipv6", "tcp"), ("ipv4", "udp"), ("ipv6", "udp")):
        k.counters[(1, marks["alice"], family, transport)] = [10, MB + 10 * 52]
    ledger.fold(c, {"s1": k.report("s1", t + 60)}, t + 60, where, Trust(KEY, reach))
    assert [n for names in asked for n in names].count("alice") <= 1
    assert ledger.book("alice").down > 3 * MB


def test_what_is_kept_of_a_device_is_no_servers_fingerprint():
    # Attack: every server holds the day's device key, so a rooted server could search stored fingerprints for
    # addresses. What the controller keeps is an HMAC of the fingerprint under a key of its own.
    c = fleet()
    where = assigned(c, {"alice": 0})
    ledger = Ledger()
    t = ts(2026, 12, 1)
    fp = "0123456789abcdef"
    rep = Kernel().report("s0", t, devices={"alice": [fp]})
    ledger.fold(c, {"s0": rep}, t, where, Trust(KEY, device_key=SECRET.derive("device-store"), device_epoch=7))
    [kept] = ledger.book("alice").devices
    assert kept.startswith("d7:") and fp not in kept
    meta, _arrays = ledger.pack()
    assert fp not in json.dumps(meta)


def test_a_servers_tls_key_may_not_be_the_controllers_own(tmp_path: Path):
    # Attack: `tls.key: .reconciler/acme/other.key` (inside the repository folder, where the state folder is by
    # default) made apply upload another inbound's ACME key to the server the pull request names.
    from reconciler.cli import main

    (tmp_path / ".reconciler" / "acme").mkdir(parents=True)
    (tmp_path / ".reconciler" / "acme" / "other.key").write_text("-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----\n")
    (tmp_path / "mine.crt").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    (tmp_path / "cluster.yaml").write_text(
        "servers:\n  - name: a\n    host: 198.18.0.10\n    country: DE\n    inbounds:\n"
        "      - {id: a-t, name: T, protocol: trojan, port: 8443,\n"
        "         tls: {server_name: a.example.net, certificate: mine.crt, key: .reconciler/acme/other.key}}\n"
        "users:\n  - {name: alice}\n")
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        code = main(["validate", "-f", str(tmp_path / "cluster.yaml")])
        assert code != 0
    assert "cluster.yaml:7:" in err.getvalue() and "controller's own files" in err.getvalue()
    from reconciler import safe_read
    with pytest.raises(safe_read.OutsideRepository):
        safe_read.read_confined(".reconciler/acme/other.key", str(tmp_path),
                                private=safe_read.private_paths([".reconciler"], str(tmp_path)))


def test_one_ipv6_host_is_one_client_at_the_acme_responder_and_a_local_proxy_is_not_capped():
    from reconciler.engine.scripts import acme
    from reconciler.loop.client_address import connection_key

    assert acme._client("2001:db8:1:2::5") == acme._client("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert acme._client("::ffff:198.18.0.7") == "198.18.0.7"
    assert connection_key("127.0.0.1", (), loopback_is_proxy=True) is None
    assert connection_key("198.18.0.7", (), loopback_is_proxy=True) == "198.18.0.7"
