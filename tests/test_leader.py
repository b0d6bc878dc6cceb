"""Standby controllers (issue 17) against a real etcd: the election, the handover of the learned state, fencing.

A real ``etcd`` (Debian's etcd-server, which ``make setup`` installs) runs on free loopback ports in a temporary
folder and is stopped by its PID. The elections are ``reconciler.loop.leader``'s own; the controllers are real
``reconciler run`` processes (SIGKILL, SIGSTOP and SIGCONT as a crash and a cut-off would do) or real ``Loop``s in
this process with generated reports (for the learned state's numbers). Servers are fake hosts
(``reconciler.ssh.fake``) or loopback ports nobody listens on: nothing leaves this machine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from etcd3gw.exceptions import ConnectionFailedError, Etcd3Exception

from reconciler.apply.run import apply_all
from reconciler.config import load_cluster
from reconciler.credentials import Secret, user_token
from reconciler.engine import remote
from reconciler.engine.singbox import LAYOUT
from reconciler.errors import SecretError
from reconciler.fleet.learned import Learned
from reconciler.lab.demo import LoopProcess, free_port
from reconciler.lab.processes import stop, wait_until
from reconciler.loop.leader import Election, Etcd, StateChannel, failure, pack, unpack
from reconciler.loop.role import Elected
from reconciler.loop.service import Loop
from reconciler.model import Cluster
from reconciler.model.cluster import LeaderSettings
from reconciler.plan.lock import FENCE_FILE, LOCK_DIR, LOCK_FILE, Fence
from reconciler.plan.observe import observe
from reconciler.ssh import Target
from reconciler.ssh.fake import FakeRunner, fake_engine
from tests.fake_agents import install_agent

ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(ETCD is None, reason="no `etcd` binary: `make setup` installs Debian's etcd-server")
SECRET_TEXT = "leader-test-secret-0123456789abcdef"
SECRET = Secret(SECRET_TEXT.encode())
LEASE = 2  # seconds: etcd's shortest lease, so the takeovers below take seconds


@contextlib.contextmanager
def running_etcd(folder: Path) -> Iterator[str]:
    """A real single-member etcd on loopback ports, its data under ``folder``; its client URL. Stopped by PID."""
    assert ETCD is not None
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = open(folder / "etcd.log", "wb")  # closed below
    proc = subprocess.Popen([ETCD, "--name", "test", "--data-dir", str(folder / "etcd-data"), "--listen-client-urls", client,
                             "--advertise-client-urls", client, "--listen-peer-urls", peer,
                             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"test={peer}"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(client + "/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        break
            except OSError:
                pass
            assert proc.poll() is None, (folder / "etcd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "etcd did not become healthy in 30 s"
            time.sleep(0.1)
        yield client
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One etcd for this module's tests (each uses keys of its own)."""
    if ETCD is None:
        pytest.skip("no `etcd` binary: `make setup` installs Debian's etcd-server")
    with running_etcd(tmp_path_factory.mktemp("etcd")) as url:
        yield url


def _prefix(request: pytest.FixtureRequest) -> str:
    return f"/test/{request.node.name}-{os.getpid()}"


def _raw_txn(url: str, compare: list[dict[str, object]]) -> bool:
    return bool(Etcd([url], 3.0).txn(compare, []).get("succeeded"))


# --------------------------------------------------------------------------- the election alone


