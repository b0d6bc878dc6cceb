"""`reconciler run` as a process, without servers: git pull, reload, HTTP outlet, graceful stop (GITOPS-5).

The lab tests run the loop against real hosts; this one needs no root: the cluster has users and
no servers, and the git remote is a local bare repository.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from reconciler.backoff import Streaks
from reconciler.credentials import Secret, user_credentials
from reconciler.lab.demo import free_port
from reconciler.loop.collect import SERVER_BACKOFF

SECRET = "run-test-secret-0123456789abcdef"


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True,
                   capture_output=True, timeout=30)


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_run_pulls_git_reloads_serves_and_stops_on_sigterm(tmp_path):
    # spec: GITOPS-5 — the loop follows the git checkout of the file; SIGTERM stops it cleanly
    origin, work, clone = tmp_path / "origin.git", tmp_path / "work", tmp_path / "clone"
    git(tmp_path, "init", "-q", "--bare", str(origin))
    git(tmp_path, "clone", "-q", str(origin), str(work))
    port, ops = free_port(), free_port()
    text = (f'settings:\n  outputs: {{listen: "127.0.0.1:{port}", operations_listen: "127.0.0.1:{ops}"}}\n'
            '  health: {report_interval: 1s}\n'
            "  git_pull_interval: 1s\nroutes:\n  - {id: r, name: R}\nusers:\n  - name: alice\n")
    (work / "cluster.yaml").write_text(text)
    git(work, "add", "cluster.yaml")
    git(work, "commit", "-q", "-m", "first")
    git(work, "push", "-q", "origin", "HEAD")
    git(tmp_path, "clone", "-q", str(origin), str(clone))
    log = open(tmp_path / "run.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "reconciler", "run", "-f", str(clone / "cluster.yaml"), "--no-watch",
                             "--duration", "120"], env={**os.environ, "RECONCILER_SECRET": SECRET}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: get(f"{base}/healthz") == 200, 30), (tmp_path / "run.log").read_text()
        secret = Secret(SECRET.encode())
        bob = user_credentials(secret, "bob", 0).token
        assert get(f"{base}/sub/{user_credentials(secret, 'alice', 0).token}") == 200
        assert get(f"{base}/sub/{bob}") == 404
        # An operator pushes a new user; the loop pulls (no file watcher here) and serves bob.
        (work / "cluster.yaml").write_text(text + "  - name: bob\n")
        git(work, "commit", "-q", "-am", "add bob")
        git(work, "push", "-q", "origin", "HEAD")
        assert wait_for(lambda: get(f"{base}/sub/{bob}") == 200, 30), (tmp_path / "run.log").read_text()
        assert (clone / ".reconciler" / "learned.npz").exists()
        assert get(f"{base}/status.json") == 404  # the public listener serves subscriptions and health only
        status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ops}/status.json", timeout=3).read())
        assert status["ready"] and status["servers"] == {}
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ops}/metrics", timeout=3).read().decode()
        assert 'reconciler_reconcile_total{kind="git",result="ok"}' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log.close()
    assert code == 0
    out = (tmp_path / "run.log").read_text()
    assert "reloaded" in out and "SIGTERM: stopping" in out and "learned state saved" in out
    assert "Traceback" not in out


def test_backoff_doubles_to_a_cap_and_resets():
    b = Streaks(SERVER_BACKOFF)
    waits = [b.failed("s", tick + 1) for tick in range(8)]  # the loop counts from the next interval
    assert waits == [0, 2, 4, 8, 16, 16, 16, 16]
    assert not b.ready("s", 7) and b.ready("s", 7 + 1 + 16)
    assert b.succeeded("s") and b.ready("s", 0) and not b.succeeded("s")
