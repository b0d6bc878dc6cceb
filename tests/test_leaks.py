"""Nothing leaks (issue 13): every byte plan and apply print or write, for a cluster with REALITY, TLS with the
operator's own certificate and key, and Shadowsocks, holds no secret — not the master secret, no credential
derived from it, no PEM block.

The servers are fake hosts (``reconciler.ssh.fake``) behind the CLI's own pool seam; the CLI runs in-process,
so stdout, stderr and the log are all captured. One server's engine rejects its configuration and echoes a
user's password in its error, as a real engine may echo a value it cannot use.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from reconciler.credentials import Secret, clash_api_secret, reality_keys, reality_short_id, ss_server_key, user_credentials
from reconciler.ssh.fake import FakeRunner, fake_engine

USERS = ("alice", "bob", "carol")


def self_signed(name: str) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) of a fresh self-signed certificate for ``name``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30)).sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def write_cluster(tmp_path: Path, rotate_bob: int = 0) -> Path:
    engine = tmp_path / "engine" / "sing-box"
    if not engine.exists():
        engine.parent.mkdir(parents=True)
        engine.write_bytes(fake_engine("1.14.4"))
        engine.chmod(0o755)
    servers = []
    for i, s in enumerate(("a", "b")):
        servers.append({"name": s, "host": f"192.0.2.{i + 1}", "country": "DE", "inbounds": [
            {"id": f"{s}-reality", "name": "R", "protocol": "vless-reality", "port": 443, "route": "r",
             "camouflage": "www.example.com"},
            {"id": f"{s}-trojan", "name": "T", "protocol": "trojan", "port": 8443, "route": "r",
             "tls": {"server_name": "t.example.com", "certificate": f"tls/{s}.crt", "key": f"tls/{s}.key"}},
            {"id": f"{s}-ss", "name": "S", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"},
        ]})
    # The fake engine prints no build tags: it declares what the real one would have (issue 14).
    doc = {"settings": {"engine": {"binary": str(engine), "capabilities": ["reality", "clash-api"]}, "harden": False},
           "servers": servers,
           "routes": [{"id": "r", "name": "R"}],
           "users": [{"name": u, **({"rotate": rotate_bob} if u == "bob" and rotate_bob else {})} for u in USERS]}
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(doc, indent=2))  # JSON is YAML
    return path


def new_certificates(tmp_path: Path) -> list[bytes]:
    pems = []
    (tmp_path / "tls").mkdir(exist_ok=True)
    for s in ("a", "b"):
        cert, key = self_signed("t.example.com")
        (tmp_path / "tls" / f"{s}.crt").write_bytes(cert)
        (tmp_path / "tls" / f"{s}.key").write_bytes(key)
        pems += [cert, key]
    return pems



def secret_values(secret: Secret) -> list[str]:
    """Every secret that must never be shown: the master secret and everything derived from it here."""
    values = [secret.value.decode()]
    for user in USERS:
        for rotate in (0, 1):
            c = user_credentials(secret, user, rotate)
            values += [c.uuid, c.password, c.ss_key_128, c.ss_key_256, c.token]
    for s in ("a", "b"):
        values += [ss_server_key(secret, f"{s}-ss", "2022-blake3-aes-128-gcm"),
                   ss_server_key(secret, f"{s}-ss", "2022-blake3-aes-256-gcm"),
                   clash_api_secret(secret, s), reality_short_id(secret, f"{s}-reality"),
                   reality_keys(secret, f"{s}-reality").private_key]  # derived on the controller (issue 14)
    return values


def test_plan_and_apply_never_show_a_secret_or_a_pem_block(cli, tmp_path, monkeypatch, caplog):
    # Issue 13 — secrets by construction: text, --json, a saved plan, apply's lines and --json, and errors
    caplog.set_level(logging.DEBUG)
    value = secrets.token_urlsafe(32)
    monkeypatch.setenv("RECONCILER_SECRET", value)
    secret = Secret(value.encode())
    runner = FakeRunner(tmp_path / "hosts")
    monkeypatch.setattr("reconciler.apply.session.pool_for", lambda state, **kw: runner)
    pems = new_certificates(tmp_path)
    path = str(write_cluster(tmp_path))
    saved = tmp_path / "plan.json"
    # b's engine rejects its configuration, quoting alice's password
    alice = user_credentials(secret, "alice").password
    runner.host("b").script(fail_check_if=alice, fail_start_if=alice)

    runs = [cli("plan", "-f", path), cli("plan", "-f", path, "--json"), cli("plan", "-f", path, "--out", str(saved))]
    assert [r.rc for r in runs] == [2, 2, 2], [r.text for r in runs]
    written = [saved.read_text()]
    runs.append(cli("apply", str(saved)))
    assert runs[-1].rc == 1 and "ok   a" in runs[-1].out and "FAIL b" in runs[-1].out, runs[-1].text
    assert "check rejected" in runs[-1].out

    # Changes with old contents read back from the servers: bob rotated, new certificates and keys.
    pems += new_certificates(tmp_path)
    write_cluster(tmp_path, rotate_bob=1)
    runs += [cli("plan", "-f", path), cli("plan", "-f", path, "--json"), cli("apply", "-f", path, "--json")]

    shown = [r.out for r in runs] + [r.err for r in runs] + written + [caplog.text]
    assert "a-trojan" in runs[0].out and "config.template.json" in runs[0].out  # the plans did show the files
    for value_ in secret_values(secret):
        for n, text in enumerate(shown):
            assert value_ not in text, f"a secret in output {n}: …{text[max(0, text.find(value_) - 80):text.find(value_) + 40]}…"
    body_lines = [line for pem in pems for line in pem.decode().splitlines() if not line.startswith("-----")]
    for n, text in enumerate(shown):
        assert "-----BEGIN" not in text and "PRIVATE KEY-----" not in text, f"a PEM block in output {n}"
        assert not [line for line in body_lines if line in text], f"part of a PEM body in output {n}"
    assert "content differs: fp:" in runs[-3].out  # the key files changed: shown by their fingerprints
    assert "rejects a configuration containing 'fp:" in runs[3].out  # the echoed password, as its fingerprint