@needs_etcd
def test_exactly_one_leads_and_a_dead_leader_is_replaced_within_two_leases(etcd, request):
    prefix = _prefix(request)
    samples: list[tuple[bool, bool]] = []

    async def scenario() -> dict[str, float]:
        stop = {n: asyncio.Event() for n in "ab"}
        elections = {n: Election(Etcd([etcd], 1.0), prefix, LEASE, identity=f"test-{n}") for n in "ab"}
        tasks = {n: asyncio.create_task(elections[n].run(stop[n])) for n in "ab"}
        try:
            deadline = time.monotonic() + 10
            while not any(e.is_leader for e in elections.values()):
                assert time.monotonic() < deadline, "nobody leads after 10 s"
                await asyncio.sleep(0.02)
            for _ in range(100):  # two seconds: exactly one leads, and it keeps leading
                samples.append((elections["a"].is_leader, elections["b"].is_leader))
                await asyncio.sleep(0.02)
            first = "a" if elections["a"].is_leader else "b"
            other = "b" if first == "a" else "a"
            old, new = elections[first], elections[other]
            fence = old.fence
            assert new.leader == old.identity and new.fence == 0
            assert _raw_txn(etcd, old.guard())
            # The leader dies (its task ends without resigning, as a SIGKILL would): nobody renews its lease.
            tasks[first].cancel()
            killed = time.monotonic()
            while not new.is_leader:
                samples.append((elections["a"].is_leader, elections["b"].is_leader))
                assert time.monotonic() - killed < 3 * LEASE, "no takeover"
                await asyncio.sleep(0.01)
            took = time.monotonic() - killed
            assert new.fence > fence, (new.fence, fence)
            assert not _raw_txn(etcd, old.guard())  # the old leader's guarded writes fail from now on
            assert _raw_txn(etcd, new.guard())
            # A clean stop resigns: a standby campaigns at its next look (a quarter lease), not at the lease's end.
            back = Election(Etcd([etcd], 1.0), prefix, LEASE, identity="test-c")
            stop["c"] = asyncio.Event()
            tasks["c"] = asyncio.create_task(back.run(stop["c"]))
            await asyncio.sleep(0.5)
            assert not back.is_leader and back.leader == new.identity
            stop[other].set()
            await tasks[other]
            await new.resign()
            resigned = time.monotonic()
            while not back.is_leader:
                assert time.monotonic() - resigned < LEASE, "no takeover after a resignation"
                await asyncio.sleep(0.01)
            handed = time.monotonic() - resigned
            assert back.fence > new.fence
            return {"takeover": took, "handover": handed}
        finally:
            for n, t in tasks.items():
                stop[n].set()
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            for e in elections.values():
                await e.resign()
                e.close()

    times = asyncio.run(scenario())
    assert all(not (a and b) for a, b in samples), "two leaders at once"
    assert sum(a != b for a, b in samples) >= 100  # exactly one most of the time (none only during the takeover)
    assert times["takeover"] < 2 * LEASE, times
    print(f"takeover after the leader died: {times['takeover']:.2f}s; after it resigned: {times['handover']:.2f}s "
          f"(lease {LEASE}s)")


@needs_etcd
def test_a_leader_cut_off_from_etcd_steps_down_before_its_lease_can_end(etcd, request):
    prefix = _prefix(request)

    async def scenario() -> tuple[float, float]:
        stop = asyncio.Event()
        changes: list[tuple[bool, float]] = []
        leader = Election(Etcd([etcd], 1.0), prefix, LEASE, identity="cut",
                          on_change=lambda leading: changes.append((leading, time.monotonic())))
        task = asyncio.create_task(leader.run(stop))
        try:
            while not leader.is_leader:
                await asyncio.sleep(0.02)

            def cut(fn):  # type: ignore[no-untyped-def]
                raise ConnectionFailedError("cut off (test)")

            leader.etcd.call = cut  # type: ignore[method-assign]
            cut_at = time.monotonic()
            while leader.is_leader:
                await asyncio.sleep(0.01)
            stepped = time.monotonic() - cut_at
            # etcd still holds the key until the lease ends: a standby can lead only after the leader stopped.
            probe = Etcd([etcd], 1.0)
            while probe.range(leader.key).get("kvs"):
                await asyncio.sleep(0.02)
            expired = time.monotonic() - cut_at
            await asyncio.sleep(0.3)
            assert changes and changes[-1][0] is False and "cut off" in leader.error
            return stepped, expired
        finally:
            stop.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            leader.close()

    stepped, expired = asyncio.run(scenario())
    assert stepped < expired and stepped < LEASE, (stepped, expired)


