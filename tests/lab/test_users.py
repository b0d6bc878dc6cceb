"""Users on real hosts (issue 16): per-user traffic measured against ground truth through real clients, and a
quota crossed by real traffic enforced by the loop — refused within an interval, back when the limit is raised.

The ground truth is what curl itself counts on the client side of each transfer (request and response headers
and bodies); the reconciler's figure is what the servers' kernels counted for each user, folded by the loop.
Several users at once, one long download and many short connections each, uploads, and both engines restarted
between the two halves. Figures go to ``$RECONCILER_BENCH_OUT`` when set (``bench/users.py --lab`` reads them).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from reconciler.credentials import Secret, user_credentials
from reconciler.lab import lab_cluster_yaml
from reconciler.lab.demo import LoopProcess, free_port
from tests.lab.conftest import ORIGIN_PORT, SECRET, Client, reconciler, reset_hosts, ssh

INTERVAL = 2.0
MB = 1 << 20


@pytest.fixture(scope="module")
def users_fleet(lab, tmp_path_factory):
    """Two sing-box servers (the origin is a third host), users alice, bob and carol (carol has a 24 MB limit),
    applied, and the loop running against them."""
    reset_hosts(lab)
    work = tmp_path_factory.mktemp("users")
    os.environ["RECONCILER_SECRET"] = SECRET
    listen = f"127.0.0.1:{free_port()}"
    path = work / "c.yaml"
    text = lab_cluster_yaml(lab, lab.state.hosts[:2], ["DE", "NL"], protocol="vless-tls", report_interval=INTERVAL,
                            listen=listen, users=3, extra_settings=("plan_interval: 120s",))
    path.write_text(text.replace("  - name: carol", "  - {name: carol, data_limit: 24MB, reset: monthly}"))
    applied = reconciler("apply", "-f", str(path))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    loop = LoopProcess(path, listen, duration=900, log_path=work / "loop.log", operations_listen=f"127.0.0.1:{free_port()}")
    assert loop.wait(lambda s: all(v["status"] == "ok" for v in s["servers"].values()), 20 * INTERVAL + 30), \
        (work / "loop.log").read_text()[-3000:]
    try:
        yield {"path": path, "work": work, "loop": loop}
    finally:
        loop.stop()


def token(user: str) -> str:
    return user_credentials(Secret(SECRET.encode()), user, 0).token


def client_of(fleet, user: str, base_port: int) -> tuple[Client, int]:
    code, body, _ = fleet["loop"].get(f"/sub/{token(user)}/sing-box")
    assert code == 200, body
    client = Client(json.loads(body), fleet["work"], base_port)
    return client, next(iter(client.ports.values()))


def curl(port: int, url: str, *extra: str, timeout: float = 60) -> tuple[int, int, int]:
    """One transfer through the user's client (a new connection each time); (bytes up, bytes down, exit code) as
    curl counts them: request headers and body, response headers and body."""
    out = subprocess.run(["curl", "-sS", "--max-time", str(timeout), "-x", f"socks5h://127.0.0.1:{port}", url,
                          "-o", "/dev/null", "-w", "%{size_request} %{size_upload} %{size_header} %{size_download}",
                          *extra], capture_output=True, text=True, timeout=timeout + 10)
    req, up, head, down = (int(x) for x in (out.stdout.split() or ["0"] * 4))
    return req + up, head + down, out.returncode


def usage(fleet) -> dict[str, dict]:
    out = reconciler("users", "-f", str(fleet["path"]), "--json")
    assert out.returncode == 0, out.stderr
    return {u["name"]: u for u in json.loads(out.stdout)["users"]}


def diagnose(lab, fleet) -> str:
    """What to look at when a figure is off: the servers' counters, what `users` says, the loop's last lines."""
    out = [ssh(lab, h, "nft list table inet reconciler_usage; grep -c routing_mark /etc/sing-box/config.json").stdout
           for h in lab.state.hosts[:2]]
    users = reconciler("users", "-f", str(fleet["path"]))
    text = "\n".join([*out, users.stdout, users.stderr, (fleet["work"] / "loop.log").read_text()[-2000:]])
    (fleet["work"] / "diagnosis.txt").write_text(text)
    return text


def record(figures: dict) -> None:
    where = os.environ.get("RECONCILER_BENCH_OUT")
    if where:
        old = json.loads(Path(where).read_text()) if Path(where).exists() else {}
        Path(where).write_text(json.dumps({**old, **figures}, indent=2))


def test_per_user_traffic_matches_what_the_clients_carried(lab, users_fleet):
    # issue 16 item 1: within 1% over 100 MB per user, several users at once, long and short connections,
    # uploads, an engine restart in the middle; never one user's bytes for another (carol carries nothing)
    fleet = users_fleet
    origin = lab.state.hosts[2]
    base = f"http://{origin.ip}:{ORIGIN_PORT}"
    before = usage(fleet)
    plan = {"alice": (40, 8), "bob": (44, 12)}  # short 1 MiB downloads, 1 MiB uploads (besides one 64 MiB download)
    clients = {u: client_of(fleet, u, 24000 + 100 * i) for i, u in enumerate(plan)}
    truth = {u: [0, 0] for u in plan}
    halfway = threading.Barrier(len(plan) + 1)
    resumed = threading.Event()
    errors: list[str] = []
    upload = fleet["work"] / "upload.bin"
    upload.write_bytes(os.urandom(MB))

    def add(user: str, got: tuple[int, int, int], what: str) -> None:
        truth[user][0] += got[0]
        truth[user][1] += got[1]
        if got[2] != 0:
            errors.append(f"{user}: {what} exited {got[2]}")

    def traffic(user: str) -> None:
        port = clients[user][1]
        short, uploads = plan[user]
        add(user, curl(port, f"{base}/stream"), "stream")  # one long connection, 64 MiB
        for _ in range(short // 2):
            add(user, curl(port, f"{base}/blob"), "blob")
        halfway.wait(120)
        resumed.wait(120)
        for _ in range(short - short // 2):
            add(user, curl(port, f"{base}/blob"), "blob")
        for _ in range(uploads):
            add(user, curl(port, f"{base}/upload", "--data-binary", f"@{upload}"), "upload")

    threads = [threading.Thread(target=traffic, args=(u,)) for u in plan]
    for t in threads:
        t.start()
    try:
        halfway.wait(300)
        for host in lab.state.hosts[:2]:  # the engines restart between the halves: the kernel's counters do not
            restarted = ssh(lab, host, "systemctl restart sing-box && sleep 1 && systemctl is-active sing-box")
            assert restarted.returncode == 0, restarted.stderr
        resumed.set()
        for t in threads:
            t.join(600)
    finally:
        resumed.set()
        for client, _ in clients.values():
            client.close()
    assert not errors, errors
    for user, (_up, down) in truth.items():
        assert down >= 100 * 1000 * 1000, (user, down)  # the amount: over 100 MB per user

    def counted() -> dict[str, dict] | None:
        now = usage(fleet)
        done = all(now[u]["download_bytes"] - before[u]["download_bytes"] >= 0.99 * truth[u][1] for u in plan)
        return now if done else None

    deadline = time.monotonic() + 6 * INTERVAL + 20
    after = counted()
    while after is None and time.monotonic() < deadline:
        time.sleep(INTERVAL)
        after = counted()
    time.sleep(2 * INTERVAL)  # and one more report: nothing more arrives than what was carried
    after = usage(fleet)
    figures = {}
    for user, (up, down) in truth.items():
        got_up = after[user]["upload_bytes"] - before[user]["upload_bytes"]
        got_down = after[user]["download_bytes"] - before[user]["download_bytes"]
        err_up, err_down = (got_up - up) / up, (got_down - down) / down
        figures[f"accuracy_{user}_download_error_pct"] = round(100 * err_down, 3)
        figures[f"accuracy_{user}_upload_error_pct"] = round(100 * err_up, 3)
        figures[f"accuracy_{user}_download_mb"] = round(down / 1e6, 1)
        assert abs(err_down) <= 0.01 and abs(err_up) <= 0.01, (user, up, got_up, down, got_down, diagnose(lab, fleet))
    assert after["carol"]["used_bytes"] == before["carol"]["used_bytes"]  # nobody else's bytes
    record(figures)
    print(json.dumps(figures, indent=2))


def test_a_quota_crossed_by_real_traffic_is_refused_within_an_interval_and_comes_back(lab, users_fleet):
    # issue 16 item 2: over quota → out of every server's configuration within one report interval (the servers
    # refuse the user's connections, the subscription says why), back when the file raises the limit
    fleet = users_fleet
    loop: LoopProcess = fleet["loop"]
    origin = lab.state.hosts[2]
    client, port = client_of(fleet, "carol", 25000)
    alice, alice_port = client_of(fleet, "alice", 25100)
    try:
        crossed = refused = None
        carried = 0
        for _ in range(200):  # bounded: 24 MB at 1 MiB a fetch crosses after 23; refused within a few intervals
            up, down, code = curl(port, f"http://{origin.ip}:{ORIGIN_PORT}/blob", timeout=10)
            if code != 0:
                refused = time.monotonic()
                break
            carried += up + down
            if crossed is None and carried >= 24 * 1000 * 1000:
                crossed = time.monotonic()
            time.sleep(0.05)
        assert crossed is not None and refused is not None, (carried, (fleet["work"] / "loop.log").read_text()[-3000:])
        latency = refused - crossed
        # One report interval to see it, then the apply (a check, a swap and a reload): well inside two intervals
        # plus the apply's own few seconds on this machine.
        assert latency <= 2 * INTERVAL + 10, latency
        code, body, _ = loop.get(f"/sub/{token('carol')}/sing-box")
        assert code == 403 and b"used its traffic limit (24.0 MB)" in body, (code, body)
        assert usage(fleet)["carol"]["state"] == "over_quota"
        log = (fleet["work"] / "loop.log").read_text()
        assert "users: out: carol (over_quota) — applying now" in log and "quota_reached: carol used the traffic limit" in log
        # Every server refuses carol now; alice, on the same servers, is served throughout.
        assert curl(alice_port, f"http://{origin.ip}:{ORIGIN_PORT}/blob", timeout=10)[2] == 0
        plan = reconciler("plan", "-f", str(fleet["path"]))
        # The CLI reads the same usage from the state folder: its plan leaves carol out too.
        assert plan.returncode == 0 and "Plan: 0 to add, 0 to change, 0 to destroy." in plan.stdout, plan.stdout + plan.stderr
        # The operator raises the limit in the file: the loop reads it and carol is back, no other step.
        fleet["path"].write_text(fleet["path"].read_text().replace("data_limit: 24MB", "data_limit: 1GB"))
        deadline = time.monotonic() + 60
        back = False
        while time.monotonic() < deadline and not back:
            time.sleep(1)
            back = loop.get(f"/sub/{token('carol')}/sing-box")[0] == 200 and \
                curl(port, f"http://{origin.ip}:{ORIGIN_PORT}/blob", timeout=10)[2] == 0
        assert back, (fleet["work"] / "loop.log").read_text()[-3000:]
        assert "back: carol" in (fleet["work"] / "loop.log").read_text()
        record({"enforcement_latency_s": round(latency, 2), "report_interval_s": INTERVAL})
    finally:
        client.close()
        alice.close()
