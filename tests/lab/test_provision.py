"""Provisioning real systemd hosts over SSH: plan, apply, real clients, rollback, locks (GITOPS-3,4,6,7)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import threading
import time
from pathlib import Path

from reconciler.credentials import Secret, user_credentials
from reconciler.lab import lab_cluster_yaml
from tests.lab.conftest import ORIGIN_PORT, SECRET, Client, blob_sha, reconciler, reset_hosts, ssh

PROTOCOL_INBOUNDS = [
    ("p-vless", "vless-tls", 443, "tls: {server_name: www.lab.test}"),
    ("p-trojan", "trojan", 8443, "tls: {server_name: www.lab.test}"),
    ("p-ss", "shadowsocks-2022", 8388, ""),
    ("p-hy2", "hysteria2", 443, "tls: {server_name: www.lab.test}"),
    ("p-tuic", "tuic", 8444, "tls: {server_name: www.lab.test}"),
]


def _has_firewall(ruleset: str) -> bool:
    """The hardening table (``table inet reconciler``) is in ``nft list ruleset``'s output — by its exact name."""
    return re.search(r"^table inet reconciler \{", ruleset, re.M) is not None


def every_protocol_cluster(lab, users=("alice", "bob"), extra_inbound: str = "") -> str:
    """vps1 serves every protocol this sing-box build supports, each in a route of its own."""
    h = lab.state.hosts[0]
    lines = ["settings: {outputs: {state_dir: .state}, harden: false}", "servers:",
             f"  - name: {h.name}", f"    host: {h.ip}",
             f"    ssh: {{identity: {lab.key}, host_key: \"{lab.host_key(h)}\"}}", "    country: DE", "    inbounds:"]
    for iid, proto, port, extra in PROTOCOL_INBOUNDS:
        lines.append(f"      - {{id: {iid}, name: \"via {proto}\", protocol: {proto}, port: {port}, route: {iid}"
                     + (f", {extra}" if extra else "") + "}")
    if extra_inbound:
        lines.append(extra_inbound)
    lines.append("routes:")
    lines += [f"  - {{id: {iid}, name: {iid}}}" for iid, *_ in PROTOCOL_INBOUNDS]
    lines.append("users:")
    lines += [f"  - name: {u}" for u in users]
    return "\n".join(lines) + "\n"