@needs_etcd
def test_a_leader_keeps_its_lease_while_an_interval_holds_the_event_loop(etcd, request):
    # A million users' first interval holds the event loop for tens of seconds of CPU work. The election runs in a
    # thread of its own (Elected.run), so the keepalives go out on time and the leader stays the leader; the loop
    # hears of the win on its own thread.
    prefix = _prefix(request)
    told: list[tuple[bool, bool]] = []

    class Led:
        learned = SimpleNamespace(ticks=0)

        def leadership_changed(self, leading: bool) -> None:
            told.append((leading, threading.current_thread() is threading.main_thread()))

    class NothingPublished:
        async def read(self, known: str | None = None) -> None:
            return None

    async def scenario() -> tuple[bool, int, float]:
        stop = asyncio.Event()
        election = Election(Etcd([etcd], 1.0), prefix, LEASE, identity="busy")
        role = Elected(election, NothingPublished())  # type: ignore[arg-type]
        role.attach(Led())  # type: ignore[arg-type]
        task = asyncio.create_task(role.run(stop))
        try:
            while not role.leads():
                await asyncio.sleep(0.02)
            assert election.elections == 1 and await role.take_over()  # the win's takeover, owed once
            assert not await role.take_over()
            end = time.monotonic() + 3 * LEASE
            while time.monotonic() < end:  # the event loop held by Python work, no await, for three leases
                sum(range(1000))
            held = role.leads()
            await asyncio.sleep(0.1)
            return held, election.elections, election.since
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            election.close()

    since = time.time()
    held, elections, won = asyncio.run(scenario())
    assert held and elections == 1 and won >= since
    assert told == [(True, True)]  # told once, on the loop's thread


# --------------------------------------------------------------------------- the learned state in etcd


@needs_etcd
def test_published_state_is_chunked_read_whole_and_only_the_leader_writes_it(etcd, request):
    prefix = _prefix(request)

    async def scenario() -> None:
        stop = asyncio.Event()
        leader = Election(Etcd([etcd], 1.0), prefix, LEASE, identity="writer")
        task = asyncio.create_task(leader.run(stop))
        dead = f"http://127.0.0.1:{free_port()}"  # an etcd member that is down: the next endpoint answers
        channel = StateChannel(Etcd([dead, etcd], 30.0), prefix, SECRET)
        try:
            while not leader.is_leader:
                await asyncio.sleep(0.02)
            blob = os.urandom(2_600_000)  # three chunks: etcd refuses a request over 1.5 MiB
            first = await channel.publish(leader.guard(), leader.fence, blob, {"by": "writer", "ticks": 7})
            assert first is not None
            got = await channel.read()
            assert got is not None and got.blob == blob and got.pointer["ticks"] == 7 and got.pointer["chunks"] == 3
            assert await channel.read(first) is None  # nothing newer than what the reader has
            second = await channel.publish(leader.guard(), leader.fence, b"small", {"by": "writer", "ticks": 8})
            assert second is not None and second > first
            got = await channel.read(first)
            assert got is not None and got.blob == b"small"
            keys = Etcd([etcd], 3.0).range(f"{prefix}/state/g/", range_end=_end(f"{prefix}/state/g/"), keys_only=True)
            names = sorted(base64.b64decode(kv["key"]).decode() for kv in keys.get("kvs", []))
            assert names == [f"{prefix}/state/g/{second}/000000"], names  # older generations deleted
            # A deposed leader (its guard no longer true) writes nothing, and the published state stays.
            deposed = leader.guard()
            stop.set()
            await task
            await leader.resign()
            assert await channel.publish(deposed, leader.fence, b"stale", {"by": "writer"}) is None
            got = await channel.read()
            assert got is not None and got.blob == b"small"
        finally:
            stop.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            leader.close()
            channel.close()

    asyncio.run(scenario())
    learned_bytes, extras = unpack(pack(b"npz", {"managed": {"a": {"host": "h"}}}))
    assert learned_bytes == b"npz" and extras == {"managed": {"a": {"host": "h"}}}


def _end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return dict(json.loads(resp.read()))


