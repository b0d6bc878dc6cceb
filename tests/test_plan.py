"""Facts parsers and plan diffs, table-driven (GITOPS-3): raw output in, typed value out; facts in, actions out."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.credentials import Redactor, Secret, fingerprint, fingerprint_digest, reality_keys, user_credentials
from reconciler.engine import remote
from reconciler.engine.adapters import LAYOUTS, desired
from reconciler.engine.base import AGENT, RESPONDER, RESPONDER_IDS, RESPONDER_SOCKET, RESPONDER_SOCKET_UNIT, RESPONDER_UNIT, USAGE_NFT, ManagedFile
from reconciler.engine.scripts import facts as facts_script
from reconciler.engine.singbox import LAYOUT
from reconciler.model import Cluster
from reconciler.plan.actions import (
    ServerPlan,
    file_diff,
    plan_removal,
    plan_server,
    preflight,
    redact,
    render_human,
    summary_line,
)
from reconciler.plan.facts import Facts, Listener, parse_facts, parse_lock, parse_ss, parse_version

SECRET = Secret(b"plan-test-secret-0123456789abcdef")
BINARY, TEMPLATE, UNIT = LAYOUT.binary, LAYOUT.template, LAYOUT.unit
CERT, KEY = "/etc/sing-box/tls/a-in.crt", "/etc/sing-box/tls/a-in.key"


@pytest.mark.parametrize("output,version", [
    ("sing-box version 1.14.4\n\nEnvironment: go1.27.3 linux/amd64\nTags: with_quic\n", "1.14.4"),
    ("sing-box version 1.13.0-beta.2\n", "1.13.0-beta.2"),
    ("bash: /usr/local/bin/sing-box: No such file or directory\n", None),
    ("", None),
    ("Mihomo Meta v1.19.32 linux amd64 with go1.26.8 Wed Sep 30 16:55:13 UTC 2026\nUse tags: with_gvisor\n", "1.19.32"),
])
def test_parse_version(output, version):
    assert parse_version(output) == version


SS = """\
tcp   LISTEN 0      4096         0.0.0.0:22        0.0.0.0:*    users:(("sshd",pid=96,fd=3))
tcp   LISTEN 0      4096       127.0.0.1:9090      0.0.0.0:*    users:(("sing-box",pid=301,fd=9))
tcp   LISTEN 0      4096               *:443             *:*    users:(("sing-box",pid=301,fd=7))
udp   UNCONN 0      0                  *:443             *:*    users:(("sing-box",pid=301,fd=8))
tcp   LISTEN 0      5               [::]:8080         [::]:*    users:(("python3",pid=77,fd=3))
garbage line
"""


def test_parse_ss():
    assert parse_ss(SS) == (
        Listener("tcp", 22, "sshd"), Listener("tcp", 443, "sing-box"), Listener("udp", 443, "sing-box"),
        Listener("tcp", 8080, "python3"), Listener("tcp", 9090, "sing-box"))
    assert parse_ss("tcp LISTEN 0 5 *:443 *:*\n") == (Listener("tcp", 443, ""),)  # no -p rights: no process


@pytest.mark.parametrize("text,value", [
    (None, None), ("", None), ('{"by": "a@b", "pid": 1, "since": 2}', {"by": "a@b", "pid": 1, "since": 2}),
    ("someone else\n", {"holder": "someone else"}), ("[1]", {"holder": "[1]"}),
])
def test_parse_lock(text, value):
    assert parse_lock(text) == value


def cluster(users=("alice",), inbound_extra=None) -> Cluster:
    ib = {"id": "a-in", "name": "A", "protocol": "trojan", "port": 443, "route": "r", "tls": {"server_name": "x.test"}}
    ib.update(inbound_extra or {})
    return Cluster.model_validate({"servers": [{"name": "a", "host": "192.0.2.1", "country": "DE", "inbounds": [ib]}],
                                   "routes": [{"id": "r", "name": "R"}], "users": [{"name": u} for u in users]})


def facts(**kw) -> Facts:
    base = dict(arch="x86_64", systemd=True, python="3.11.2", files={}, engine_version=None, engine_sha256=None,
                engine_size=None, active="inactive", enabled="disabled", listeners=(), public={}, present={}, lock=None)
    base.update(kw)
    return Facts(**base)


def converged(d, **kw) -> Facts:
    """Facts of a server that already runs exactly ``d``."""
    return facts(files={f.path: f.sha256 for f in (*d.files, *d.firewall)}, engine_version=d.binary.version,
                 active="active", enabled="enabled", firewall=True, **kw)


def kinds(actions) -> list[tuple[str, str]]:
    return [(a.sign, a.kind) for a in actions]


def test_bare_host_plan():
    d = desired(cluster(), cluster().servers[0], SECRET, 1.8e9)
    acts = plan_server(d, facts())
    # issue 14: the self-signed certificate is derived on the controller and written like any file (opaque)
    assert kinds(acts) == [("+", "install-engine")] + [("+", "write-file")] * 10 + [("~", "restart"), ("+", "harden")]
    assert {a.target for a in acts if a.kind == "write-file"} == {TEMPLATE, UNIT, AGENT, RESPONDER, RESPONDER_IDS,
                                                                   RESPONDER_UNIT, RESPONDER_SOCKET_UNIT, USAGE_NFT, CERT, KEY}
    key = next(a for a in acts if a.target == KEY)
    assert key.diff.startswith("create: fp:") and "BEGIN" not in render_human([ServerPlan("a", "h", acts)])


def test_a_fresh_reality_server_plans_no_key_generation_and_shows_no_key():
    # issue 14: the REALITY pair is derived on the controller; the plan writes it in the configuration, unseen
    ib = {"id": "a-in", "name": "A", "protocol": "vless-reality", "port": 443, "route": "r", "camouflage": "www.example.com"}
    c = Cluster.model_validate({"servers": [{"name": "a", "host": "192.0.2.1", "country": "DE", "inbounds": [ib]}],
                                "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}]})
    d = desired(c, c.servers[0], SECRET, 1.8e9)
    acts = plan_server(d, facts())
    assert kinds(acts) == [("+", "install-engine")] + [("+", "write-file")] * 8 + [("~", "restart"), ("+", "harden")]
    private = reality_keys(SECRET, "a-in").private_key
    shown = render_human([ServerPlan("a", "192.0.2.1", acts)]) + json.dumps([a.as_json() for a in acts])
    assert private not in shown and '"private_key": "fp:' in shown


def test_agent_change_does_not_reload_the_engine():
    # spec: HEALTH-1 — the collection agent is a managed file, but a new agent must not interrupt users
    d = desired(cluster(), cluster().servers[0], SECRET, 1.8e9)
    f = converged(d)
    f = facts(**{**f.__dict__, "files": {**f.files, AGENT: "0" * 64}})
    acts = plan_server(d, f)
    assert kinds(acts) == [("~", "write-file")]
    assert acts[0].target == AGENT


def test_converged_host_has_nothing_to_do():
    d = desired(cluster(), cluster().servers[0], SECRET, 1.8e9)
    assert plan_server(d, converged(d)) == []


@pytest.mark.parametrize("change,expected", [
    ({"users": ("alice", "bob")}, [("~", "write-file"), ("~", "reload")]),
    ({"active": "failed"}, [("+", "start")]),
    ({"enabled": "disabled"}, [("~", "start")]),
    ({"engine_version": "1.13.0"}, [("~", "install-engine"), ("~", "restart")]),
    ({"unit": "edited"}, [("~", "write-file"), ("~", "restart")]),
    ({"key_missing": True}, [("+", "write-file"), ("~", "reload")]),
])
def test_one_difference_one_plan(change, expected):
    base = cluster()
    d = desired(base, base.servers[0], SECRET, 1.8e9)
    f = converged(d)
    if "users" in change:
        c2 = cluster(users=change["users"])
        d = desired(c2, c2.servers[0], SECRET, 1.8e9)
    if "active" in change:
        f = facts(**{**f.__dict__, "active": change["active"]})
    if "enabled" in change:
        f = facts(**{**f.__dict__, "enabled": change["enabled"]})
    if "engine_version" in change:
        f = facts(**{**f.__dict__, "engine_version": change["engine_version"]})
    if "unit" in change:
        f = facts(**{**f.__dict__, "files": {**f.files, UNIT: "0" * 64}})
    if "key_missing" in change:
        f = facts(**{**f.__dict__, "files": {**f.files, KEY: None}})
    assert kinds(plan_server(d, f)) == expected


def test_diffs_show_fingerprints_where_credentials_were():
    # Issue 13: the structure stays readable; a changed credential is a changed fingerprint, never a value
    c1, c2 = cluster(), cluster(users=("alice", "bob"))
    d1, d2 = desired(c1, c1.servers[0], SECRET, 1.8e9), desired(c2, c2.servers[0], SECRET, 1.8e9)
    stale = {"name": "carol", "password": "carols-password-from-long-ago"}  # a user removed since: unknown now
    old_doc = json.loads(next(f.content for f in d1.files if f.path == TEMPLATE))
    old_doc["inbounds"][0]["users"].append(stale)
    acts = plan_server(d2, converged(d1), {TEMPLATE: json.dumps(old_doc, indent=2, sort_keys=True).encode()})
    diff = next(a.diff for a in acts if a.kind == "write-file")
    bob, alice = user_credentials(SECRET, "bob"), user_credentials(SECRET, "alice")
    assert '+          "name": "bob",' in diff and f'"password": "{fingerprint(bob.password)}"' in diff
    assert f'-          "password": "{fingerprint(stale["password"])}"' in diff
    for value in (bob.password, alice.password, stale["password"]):
        assert value not in diff
    assert redact('"uuid": "abc", "short_id": ["", "0a"]') == \
        f'"uuid": "{fingerprint("abc")}", "short_id": ["", "{fingerprint("0a")}"]'
    shown = fingerprint("abc")  # keyed: not the plain sha256's prefix, which a search of short values reverses
    assert shown.startswith("fp:") and shown.endswith("…") and len(shown) == 3 + 12 + 1
    assert hashlib.sha256(b"abc").hexdigest()[:12] not in shown and fingerprint("abc") == shown


PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\n"


@pytest.mark.parametrize("text,shown", [  # made when the test runs: the fingerprints' key is the process's then
    (PEM, lambda: f"<PEM private key {fingerprint(PEM[:-1])}>\n"),
    ("cut: -----BEGIN CERTIFICATE-----\nMIIB", lambda: f"cut: <PEM certificate {fingerprint('-----BEGIN CERTIFICATE-----' + chr(10) + 'MIIB')}>"),
    ("MIIB\n-----END RSA PRIVATE KEY-----", lambda: "MIIB\n<PEM marker>"),
    ("the engine said: bad key alice-pw-0123", lambda: f"the engine said: bad key {fingerprint('alice-pw-0123')}"),
    ("nothing secret", lambda: "nothing secret"),
])
def test_the_redactor_replaces_pem_blocks_and_known_values(text, shown):
    assert Redactor.of(["alice-pw-0123"])(text) == shown()


def test_opaque_files_are_shown_as_fingerprints_only():
    # Issue 13: key material and certificates are never diffed; their fingerprints say that they change
    key = ManagedFile("/etc/sing-box/tls/a.key", PEM.encode(), 0o600, secret=True, opaque=True)
    assert file_diff(key, None) == f"create: {fingerprint(PEM)}"
    assert file_diff(key, b"old bytes are never even read", "ab" * 32) == f"content differs: {fingerprint_digest('ab' * 32)} → {fingerprint(PEM)}"
    plain = ManagedFile("/etc/x.conf", b"a = 1\n" + PEM.encode())  # a PEM inside a file that is not opaque
    assert "BEGIN" not in file_diff(plain, b"a = 0\n") and "<PEM private key fp:" in file_diff(plain, b"a = 0\n")
    assert "content" not in repr(key) and "MIIE" not in repr(key)


def test_harden_plans_a_firewall_with_ssh_and_the_inbound_ports():
    d = desired(cluster(), cluster().servers[0], SECRET, 1.8e9)
    rules = d.firewall[0].content.decode()
    assert "policy drop" in rules and "tcp dport 22 accept" in rules and "tcp dport { 443 } accept" in rules
    assert rules.index("dport 22 accept") < rules.index("ct state invalid drop")  # never cut our own session
    lost = facts(**{**converged(d).__dict__, "firewall": False})  # someone flushed the rules: drift
    assert kinds(plan_server(d, lost)) == [("~", "harden")]
    off = Cluster.model_validate({**cluster().model_dump(mode="json", exclude={"routes": {0: {"implicit"}}}),
                                  "settings": {"harden": False}})
    assert desired(off, off.servers[0], SECRET, 1.8e9).firewall == ()


def test_preflight_refusals():
    d = desired(cluster(), cluster().servers[0], SECRET, 1.8e9)
    assert preflight(facts(), d) == []
    assert "not a systemd host" in preflight(facts(systemd=False), d)[0]
    assert "unsupported architecture 'mips'" in preflight(facts(arch="mips"), d)[0]
    taken = preflight(facts(listeners=(Listener("tcp", 443, "nginx"),)), d)
    assert taken == ["port 443/tcp is taken by 'nginx'; free it or choose another port"]
    assert preflight(facts(listeners=(Listener("tcp", 443, "sing-box"),)), d) == []


def test_prune_removes_keys_of_inbounds_that_left_and_whole_servers():
    d = desired(cluster(), cluster().servers[0], SECRET, 1.8e9)
    f = facts(**{**converged(d).__dict__, "extra": (CERT, KEY, "/etc/sing-box/tls/gone.crt", "/etc/sing-box/reality/gone.key")})
    assert plan_server(d, f) == []  # nothing without --prune
    pruned = plan_server(d, f, prune=True)
    assert [(a.sign, a.target) for a in pruned] == [("-", "/etc/sing-box/tls/gone.crt"), ("-", "/etc/sing-box/reality/gone.key")]
    # issue 14: a REALITY pair an older version generated on the server is unused, its inbound still here or not
    assert "derived on the controller" in pruned[1].reason
    installed = converged(d)
    installed = facts(**{**installed.__dict__, "files": {**installed.files, BINARY: "ab" * 32}})
    removal = plan_removal(installed, LAYOUTS)
    assert kinds(removal)[0] == ("-", "stop") and {a.target for a in removal[1:]} == {
        TEMPLATE, UNIT, BINARY, AGENT, RESPONDER, RESPONDER_IDS, RESPONDER_SOCKET_UNIT, RESPONDER_UNIT, USAGE_NFT,
        RESPONDER_SOCKET}  # the responder's listener is held by systemd: stopped, not only its unit removed
    assert plan_removal(facts(), LAYOUTS) == []


def test_human_output_ends_like_terraform():
    p = ServerPlan("a", "192.0.2.1", actions=plan_server(desired(cluster(), cluster().servers[0], SECRET, 1.8e9), facts()))
    text = render_human([p])
    assert text.strip().endswith("Plan: 12 to add, 1 to change, 0 to destroy.") and "\033[" not in text
    # issue 15: a server that could not be planned is never summarised away
    text = render_human([p, ServerPlan("b", "192.0.2.2", error="cannot connect")])
    assert "Plan: 12 to add, 1 to change, 0 to destroy." in text
    assert text.strip().endswith("Incomplete: 1 server could not be planned (b); what they need is not counted above.")
    assert "! server b (192.0.2.2): cannot observe: cannot connect" in text
    painted = render_human([p], color=True)
    assert "\033[32m    + install-engine" in painted and "\033[33m    ~ restart" in painted
    # the agent's source is one line in a plan, not its diff
    agent = next(a for a in p.actions if a.target == AGENT)
    assert agent.diff.startswith("new version: fp:") and "\n" not in agent.diff
    assert summary_line([]) == "Plan: 0 to add, 0 to change, 0 to destroy."


def test_parse_facts_of_a_real_payload():
    raw = json.dumps({"arch": "x86_64", "systemd": True, "python": "3.11.2", "files": {TEMPLATE: None},
                      "binary": {"exists": True, "size": 10, "sha256": "ab", "version": {"out": "sing-box version 1.14.4\n"}},
                      "active": "active", "enabled": "enabled", "ss": SS, "public": {}, "present": {}, "lock": None,
                      "extra": []})
    f = parse_facts(raw)
    assert f.engine_version == "1.14.4" and f.engine_sha256 == "ab" and f.files == {TEMPLATE: None}
    assert Listener("udp", 443, "sing-box") in f.listeners
    assert f.digest() == parse_facts(raw).digest()


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20))
@settings(max_examples=300, deadline=None)
def test_the_facts_scripts_hand_written_json_is_json(value):
    # The facts script writes JSON without importing json (it starts ~35 ms sooner on a small VPS):
    # whatever it emits must parse back to the same value — control characters, quotes, non-ASCII.
    assert json.loads(facts_script.enc(value)) == value


def test_the_facts_script_runs_here_and_parses(tmp_path):
    # The whole script under this machine's python3 (the one servers run is Debian's; the lab tests run it there).
    managed = tmp_path / "managed.json"
    managed.write_text('{"a": "b"}')
    req = {"files": [str(managed), str(tmp_path / "missing")], "binary": str(tmp_path / "sing-box"), "service": "none.service",
           "public": [str(managed)], "private": [str(tmp_path / "key")], "lock": str(tmp_path / "lock"), "wants": str(tmp_path / "wants"),
           "dirs": [str(tmp_path)], "firewall": False}
    out = subprocess.run(["python3", "-I", "-S", "-c", remote.facts_script(req)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    f = parse_facts(out.stdout)
    assert f.files == {str(managed): hashlib.sha256(managed.read_bytes()).hexdigest(), str(tmp_path / "missing"): None}
    assert f.engine_version is None and f.public == {str(managed): '{"a": "b"}'} and f.present == {str(tmp_path / "key"): False}
    assert f.extra == (str(managed),) and f.lock is None


def test_the_facts_scripts_commands_are_bounded():
    # A hung command (systemctl waiting on a wedged PID 1) must not hang the observation.
    import time

    start = time.monotonic()
    res = facts_script.run(["sleep", "30"], limit=0.3)
    assert time.monotonic() - start < 10 and res["code"] != 0 and "timed out" in res["out"]
    assert facts_script.run(["echo", "hi"]) == {"code": 0, "out": "hi\n", "err": ""}
    assert facts_script.run(["/nonexistent/tool"])["code"] == -1


def test_the_facts_script_starts_lean(tmp_path):
    # It runs at every observation: no json, subprocess or hashlib on a converged server (~35 ms of a VPS's CPU).
    req = {"files": [], "binary": str(tmp_path / "sing-box"), "service": "none.service", "public": [], "private": [],
           "lock": str(tmp_path / "lock"), "wants": str(tmp_path / "wants"), "dirs": [], "firewall": False}
    out = subprocess.run(["python3", "-I", "-S", "-X", "importtime", "-c", remote.facts_script(req)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert imported and not imported & {"json", "subprocess", "hashlib", "typing", "platform"}, imported


@pytest.mark.parametrize("script", [remote.FACTS, remote.COMMIT, remote.ENGINE, remote.FIREWALL, remote.LOCK, remote.FILES],
                         ids=lambda s: s.name)
def test_server_scripts_are_python_3_7_and_standard_library_only(script):
    # The servers' own python3 runs them: the oldest we meet is 3.7 (feature_version rejects newer syntax).
    import ast
    import sys

    tree = ast.parse(script.source, feature_version=(3, 7))
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules <= set(sys.stdlib_module_names) | {"_sha2"}, modules  # _sha2: the built-in sha256 of 3.12+


def test_the_lock_lease_outlasts_every_bounded_step_and_stale_locks_are_recognised():
    # spec: GITOPS-4 — only a dead apply's lock may be taken over: past the lease, or ours with its process gone
    from reconciler.plan.lock import LEASE_SECONDS, LONGEST_STEP_SECONDS, describe, holder, is_stale

    assert LEASE_SECONDS >= LONGEST_STEP_SECONDS + 5 * 60
    now = 1.8e9
    me = holder(now)
    assert not is_stale(None, now, me)
    assert not is_stale({"by": "ci@runner-7", "pid": 1, "since": int(now) - LEASE_SECONDS + 60}, now, me)
    assert is_stale({"by": "ci@runner-7", "pid": 1, "since": int(now) - LEASE_SECONDS - 1}, now, me)
    assert not is_stale({**me, "pid": me["pid"]}, now, me)  # our own, alive
    assert is_stale({**me, "pid": 2 ** 22 + 7}, now, me)  # ours, and that process is gone
    assert not is_stale({"holder": "someone else"}, now, me)  # no age to judge: the operator removes it
    assert describe({"by": "ci@runner-7", "pid": 4242, "since": 1800000000}) == "ci@runner-7 (pid 4242) since 2027-01-15 08:00:00 UTC"
    assert describe({"holder": "x"}, "someone else\n") == "someone else"