def test_bare_hosts_plan_apply_replan(lab, env):
    # spec: GITOPS-3, GITOPS-4
    reset_hosts(lab)
    Path("c.yaml").write_text(lab_cluster_yaml(lab, lab.state.hosts[:3], ["DE", "DE", "US"]))
    assert reconciler("validate", "c.yaml").returncode == 0
    plan = reconciler("plan", "-f", "c.yaml")
    assert plan.returncode == 2, plan.stdout + plan.stderr
    # per server: the engine, its configuration, unit, agent, TLS certificate and key (derived: issue 14), the
    # per-user counting table (issue 16), the probe responder with its unit and listener; a restart
    assert plan.stdout.strip().endswith("Plan: 33 to add, 3 to change, 0 to destroy."), plan.stdout
    # Credentials show as fingerprints, never as themselves (the users' uuids are derived from the lab secret).
    alice = user_credentials(Secret(SECRET.encode()), "alice")
    assert "\"uuid\": \"fp:" in plan.stdout and alice.uuid not in plan.stdout and alice.password not in plan.stdout
    apply = reconciler("apply", "-f", "c.yaml")
    assert apply.returncode == 0, apply.stdout + apply.stderr
    assert "Apply: 3 ok, 0 failed, 3 changed." in apply.stdout
    for phase in ("connect", "preflight", "lock", "install engine", "configure", "start", "verify", "done"):
        assert f"vps1: {phase}" in apply.stderr  # plain progress lines when not a terminal
    for h in lab.state.hosts[:3]:
        out = ssh(lab, h, "systemctl is-active sing-box; systemctl is-enabled sing-box; ss -Hltn sport = :443 | wc -l")
        assert out.stdout.split() == ["active", "enabled", "1"], out
    # The probe responder is socket-activated: systemd listens for it from the engine's start on, and the responder
    # starts at the first request, which it answers.
    first = lab.state.hosts[0]
    out = ssh(lab, first, "systemctl is-active reconciler-responder.socket reconciler-responder.service; "
                          "ss -Hltn sport = :9097 | wc -l")
    assert out.stdout.split() == ["active", "inactive", "1"], out
    probe = ("python3 -c \"import socket; c = socket.create_connection(('127.0.0.1', 9097)); "
             "c.sendall(b'GET /pad/2000 HTTP/1.1\\r\\n\\r\\n'); print(c.recv(64).split()[1].decode())\"; "
             "systemctl is-active reconciler-responder.service")
    assert ssh(lab, first, probe).stdout.split() == ["204", "active"]
    # The commit's verify tells the engine's listeners from /proc: held by a process of the unit's own cgroup
    from reconciler.engine import remote

    held = remote.COMMIT.source.replace('if __name__ == "__main__":\n    main()', "") + (
        "\nprint(held_by_unit('/', 'sing-box.service', [(443, 'tcp')]), "
        "held_by_unit('/', 'sing-box.service', [(443, 'tcp'), (22, 'tcp')]), held_by_unit('/', 'ssh.service', [(443, 'tcp')]))\n")
    assert ssh(lab, first, "python3 -I -S -c " + shlex.quote(held)).stdout.split() == ["True", "False", "False"]
    again = reconciler("plan", "-f", "c.yaml", "--json")
    assert again.returncode == 0, again.stdout
    assert json.loads(again.stdout)["summary"] == {"add": 0, "change": 0, "destroy": 0}
    # A converged server is observed in one short shell session (its stamp; reconciler.plan.stamp), and drift is
    # still seen: an engine stopped, a file edited on the server.
    hosts = lab.state.hosts[:3]
    assert sorted(json.loads(Path(".reconciler-lab/observed.json").read_text())) == sorted(h.name for h in hosts)
    assert reconciler("plan", "-f", "c.yaml").returncode == 0
    ssh(lab, hosts[0], "systemctl stop sing-box")
    ssh(lab, hosts[1], "echo ' ' >> /etc/sing-box/config.template.json")
    drift = reconciler("plan", "-f", "c.yaml", "--json")
    assert drift.returncode == 2, drift.stdout + drift.stderr
    assert {s["server"] for s in json.loads(drift.stdout)["servers"] if s["actions"]} == {hosts[0].name, hosts[1].name}
    assert reconciler("apply", "-f", "c.yaml").returncode == 0
    assert json.loads(reconciler("plan", "-f", "c.yaml", "--json").stdout)["summary"] == {"add": 0, "change": 0,
                                                                                          "destroy": 0}
    # issue 14: what each server serves is the certificate derived from the secret: its pins need no read-back
    from reconciler.certificates import derived_certificate

    for h in lab.state.hosts[:3]:
        served = ssh(lab, h, f"cat /etc/sing-box/tls/{h.name}-in.crt").stdout
        assert served == derived_certificate(Secret(SECRET.encode()), f"{h.name}-in", "www.lab.test").cert_pem


def test_a_real_client_moves_bytes_through_every_protocol(lab, env):
    # Real sing-box server and client; the origin in another namespace sees the server's address.
    reset_hosts(lab)
    Path("c.yaml").write_text(every_protocol_cluster(lab))
    apply = reconciler("apply", "-f", "c.yaml")
    assert apply.returncode == 0, apply.stdout + apply.stderr
    doc = json.loads(reconciler("subscription", "alice", "--format", "sing-box", "-f", "c.yaml").stdout)
    client = Client(doc, env)
    origin = lab.state.hosts[2]
    try:
        for tag in client.ports:
            body = client.fetch(tag, f"http://{origin.ip}:{ORIGIN_PORT}/blob")
            assert hashlib.sha256(body).hexdigest() == blob_sha(), tag
            assert client.fetch(tag, f"http://{origin.ip}:{ORIGIN_PORT}/ip").decode() == lab.state.hosts[0].ip, tag
    finally:
        client.close()
    assert len(client.ports) == 5


