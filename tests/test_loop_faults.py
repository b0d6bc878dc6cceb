"""The loop survives faults and tells the truth about them (/healthz, metrics), and saves its
state on every exit path.

The real ``Loop.run`` runs in-process with its HTTP server on loopback, against the fake runner whose hosts'
agents answer (``tests.fake_agents``); faults come in through the loop's seams (its runner, clock, role and
collection), never by replacing a method of the loop. The lab tests (tests/lab/) inject the same faults on
real hosts.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from pathlib import Path

from reconciler.config import load_cluster
from reconciler.credentials import Secret
from reconciler.lab.demo import free_port
from reconciler.loop.clock import Clock, FakeClock, SystemClock
from reconciler.loop.collect import Collection
from reconciler.loop.role import Elected, Role
from reconciler.loop.service import Loop
from reconciler.ssh.fake import FakeRunner
from tests.fake_agents import HEALTHY, install_agent

SECRET = Secret(b"loop-faults-test-secret-0123456789")


def write_cluster(tmp_path) -> tuple[str, int, int]:
    """(the cluster file, its public port, its operations port: health with reasons, metrics)."""
    path = tmp_path / "cluster.yaml"
    port, ops = free_port(), free_port()
    path.write_text(f'settings:\n  self_heal: false\n  outputs: {{listen: "127.0.0.1:{port}", operations_listen: "127.0.0.1:{ops}"}}\n'
                    '  health: {report_interval: 1s}\n'
                    "servers:\n"
                    "  - {name: a, host: 198.18.0.10, country: DE, inbounds: [{id: a-in, name: A, protocol: shadowsocks-2022, port: 8388}]}\n"
                    "  - {name: b, host: 198.18.0.11, country: DE, inbounds: [{id: b-in, name: B, protocol: shadowsocks-2022, port: 8388}]}\n"
                    "users:\n  - name: alice\n")
    return str(path), port, ops


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:  # not listening yet
        return 0, ""


def make_loop(path: str, port: int, clock: Clock | None = None, agent: str = HEALTHY, role: Role | None = None) -> Loop:
    """The loop over fake hosts (observed and planned, never applied to: self_heal is off) whose agents answer."""
    cluster = load_cluster(path).cluster
    assert cluster is not None
    runner = FakeRunner(Path(path).parent / "hosts")
    for s in cluster.servers:
        install_agent(runner, s.name, agent)
    return Loop(path, cluster, SECRET, listen=f"127.0.0.1:{port}", watch=False, clock=clock, runner=runner, role=role)


async def watch(ops: int, loop: Loop, until: float, probe) -> list[tuple[int, str]]:  # type: ignore[no-untyped-def]
    """/healthz seen every 0.2 s while ``probe`` has not returned True (bounded by ``until``)."""
    seen = []
    while time.monotonic() < until and not loop.stop.is_set():
        seen.append(await asyncio.to_thread(get, f"http://127.0.0.1:{ops}/healthz"))
        if probe(seen):
            break
        await asyncio.sleep(0.2)
    return seen


class FailingOnce(Collection):
    """The real collection (the fake hosts' agents answer), but interval 2 meets a bug."""

    calls = 0

    async def collect(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        FailingOnce.calls += 1
        if FailingOnce.calls == 2:
            raise RuntimeError("a bug in one interval")
        return await super().collect(*args, **kwargs)


class TickerFails(SystemClock):
    """The system's clock, but the interval timer's third wait fails: the tick task itself crashes."""

    def __init__(self) -> None:
        self.stop: asyncio.Event | None = None  # the loop's
        self.waits = 0

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        if event is self.stop:  # the interval timer (no deadline task here): the planner waits on plan_now
            self.waits += 1
            if self.waits == 3:
                raise SystemError("the tick task itself fails")
        return await super().wait(event, seconds)


def test_a_failing_interval_and_a_crashing_task_are_survived_told_and_counted(tmp_path):
    # spec: HEALTH-1 — intervals continue; /healthz says what failed until it runs cleanly again
    path, port, ops = write_cluster(tmp_path)
    cluster = load_cluster(path).cluster
    assert cluster is not None
    runner = FakeRunner(Path(path).parent / "hosts")
    for s in cluster.servers:
        install_agent(runner, s.name, HEALTHY)
    FailingOnce.calls = 0
    clock = TickerFails()
    loop = Loop(path, cluster, SECRET, listen=f"127.0.0.1:{port}", watch=False, runner=runner, clock=clock,
                collection=FailingOnce)
    clock.stop = loop.stop

    async def scenario() -> tuple[int, list[tuple[int, str]], str]:
        runner = asyncio.create_task(loop.run())
        seen = await watch(ops, loop, time.monotonic() + 30, lambda s: FailingOnce.calls >= 7 and s[-1][0] == 200)
        metrics = await asyncio.to_thread(get, f"http://127.0.0.1:{ops}/metrics")
        loop.stop.set()
        return await asyncio.wait_for(runner, 30), seen, metrics[1]

    rc, seen, metrics = asyncio.run(scenario())
    assert rc == 0
    bodies = [b for code, b in seen if code == 503]
    assert any("interval 2 failed: RuntimeError" in b for b in bodies), seen
    assert any("failed and restarting: the tick task" in b for b in bodies), seen
    assert seen[-1][0] == 200 and FailingOnce.calls >= 7  # it recovered and went on ticking
    assert 'reconciler_task_failures_total{task="tick"} 1.0' in metrics
    assert 'reconciler_reconcile_total{kind="collect",result="error"} 1.0' in metrics
    # State is saved on the way out.
    state = tmp_path / ".reconciler" / "learned.npz"
    assert state.exists() and oct(state.stat().st_mode & 0o777) == "0o600"


def test_state_is_saved_even_when_the_loop_is_stopped_mid_interval(tmp_path):
    path, port, ops = write_cluster(tmp_path)
    started = Path(path).parent / "agent-started"
    # Every agent hangs (a stuck server): the stop below comes in the middle of the interval's collection.
    loop = make_loop(path, port, agent=f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n")

    async def scenario() -> int:
        runner = asyncio.create_task(loop.run())
        for _ in range(200):
            if started.exists():
                break
            await asyncio.sleep(0.1)
        assert started.exists()
        loop.stop.set()
        return await asyncio.wait_for(runner, 30)

    assert asyncio.run(scenario()) == 0
    assert (tmp_path / ".reconciler" / "learned.npz").exists()


def test_a_big_learned_state_is_saved_at_most_every_five_minutes_and_always_at_a_stop(tmp_path, monkeypatch):
    # A big learned state (a million users: ~50 MB) is written after an interval only when BIG_STATE_EVERY has
    # passed since the last write; a small one after every interval; every stop writes it. What is on disk is
    # always a whole state that reads back.
    import reconciler.loop.service as service
    from reconciler.fleet.learned import Learned

    path, port, ops = write_cluster(tmp_path)
    clock = FakeClock(start=time.time())
    loop = make_loop(path, port, clock)
    learned_file = tmp_path / ".reconciler" / "learned.npz"

    def ticks_on_disk() -> int:
        return Learned.from_bytes(learned_file.read_bytes()).ticks

    async def intervals(n: int, step: float) -> None:
        for _ in range(n):
            clock.advance(step)
            assert await loop.tick() is not None

    asyncio.run(intervals(3, 60))
    assert ticks_on_disk() == 3  # small: every interval
    monkeypatch.setattr(service, "BIG_STATE_BYTES", 1)  # every state written is big now
    asyncio.run(intervals(4, 60))
    assert ticks_on_disk() == 3  # 240 s since the last write: not yet
    asyncio.run(intervals(1, 60))
    assert ticks_on_disk() == 8  # 300 s since the last write
    asyncio.run(intervals(2, 60))
    assert ticks_on_disk() == 8
    loop._save()  # what every stop calls
    assert ticks_on_disk() == 10


def test_a_leader_serializes_its_learned_state_once_an_interval_for_the_folder_and_the_publish(tmp_path, monkeypatch):
    # A leader writes its state to the folder and publishes it to etcd after each interval: one serialization
    # (a million users' state took ~1 CPU-s to serialize), the same bytes in both; nothing kept after the publish.
    # The election and the channel are stand-ins here: tests/test_leader.py runs the real ones against etcd.
    from types import SimpleNamespace

    from reconciler.fleet.learned import Learned
    from reconciler.loop.leader import unpack

    path, port, ops = write_cluster(tmp_path)
    leading = SimpleNamespace(is_leader=True, on_change=None)  # an election won, never asked again
    loop = make_loop(path, port, role=Elected(leading, object()))  # type: ignore[arg-type]
    calls = [0]
    real = Learned.to_bytes

    def counting(self: Learned) -> bytes:
        calls[0] += 1
        return real(self)

    monkeypatch.setattr(Learned, "to_bytes", counting)
    assert asyncio.run(loop.tick()) is not None
    assert calls[0] == 1
    assert isinstance(loop.role, Elected)
    blob = loop.role.bundle()
    assert calls[0] == 1 and unpack(blob)[0] == (tmp_path / ".reconciler" / "learned.npz").read_bytes()
    assert loop._serialized is None  # the ~50 MB are not kept past the publish
    loop.role.bundle()
    assert calls[0] == 2  # nothing kept: a later bundle serializes the state as it is then


def test_healthz_names_what_failed_until_it_recovers(tmp_path):
    path, port, ops = write_cluster(tmp_path)
    loop = make_loop(path, port)
    loop._interval_error = "interval 1 failed: x"
    assert loop._healthy() == (False, "interval 1 failed: x")
    loop._interval_error = ""
    loop._failed["plan"] = time.time()
    assert loop._healthy()[0] is False and "plan" in loop._healthy()[1]
    loop._recovered("plan")
    assert "failed" not in loop._healthy()[1]
