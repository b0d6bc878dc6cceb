"""Standby controllers on real hosts (issue 17): two `reconciler run` against the same lab hosts and a real etcd; the
leader is SIGKILLed in the middle of its first apply, the standby takes over, its applies succeed on every server,
and an apply carrying the dead leader's fence is refused by the servers (their fence, under their apply lock)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from reconciler.apply.session import pool_for
from reconciler.config import load_cluster
from reconciler.credentials import Secret, user_token
from reconciler.lab import lab_cluster_yaml
from reconciler.lab.demo import LoopProcess, free_port
from reconciler.lab.processes import wait_until
from reconciler.plan import lock
from reconciler.ssh import Target
from reconciler.state.folder import StateFolder
from tests.lab.conftest import SECRET, reset_hosts, ssh
from tests.test_leader import running_etcd

LEASE = 3  # seconds
HOSTS = 3


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("no `etcd` binary: `make setup` installs Debian's etcd-server")
    with running_etcd(tmp_path) as url:
        yield url


def _leader(p: LoopProcess) -> dict:
    got = p.status().get("leader")
    return got if isinstance(got, dict) else {}


def _wait(predicate, timeout: float, poll: float = 0.1):
    return wait_until(predicate, timeout, poll)


def _checkout(work: Path, name: str, text: str) -> Path:
    folder = work / name
    folder.mkdir()
    (folder / "c.yaml").write_text(text)
    return folder / "c.yaml"


def test_the_leader_killed_mid_apply_is_replaced_and_its_fence_is_refused_by_the_servers(lab, etcd, tmp_path, monkeypatch):
    monkeypatch.setenv("RECONCILER_SECRET", SECRET)
    reset_hosts(lab)
    hosts = lab.state.hosts[:HOSTS]
    for h in hosts:
        ssh(lab, h, "rm -f /var/lib/reconciler/fence")
    text = lab_cluster_yaml(lab, hosts, ["DE", "NL", "DE"], protocol="shadowsocks-2022", report_interval=2.0,
                            extra_settings=("plan_interval: 5s",
                                            f'leader: {{etcd: ["{etcd}"], lease: {LEASE}s, name: lab-{os.getpid()}}}'))
    files = {n: _checkout(tmp_path, n, text) for n in ("a", "b")}
    token = user_token(Secret(SECRET.encode()), "alice")
    procs: list[LoopProcess] = []

    def start(name: str) -> LoopProcess:
        p = LoopProcess(files[name], f"127.0.0.1:{free_port()}", 600, log_path=tmp_path / f"{name}.log")
        procs.append(p)
        return p

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    try:
        first, second = start("a"), start("b")  # both at once: whichever wins leads, the other stands by
        assert _wait(lambda: {_leader(first).get("role"), _leader(second).get("role")} == {"leader", "standby"}, 60), \
            log("a")[-3000:] + log("b")[-3000:]
        names = ("a", "b") if _leader(first).get("role") == "leader" else ("b", "a")
        old, new = (first, second) if names[0] == "a" else (second, first)
        # a standby says "standby" from its start, and names the leader once its first round has read etcd
        assert _wait(lambda: _leader(new).get("leader") == _leader(old)["identity"], 2 * LEASE), _leader(new)
        # The leader's first plan applies to the bare hosts (engine upload, configuration, start): kill it in the middle.
        assert _wait(lambda: "applying:" in log(names[0]), 120, poll=0.05), log(names[0])[-3000:]
        time.sleep(0.5)
        fence_a = int(_leader(old)["fence"])
        old.kill()
        killed = time.monotonic()
        assert _wait(lambda: _leader(new).get("role") == "leader", 2 * LEASE, poll=0.05), log(names[1])[-3000:]
        took = time.monotonic() - killed
        fence_b = int(_leader(new)["fence"])
        assert fence_b > fence_a
        # A change in the file (both checkouts, as a git pull would bring it): the new leader must apply it.
        for f in files.values():
            f.write_text(f.read_text() + "  - name: zed\n")
        b = new

        # The new leader's applies succeed on every server (a lock the dead leader left is stale: its process is
        # gone, and it ran on this machine) and each server records the new leader's fence.
        def converged() -> bool:
            for h in hosts:
                out = ssh(lab, h, "cat /var/lib/reconciler/fence; systemctl is-active sing-box").stdout.split()
                if out != [str(fence_b), "active"]:
                    return False
            return True

        assert _wait(converged, 180, poll=1.0), log(names[1])[-5000:]
        assert "leading from interval" in log(names[1])
        assert b.get(f"/sub/{token}/links")[0] == 200

        # The dead leader's fence is refused by every server, under the lock, before anything changes.
        cluster = load_cluster(str(files["a"])).cluster
        assert cluster is not None

        async def old_leader_tries() -> list[str]:
            pool = pool_for(StateFolder(tmp_path / "old-leader-state"))
            refusals = []
            try:
                for server in cluster.servers:
                    with pytest.raises(lock.FenceRefused) as err:
                        await lock.acquire(pool, Target.from_server(server), server.name, fence=lock.Fence(fence_a))
                    refusals.append(str(err.value))
            finally:
                await pool.close()
            return refusals

        refusals = asyncio.run(old_leader_tries())
        assert len(refusals) == HOSTS and all(f"newer controller (fence {fence_b})" in r and f"(fence {fence_a})" in r
                                              for r in refusals), refusals
        for h in hosts:
            assert ssh(lab, h, "test -e /run/reconciler.lock && echo held || echo free").stdout.strip() == "free"
            assert ssh(lab, h, "cat /var/lib/reconciler/fence").stdout.strip() == str(fence_b)
        print(f"lab: takeover after SIGKILL mid-apply {took:.2f}s (lease {LEASE}s); fences {fence_a} → {fence_b}")
    finally:
        for p in procs:
            p.stop(signal.SIGTERM, timeout=30)
        for h in hosts:
            ssh(lab, h, "rm -f /var/lib/reconciler/fence")
        reset_hosts(lab)