def test_adding_a_user_plans_applies_and_keeps_existing_connections(lab, env):
    # spec: GITOPS-3, GITOPS-4 (reload, not restart: existing connections survive)
    reset_hosts(lab)
    Path("c.yaml").write_text(every_protocol_cluster(lab))
    assert reconciler("apply", "-f", "c.yaml").returncode == 0
    alice = Client(json.loads(reconciler("subscription", "alice", "--format", "sing-box", "-f", "c.yaml").stdout), env)
    origin = lab.state.hosts[2]
    got: dict[str, bytes] = {}
    slow = threading.Thread(target=lambda: got.setdefault("blob", alice.fetch(
        "via vless-tls", f"http://{origin.ip}:{ORIGIN_PORT}/blob", timeout=60, limit="150k")))
    try:
        slow.start()
        time.sleep(1.5)  # the download is under way
        Path("c.yaml").write_text(every_protocol_cluster(lab, users=("alice", "bob", "carol")))
        plan = reconciler("plan", "-f", "c.yaml")
        assert plan.returncode == 2 and "reload" in plan.stdout, plan.stdout
        assert reconciler("apply", "-f", "c.yaml").returncode == 0
        slow.join(90)
        assert hashlib.sha256(got["blob"]).hexdigest() == blob_sha()  # survived the reload
    finally:
        alice.close()
    carol = Client(json.loads(reconciler("subscription", "carol", "--format", "sing-box", "-f", "c.yaml").stdout), env, 22000)
    try:
        assert carol.fetch("via trojan", f"http://{origin.ip}:{ORIGIN_PORT}/ip").decode() == lab.state.hosts[0].ip
    finally:
        carol.close()
    assert reconciler("plan", "-f", "c.yaml").returncode == 0


def test_a_config_the_engine_rejects_rolls_back_and_the_old_one_keeps_serving(lab, env):
    # spec: GITOPS-4
    reset_hosts(lab)
    Path("c.yaml").write_text(every_protocol_cluster(lab))
    assert reconciler("apply", "-f", "c.yaml").returncode == 0
    before = ssh(lab, lab.state.hosts[0], "sha256sum /etc/sing-box/config.json").stdout
    Path("bad.crt").write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    Path("bad.key").write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    broken = every_protocol_cluster(lab, extra_inbound=(
        "      - {id: p-broken, name: broken, protocol: trojan, port: 9443, route: p-trojan, "
        "tls: {server_name: x.lab.test, certificate: bad.crt, key: bad.key}}"))
    Path("c.yaml").write_text(broken)
    apply = reconciler("apply", "-f", "c.yaml")
    assert apply.returncode == 1
    assert "sing-box check rejected the new configuration" in apply.stdout, apply.stdout
    h = lab.state.hosts[0]
    assert ssh(lab, h, "sha256sum /etc/sing-box/config.json").stdout == before
    assert ssh(lab, h, "systemctl is-active sing-box").stdout.strip() == "active"
    assert ssh(lab, h, "test -e /run/reconciler.lock && echo held || echo free").stdout.strip() == "free"
    # A bare host is not checked before the start (nothing runs there to protect): the failed start
    # is explained by the same check afterwards, and the host is left as bare as it was.
    bare = lab.state.hosts[0]
    ssh(lab, bare, "systemctl disable --now sing-box 2>/dev/null; rm -rf /etc/sing-box /usr/local/bin/sing-box* "
                   "/etc/systemd/system/sing-box.service; systemctl daemon-reload")
    apply = reconciler("apply", "-f", "c.yaml", "--json")
    assert apply.returncode == 1
    got = {r["server"]: r for r in json.loads(apply.stdout)}["vps1"]
    assert "sing-box check rejected the new configuration" in got["message"], got
    assert got["rolled_back"] and got["details"]["commit"]["rollback_verified"], got
    gone = "test -e /etc/sing-box/config.json || test -e /usr/local/bin/sing-box || test -e /etc/systemd/system/sing-box.service"
    assert ssh(lab, bare, f"{gone} && echo left || echo bare").stdout.strip() == "bare"
    assert ssh(lab, bare, "systemctl is-active sing-box").stdout.strip() != "active"
    assert ssh(lab, bare, "test -e /run/reconciler.lock && echo held || echo free").stdout.strip() == "free"
    Path("c.yaml").write_text(every_protocol_cluster(lab))
    assert reconciler("apply", "-f", "c.yaml").returncode == 0
    client = Client(json.loads(reconciler("subscription", "bob", "--format", "sing-box", "-f", "c.yaml").stdout), env, 23000)
    try:
        assert client.fetch("via shadowsocks-2022", f"http://{lab.state.hosts[2].ip}:{ORIGIN_PORT}/ip")
    finally:
        client.close()