@needs_etcd
def test_an_etcd_with_authentication_is_reached_as_its_user_with_the_password_from_the_environment(tmp_path, monkeypatch):
    with running_etcd(tmp_path) as url:
        for path, body in (("auth/role/add", {"name": "root"}), ("auth/user/add", {"name": "root", "password": "pw-0123456789"}),
                           ("auth/user/grant", {"user": "root", "role": "root"}), ("auth/enable", {})):
            _post(f"{url}/v3/{path}", body)
        settings = LeaderSettings(etcd=[url], lease=LEASE, username="root", name="auth")
        monkeypatch.delenv("RECONCILER_ETCD_PASSWORD", raising=False)
        with pytest.raises(SecretError, match="RECONCILER_ETCD_PASSWORD holds no password"):
            Etcd.from_settings(settings, str(tmp_path), 2.0)
        monkeypatch.setenv("RECONCILER_ETCD_PASSWORD", "wrong-password")
        with pytest.raises(Etcd3Exception) as err:
            Etcd.from_settings(settings, str(tmp_path), 2.0).range("/x")
        assert "authentication failed" in failure(err.value), failure(err.value)
        monkeypatch.setenv("RECONCILER_ETCD_PASSWORD", "pw-0123456789")
        client = Etcd.from_settings(settings, str(tmp_path), 2.0)
        with pytest.raises(Etcd3Exception):  # without the token: refused
            Etcd([url], 2.0).range("/x")

        async def scenario() -> None:
            stop = asyncio.Event()
            election = Election(client, settings.prefix, settings.lease, identity="authed")
            task = asyncio.create_task(election.run(stop))
            try:
                deadline = time.monotonic() + 10
                while not election.is_leader:
                    assert time.monotonic() < deadline, election.error
                    await asyncio.sleep(0.02)
                client.clients[0].session.headers["Authorization"] = "expired"  # as after an etcd restart
                channel = StateChannel(client, settings.prefix, SECRET)
                assert await channel.publish(election.guard(), election.fence, b"state", {"by": "authed"}) is not None
                got = await channel.read()
                assert got is not None and got.blob == b"state"
                channel.close()
            finally:
                stop.set()
                await asyncio.gather(task, return_exceptions=True)
                await election.resign()
                election.close()

        asyncio.run(scenario())


# --------------------------------------------------------------------------- fencing on the servers


