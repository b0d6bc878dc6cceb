"""Plan and apply end to end against fake hosts (GITOPS-3, GITOPS-4, GITOPS-7): the real server-side scripts run
locally against a temporary directory per server (``reconciler.ssh.fake``); no root, no network.

Each test asserts on the fake host's files and systemd state, not only on results. tests/lab/ covers real hosts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import pytest

from reconciler.apply.run import ServerResult, apply_all
from reconciler.credentials import Secret, reality_keys
from reconciler.engine.base import AGENT, FIREWALL, RESPONDER, USAGE_NFT
from reconciler.engine.singbox import LAYOUT
from reconciler.errors import ConfigError, RemoteCommandError, StalePlan
from reconciler.model import Cluster
from reconciler.plan.lock import LEASE_SECONDS, LOCK_DIR, LOCK_FILE
from reconciler.plan.observe import Observed, fingerprint, observe
from reconciler.plan.saved import check_fresh, load_plan, save_plan
from reconciler.ssh import Target
from reconciler.ssh.fake import FakeRunner, fake_engine

BINARY, CONFIG, SERVICE, TEMPLATE, UNIT = LAYOUT.binary, LAYOUT.config, LAYOUT.service, LAYOUT.template, LAYOUT.unit

SECRET = Secret(b"fakehost-test-secret-0123456789abc")
NOW = 1.8e9


def cluster(tmp_path: Path, users=("alice",), servers=("a",), inbounds=None, harden=True) -> Cluster:
    engine = tmp_path / "engine" / "sing-box"
    if not engine.exists():
        engine.parent.mkdir(parents=True, exist_ok=True)
        engine.write_bytes(fake_engine("1.14.4"))
        engine.chmod(0o755)
    inbounds = inbounds or [
        {"id": "{s}-tls", "name": "T", "protocol": "trojan", "port": 443, "route": "r", "tls": {"server_name": "x.test"}},
        {"id": "{s}-ss", "name": "S", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"},
    ]
    return Cluster.model_validate({
        "settings": {"engine": {"binary": str(engine)}, "harden": harden},
        "servers": [{"name": s, "host": f"192.0.2.{i + 1}", "country": "DE",
                     "inbounds": [{**ib, "id": ib["id"].format(s=s)} for ib in inbounds]} for i, s in enumerate(servers)],
        "routes": [{"id": "r", "name": "R"}], "users": [{"name": u} for u in users]})


def plan(c: Cluster, runner: FakeRunner, prune: bool = False, previous=None) -> list[Observed]:
    return asyncio.run(observe(c, SECRET, runner, ".", prune, previous, NOW))


def apply(observed: list[Observed], runner: FakeRunner) -> list[ServerResult]:
    async def go() -> list[ServerResult]:
        try:
            return await apply_all(observed, runner, lambda server, phase: None, verify_timeout=5.0)
        finally:
            await runner.close()

    return asyncio.run(go())


def kinds(o: Observed) -> list[tuple[str, str]]:
    return [(a.sign, a.kind) for a in o.plan.actions]


@pytest.fixture
def runner(tmp_path) -> FakeRunner:
    return FakeRunner(tmp_path / "hosts")


def converge(tmp_path, runner, c=None) -> Cluster:
    c = c or cluster(tmp_path)
    results = apply(plan(c, runner), runner)
    assert all(r.ok for r in results), [r.message for r in results]
    return c


def test_a_bare_host_is_planned_then_provisioned(tmp_path, runner):
    # spec: GITOPS-3, GITOPS-4 — the plan says what changes; apply does exactly that, and verifies it
    c = cluster(tmp_path)
    [o] = plan(c, runner)
    assert kinds(o) == [("+", "install-engine")] + [("+", "write-file")] * 10 + [("~", "restart"), ("+", "harden")]
    host = runner.host("a")
    assert host.read(TEMPLATE) is None and host.unit(SERVICE)["active"] == "inactive"

    [r] = apply([o], runner)
    assert r.ok and r.changed and r.phase == "done", r.message
    for f in o.desired.files:
        assert host.read(f.path) == f.content, f.path
        assert host.path(f.path).stat().st_mode & 0o777 == f.mode
    assert host.read(BINARY) == fake_engine("1.14.4")
    assert host.read(BINARY + ".sha256").decode() == hashlib.sha256(fake_engine("1.14.4")).hexdigest()
    assert host.read(BINARY + ".version").decode().startswith("sing-box version 1.14.4")
    assert host.read(CONFIG) == next(f.content for f in o.desired.files if f.path == TEMPLATE)  # nothing to fill in
    assert host.read("/etc/sing-box/tls/a-tls.key").startswith(b"-----BEGIN PRIVATE KEY-----")
    unit = host.unit(SERVICE)
    assert unit["active"] == "active" and unit["enabled"] and unit["starts"] == 1
    assert unit["listeners"] == [(443, "tcp"), (8388, "tcp"), (8388, "udp")]
    # a bare server's engine is enabled and started by one systemctl (each costs ~15 ms of a cold host's CPU)
    assert [line for line in host.log if SERVICE in line and line.split()[0] in ("enable", "start", "restart")] == [
        f"enable --now --no-reload {SERVICE}"]
    assert "table inet reconciler" in host.firewall and host.read(FIREWALL) == o.desired.firewall[0].content
    assert host.unit("reconciler-firewall.service")["enabled"]
    assert not host.path(LOCK_DIR).exists()  # released
    assert not list(host.path("/etc/sing-box").glob("*.reconciler-*"))  # nothing staged is left behind
    # issue 14: the certificate is the one derived from the secret, so clients' pins are known without reading it back
    from reconciler.certificates import derived_certificate

    made = derived_certificate(SECRET, "a-tls", "x.test")
    assert host.read("/etc/sing-box/tls/a-tls.crt") == made.cert_pem.encode()


def test_a_second_apply_changes_nothing_and_asks_systemd_nothing(tmp_path, runner):
    # spec: GITOPS-3 — converged servers plan nothing; a no-op apply touches neither files nor units
    c = converge(tmp_path, runner)
    host = runner.host("a")
    before = {p: p.stat().st_mtime_ns for p in host.path("/etc").rglob("*") if p.is_file()}
    log = host.log
    [o] = plan(c, runner)
    assert o.plan.actions == [] and o.facts.active == "active" and o.facts.enabled == "enabled"
    runner.calls.clear()
    [r] = apply([o], runner)
    assert r.ok and not r.changed and r.message == "up to date"
    assert runner.calls == []  # not even the lock
    assert host.log == log  # the converged facts came without systemctl (the unit's cgroup and wants link)
    assert {p: p.stat().st_mtime_ns for p in host.path("/etc").rglob("*") if p.is_file()} == before


def test_a_change_the_engine_rejects_is_not_swapped_in(tmp_path, runner):
    # spec: GITOPS-7 — `sing-box check` refuses the new configuration: the running one stays, untouched
    converge(tmp_path, runner)
    host = runner.host("a")
    old = host.read(TEMPLATE), host.read(CONFIG)
    host.script(fail_check_if='"name": "bob"')
    [o] = plan(cluster(tmp_path, users=("alice", "bob")), runner)
    assert kinds(o) == [("~", "write-file"), ("~", "reload")]
    [r] = apply([o], runner)
    assert not r.ok and "check failed" in r.message and "nothing was changed" in r.message and not r.rolled_back
    assert (host.read(TEMPLATE), host.read(CONFIG)) == old
    assert host.unit(SERVICE)["active"] == "active" and host.unit(SERVICE)["starts"] == 1
    assert not host.path(LOCK_DIR).exists()


def test_a_unit_that_fails_after_the_restart_gets_the_previous_files_back(tmp_path, runner):
    # spec: GITOPS-7 — the new configuration passes check but the service does not come up: roll back, restart
    converge(tmp_path, runner)
    host = runner.host("a")
    old = host.read(TEMPLATE), host.read(CONFIG)
    host.script(fail_start_if='"name": "bob"')
    [o] = plan(cluster(tmp_path, users=("alice", "bob")), runner)
    [r] = apply([o], runner)
    assert not r.ok and r.rolled_back and "verify failed" in r.message, r.message
    assert r.details["commit"]["rollback_verified"] is True
    assert (host.read(TEMPLATE), host.read(CONFIG)) == old
    unit = host.unit(SERVICE)
    assert unit["active"] == "active" and unit["listeners"] == [(443, "tcp"), (8388, "tcp"), (8388, "udp")]
    assert not list(host.path("/etc/sing-box").glob("*.reconciler-*")) and not host.path(LOCK_DIR).exists()


def test_one_servers_failure_is_that_servers_result(tmp_path, runner):
    # spec: GITOPS-4 — servers apply in parallel; a failing one never stops the others
    c = cluster(tmp_path, servers=("a", "b"))
    runner.host("b").script(fail_start_if="")  # b's engine never starts
    results = apply(plan(c, runner), runner)
    assert [(r.server, r.ok) for r in results] == [("a", True), ("b", False)]
    assert runner.host("a").unit(SERVICE)["active"] == "active"
    assert runner.host("b").unit(SERVICE)["active"] != "active" and runner.host("b").read(CONFIG) is None


def test_a_held_lock_refuses_the_apply_and_a_stale_one_is_taken_over(tmp_path, runner):
    # spec: GITOPS-4 — one apply at a time per server; a lock whose lease ran out belongs to a dead apply
    c = cluster(tmp_path)
    host = runner.host("a")
    other = json.dumps({"by": "ci@runner-7", "pid": 4242, "since": int(time.time()) - 60})
    host.write(LOCK_FILE, other.encode())
    [o] = plan(c, runner)
    assert o.facts.lock == json.loads(other)
    log = host.log
    [r] = apply([o], runner)
    assert not r.ok and r.phase == "lock" and "another apply holds the lock on a: ci@runner-7 (pid 4242)" in r.message
    assert host.read(LOCK_FILE).decode() == other and host.read(TEMPLATE) is None and host.log == log
    assert host.read(BINARY + ".reconciler-new") is None  # the engine step never ran under another's lock

    stale = json.dumps({"by": "ci@runner-7", "pid": 4242, "since": int(time.time()) - LEASE_SECONDS - 5})
    host.write(LOCK_FILE, stale.encode())
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    assert host.read(TEMPLATE) is not None and not host.path(LOCK_DIR).exists()


def test_a_cold_server_takes_its_lock_in_the_engine_steps_session(tmp_path, runner):
    # The lock script takes the lock, then runs the engine step in the same process: one Python start and one
    # round trip less per cold server. What it runs is the same: the lock's holder, the engine staged under it.
    c = cluster(tmp_path)
    [o] = plan(c, runner)
    runner.calls.clear()
    [r] = apply([o], runner)
    assert r.ok, r.message
    steps = [(name, req.get("op"), req.get("then_name")) for _, name, req in runner.calls]
    assert steps[:2] == [("lock", "acquire", "engine"), ("commit", None, None)], steps
    assert not any(name == "engine" for name, _, _ in steps)
    host = runner.host("a")
    assert host.read(BINARY) == fake_engine("1.14.4") and not host.path(LOCK_DIR).exists()


def test_a_lock_the_engine_step_may_have_taken_is_given_back_when_its_session_fails_and_never_anothers(tmp_path):
    # The session that takes the lock and stages the engine fails (the connection drops) after the server took
    # the lock: the lock is released, since its holder is ours. Had another apply's lock been there, it stays.
    from reconciler.errors import ConnectError

    other = json.dumps({"by": "ci@runner-7", "pid": 4242, "since": int(time.time())})

    class Drops(FakeRunner):
        mode = "after"

        async def script(self, target, script, request, **kw):  # type: ignore[no-untyped-def]
            if script.name == "lock" and request.get("then"):
                if self.mode == "after":
                    await super().script(target, script, request, **kw)
                else:  # another apply took it meanwhile; our session never got there
                    self.host(target.name).write(LOCK_FILE, other.encode())
                raise ConnectError(f"{target.name}: connection lost while running a command (test)", target.name)
            return await super().script(target, script, request, **kw)

    for mode in ("after", "before"):
        runner = Drops(tmp_path / mode)
        runner.mode = mode
        c = cluster(tmp_path / mode)
        [r] = apply(plan(c, runner), runner)
        host = runner.host("a")
        assert not r.ok and "connection lost" in r.message, r.message
        if mode == "after":
            assert not host.path(LOCK_DIR).exists()  # ours: given back
        else:
            assert host.read(LOCK_FILE).decode() == other  # another's: untouched


def test_a_lock_taken_by_the_engine_step_is_renewed_a_third_of_the_lease_after_it_was_written(tmp_path, runner):
    # Renewal counts from the lock's `since` (written when the engine step's session began), not from when the
    # controller heard back: after a long step the first renewal is due at once. Never before the lock is taken.
    from reconciler.plan import lock

    c = cluster(tmp_path)
    target = Target.from_server(c.servers[0])

    async def scenario() -> tuple[int, int, int, int]:
        d = lock.Deferred(runner, target, "a", [], [], None)
        async with lock.Renewal(runner, target, every=0.3, deferred=d) as idle:
            await asyncio.sleep(1.0)  # never taken: nothing renewed
        await lock.acquire(runner, target, "a")
        d.since = time.time() - 5  # the step took 5 s: the first renewal is due at once
        d.is_taken.set()
        async with lock.Renewal(runner, target, every=3.0, deferred=d) as late:
            until = time.monotonic() + 2.5  # well before `every` would bring it
            while not late.renewed and time.monotonic() < until:
                await asyncio.sleep(0.05)
            at_once = late.renewed
        d.since = time.time()
        async with lock.Renewal(runner, target, every=3.0, deferred=d) as fresh:
            await asyncio.sleep(1.0)
            not_yet = fresh.renewed
            until = time.monotonic() + 6
            while not fresh.renewed and time.monotonic() < until:
                await asyncio.sleep(0.05)
        return idle.renewed, at_once, not_yet, fresh.renewed

    assert asyncio.run(scenario()) == (0, 1, 0, 1)


def test_prune_removes_keys_of_inbounds_that_left_and_whole_servers(tmp_path, runner):
    # spec: GITOPS-3 — with --prune, what left the cluster file leaves the servers
    c = converge(tmp_path, runner, cluster(tmp_path, servers=("a", "b")))
    a, b = runner.host("a"), runner.host("b")
    assert a.read("/etc/sing-box/tls/a-tls.crt") is not None
    only_ss = [{"id": "{s}-ss", "name": "S", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"}]
    smaller = cluster(tmp_path, servers=("a",), inbounds=only_ss)
    previous = {s.name: {"name": s.name, "host": s.host, "port": 22, "user": "root"} for s in c.servers}
    observed = plan(smaller, runner, prune=True, previous=previous)
    [oa, ob] = observed
    assert ("-", "remove-file") in kinds(oa) and ob.plan.removed
    # configuration, its copy, unit, binary, TLS pair; the responder's listener stopped; the agent, the responder and
    # the per-user counters
    assert kinds(ob) == [("-", "stop")] + [("-", "remove-file")] * 6 + [("-", "stop")] + [("-", "remove-file")] * 6
    results = apply(observed, runner)
    assert all(r.ok for r in results), [r.message for r in results]
    assert a.read("/etc/sing-box/tls/a-tls.crt") is None and a.read("/etc/sing-box/tls/a-tls.key") is None
    assert a.unit(SERVICE)["listeners"] == [(8388, "tcp"), (8388, "udp")]
    assert b.unit(SERVICE)["active"] == "inactive" and not b.unit(SERVICE)["enabled"]
    for path in (BINARY, BINARY + ".sha256", BINARY + ".version", TEMPLATE, UNIT, CONFIG, "/etc/sing-box/tls/b-tls.key"):
        assert b.read(path) is None, path
    assert b.read(AGENT) is None and b.read(RESPONDER) is None and b.read(USAGE_NFT) is None  # nothing of ours is left
    assert all(not o.plan.actions for o in plan(smaller, runner, prune=True, previous={"a": previous["a"]}))


REALITY = [{"id": "{s}-reality", "name": "R", "protocol": "vless-reality", "port": 443, "route": "r",
            "camouflage": "www.example.com"}]


def test_a_reality_server_gets_its_derived_key_and_one_an_older_version_keyed_is_rekeyed(tmp_path, runner):
    # issue 14: no key generation on the server; config.json is the template, the derived private key in it.
    # A server an older version provisioned (a placeholder in the template, its own pair under reality/) gets the
    # derived key at its next apply, and --prune removes the pair it generated.
    c = cluster(tmp_path, inbounds=REALITY)
    [o] = plan(c, runner)
    assert not [a for a in o.plan.actions if a.target.endswith(".key")]
    [r] = apply([o], runner)
    assert r.ok, r.message
    host = runner.host("a")
    private = reality_keys(SECRET, "a-reality").private_key
    config = json.loads(host.read(CONFIG) or b"")
    assert config["inbounds"][0]["tls"]["reality"]["private_key"] == private and host.read(CONFIG) == host.read(TEMPLATE)
    assert not list(host.path("/etc/sing-box").rglob("*reality*.key"))  # no pair on the server

    old = (host.read(TEMPLATE) or b"").replace(private.encode(), b"@@REALITY_PRIVATE_KEY:a-reality@@")
    host.write(TEMPLATE, old)
    host.write("/etc/sing-box/reality/a-reality.key", b"server-made-private-key\n")
    host.write("/etc/sing-box/reality/a-reality.pub", b"server-made-public-key\n")
    [o] = plan(c, runner, prune=True)
    assert [(a.kind, a.target) for a in o.plan.actions] == [
        ("write-file", TEMPLATE), ("reload", SERVICE), ("remove-file", "/etc/sing-box/reality/a-reality.key"),
        ("remove-file", "/etc/sing-box/reality/a-reality.pub")]
    [r] = apply([o], runner)
    assert r.ok, r.message
    assert json.loads(host.read(CONFIG) or b"")["inbounds"][0]["tls"]["reality"]["private_key"] == private
    assert host.read("/etc/sing-box/reality/a-reality.key") is None and plan(c, runner, prune=True)[0].plan.actions == []


def test_a_saved_plan_is_refused_once_a_server_changed(tmp_path, runner):
    # spec: GITOPS-3 — apply FILE carries out the saved plan only while its desired state and facts still hold
    converge(tmp_path, runner, cluster(tmp_path, servers=("a", "b")))
    c = cluster(tmp_path, servers=("a", "b"), users=("alice", "bob"))
    observed = plan(c, runner)
    saved_path = tmp_path / "plan.json"
    save_plan(saved_path, [o.plan for o in observed], fingerprint(observed), tmp_path / "c.yaml")
    saved = load_plan(saved_path)
    assert saved.cluster_file == str((tmp_path / "c.yaml").resolve()) and saved.prune and saved.keep == ()
    check_fresh(saved, plan(c, runner))  # nothing changed: it holds

    runner.host("b").write(UNIT, b"[Service]\nExecStart=/bin/true\n")  # drift on b since the plan
    with pytest.raises(StalePlan) as err:
        check_fresh(saved, plan(c, runner))
    assert err.value.servers == ["b"]
    with pytest.raises(StalePlan) as err:  # the desired state changed for both
        check_fresh(saved, plan(cluster(tmp_path, servers=("a", "b"), users=("alice", "carol")), runner))
    assert err.value.servers == ["a", "b"]


@pytest.mark.parametrize("text,reason", [
    (None, "cannot read"), ("{not json", "is not JSON"), ("[]", "not a JSON object"),
    ('{"fingerprint": "x", "file": "c.yaml", "prune": false}', "`servers` is missing"),
    ('{"fingerprint": "x", "file": "c.yaml", "prune": false, "servers": [{"server": "a"}]}', "servers[0] lacks"),
])
def test_an_unreadable_saved_plan_is_a_config_error(tmp_path, text, reason):
    path = tmp_path / "plan.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_plan(path)
    assert reason in str(err.value) and str(path) in str(err.value)


def test_an_engine_that_reports_another_version_is_not_installed(tmp_path, runner):
    # spec: GITOPS-4 — the engine is pinned by version: staged bytes that report another are removed, nothing swapped
    c = cluster(tmp_path)
    pinned = Cluster.model_validate({**c.model_dump(mode="json", exclude={"routes": {0: {"implicit"}}}),
                                     "settings": {**c.settings.model_dump(mode="json"), "engine": {
                                         "binary": c.settings.engine.binary, "version": "1.13.0"}}})
    [o] = plan(pinned, runner)
    [r] = apply([o], runner)
    host = runner.host("a")
    assert not r.ok and r.phase == "install engine" and "not version 1.13.0" in r.message, r.message
    assert not list(host.path("/usr/local/bin").iterdir()) and host.read(TEMPLATE) is None
    assert not host.path(LOCK_DIR).exists() and host.unit(SERVICE)["active"] == "inactive"


def test_the_ssh_pool_sends_the_same_scripts_as_the_fake(tmp_path, monkeypatch):
    # The real runner's command lines (quoting, the spliced or stdin request, setsid) run through a local shell
    # in place of SSH: the lock script takes, refuses and releases the lock under a root folder.
    import subprocess

    from reconciler.engine import remote
    from reconciler.ssh import KnownHosts, Result, SSHPool, Target

    commands: list[str] = []

    async def run(target, command, check=True, timeout=120.0, input=None):  # what SSH would do on the server
        commands.append(command)
        out = subprocess.run(["sh", "-c", command], input=input.encode() if isinstance(input, str) else input,
                             capture_output=True, timeout=timeout)
        return Result(out.returncode, out.stdout.decode(), out.stderr.decode())

    pool = SSHPool(KnownHosts(tmp_path / "known_hosts.json"))
    monkeypatch.setattr(pool, "run", run)
    t, root = Target("a", "192.0.2.1"), str(tmp_path / "server")
    (tmp_path / "server/run").mkdir(parents=True)
    req = {"op": "acquire", "lock": LOCK_DIR, "holder_file": LOCK_FILE, "holder": "me", "dirs": ["/etc/x"], "root": root}
    got = [json.loads(asyncio.run(pool.script(t, remote.LOCK, req)).stdout) for _ in range(2)]
    assert got == [{"ok": True}, {"ok": False, "holder": "me"}] and (tmp_path / "server/etc/x").is_dir()
    assert commands[0].startswith("python3 -I -S -c ")
    asyncio.run(pool.script(t, remote.LOCK, {"op": "release", "lock": LOCK_DIR, "root": root}))
    assert not (tmp_path / "server/run/reconciler.lock").exists()
    with pytest.raises(RemoteCommandError) as err:  # the commit reads its request on stdin, under setsid -w
        asyncio.run(pool.script(t, remote.COMMIT, {"root": root}, timeout=30))
    assert commands[-1].startswith("setsid -w python3 -I -S -c ") and "the commit script" in str(err.value)
    assert "KeyError" in err.value.stderr


def test_a_firewall_that_cuts_new_ssh_connections_is_rolled_back_by_the_server(tmp_path, runner):
    # Issue: securing the server — the rules stay only if a fresh SSH connection still gets in
    host = runner.host("a")
    host.new_connections = False  # as if the new rules dropped new SSH sessions
    [o] = plan(cluster(tmp_path), runner)
    [r] = apply([o], runner)
    assert not r.ok and r.phase == "harden" and "no fresh SSH connection got through" in r.message, r.message
    assert "the service itself was applied" in r.message and host.unit(SERVICE)["active"] == "active"
    assert host.firewall is None and host.read(FIREWALL) is None  # the previous (no) table is back; nothing kept
    assert not host.unit("reconciler-firewall.service")["enabled"] and not host.path(LOCK_DIR).exists()
    host.new_connections = True
    [o] = plan(cluster(tmp_path), runner)
    assert kinds(o) == [("~", "harden")]  # the next plan tries again (its boot unit is already there)


def test_a_slow_apply_renews_its_lock_so_it_is_never_taken_over(tmp_path, runner, monkeypatch):
    # spec: GITOPS-4 — a live apply keeps its lock however long it runs: `since` moves every third of the lease,
    # so another apply meanwhile finds it held, not stale; renewal ends with the apply (no lock left behind)
    from reconciler.engine import remote
    from reconciler.plan import lock
    from reconciler.plan.facts import parse_lock

    monkeypatch.setattr(lock, "LEASE_SECONDS", 3)  # renewed every second; the engine step below takes 4.5 s
    other = {"by": "ci@elsewhere", "pid": 1}
    verdicts: list[tuple[bool, bool, bool]] = []
    real_script = FakeRunner.script

    async def slow_script(self, target, script, request, **kw):
        if script.name == "engine":  # a slow upload, under the lock
            first = json.loads(self.host(target.name).read(LOCK_FILE))
            await asyncio.sleep(3.6)
            ask = {"op": "acquire", "lock": LOCK_DIR, "holder_file": LOCK_FILE, "holder": json.dumps(other)}
            answer = json.loads((await real_script(self, target, remote.LOCK, ask)).stdout)
            now = time.time()
            # (taken?, stale as renewed?, stale as first written?) — what another apply's acquire decides on
            verdicts.append((answer["ok"], lock.is_stale(parse_lock(answer["holder"]), now, other),
                             lock.is_stale(first, now, other)))
            await asyncio.sleep(0.9)
        return await real_script(self, target, script, request, **kw)

    # The lock on its own step, before the slow one (a lock the engine step takes is tested below: no step under
    # it outlasts the lease, LONGEST_STEP_SECONDS < LEASE_SECONDS, which this test shortens to 3 s).
    monkeypatch.setattr("reconciler.apply.run.DEFER_LOCK", False)
    monkeypatch.setattr(FakeRunner, "script", slow_script)
    [o] = plan(cluster(tmp_path, harden=False), runner)
    [r] = apply([o], runner)
    assert r.ok, r.message
    assert verdicts == [(False, False, True)]  # held and fresh, though the first holder is past the lease
    renewals = [c for c in runner.calls if c[1] == "lock" and c[2]["op"] == "renew"]
    assert len(renewals) >= 3
    host = runner.host("a")
    assert not host.path(LOCK_DIR).exists()
    time.sleep(1.5)
    assert not host.path(LOCK_DIR).exists() and len(renewals) == len(
        [c for c in runner.calls if c[1] == "lock" and c[2]["op"] == "renew"])  # nothing renews after the end


def test_renewing_never_recreates_a_released_lock_nor_touches_anothers(tmp_path, runner):
    # The renew op writes only over our own holder, inside a lock folder that still exists
    from reconciler.plan import lock

    t = Target("a", "192.0.2.1")
    host = runner.host("a")
    assert asyncio.run(lock.renew(runner, t)) is False and not host.path(LOCK_DIR).exists()
    asyncio.run(lock.acquire(runner, t, "a", now=100.0))
    assert asyncio.run(lock.renew(runner, t, now=200.0)) is True and json.loads(host.read(LOCK_FILE))["since"] == 200
    host.write(LOCK_FILE, json.dumps({"by": "ci@elsewhere", "pid": 1, "since": 5}).encode())
    assert asyncio.run(lock.renew(runner, t, now=300.0)) is False and json.loads(host.read(LOCK_FILE))["since"] == 5


def _two_server_file(tmp_path: Path, servers=("a", "b"), retired=()) -> str:
    engine = tmp_path / "engine" / "sing-box"
    if not engine.exists():
        engine.parent.mkdir(parents=True, exist_ok=True)
        engine.write_bytes(fake_engine("1.14.4"))
        engine.chmod(0o755)
    lines = [f"settings: {{harden: false, engine: {{binary: {engine}, capabilities: [clash-api]}}}}", "servers:"]
    for i, s in enumerate(servers):
        lines.append(f"  - {{name: {s}, host: 192.0.2.{i + 1}, country: DE, inbounds: [{{id: {s}-ss, name: S, "
                     "protocol: shadowsocks-2022, port: 8388, route: r}]}")
    lines += ["routes: [{id: r, name: R}]", "users: [{name: alice}]"]
    if retired:
        lines.append(f"retired: [{', '.join(retired)}]")
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_server_that_left_the_file_is_removed_by_default_unless_kept(tmp_path, runner, monkeypatch, cli):
    # spec: GITOPS-7 (issue 15): Terraform's way — what leaves the file is `-` in every plan and removed on apply
    monkeypatch.setenv("RECONCILER_SECRET", "fakehost-cli-secret-0123456789abcdef")
    monkeypatch.setattr("reconciler.apply.session.pool_for", lambda state, **kw: runner)
    path = _two_server_file(tmp_path)
    assert cli("apply", "-f", path).rc == 0
    b = runner.host("b")
    assert b.unit(SERVICE)["active"] == "active"
    path = _two_server_file(tmp_path, servers=("a",))
    run = cli("plan", "-f", path)
    assert run.rc == 2 and "server b (192.0.2.2) — left the cluster file" in run.out, run.text
    assert "- stop sing-box.service" in run.out and "Plan: 0 to add, 0 to change, 12 to destroy." in run.out
    assert "left the cluster file" not in cli("plan", "-f", path, "--keep", "b").out  # kept this time
    kept = _two_server_file(tmp_path, servers=("a",), retired=("b",))
    assert cli("plan", "-f", kept).rc == 0  # kept on purpose
    # Unreachable: the removal stays pending, never forgotten
    b.reachable = False
    path = _two_server_file(tmp_path, servers=("a",))
    failed = cli("apply", "-f", path)
    assert failed.rc == 1 and "FAIL b" in failed.out
    assert "b" in json.loads((tmp_path / ".reconciler" / "managed.json").read_text())
    b.reachable = True
    done = cli("apply", "-f", path)
    assert done.rc == 0, done.text
    assert b.unit(SERVICE)["active"] == "inactive" and b.read(TEMPLATE) is None and b.read(BINARY) is None
    assert "b" not in json.loads((tmp_path / ".reconciler" / "managed.json").read_text())
    assert cli("plan", "-f", path).rc == 0


def test_plan_console_like_terraform(tmp_path, runner, monkeypatch, cli):
    # issue 15: --server limits, a plan with errors is not saved, `show` prints a saved plan, apply asks on a terminal
    import sys

    monkeypatch.setenv("RECONCILER_SECRET", "fakehost-cli-secret-0123456789abcdef")
    monkeypatch.setattr("reconciler.apply.session.pool_for", lambda state, **kw: runner)
    path = _two_server_file(tmp_path, servers=("fra-1", "fra-2", "nyc-1"))
    limited = cli("plan", "-f", path, "--server", "fra-*")
    assert "server fra-1" in limited.out and "server fra-2" in limited.out and "nyc-1" not in limited.out
    runner.host("nyc-1").reachable = False
    out = tmp_path / "plan.json"
    broken = cli("plan", "-f", path, "--out", str(out))
    assert broken.rc == 1 and not out.exists() and "not saved" in broken.err
    assert "Incomplete: 1 server could not be planned (nyc-1)" in broken.out
    good = cli("plan", "-f", path, "--server", "fra-1", "--out", str(out))
    assert good.rc == 2 and out.exists()
    shown = cli("show", str(out))
    assert shown.rc == 0 and "server fra-1" in shown.out and "+ install-engine" in shown.out
    # On a terminal, apply shows the plan and asks; anything but `yes` changes nothing
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt="": "no")
    refused = cli("apply", "-f", path, "--server", "fra-1")
    assert refused.rc == 1 and "apply cancelled" in refused.err and "+ install-engine" in refused.out
    assert runner.host("fra-1").read(TEMPLATE) is None
    monkeypatch.setattr("builtins.input", lambda prompt="": "yes")
    assert cli("apply", "-f", path, "--server", "fra-1").rc == 0
    assert runner.host("fra-1").read(TEMPLATE) is not None and runner.host("fra-2").read(TEMPLATE) is None


def test_a_wave_that_fails_is_rolled_back_whole_and_later_waves_are_untouched(tmp_path, runner):
    # issue 15: `apply --wave 2,rest`: wave 1's failing server rolls back by itself, its healthy neighbour is rolled
    # back with it (the wave is judged as one), and wave 2 never sees the change
    from reconciler.apply.waves import apply_in_waves, parse, partition

    four = ("a", "b", "c", "d")
    converge(tmp_path, runner, cluster(tmp_path, servers=four))
    before = {s: runner.host(s).read(TEMPLATE) for s in four}
    runner.host("b").script(fail_start_if='"bob"')
    observed = plan(cluster(tmp_path, users=("alice", "bob"), servers=four), runner)
    assert [[o.plan.server for o in w] for w in partition(observed, parse("2,rest"))] == [["a", "b"], ["c", "d"]]

    async def go():
        try:
            return await apply_in_waves(observed, runner, lambda s, p: None, "2,rest", settle=0.1, verify_timeout=5.0)
        finally:
            await runner.close()

    results = {r.server: r for r in asyncio.run(go())}
    assert not results["b"].ok and results["b"].rolled_back  # its own commit failed and rolled back
    assert not results["a"].ok and results["a"].rolled_back and "wave 1 rolled back" in results["a"].message
    assert all("not applied: wave 1 failed" in results[s].message for s in ("c", "d"))
    for s in four:  # every server serves the old configuration
        assert runner.host(s).read(TEMPLATE) == before[s], s
        assert runner.host(s).unit(SERVICE)["active"] == "active", s
        assert not list(runner.host(s).path("/etc/sing-box").glob("*.reconciler-old")), s
    # without the fault every wave passes, one after the other
    runner.host("b").script(fail_start_if=None)
    observed = plan(cluster(tmp_path, users=("alice", "bob"), servers=four), runner)
    results = {r.server: r for r in asyncio.run(go())}
    assert all(r.ok for r in results.values()), {s: r.message for s, r in results.items()}
    assert all(b'"bob"' in (runner.host(s).read(TEMPLATE) or b"") for s in four)
    assert not list(runner.host("a").path("/etc/sing-box").glob("*.reconciler-old"))


def test_wave_specs_are_checked():
    from reconciler.apply.waves import parse
    from reconciler.errors import InvalidInput

    assert parse("1,25%,rest") == ["1", "25%", "rest"] and parse("all") == ["rest"]
    for bad in ("0,rest", "rest,1", "150%", "one"):
        with pytest.raises(InvalidInput):
            parse(bad)


def test_the_agent_apply_installed_answers_the_loop_on_a_fake_host_like_every_script(tmp_path, runner):
    # The collection agent is a Script like the others (installed by apply, run from its path): the fake host runs
    # the very file apply put there, with the request a real interval sends, and the loop's parser reads its answer.
    from reconciler.credentials import clash_api_secret, device_fingerprint_key
    from reconciler.engine import remote
    from reconciler.fleet.reports import agent_request, asked_probes, parse_report

    c = cluster(tmp_path)
    target = Target.from_server(c.servers[0])
    with pytest.raises(RemoteCommandError, match="No such file"):  # before apply: not installed
        asyncio.run(runner.script(target, remote.AGENT, {}))
    converge(tmp_path, runner, c)
    req = agent_request(c, "a", clash_api_secret(SECRET, "a"), 0.5, device_fingerprint_key(SECRET, 1), interval=1)
    res = asyncio.run(runner.script(target, remote.AGENT, req, timeout=60))
    report = parse_report("a", res.stdout, 1.8e9, asked_probes(req))
    assert report.service_ok  # the fake systemd runs the engine apply started
    assert report.listeners and all(report.listeners.values()), report.listeners  # /proc/net under the host's root
    assert runner.scripts("a")[-1] == "agent"
