"""Each server's verdict history (when it changed, to what, why): bounded, kept across restarts and takeovers, and
shown by `status SERVER`."""

from __future__ import annotations

import asyncio
import json
import random
import re

import numpy as np

from reconciler.credentials import Secret
from reconciler.fleet.history import KEEP_CHANGES, KEEP_SECONDS, History
from reconciler.fleet.learned import Learned
from reconciler.health.topology import Topology
from reconciler.health.verdicts import NO_DATA, OK, STATUS_NAMES, UNREACHABLE
from reconciler.loop.clock import FakeClock
from reconciler.loop.service import Loop
from tests.fake_agents import HEALTHY, install_agent, shadowsocks_fleet

SECRET = Secret(b"history-test-secret-0123456789abcdef")


class _Verdicts:
    """What History reads of an interval's verdicts: the servers' status codes, and a reason when one changes."""

    def __init__(self, topology: Topology, codes: np.ndarray) -> None:
        self.topology, self.server_status = topology, codes

    def server(self, name: str):  # type: ignore[no-untyped-def]
        return type("SV", (), {"reason": f"{name} is {STATUS_NAMES[int(self.server_status[self.topology.servers.index(name)])]}"})


def test_a_flapping_server_over_weeks_of_intervals_keeps_a_bounded_week():
    # spec: HEALTH-13 — a fleet of three, one server flapping at random for 30 days of minute intervals
    topo = Topology(servers=("a", "b", "c"), countries=("DE", "DE", "RU"), probers=(False, False, False),
                    inbounds=("a-in", "b-in", "c-in"), inbound_server=(0, 1, 2))
    rng = random.Random(29)
    history, now, flips = History(), 1_800_000_000.0, 0
    codes = np.array([OK, OK, OK], np.int8)
    for _ in range(30 * 1440):
        now += 60
        if rng.random() < 0.05:
            codes[2] = rng.choice([OK, UNREACHABLE, NO_DATA])
            flips += 1
        history.observe(_Verdicts(topo, codes.copy()), now)  # type: ignore[arg-type]
        assert len(history.changes["c"]) <= KEEP_CHANGES
    c = history.of("c", now)
    assert c[0][0].at <= now - KEEP_SECONDS or len(c) == KEEP_CHANGES  # the change in force at the window's start
    assert all(x.at >= now - KEEP_SECONDS for x, _ in c[1:])
    assert all(a.status != b.status for (a, _), (b, _) in zip(c, c[1:], strict=False))  # changes only
    assert sum(lasted for _, lasted in c) == now - c[0][0].at  # the durations add up to the span shown
    assert [x.status for x, _ in history.of("a", now)] == ["ok"]  # a steady server: one entry, its first
    # What a state file says of it is hostile input: only well-formed, ordered changes of known servers.
    back = History.from_json(json.loads(json.dumps(history.to_json())), topo.servers)
    assert back.changes == history.changes
    junk = {"c": [[1.0, "ok", "x"], [0.5, "ok", "earlier"], ["x", "ok", ""], [2.0, "owned", ""], [float("nan"), "ok", ""]],
            "zz": [[1.0, "ok", ""]], "a": "nope"}
    assert History.from_json(junk, topo.servers).to_json() == {"c": [[1.0, "ok", "x"]]}


def test_the_history_survives_a_restart_and_status_shows_it(tmp_path, cli):
    path, cluster, runner = shadowsocks_fleet(tmp_path, "ab")
    for name in "ab":
        install_agent(runner, name, HEALTHY)
    runner.host("b").reachable = False
    clock = FakeClock()
    loop = Loop(str(path), cluster, SECRET, watch=False, runner=runner, clock=clock)

    async def intervals(n: int) -> None:
        for _ in range(n):
            assert await loop.tick() is not None
            clock.advance(60)
    asyncio.run(intervals(3))
    runner.host("b").reachable = True
    loop.collection.backoff.failures.clear()
    loop.collection.backoff.next_try.clear()
    asyncio.run(intervals(2))
    loop._save()
    saved = Learned.from_bytes((tmp_path / ".reconciler" / "learned.npz").read_bytes())  # what a restart reads
    assert [c.status for c in saved.history.changes["b"]] == ["no_data", "ok"]
    assert saved.history.changes["b"][0].reason.startswith("no data — SSH unreachable")
    assert saved.history.changes == loop.learned.history.changes  # and a standby, which gets the same bytes
    run = cli("status", "b", "-o", "json", "-f", str(path))
    doc = json.loads(run.out)
    assert [h["status"] for h in doc["history"]] == ["no_data", "ok"] and doc["history"][0]["for_seconds"] == 180
    table = cli("status", "b", "-f", str(path)).out
    assert "verdicts of the last 7 days:" in table, table
    assert re.search(r"no_data +for 3m  — no data — SSH unreachable", table), table
