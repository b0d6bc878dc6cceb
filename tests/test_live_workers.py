"""The live endpoint in worker processes (settings.outputs.workers > 1): the files' bytes and ETags from
every worker, new snapshots reach all of them, a crashed worker is replaced, and nothing outlives the loop.

Real processes on a free loopback port (spawned, as the loop starts them); no root, no servers.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from reconciler.balance import Snapshot
from reconciler.config import load_cluster
from reconciler.credentials import user_credentials
from reconciler.fleet.learned import Learned
from reconciler.lab.demo import free_port
from reconciler.loop import workers
from reconciler.loop.service import Loop
from reconciler.loop.workers import CLUSTER_FILE, SNAPSHOT_FILE, LiveWorkers, worker_count
from reconciler.model import Cluster
from reconciler.publish import FileOutlet
from reconciler.ssh.fake import FakeRunner
from reconciler.subscriptions import render
from tests.fake_agents import install_agent
from tests.test_loop import SECRET, cluster, snapshot_after

FILES = {"links": "links.txt", "sing-box": "sing-box.json", "clash": "clash.yaml"}


def fetch(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    """One request on a connection of its own (so that the kernel spreads them over the workers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers={"User-Agent": "v2rayN/6.0", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not serving anything, but it is not reaped either: count it as alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def until(probe: Callable[[], object], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = probe()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or probe}")


def token(user: str) -> str:
    return user_credentials(SECRET, user, 0).token


async def same_as_files(port: int, subs: Path, users: list[str]) -> None:
    """Every user's documents, each on a new connection, equal the files byte for byte, ETag for ETag."""
    for user in users:
        tok = token(user)
        written = json.loads((subs / tok / "headers.json").read_text())
        for fmt, name in FILES.items():
            status, body, headers = await asyncio.to_thread(fetch, port, f"/sub/{tok}/{fmt}")
            assert status == 200, (user, fmt, status, body)
            assert body == (subs / tok / name).read_bytes(), (user, fmt)
            assert headers["etag"] == written[fmt]["etag"], (user, fmt)
            assert {k: headers[k.lower()] for k in written[fmt]} == written[fmt]


async def same_as_render(port: int, snap: Snapshot, users: list[str]) -> None:
    for user in users:
        for fmt in FILES:
            doc = render(snap, user, fmt, SECRET)
            status, body, headers = await asyncio.to_thread(fetch, port, f"/sub/{token(user)}/{fmt}")
            assert (status, body) == (doc.status, doc.body), (user, fmt)
            assert {k: headers.get(k.lower()) for k in doc.headers} == doc.headers, (user, fmt)
            if not doc.refused:
                assert headers["etag"] == doc.etag


def test_worker_count_reads_the_setting():
    assert worker_count(1) == 1 and worker_count(3) == 3
    assert worker_count(0) == worker_count("auto") == (os.cpu_count() or 1)


def test_the_cached_documents_leave_the_cyclic_gcs_sight(monkeypatch):
    """A full collection walking 100k users' cached documents was a ~200 ms pause under load: they are frozen
    as they accumulate, as the snapshot is when published (the answers are the same)."""
    import gc

    from reconciler.publish import LiveAnswers, Tokens

    c = cluster(3, users=30, protocol="shadowsocks-2022")
    snap = snapshot_after(c, Learned.fresh(c))
    monkeypatch.setattr(LiveAnswers, "FREEZE_EVERY", 10)
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    try:
        answers.publish(snap)
        frozen = gc.get_freeze_count()
        docs = [answers.answer(u.name, "links") for u in c.users]
        assert gc.get_freeze_count() > frozen
        assert docs == [render(snap, u.name, "links", SECRET) for u in c.users]
    finally:
        gc.unfreeze()


def test_two_workers_answer_like_the_files_follow_new_snapshots_survive_a_crash_and_leave_nothing(tmp_path):
    c = cluster(5, users=60, protocol="shadowsocks-2022")
    snap = snapshot_after(c, Learned.fresh(c))
    subs = tmp_path / "subs"
    FileOutlet(subs, tmp_path / "files-state", SECRET).write(snap)
    port = free_port()
    health = {"ok": True}
    state = tmp_path / "state"
    users = [u.name for u in c.users]

    async def scenario() -> list[int]:
        pool = LiveWorkers(2, "127.0.0.1", port, SECRET, state, str(tmp_path), lambda: (health["ok"], "why"))
        await pool.start()
        seen = list(pool.pids)
        try:
            assert len(set(seen)) == 2 and all(alive(p) for p in seen)
            # No snapshot yet: every token is asked to come back (as the single process before its first interval),
            # never a 404 an app could take for a deleted subscription.
            assert (await asyncio.to_thread(fetch, port, f"/sub/{token('u0')}/links"))[0] == 503
            pool.publish(snap)
            await until(lambda: _all_at(pool, 1), what="both workers at generation 1")
            for name in (CLUSTER_FILE, SNAPSHOT_FILE):
                assert oct((state / name).stat().st_mode & 0o777) == "0o600"

            await same_as_files(port, subs, users)
            stats = await pool.stats()
            assert sorted(s.pid for s in stats) == sorted(seen) and all(s.served > 0 for s in stats), stats
            etag = json.loads((subs / token("u1") / "headers.json").read_text())["links"]["etag"]
            status, _, _ = await asyncio.to_thread(fetch, port, f"/sub/{token('u1')}/links", {"If-None-Match": etag})
            assert status == 304
            status, page, headers = await asyncio.to_thread(  # a browser still gets the page
                fetch, port, f"/sub/{token('u1')}", {"User-Agent": "Mozilla/5.0 (X11; Linux x86_64) Firefox/128.0",
                                                     "Accept": "text/html,*/*;q=0.8"})
            assert status == 200 and headers["content-type"].startswith("text/html") and b"<html" in page.lower()

            # /healthz on the public port says what the loop's process says, from every worker.
            assert {(await asyncio.to_thread(fetch, port, "/healthz"))[0] for _ in range(12)} == {200}
            health["ok"] = False
            await asyncio.sleep(2.5)
            assert {(await asyncio.to_thread(fetch, port, "/healthz"))[0] for _ in range(12)} == {503}
            health["ok"] = True
            await asyncio.sleep(2.5)
            assert {(await asyncio.to_thread(fetch, port, "/healthz"))[0] for _ in range(12)} == {200}

            # A new interval's snapshot (no verdicts: every server in rotation; u0 moved to another inbound):
            # every worker answers from it.
            moved = dict(snap.assignments)
            before = moved[("u0", "r")]
            moved[("u0", "r")] = next(r.inbound.id for r in c.inbounds if r.inbound.id != before)
            snap2 = Snapshot(cluster=c, now=snap.now + 10, assignments=moved, usage=snap.usage)
            assert render(snap2, "u0", "links", SECRET).body != render(snap, "u0", "links", SECRET).body
            pool.publish(snap2)
            await until(lambda: _all_at(pool, 2), what="both workers at generation 2")
            await same_as_render(port, snap2, ["u0", "u1", "u2"] * 4)

            # A changed file (a new user, another title, u3 disabled): the cluster goes out again.
            data = c.model_dump(mode="json", exclude_defaults=True)
            data["settings"].setdefault("outputs", {})["profile_title"] = "Elsewhere"
            data["users"].append({"name": "newbie"})
            data["users"][3]["enabled"] = False
            c3 = Cluster.model_validate(data)
            snap3 = Snapshot(cluster=c3, now=snap2.now + 10, assignments=moved)
            pool.publish(snap3)
            await until(lambda: _all_at(pool, 3), what="both workers at generation 3")
            await same_as_render(port, snap3, ["newbie", "u0", "u3"] * 4)
            assert (await asyncio.to_thread(fetch, port, f"/sub/{token('u3')}/links"))[0] == 403

            # A worker killed: the other answers meanwhile, and another takes its place with the snapshot.
            victim = seen[0]
            os.kill(victim, signal.SIGKILL)
            # Connections queued on the killed worker's socket are reset (the kernel does not move them), so wait
            # until its process is reaped: no thread of it holds that socket any more.
            await until(lambda: victim not in pool.pids, what="the killed worker reaped")
            for _ in range(10):
                assert (await asyncio.to_thread(fetch, port, f"/sub/{token('u5')}/links"))[0] == 200
            await until(lambda: pool.restarts == 1 and len(pool.pids) == 2, what="the worker restarted")
            assert victim not in pool.pids and not alive(victim)
            seen += [p for p in pool.pids if p not in seen]
            await until(lambda: _all_at(pool, 3), what="the new worker at generation 3")
            await same_as_render(port, snap3, ["newbie", "u0", "u3", "u7"] * 5)
        finally:
            await pool.stop()
        return seen

    pids = asyncio.run(scenario())
    assert len(pids) == 3
    assert not [p for p in pids if alive(p)]
    assert not (state / CLUSTER_FILE).exists() and not (state / SNAPSHOT_FILE).exists()


async def _all_at(pool: LiveWorkers, generation: int) -> bool:
    stats = await pool.stats()
    return len(stats) == pool.count and all(s.generation == generation for s in stats)


def test_a_hung_worker_is_killed_and_replaced(tmp_path, monkeypatch):
    """Alive but deaf (here: stopped): it would never exit, so it is killed once it stops answering heartbeats."""
    monkeypatch.setattr(workers, "HUNG_AFTER", 2.0)
    c = cluster(3, users=5, protocol="shadowsocks-2022")
    snap = snapshot_after(c, Learned.fresh(c))
    port = free_port()

    async def scenario() -> list[int]:
        pool = LiveWorkers(1, "127.0.0.1", port, SECRET, tmp_path / "state", str(tmp_path), lambda: (True, "ok"))
        await pool.start()
        try:
            pool.publish(snap)
            await until(lambda: _all_at(pool, 1), what="the worker at generation 1")
            hung = pool.pids[0]
            os.kill(hung, signal.SIGSTOP)
            await until(lambda: pool.restarts == 1 and pool.pids and hung not in pool.pids, what="a new worker")
            await until(lambda: _all_at(pool, 1), what="the new worker at generation 1")
            await same_as_render(port, snap, ["u0", "u4"])
            return [hung, *pool.pids]
        finally:
            await pool.stop()

    pids = asyncio.run(scenario())
    assert not [p for p in pids if alive(p)]


def test_a_port_in_use_is_an_error_not_a_shared_port(tmp_path):
    """SO_REUSEPORT would let the workers join another listener of ours (a second `reconciler run`) and split its
    traffic: they refuse a port something listens on, as one process does."""
    import errno
    import socket

    port = free_port()

    async def scenario() -> None:
        first = LiveWorkers(1, "127.0.0.1", port, SECRET, tmp_path / "a", str(tmp_path), lambda: (True, "ok"))
        await first.start()
        try:
            second = LiveWorkers(1, "127.0.0.1", port, SECRET, tmp_path / "b", str(tmp_path), lambda: (True, "ok"))
            try:
                await second.start()
            except OSError as exc:
                assert exc.errno == errno.EADDRINUSE
            else:
                raise AssertionError("a second set of workers joined the port")
            assert second.pids == []
        finally:
            await first.stop()

    asyncio.run(scenario())
    with socket.socket() as plain:  # a plain listener (nginx, say) on the port
        plain.bind(("127.0.0.1", port))
        plain.listen()
        pool = LiveWorkers(1, "127.0.0.1", port, SECRET, tmp_path / "c", str(tmp_path), lambda: (True, "ok"))
        try:
            asyncio.run(pool.start())
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE
        else:
            raise AssertionError("workers started on a port in use")


ORPHAN = """
import asyncio, sys
from pathlib import Path
from reconciler.loop.workers import LiveWorkers
from tests.test_loop import SECRET

async def main():
    pool = LiveWorkers(2, "127.0.0.1", int(sys.argv[1]), SECRET, Path(sys.argv[2]), sys.argv[2], lambda: (True, "ok"))
    await pool.start()
    print(" ".join(map(str, pool.pids)), flush=True)
    await asyncio.sleep(120)

if __name__ == "__main__":  # the workers are spawned: they import this file again
    asyncio.run(main())
"""


def test_workers_stop_when_the_loops_process_is_killed(tmp_path):
    """SIGKILL leaves the loop's process no time to stop anything: the workers see their pipe close and stop."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(script), str(free_port()), str(tmp_path / "state")], cwd=root,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


CLUSTER = """settings:
  self_heal: false  # the fake hosts are observed and planned, never applied to
  outputs: {{listen: "127.0.0.1:{port}", operations_listen: "127.0.0.1:{ops}", workers: 2}}
  health: {{report_interval: 60s}}  # one interval in this test
servers:
  - {{name: a, host: 198.18.0.10, country: DE, inbounds: [{{id: a-in, name: A, protocol: shadowsocks-2022, port: 8388}}]}}
  - {{name: b, host: 198.18.0.11, country: DE, inbounds: [{{id: b-in, name: B, protocol: shadowsocks-2022, port: 8388}}]}}
users:
  - name: alice
  - name: bob
"""


def _fake_hosts(tmp_path: Path, cluster: Cluster) -> FakeRunner:
    """The servers as fake hosts whose agents answer healthy: the loop's own collection and planning run."""
    runner = FakeRunner(tmp_path / "hosts")
    for s in cluster.servers:
        install_agent(runner, s.name)
    return runner


def test_the_loop_runs_its_public_side_in_workers_and_stops_them(tmp_path):
    path = tmp_path / "cluster.yaml"
    port, ops = free_port(), free_port()
    path.write_text(CLUSTER.format(port=port, ops=ops))
    c = load_cluster(str(path)).cluster
    assert c is not None and c.settings.outputs.workers == 2
    loop = Loop(str(path), c, SECRET, watch=False, runner=_fake_hosts(tmp_path, c))
    subs = tmp_path / "subscriptions"

    async def scenario() -> tuple[int, list[int]]:
        runner = asyncio.create_task(loop.run())
        try:
            await until(lambda: loop.live is not None and len(loop.live.pids) == 2, what="the workers")
            assert loop.live is not None
            pids = list(loop.live.pids)
            await until(lambda: (subs / token("alice") / "headers.json").exists(), what="the files")
            await until(lambda: _all_at(loop.live, 1) if loop.live.generation == 1 else False,
                        what="the first interval in every worker")
            await same_as_files(port, subs, ["alice", "bob"] * 5)
            assert (await asyncio.to_thread(fetch, port, "/healthz"))[0] == 200
            assert (await asyncio.to_thread(fetch, port, "/metrics"))[0] == 404  # operations stay on their own port
            status, metrics, _ = await asyncio.to_thread(fetch, ops, "/metrics")
            assert status == 200 and b"reconciler_" in metrics
        finally:
            loop.stop.set()
        return await asyncio.wait_for(runner, 30), pids

    rc, pids = asyncio.run(scenario())
    assert rc == 0 and len(pids) == 2
    assert not [p for p in pids if alive(p)]


def test_workers_need_the_operations_pages_on_their_own_port(tmp_path, caplog):
    """operations_listen equal to listen: the loop's process must answer both, so it does, alone (and says so)."""
    path = tmp_path / "cluster.yaml"
    port = free_port()
    path.write_text(CLUSTER.format(port=port, ops=port))
    c = load_cluster(str(path)).cluster
    assert c is not None
    loop = Loop(str(path), c, SECRET, watch=False, runner=_fake_hosts(tmp_path, c))

    async def scenario() -> int:
        runner = asyncio.create_task(loop.run())
        try:
            links = tmp_path / "subscriptions" / token("alice") / "links.txt"
            await until(links.exists, what="files")
            assert loop.live is None
            status, body, _ = await asyncio.to_thread(fetch, port, f"/sub/{token('alice')}/links")
            assert status == 200 and body == links.read_bytes()
            assert (await asyncio.to_thread(fetch, port, "/metrics"))[0] == 200
        finally:
            loop.stop.set()
        return await asyncio.wait_for(runner, 30)

    assert asyncio.run(scenario()) == 0
    assert "one process answers both" in caplog.text