def _fake_cluster(tmp_path: Path, users: tuple[str, ...]) -> Cluster:
    engine = tmp_path / "engine" / "sing-box"
    if not engine.exists():
        engine.parent.mkdir(parents=True, exist_ok=True)
        engine.write_bytes(fake_engine("1.14.4"))
        engine.chmod(0o755)
    return Cluster.model_validate({
        "settings": {"engine": {"binary": str(engine)}, "harden": False},
        "servers": [{"name": "a", "host": "192.0.2.1", "country": "DE",
                     "inbounds": [{"id": "a-ss", "name": "S", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"}]}],
        "routes": [{"id": "r", "name": "R"}], "users": [{"name": u} for u in users]})


def test_the_lock_script_refuses_an_older_fence_under_the_lock_before_anything_changes(tmp_path):
    runner = FakeRunner(tmp_path / "hosts")
    host = runner.host("a")
    t = Target("a", "192.0.2.1")

    def acquire(**extra: object) -> dict[str, object]:
        req = {"op": "acquire", "lock": LOCK_DIR, "holder_file": LOCK_FILE, "holder": "{}", "dirs": ["/etc/x"], **extra}
        return dict(json.loads(asyncio.run(runner.script(t, remote.LOCK, req)).stdout))

    def release() -> None:
        asyncio.run(runner.script(t, remote.LOCK, {"op": "release", "lock": LOCK_DIR}))

    assert acquire(fence=7, fence_file=FENCE_FILE) == {"ok": True}
    assert host.read(FENCE_FILE) == b"7\n" and host.path(LOCK_DIR).is_dir()
    release()
    refused = acquire(fence=5, fence_file=FENCE_FILE)
    assert refused == {"ok": False, "refused": "refused: a newer controller (fence 7) has applied here; this one "
                                               "(fence 5) is not the leader"}, refused
    assert not host.path(LOCK_DIR).exists() and host.read(FENCE_FILE) == b"7\n"  # the lock given back, nothing changed
    assert acquire(fence=7, fence_file=FENCE_FILE) == {"ok": True}  # the same leader again
    release()
    assert acquire() == {"ok": True}  # unfenced (no election; an operator's `apply`): allowed
    assert host.read(FENCE_FILE) == b"7\n"
    assert acquire(fence=9, fence_file=FENCE_FILE)["ok"] is False  # held (by the unfenced one): no fence recorded
    assert host.read(FENCE_FILE) == b"7\n"
    release()
    assert acquire(fence=9, fence_file=FENCE_FILE) == {"ok": True} and host.read(FENCE_FILE) == b"9\n"


def test_a_deposed_leaders_apply_is_refused_by_the_server_and_by_itself(tmp_path):
    runner = FakeRunner(tmp_path / "hosts")
    host = runner.host("a")
    config = LAYOUT.template  # the engine's configuration as the commit writes it

    def apply(c: Cluster, fence: Fence | None) -> list:  # type: ignore[type-arg]
        async def go() -> list:  # type: ignore[type-arg]
            observed = await observe(c, SECRET, runner, ".", False, None, 1.8e9)
            try:
                return await apply_all(observed, runner, lambda server, phase: None, verify_timeout=5.0, fence=fence)
            finally:
                await runner.close()

        return asyncio.run(go())

    [r] = apply(_fake_cluster(tmp_path, ("alice",)), Fence(40))
    assert r.ok, r.message
    assert host.read(FENCE_FILE) == b"40\n"
    before = host.read(config)
    assert before is not None
    # A newer leader (fence 41) applies; the old one (fence 40) comes back with a change of its own: refused.
    [r] = apply(_fake_cluster(tmp_path, ("alice", "bob")), Fence(41))
    assert r.ok, r.message
    after_new = host.read(config)
    [r] = apply(_fake_cluster(tmp_path, ("alice", "bob", "carol")), Fence(40))
    assert not r.ok and r.phase == "lock", r
    assert "refused: a newer controller (fence 41) has applied here; this one (fence 40) is not the leader" in r.message
    assert host.read(config) == after_new and host.read(FENCE_FILE) == b"41\n" and not host.path(LOCK_DIR).exists()
    # A leader that knows it was deposed stops before the lock (and before the commit).
    [r] = apply(_fake_cluster(tmp_path, ("alice", "bob", "carol")), Fence(42, lambda: False))
    assert not r.ok and "no longer the leader" in r.message and host.read(FENCE_FILE) == b"41\n"
    assert host.read(config) == after_new


# --------------------------------------------------------------------------- real `reconciler run` processes


def _cluster_text(etcd: str, name: str, dead_port: int, lease: float = LEASE) -> str:
    # Servers on a loopback port nobody listens on: collection and planning fail fast, and stay on this machine.
    return (f"settings:\n  health: {{report_interval: 1s}}\n  plan_interval: 30s\n"
            f"  leader: {{etcd: [\"{etcd}\"], lease: {lease}s, name: {name}}}\n"
            "servers:\n"
            f"  - {{name: a, host: 127.0.0.1, ssh: {{port: {dead_port}}}, country: DE, inbounds: "
            "[{id: a-in, name: A, protocol: shadowsocks-2022, port: 8388}]}\n"
            f"  - {{name: b, host: 127.0.0.1, ssh: {{port: {dead_port}}}, country: DE, inbounds: "
            "[{id: b-in, name: B, protocol: shadowsocks-2022, port: 8389}]}\n"
            "users:\n  - name: alice\n")


def _checkout(tmp_path: Path, name: str, text: str) -> Path:
    """One controller's own checkout of the same file (its own state folder beside it)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "cluster.yaml").write_text(text)
    return folder / "cluster.yaml"


@contextlib.contextmanager
def _controllers(tmp_path: Path, text: str, seconds: float) -> Iterator[Callable[[str], LoopProcess]]:
    """Starts `reconciler run` on checkout ``name`` of the same file (``a``, ``b``; its log at tmp_path/NAME.log,
    killed after ``seconds``); every process it started is stopped on the way out (SIGCONT first, if stopped)."""
    files = {n: _checkout(tmp_path, n, text) for n in ("a", "b")}
    procs: list[LoopProcess] = []

    def start(name: str) -> LoopProcess:
        p = LoopProcess(files[name], f"127.0.0.1:{free_port()}", seconds, log_path=tmp_path / f"{name}.log")
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
            p.stop(signal.SIGKILL if p.proc.poll() is None else signal.SIGTERM, timeout=10)


def _leader(proc: LoopProcess) -> dict[str, object]:
    st = proc.status()
    leader = st.get("leader")
    return leader if isinstance(leader, dict) else {}


def _wait(predicate, timeout: float, poll: float = 0.05):  # type: ignore[no-untyped-def]
    return wait_until(predicate, timeout, poll)


@needs_etcd
def test_two_controllers_one_leads_a_killed_or_stopped_leader_is_replaced_and_comes_back_as_standby(
        etcd, tmp_path, monkeypatch):
    monkeypatch.setenv("RECONCILER_SECRET", SECRET_TEXT)
    text = _cluster_text(etcd, f"procs-{os.getpid()}", free_port())
    token = user_token(SECRET, "alice")

    def serves(p: LoopProcess) -> bool:
        return p.get(f"/sub/{token}/links")[0] == 200

    with _controllers(tmp_path, text, 300) as start:
        a = start("a")
        assert _wait(lambda: _leader(a).get("role") == "leader" and _leader(a)["state"]["ticks"] >= 2, 60), \
            (tmp_path / "a.log").read_text()[-3000:]
        b = start("b")
        # b names a as the leader once its first look at etcd answered (under load that can take a few rounds)
        st = _wait(lambda: (lb := _leader(b)).get("role") == "standby" and (lb["state"]["ticks"] or 0) >= 3
                   and lb["leader"] == _leader(a).get("identity") and lb, 60)
        assert st, (_leader(a), _leader(b), (tmp_path / "a.log").read_text()[-2000:], (tmp_path / "b.log").read_text()[-2000:])
        assert st["state"]["published_by"] == _leader(a)["identity"]
        assert serves(a) and serves(b)  # both answer subscriptions; the standby from the leader's state
        assert b.get("/healthz")[0] == 200 and b"ok: standby" in b.get("/healthz")[1]
        assert b'reconciler_leader{identity="' in b.get("/metrics")[1]

        # 1. SIGKILL the leader: the standby leads within two leases and continues its learned state.
        old = _leader(a)
        fence_a, ticks_a = int(old["fence"]), int(old["state"]["ticks"])
        a.kill()
        killed, killed_at = time.monotonic(), time.time()
        seen_serving = []
        while _leader(b).get("role") != "leader":
            seen_serving.append(serves(b))
            assert time.monotonic() - killed < 3 * LEASE + 5, (tmp_path / "b.log").read_text()[-3000:]
        takeover = float(_leader(b)["since"]) - killed_at  # when it won, by its own clock (this machine's): no polling lag
        assert takeover < 2 * LEASE, takeover
        assert all(seen_serving), "the standby stopped answering subscriptions during the takeover"
        st = _wait(lambda: (lb := _leader(b)).get("state", {}).get("generation") and lb["state"]["published_by"] == lb["identity"]
                   and lb, 20)
        assert st and int(st["fence"]) > fence_a, st
        assert int(st["state"]["ticks"]) > ticks_a, (st, ticks_a)  # counting on from the published state, not from 0
        log_b = (tmp_path / "b.log").read_text()
        assert "leading from interval" in log_b and "published by" in log_b, log_b[-3000:]

        # 2. The old checkout starts again: a standby now. Then the leader is stopped (SIGSTOP: cut off, its lease
        #    not renewed): the standby leads; SIGCONT: the old leader finds its lease gone and stands by.
        a2 = start("a")
        assert _wait(lambda: _leader(a2).get("role") == "standby" and _leader(a2).get("leader") == _leader(b)["identity"], 60)
        fence_b = int(_leader(b)["fence"])
        b.proc.send_signal(signal.SIGSTOP)
        stopped, stopped_at = time.monotonic(), time.time()
        while _leader(a2).get("role") != "leader":
            assert serves(a2)
            assert time.monotonic() - stopped < 3 * LEASE + 5, (tmp_path / "a.log").read_text()[-3000:]
        takeover2 = float(_leader(a2)["since"]) - stopped_at
        assert takeover2 < 2 * LEASE, takeover2
        assert int(_leader(a2)["fence"]) > fence_b
        b.proc.send_signal(signal.SIGCONT)
        assert _wait(lambda: _leader(b).get("role") == "standby", 2 * LEASE), (tmp_path / "b.log").read_text()[-3000:]
        time.sleep(1.5)
        assert _leader(a2).get("role") == "leader" and _leader(b).get("role") == "standby"
        assert serves(a2) and serves(b)
        log_b = (tmp_path / "b.log").read_text()
        assert "no longer the leader" in log_b, log_b[-3000:]
        assert "applying:" not in log_b  # it never reached a server (none answers here; the fence test shows the rest)

        # 3. A clean stop of the leader resigns: the standby leads at its next look, well within one lease.
        stopped_at = time.time()
        a2.stop()
        assert _wait(lambda: _leader(b).get("role") == "leader", 2 * LEASE)
        handover = float(_leader(b)["since"]) - stopped_at  # from the SIGTERM: its last publish, resign and exit included
        print(f"takeover after SIGKILL {takeover:.2f}s, after SIGSTOP {takeover2:.2f}s, after SIGTERM {handover:.2f}s "
              f"(lease {LEASE}s)")
        assert b.stop() == 0


# --------------------------------------------------------------------------- the learned numbers carried over


def _loop_file(tmp_path: Path, name: str, etcd: str, prefix_name: str) -> tuple[str, int, int]:
    folder = tmp_path / name
    folder.mkdir()
    port, ops = free_port(), free_port()
    path = folder / "cluster.yaml"
    path.write_text(f'settings:\n  self_heal: false\n  outputs: {{listen: "127.0.0.1:{port}", operations_listen: "127.0.0.1:{ops}"}}\n'
                    f"  health: {{report_interval: 1s}}\n  leader: {{etcd: [\"{etcd}\"], lease: {LEASE}s, name: {prefix_name}}}\n"
                    "servers:\n"
                    "  - {name: a, host: 198.18.0.10, country: DE, inbounds: [{id: a-in, name: A, protocol: shadowsocks-2022, port: 8388}]}\n"
                    "  - {name: b, host: 198.18.0.11, country: DE, inbounds: [{id: b-in, name: B, protocol: shadowsocks-2022, port: 8388}]}\n"
                    "users:\n  - name: alice\n")
    return str(path), port, ops


def _reporting_loops(tmp_path: Path, etcd: str, agent: str) -> dict[str, Loop]:
    """Two controllers' Loops (``x``, ``y``) in one election over the same fake hosts, whose agents run ``agent``
    (observed and planned, never applied to: self_heal is off)."""
    runner = FakeRunner(tmp_path / "hosts")
    for server in ("a", "b"):
        install_agent(runner, server, agent)
    loops: dict[str, Loop] = {}
    for n in ("x", "y"):
        path, port, _ = _loop_file(tmp_path, n, etcd, f"loops-{os.getpid()}")
        cluster = load_cluster(path).cluster
        assert cluster is not None
        loops[n] = Loop(path, cluster, SECRET, listen=f"127.0.0.1:{port}", watch=False, runner=runner)
    return loops


def _capture_publishes(loops: dict[str, Loop]) -> dict[str, list[bytes]]:
    """Every blob each loop publishes (and etcd took), per loop, in order."""
    published: dict[str, list[bytes]] = {"x": [], "y": []}
    for n, loop in loops.items():
        assert isinstance(loop.role, Elected)
        real = loop.role.channel.publish_sync

        def capture(guard, fence, blob, meta, real=real, n=n):  # type: ignore[no-untyped-def]
            got = real(guard, fence, blob, meta)
            if got is not None:
                published[n].append(blob)
            return got

        loop.role.channel.publish_sync = capture  # type: ignore[method-assign]
    return published


async def _publishing_leader(loops: dict[str, Loop], published: dict[str, list[bytes]]) -> str:
    """The loop that leads once it has published four times (within 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        leaders = [n for n, loop in loops.items() if loop.role.leads()]
        if leaders and len(published[leaders[0]]) >= 4:
            return leaders[0]
        assert time.monotonic() < deadline, "no leader publishing"
        await asyncio.sleep(0.05)


async def _cut_off_and_take_over(old: Loop, new: Loop, cut: Path, channel: bool = True) -> float:
    """Cuts the old leader off from etcd (its calls fail as in a network cut, from the time written to ``cut``); the
    seconds until the standby leads (the old one gives up within a lease). ``channel=False``: the election only (its
    state goes elsewhere, which it still reaches)."""
    assert isinstance(old.role, Elected) and isinstance(new.role, Elected)
    assert old.role.election is not None and new.role.election is not None

    def unreachable(fn):  # type: ignore[no-untyped-def]
        raise ConnectionFailedError("network cut (test)")

    old.role.election.etcd.call = unreachable  # type: ignore[method-assign]
    if channel:
        old.role.channel.etcd.call = unreachable  # type: ignore[attr-defined]
    cut.write_text(repr(time.time()))
    cut_at = time.monotonic()
    while not new.role.election.is_leader:
        assert not old.role.election.is_leader or time.monotonic() - cut_at < LEASE
        assert time.monotonic() - cut_at < 3 * LEASE, "no takeover"
        await asyncio.sleep(0.01)
    took = time.monotonic() - cut_at
    assert not old.role.election.is_leader
    return took


async def _network_cut(loops: dict[str, Loop], published: dict[str, list[bytes]],
                       cut: Path, channel: bool = True) -> tuple[Learned, Learned, float]:
    """Runs both loops until one leads and publishes, cuts it off, and lets the standby lead for two intervals: (the
    old leader's last published state, the new leader's learned state, the takeover's seconds)."""
    runs = {n: asyncio.create_task(loop.run()) for n, loop in loops.items()}
    try:
        leader = await _publishing_leader(loops, published)
        other = "y" if leader == "x" else "x"
        old, new = loops[leader], loops[other]
        assert isinstance(old.role, Elected) and isinstance(new.role, Elected)
        assert old.role.election is not None and new.role.election is not None
        await asyncio.sleep(1.2)
        assert not new.role.election.is_leader and new.learned.ticks >= 2  # the standby follows the published state
        took = await _cut_off_and_take_over(old, new, cut, channel)
        last = Learned.from_bytes(unpack(published[leader][-1])[0])
        while len(published[other]) < 2:  # two intervals of its own
            await asyncio.sleep(0.05)
        return last, new.learned, took
    finally:
        for loop in loops.values():
            loop.stop.set()
        await asyncio.wait_for(asyncio.gather(*runs.values(), return_exceptions=True), 30)


def counting_agent(cut: Path) -> str:
    """Each server's agent: cumulative bytes at 40 Mbps, then 8 Mbps once the leader is cut off (from the time written
    to ``cut``)."""
    return (f"import json, os, sys, time\nreq = json.load(sys.stdin)\nstarted, cut = {time.time()!r}, {str(cut)!r}\n"
            "t = time.time()\nfast_until = float(open(cut).read()) if os.path.exists(cut) else t\n"
            "down = int(5e6 * (min(t, fast_until) - started) + 1e6 * max(0.0, t - fast_until))\n"
            "print(json.dumps({'service': 'active', 'listeners': {'8388/tcp': True, '8388/udp': True},\n"
            "                  'traffic': {'up': 0, 'down': down},\n"
            "                  'probes': {p['id']: {'ok': True, 'rtt_ms': 1.0} for p in req.get('probes', [])}}))\n")


def _assert_continued(last: Learned, now: Learned, took: float) -> None:
    """The new leader took over within two leases and went on from the old one's published capacities, counters
    and evaluations (none re-learned from zero)."""
    assert took < 2 * LEASE, took
    assert not np.isnan(last.capacity.peak).any() and (last.capacity.peak > 30).all(), last.capacity.peak
    np.testing.assert_array_equal(now.capacity.peak, last.capacity.peak)  # not re-learned from zero
    np.testing.assert_array_equal(now.capacity.peak_time, last.capacity.peak_time)
    assert now.ticks >= last.ticks + 2
    assert all(now.bytes_total[s] > last.bytes_total[s] > 0 for s in ("a", "b"))
    assert now.health.evaluations >= last.health.evaluations + 2


@needs_etcd
def test_the_new_leader_continues_the_capacities_streaks_and_counters_the_old_one_published(etcd, tmp_path):
    # The old leader is cut off from etcd (a network cut); the standby takes over with the same capacity peaks.
    cut = tmp_path / "cut-at"
    loops = _reporting_loops(tmp_path, etcd, counting_agent(cut))
    published = _capture_publishes(loops)
    last, now, took = asyncio.run(_network_cut(loops, published, cut))
    _assert_continued(last, now, took)
    print(f"takeover after a network cut: {took:.2f}s (lease {LEASE}s)")