def test_a_second_apply_is_refused_while_the_lock_is_held(lab, env):
    # spec: GITOPS-4
    reset_hosts(lab)
    Path("c.yaml").write_text(lab_cluster_yaml(lab, lab.state.hosts[:3], ["DE"]))
    h = lab.state.hosts[1]
    ssh(lab, h, "mkdir -p /run/reconciler.lock && printf '%s' '{\"by\": \"ci@runner-7\", \"pid\": 4242, \"since\": 1800000000}' "
                "> /run/reconciler.lock/holder")
    apply = reconciler("apply", "-f", "c.yaml")
    assert apply.returncode == 1
    assert "another apply holds the lock on vps2: ci@runner-7 (pid 4242) since 2027-01-15" in apply.stdout, apply.stdout
    assert "Apply: 2 ok, 1 failed" in apply.stdout  # the others were not stopped by it
    assert ssh(lab, h, "test -e /usr/local/bin/sing-box && echo yes || echo no").stdout.strip() == "no"
    ssh(lab, h, "rm -rf /run/reconciler.lock")
    assert reconciler("apply", "-f", "c.yaml").returncode == 0


def test_concurrent_applies_never_both_touch_a_server(lab, env):
    reset_hosts(lab)
    Path("c.yaml").write_text(lab_cluster_yaml(lab, lab.state.hosts[:3], ["DE"]))
    import subprocess
    import sys

    exe = str(Path(sys.executable).with_name("reconciler"))
    procs = [subprocess.Popen([exe, "apply", "-f", "c.yaml"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    refusals = sum(o.count("another apply holds the lock") for o in outs)
    changed = sum(int(o.split(" changed.")[0].rsplit(" ", 1)[1]) for o in outs if " changed." in o)
    assert changed + refusals >= 3 and changed <= 3, outs  # each server changed once; the loser was refused
    assert reconciler("plan", "-f", "c.yaml").returncode == 0


def test_ssh_cut_mid_apply_leaves_old_or_new_and_a_rerun_converges(lab, env):
    # spec: GITOPS-4: never a mix of old and new
    reset_hosts(lab)
    Path("c.yaml").write_text(every_protocol_cluster(lab))
    assert reconciler("apply", "-f", "c.yaml").returncode == 0
    h = lab.state.hosts[0]
    old = ssh(lab, h, "sha256sum /etc/sing-box/config.template.json").stdout.split()[0]
    Path("c.yaml").write_text(every_protocol_cluster(lab, users=("alice", "bob", "dave")))
    import subprocess
    import sys

    proc = subprocess.Popen([str(Path(sys.executable).with_name("reconciler")), "apply", "-f", "c.yaml"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "vps1: configure" not in (proc.stderr.readline() or ""):
        pass
    # Cut SSH: drop the controller's traffic to port 22 (and the session with it).
    import subprocess as sp

    sp.run(["nft", "-f", "-"], input="table inet rlab_cut {\n chain output {\n type filter hook output priority 0;\n"
                                     f" ip daddr {h.ip} tcp dport 22 drop\n }}\n}}\n", text=True, check=True)
    try:
        proc.communicate(timeout=120)  # drains and closes the pipes too
    finally:
        sp.run(["nft", "delete", "table", "inet", "rlab_cut"], check=False)
    time.sleep(3)  # a started commit finishes on the server by itself
    tpl = ssh(lab, h, "sha256sum /etc/sing-box/config.template.json").stdout.split()[0]
    users = ssh(lab, h, "python3 -c \"import json;print(sorted(u['name'] for u in "  # the users (not the probe credential)
                        "json.load(open('/etc/sing-box/config.json'))['inbounds'][0]['users'] if u['name'][0] != '~'))\""
                ).stdout.strip()
    if tpl == old:
        assert users == "['alice', 'bob']"
    else:
        assert users == "['alice', 'bob', 'dave']"
    assert ssh(lab, h, "systemctl is-active sing-box").stdout.strip() == "active"
    assert ssh(lab, h, "ls /etc/sing-box | grep -c reconciler-new || true").stdout.strip() in ("", "0")
    rerun = reconciler("apply", "-f", "c.yaml")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert reconciler("plan", "-f", "c.yaml").returncode == 0


def test_changed_host_key_is_refused(lab, env):
    # spec: GITOPS-6
    reset_hosts(lab)
    text = lab_cluster_yaml(lab, lab.state.hosts[:1], ["DE"])
    other = lab.host_key(lab.state.hosts[1])
    Path("c.yaml").write_text(text.replace(lab.host_key(lab.state.hosts[0]), other))
    plan = reconciler("plan", "-f", "c.yaml")
    assert plan.returncode == 1 and "host key differs from the pinned one" in plan.stdout, plan.stdout
    # Trust on first use: without a pinned key the first contact is recorded, later changes refused.
    unpinned = "\n".join(line.split(", host_key")[0] + "}" if "host_key" in line else line for line in text.splitlines())
    Path("c.yaml").write_text(unpinned + "\n")
    assert reconciler("plan", "-f", "c.yaml").returncode == 2
    known = json.loads(Path(".reconciler-lab/known_hosts.json").read_text())
    assert known[f"{lab.state.hosts[0].ip}:22"] == lab.host_key(lab.state.hosts[0])
    known[f"{lab.state.hosts[0].ip}:22"] = other
    Path(".reconciler-lab/known_hosts.json").write_text(json.dumps(known))
    assert "host key differs" in reconciler("plan", "-f", "c.yaml").stdout


def test_preflight_refuses_a_port_taken_by_something_else(lab, env):
    reset_hosts(lab)
    h = lab.state.hosts[0]
    ssh(lab, h, "systemd-run --unit=squatter python3 -m http.server 443")
    try:
        time.sleep(1)
        Path("c.yaml").write_text(lab_cluster_yaml(lab, [h], ["DE"]))
        plan = reconciler("plan", "-f", "c.yaml")
        assert plan.returncode == 1 and "port 443/tcp is taken by 'python3'" in plan.stdout, plan.stdout
        apply = reconciler("apply", "-f", "c.yaml")
        assert apply.returncode == 1 and "refused by preflight" in apply.stdout
        assert ssh(lab, h, "test -e /usr/local/bin/sing-box && echo yes || echo no").stdout.strip() == "no"
    finally:
        ssh(lab, h, "systemctl stop squatter")


def test_saved_plans_apply_exactly_and_stale_ones_are_refused(lab, env):
    # spec: GITOPS-3
    reset_hosts(lab)
    Path("c.yaml").write_text(lab_cluster_yaml(lab, lab.state.hosts[:2], ["DE"]))
    assert reconciler("plan", "-f", "c.yaml", "--out", "p.json").returncode == 2
    Path("c.yaml").write_text(Path("c.yaml").read_text().replace("  - name: bob\n", "  - name: bob\n  - name: erin\n"))
    stale = reconciler("apply", "p.json")
    assert stale.returncode == 1 and "the saved plan is stale" in stale.stderr
    assert reconciler("plan", "-f", "c.yaml", "--out", "p.json").returncode == 2
    assert reconciler("apply", "p.json").returncode == 0
    assert reconciler("apply", "p.json").returncode == 1  # the servers changed since: stale now


def test_a_server_that_left_the_file_is_removed_by_default(lab, env):
    # spec: GITOPS-7 (issue 15): Terraform's way, no flag: `-` in the plan, then the engine stopped and credentials gone
    reset_hosts(lab)
    Path("c.yaml").write_text(lab_cluster_yaml(lab, lab.state.hosts[:2], ["DE"]))
    assert reconciler("apply", "-f", "c.yaml").returncode == 0
    gone = lab.state.hosts[1]
    assert ssh(lab, gone, "test -e /etc/sing-box/tls/vps2-in.key && echo yes").stdout.strip() == "yes"
    Path("c.yaml").write_text(lab_cluster_yaml(lab, lab.state.hosts[:1], ["DE"]))
    plan = reconciler("plan", "-f", "c.yaml")
    assert plan.returncode == 2 and "left the cluster file" in plan.stdout and "to destroy" in plan.stdout
    assert "- stop sing-box.service" in plan.stdout
    assert "left the cluster file" not in reconciler("plan", "-f", "c.yaml", "--keep", "vps2").stdout
    assert reconciler("apply", "-f", "c.yaml").returncode == 0
    assert ssh(lab, gone, "systemctl is-active sing-box").stdout.strip() != "active"
    assert ssh(lab, gone, "systemctl is-active reconciler-responder.socket").stdout.strip() != "active"
    assert ssh(lab, gone, "ss -Hltn sport = :9097 | wc -l").stdout.strip() == "0"  # nothing left listening
    left = ssh(lab, gone, "find /usr/local/bin /etc/sing-box -type f 2>/dev/null").stdout
    assert left.strip() == "", left  # engine, configuration, keys and certificates: gone
    assert json.loads(reconciler("plan", "-f", "c.yaml", "--json").stdout)["summary"] == {"add": 0, "change": 0, "destroy": 0}


def test_harden_allows_ssh_and_inbounds_only_and_never_locks_us_out(lab, env):
    # Issue: securing the server — nftables, confirmed over a fresh SSH connection or rolled back.
    import socket
    import subprocess as sp

    from reconciler.engine import remote

    reset_hosts(lab)
    h = lab.state.hosts[0]
    for host in lab.state.hosts:
        ssh(lab, host, "nft delete table inet reconciler 2>/dev/null; systemctl disable reconciler-firewall 2>/dev/null; true")
    ssh(lab, h, "systemd-run --unit=other-service python3 -m http.server 9999")
    try:
        time.sleep(1)
        socket.create_connection((h.ip, 9999), timeout=3).close()  # open before hardening
        Path("c.yaml").write_text(lab_cluster_yaml(lab, [h], ["DE"], harden=True))
        plan = reconciler("plan", "-f", "c.yaml")
        assert "+ harden nftables: allow SSH and the inbound ports only (443/tcp)" in plan.stdout, plan.stdout
        apply = reconciler("apply", "-f", "c.yaml")
        assert apply.returncode == 0, apply.stdout + apply.stderr
        assert _has_firewall(ssh(lab, h, "nft list ruleset").stdout)
        assert ssh(lab, h, "systemctl is-enabled reconciler-firewall").stdout.strip() == "enabled"
        socket.create_connection((h.ip, 443), timeout=3).close()  # the inbound
        try:
            socket.create_connection((h.ip, 9999), timeout=3).close()
            raise AssertionError("port 9999 is still reachable")
        except OSError:
            pass
        assert reconciler("plan", "-f", "c.yaml").returncode == 0
        # Without a confirmation from a fresh connection, the server restores the previous rules itself.
        ssh(lab, h, "nft delete table inet reconciler; cp /etc/reconciler/firewall.nft /tmp/fw.nft")
        req = {"op": "apply", "new": "/tmp/fw.nft", "path": "/tmp/fw-kept.nft", "confirm": "/run/never",
               "loaded": "/tmp/loaded", "out": "/tmp/fw.out", "timeout": 2}
        text = remote.FIREWALL.prepare(req)[0]
        out = sp.run(["ssh", "-i", str(lab.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                      "-o", "LogLevel=ERROR", f"root@{h.ip}", f"python3 -I -S -c {shlex_quote(text)}; cat /tmp/fw.out"],
                     capture_output=True, text=True, timeout=60)
        assert json.loads(out.stdout.strip().splitlines()[-1])["ok"] is False and "rolled back" in out.stdout
        # the firewall's table is gone; the per-user counting table (inet reconciler_usage) is not the firewall
        assert not _has_firewall(ssh(lab, h, "nft list ruleset").stdout)
    finally:
        ssh(lab, h, "systemctl stop other-service; nft delete table inet reconciler; "
                    "systemctl disable reconciler-firewall; true")


def shlex_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
