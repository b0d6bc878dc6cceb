"""Users' usage, limits and standing (issue 16): reset periods, the file's errors, the ledger that turns the
servers' kernel counters into each user's bytes (simulated over thousands of intervals against ground truth),
the standing that decides who is served, the plan's reasons, the events, and the loop's enforcement.

The lab test (tests/lab/test_users.py) measures the same path against real clients on real hosts; these run
the pure parts through every case a fleet meets, fast."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import random
import threading
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

import reconciler.fleet.reports as reports_module
from reconciler.balance import Snapshot
from reconciler.config import load_cluster
from reconciler.credentials import Secret, user_credentials
from reconciler.engine.adapters import desired
from reconciler.engine.base import MARK_BASE, mark_key, usage_marks
from reconciler.fleet import parse_report
from reconciler.fleet.counters import HEADER_BYTES, owner_id
from reconciler.fleet.events import user_events
from reconciler.fleet.reports import KIND_OF, CounterRows
from reconciler.fleet.usage import Ledger
from reconciler.loop.clock import FakeClock
from reconciler.model import Cluster, UserUsage
from reconciler.model.cluster import Reset
from reconciler.plan.actions import withheld_text
from reconciler.ssh.fake import FakeRunner
from reconciler.subscriptions import render
from tests.fake_agents import answering, install_agent

SECRET = Secret(b"users-usage-test-secret-0123456789")
MB = 1_000_000


def ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


def cluster(users: list[dict], servers: int = 2, **users_settings: object) -> Cluster:
    return Cluster.model_validate({
        "settings": {"users": users_settings} if users_settings else {},
        "servers": [{"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": "DE",
                     "inbounds": [{"id": f"s{i}-in", "name": f"S{i}", "protocol": "trojan", "port": 8443, "route": "r",
                                   "tls": {"server_name": "www.example.com"}}]} for i in range(servers)],
        "routes": [{"id": "r", "name": "R"}], "users": users})


# ------------------------------------------------------------------ periods and the file


@pytest.mark.parametrize(("reset", "now", "start", "end"), [
    ("monthly", ts(2026, 2, 20, 12), ts(2026, 2, 1), ts(2026, 3, 1)),
    ({"period": "monthly", "day": 31}, ts(2026, 2, 20), ts(2026, 1, 31), ts(2026, 2, 28)),  # a short month: its last day
    ({"period": "monthly", "day": 31}, ts(2026, 2, 28), ts(2026, 2, 28), ts(2026, 3, 31)),
    ({"period": "monthly", "day": 15}, ts(2026, 1, 3), ts(2025, 12, 15), ts(2026, 1, 15)),  # across a year
    ({"period": "monthly", "day": 15}, ts(2026, 12, 15), ts(2026, 12, 15), ts(2027, 1, 15)),  # at the boundary
    ({"period": "weekly", "day": "friday"}, ts(2026, 2, 20, 23), ts(2026, 2, 20), ts(2026, 2, 27)),
    ("weekly", ts(2026, 11, 30, 8), ts(2026, 11, 30), ts(2026, 12, 7)),  # a Monday
    ("never", ts(2026, 2, 20), 0.0, None),
])
def test_reset_periods(reset, now, start, end):
    assert Reset.model_validate(reset).bounds(now) == (start, end)


@pytest.mark.parametrize(("line", "col", "message"), [
    ("data_limit: lots", 17, "'lots' is not a size; write it like 500MB"),
    ("reset: {period: monthly, day: 32}", 12, "a monthly reset needs a day of the month from 1 to 31, not 32"),
    ("reset: {period: weekly, day: funday}", 12, "not 'funday' — did you mean 'sunday'?"),
    ("reset: fortnightly", 12, "'fortnightly' is not allowed"),
    ("device_limit: -1", 19, "device_limit: -1 is out of range (must be at least 1)"),
    ("expires: 2026-13-01", 14, "'2026-13-01' is not a valid date: month must be in 1..12"),
])
def test_bad_user_fields_are_told_where_and_what(tmp_path, line, col, message):
    path = tmp_path / "c.yaml"
    path.write_text("servers: []\nusers:\n  - name: alice\n  - name: bob\n    " + line + "\n")
    result = load_cluster(str(path))
    assert result.cluster is None
    [d] = [d for d in result.diagnostics if d.severity == "error"]
    assert (d.line, d.col) == (5, col) and message in d.message, (d.line, d.col, d.message)


# ------------------------------------------------------------------ the ledger against ground truth


class Kernel:
    """One server's nftables counters, fed the way the kernel feeds them: per packet of each user's connections."""

    def __init__(self) -> None:
        self.counters: dict[tuple[int, int, str, str], list[int]] = {}  # (side, mark, family, transport) → [pkts, bytes]
        self.epoch = "boot-1"

    def reboot(self) -> None:
        self.counters.clear()
        self.epoch = self.epoch + "+"

    def carry(self, rng: random.Random, mark: int, side: int, payload: int) -> None:
        family, transport = rng.choice([("ipv4", "tcp"), ("ipv6", "tcp"), ("ipv4", "udp"), ("ipv6", "udp")])
        header = HEADER_BYTES[(family, transport)]
        row = self.counters.setdefault((side, mark, family, transport), [0, 0])
        left = payload
        while left > 0:  # segments of up to 64 KB (GSO/GRO: one header each), and pure ACKs in between
            seg = min(left, rng.choice([1448, 65160, 65160, 9000]))
            row[0] += 1
            row[1] += seg + header
            left -= seg
            if rng.random() < 0.3:
                row[0] += 1
                row[1] += header
        # ICMP errors about a connection carry no payload of the user's
        if rng.random() < 0.05:
            icmp = self.counters.setdefault((side, mark, "ipv4", "icmp"), [0, 0])
            icmp[0] += 1
            icmp[1] += 56

    def answer(self, devices: dict[str, list[str]] | None = None, open_users: list[str] | None = None) -> dict[str, object]:
        """What an agent on this kernel answers."""
        rows: dict[str, list[list[object]]] = {"tx": [], "rx": []}
        for (side, mark, family, transport), (pkts, nbytes) in self.counters.items():
            rows["tx" if side == 0 else "rx"].append([mark, family, transport, pkts, nbytes])
        return {"service": "active", "listeners": {}, "traffic": None, "probes": {}, "usage": {**rows, "epoch": self.epoch},
                "devices": devices or {}, "users": open_users or []}

    def report(self, name: str, at: float, devices: dict[str, list[str]] | None = None,
               open_users: list[str] | None = None) -> object:
        return parse_report(name, json.dumps(self.answer(devices, open_users)), at)


def test_the_ledger_counts_each_users_payload_exactly_over_thousands_of_intervals():
    # Exact per user, engine restarts change nothing (the counters are the kernel's); a reboot is a new baseline
    # (what a server carried between its reboot and its next read is not counted: a server claiming a new epoch
    # never adds a whole counter), a first contact is a baseline, never another user's bytes
    rng = random.Random(16)
    names = [f"u{i}" for i in range(40)]
    c = cluster([{"name": n} for n in names], servers=5)
    marks = usage_marks(c, b"")
    kernels = {s.name: Kernel() for s in c.servers}
    ledger = Ledger()
    truth = {n: [0, 0] for n in names}
    now = ts(2026, 11, 1)
    for k in kernels.values():  # traffic before the controller ever looked: not this controller's to count
        k.carry(rng, marks["u0"], 1, 5 * MB)
    read: dict[str, bool] = {}
    rebased: set[str] = set()  # rebooted and not read since: what they carry until that read is a baseline
    for tick in range(2000):
        now += 60
        if tick % 500 == 250:  # a reboot right after a read (what was carried since a read is lost with the kernel)
            victim = rng.choice([name for name, ok in read.items() if ok])
            kernels[victim].reboot()
            rebased.add(victim)
        for _ in range(rng.randrange(0, 12)):
            user, server = rng.choice(names), rng.choice(list(kernels))
            up, down = rng.randrange(0, 200_000), rng.randrange(0, 3 * MB)
            if tick > 0 and server not in rebased:  # the first interval is the baseline
                truth[user][0] += up
                truth[user][1] += down
            kernels[server].carry(rng, marks[user], 0, up)
            kernels[server].carry(rng, marks[user], 1, down)
        reports = {name: (None if rng.random() < 0.05 else k.report(name, now)) for name, k in kernels.items()}
        if tick == 0:
            reports = {name: k.report(name, now) for name, k in kernels.items()}
        read = {name: rep is not None for name, rep in reports.items()}
        rebased -= {name for name, ok in read.items() if ok}
        ledger.fold(c, reports, now)
    ledger.fold(c, {name: k.report(name, now + 60) for name, k in kernels.items()}, now + 60)  # the last missed ones
    # Persisted and read back: the same figures.
    meta, arrays = ledger.pack()
    ledger = Ledger.unpack(json.loads(json.dumps(meta)), {k: v.copy() for k, v in arrays.items()})
    view = ledger.view(c, now + 60)
    for n in names:
        assert (ledger.book(n).total, view[n].total) == (sum(truth[n]),) * 2, n
    assert sum(v[0] + v[1] for v in ledger.by_server.values()) == sum(sum(t) for t in truth.values())


def test_the_row_order_memo_counts_exactly_what_matching_every_report_afresh_counts():
    # The ledger remembers how each server's last report was matched to users (read_counters' RowOrder) and reuses
    # it for a report with the same keys in the same order. Over reports that keep their rows, grow them, shuffle
    # them, repeat a key, change the file's users (a new index) and reboot, a ledger using the memo and one that
    # matches every report afresh hold the same counters and books after every interval.
    rng = random.Random(17)
    names = [f"u{i}" for i in range(30)]
    files = [cluster([{"name": n} for n in names[:k]], servers=3) for k in (30, 24, 30)]  # 24: six users leave
    marks = usage_marks(files[0], b"")
    kernels = {s.name: Kernel() for s in files[0].servers}
    memo, afresh = Ledger(), Ledger()
    reused = 0
    now = ts(2026, 11, 1)
    for tick in range(600):
        now += 60
        c = files[(tick // 150) % 3]
        if tick % 97 == 50:
            rng.choice(list(kernels.values())).reboot()
        if rng.random() < 0.3:  # new counters this interval (the keys change), else the same rows grow
            for _ in range(rng.randrange(1, 4)):
                kernels[rng.choice(list(kernels))].carry(rng, marks[rng.choice(names)], rng.randrange(2), 90_000)
        for k in kernels.values():
            for row in k.counters.values():
                row[0] += 3
                row[1] += 3 * 1500
        reports = {}
        for name, k in kernels.items():
            rep = k.report(name, now)
            tx = rep.usage.tx
            if rng.random() < 0.05 and len(tx.marks) > 1:  # the same rows in another order: the memo must not match
                turn = np.array(rng.sample(range(len(tx.marks)), len(tx.marks)))
                tx = CounterRows(tx.marks[turn], tx.kinds[turn], tx.packets[turn], tx.nbytes[turn])
                rep = dataclasses.replace(rep, usage=dataclasses.replace(rep.usage, tx=tx))
            reports[name] = rep
        before = {s: o for s, o in memo._orders.items()}
        memo.fold(c, reports, now)
        reused += sum(memo._orders.get(s) is o for s, o in before.items())
        afresh._orders.clear()
        afresh.fold(c, reports, now)
        for server in kernels:
            a, b = memo.counters.get(server), afresh.counters.get(server)
            assert (a is None) == (b is None)
            if a is not None:
                for col in ("keys", "owners", "packets", "nbytes"):
                    assert np.array_equal(getattr(a, col), getattr(b, col)), (tick, server, col)
        for col in ("up", "down", "total"):
            assert np.array_equal(getattr(memo.books, col), getattr(afresh.books, col)), (tick, col)
    assert 300 < reused < 3 * 600  # the memo was used, and not for every report
    assert memo.by_server == afresh.by_server and memo.by_route == afresh.by_route


def test_a_mark_that_changes_owner_is_a_baseline_and_periods_start_from_zero():
    c = cluster([{"name": "alice", "data_limit": "10MB", "reset": "monthly"}, {"name": "bob"}])
    marks = usage_marks(c, b"")
    k = Kernel()
    rng = random.Random(1)
    ledger = Ledger()
    t0 = ts(2026, 11, 30, 23, 50)
    ledger.fold(c, {"s0": k.report("s0", t0)}, t0)
    k.carry(rng, marks["alice"], 1, 4 * MB)
    ledger.fold(c, {"s0": k.report("s0", t0 + 60)}, t0 + 60)
    assert ledger.view(c, t0 + 60)["alice"].down == 4 * MB
    # Midnight of December 1st: a new period for alice (monthly), bob never resets.
    view = ledger.view(c, ts(2026, 12, 1, 0, 0, 1))
    assert view["alice"].used == 0 and view["alice"].total == 4 * MB
    k.carry(rng, marks["alice"], 0, 1 * MB)
    ledger.fold(c, {"s0": k.report("s0", ts(2026, 12, 1, 0, 1))}, ts(2026, 12, 1, 0, 1))
    assert (ledger.book("alice").up, ledger.book("alice").down) == (MB, 0)
    # Alice's mark now belongs to bob (as if a collision moved it): a baseline, none of it bob's.
    owner_swapped = {"s0": k.report("s0", ts(2026, 12, 1, 0, 2))}
    ledger.counters["s0"] = ledger.counters["s0"].with_owners(owner_id("bob"))
    k.carry(rng, marks["alice"], 1, 2 * MB)
    ledger.fold(c, owner_swapped, ts(2026, 12, 1, 0, 2))
    assert ledger.book("bob").total == 0


def test_marks_are_unique_stable_and_leave_room_for_the_operators_marks():
    names = [f"user{i}" for i in range(20_000)]
    c = cluster([{"name": n} for n in names])
    marks = usage_marks(c, b"")
    assert len(set(marks.values())) == len(names)
    assert all(m & 0xFF000000 == MARK_BASE for m in marks.values())
    more = usage_marks(cluster([{"name": n} for n in [*names, "newcomer"]]), b"")
    changed = [n for n in names if more[n] != marks[n]]
    assert len(changed) <= 1  # only a user the newcomer collides with (one in 16 million per pair) can move


def test_hostile_usage_costs_that_servers_usage_never_its_report():
    for usage in ({"tx": "x", "rx": []}, {"tx": [[2**40, "ipv4", "tcp", 1, 1]], "rx": []},
                  {"tx": [[1, "ipv4", "tcp", -1, 1]], "rx": []}, {"tx": [[1, ["a"], "tcp", 1, 1]], "rx": []}, "x"):
        rep = parse_report("s0", json.dumps({"service": "active", "usage": usage}), 1.0)
        assert rep.service_ok and rep.usage is None and rep.usage_error, usage
    rep = parse_report("s0", json.dumps({"service": "active", "usage": {"error": "no nft"}}), 1.0)
    assert rep.usage is None and rep.usage_error == "no nft"
    rep = parse_report("s0", json.dumps({"service": "active", "usage": {"tx": [[1, 2, 6, 1, 100]], "rx": []}}), 1.0)
    assert rep.usage is not None and rep.usage.tx == CounterRows.of([(1, "ipv4", "tcp", 1, 100)])  # older nft: numbers
    assert rep.usage.tx.kinds.tolist() == [KIND_OF[("ipv4", "tcp")]] and KIND_OF[("ipv4", "tcp")] != 0


def test_a_ledger_written_by_state_format_1_is_read_and_counting_goes_on_exactly():
    # Format 1 kept the counters as JSON ("side:mark:family:transport" → [owner, packets, bytes]).
    c = cluster([{"name": "alice"}, {"name": "bob"}])
    marks = usage_marks(c, b"")
    old = {"counters": {"s0": {f"0:{marks['alice']}:ipv4:tcp": ["alice", 10, 10 * 52 + 5 * MB],
                               f"1:{marks['bob']}:2:6": ["bob", 4, 4 * 52 + MB],  # older nft: numbers
                               f"0:{marks['alice']}:ipv4:icmp": ["alice", 1, 56]}},
           "epochs": {"s0": "e"}, "users": {"alice": [0.0, 5 * MB, 0, 5 * MB, 1.0, 0.5, {}, ["s0"]]},
           "by_server": {"s0": [5 * MB, 0]}, "by_route": {"r": [5 * MB, 0]}, "last_fold": 1.0, "said": {}}
    ledger = Ledger.from_json(old)
    rows = {"tx": [[marks["alice"], "ipv4", "tcp", 20, 20 * 52 + 7 * MB], [marks["alice"], "ipv4", "icmp", 2, 112]],
            "rx": [[marks["bob"], "ipv4", "tcp", 6, 6 * 52 + 3 * MB]]}
    rep = parse_report("s0", json.dumps({"service": "active", "usage": {**rows, "epoch": "e"}}), 61.0)
    assert ledger.fold(c, {"s0": rep}, 61.0) == {"alice": (2 * MB, 0), "bob": (0, 2 * MB)}
    assert (ledger.book("alice").up, ledger.book("bob").down) == (7 * MB, 2 * MB)


def test_a_hostile_ledger_in_the_state_is_refused_whole():
    c = cluster([{"name": "alice"}])
    ledger = Ledger()
    k = Kernel()
    ledger.fold(c, {"s0": k.report("s0", 1.0)}, 1.0)
    for side in (0, 1):
        k.carry(random.Random(2), usage_marks(c, b"")["alice"], side, MB)
    ledger.fold(c, {"s0": k.report("s0", 61.0)}, 61.0)
    meta, arrays = ledger.pack()
    assert len(arrays["c_keys"]) >= 2 and Ledger.unpack(meta, arrays).book("alice").total == 2 * MB
    for broken_meta, broken in (
            (meta, {**arrays, "u_up": arrays["u_up"][:0]}),  # a column shorter than the names
            ({**meta, "counter_rows": [len(arrays["c_keys"]) + 1]}, arrays),  # rows that are not there
            (meta, {**arrays, "c_keys": arrays["c_keys"][::-1].copy()}),  # unsorted keys (searches would lie)
            (meta, {**arrays, "c_owners": arrays["c_owners"].reshape(-1, 1)}),  # a column of another shape
            (meta, {**arrays, "u_up": arrays["u_up"].astype(object)})):  # not numbers
        with pytest.raises(ValueError):
            Ledger.unpack(broken_meta, broken)


def test_a_state_that_overflows_is_a_fresh_start_and_totals_saturate_instead_of_breaking_the_save():
    from reconciler.fleet.learned import Learned, _npz, state_arrays
    c = cluster([{"name": "alice"}])
    learned = Learned.fresh(c)
    marks = usage_marks(c, b"")
    learned.ledger = Ledger.from_json({"counters": {}, "users": {"alice": [0.0, 2**64, 0, 2**64, None, 0.0, {}, []]},
                                       "by_server": {}, "by_route": {}, "last_fold": 0.0})
    assert Ledger.unpack(*learned.ledger.pack()).book("alice").total == 2**63 - 1  # saturated, saved
    blob = learned.to_bytes()
    assert Learned.restore(blob, c)[1] is None
    # A format-1 counter beyond 64 bits cannot be read: OverflowError, which restore takes as a fresh start.
    with pytest.raises(OverflowError):
        Ledger.from_json({"counters": {"s0": {f"0:{marks['alice']}:ipv4:tcp": ["alice", 2**64, 1]}}, "users": {},
                          "by_server": {}, "by_route": {}, "last_fold": 0.0})
    # A state file (format 2) whose counter row count is not a number: the same.
    arrays = state_arrays(blob)
    meta = json.loads(arrays["meta"].tobytes())
    meta["usage"]["counter_rows"] = [float("inf")]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    fresh, why = Learned.restore(_npz(arrays), c)
    assert why is not None and "OverflowError" in why and fresh.ticks == 0


def test_the_snapshot_travels_to_workers_with_its_standings_and_an_empty_memo():
    # A pass in worker processes pickles its snapshot: the standings (decided once, for all users) go along and
    # stay right; the memo, keyed by its consumers' slots, which an unpickled copy could never find, goes empty.
    import pickle

    from reconciler.balance import decide
    c = cluster([{"name": "alice", "enabled": False}, {"name": "bob"}])
    snap = Snapshot(cluster=c, now=1.0)
    assert [snap.standing(u) for u in c.users] == ["disabled", "active"]
    decide(snap, "bob")
    assert snap.memo._slots  # (filled by the decision)
    copy = pickle.loads(pickle.dumps(snap))
    assert "standings" in copy.__dict__ and copy.standings.tolist() == snap.standings.tolist()
    assert not copy.memo._slots and [copy.standing(u) for u in copy.cluster.users] == ["disabled", "active"]


def test_counters_reported_twice_or_beyond_belief_count_once_and_bounded():
    c = cluster([{"name": "alice"}, {"name": "bob"}])
    marks = usage_marks(c, b"")
    ledger = Ledger()

    def report(rows: dict[str, list[list[object]]], at: float) -> object:
        return parse_report("s0", json.dumps({"service": "active", "usage": {**rows, "epoch": "e"}}), at)

    ledger.fold(c, {"s0": report({"tx": [[marks["alice"], "ipv4", "udp", 1, 28 + 100]], "rx": []}, 1.0)}, 1.0)
    twice = {"tx": [[marks["alice"], "ipv4", "udp", 2, 56 + 200], [marks["alice"], "ipv4", "udp", 3, 84 + 400]],
             "rx": [[marks["bob"], "ipv4", "tcp", 10, 2**63 - 1]]}
    got = ledger.fold(c, {"s0": report(twice, 61.0)}, 61.0)
    assert got["alice"] == (300, 0)  # the last row of a key counts, once
    assert 0 < got["bob"][1] <= 2**56  # a counter beyond belief is bounded, never negative, never someone else's


def test_the_column_check_of_counters_agrees_with_the_row_check():
    # The fast path (columns) must accept exactly what the row-by-row check accepts, and read it the same.
    rng = random.Random(5)
    values = [0, 1, 2**31, 2**32 - 1, 2**32, -1, 2**63 - 1, 2**63, True, 1.5, "7", None]
    names = ["ipv4", "tcp", "x" * 16, "y" * 17, 2, 6, "", True, None, ["a"]]
    for _ in range(3000):
        rows = [[rng.choice(values[:4]), rng.choice(names[:3]), rng.choice(names[:3]), rng.choice(values[:4]),
                 rng.choice(values[:4])] for _ in range(rng.randrange(0, 4))]
        if rows and rng.random() < 0.7:
            row = rng.choice(rows)
            col = rng.randrange(5)
            row[col] = rng.choice(names if col in (1, 2) else values)
            if rng.random() < 0.1:
                row.append(0)
        text = json.dumps({"service": "active", "usage": {"tx": rows, "rx": []}})
        fast = parse_report("s0", text, 1.0)
        original = reports_module._usage_rows_fast
        reports_module._usage_rows_fast = lambda items: None  # the row-by-row check alone
        try:
            slow = parse_report("s0", text, 1.0)
        finally:
            reports_module._usage_rows_fast = original
        assert (fast.usage, fast.usage_error) == (slow.usage, slow.usage_error), rows


def test_the_agents_packed_counters_read_as_its_rows_do():
    # Agent 2 packs its counters (four base64 columns): the controller reads exactly what agent 1's rows said;
    # rows the kernel could not have made are counted, not sent, and make that server's usage unreadable (as
    # agent 1's rows did), with the reason.
    from reconciler.engine.agent import packed

    rng = random.Random(7)
    names = ["ipv4", "ipv6", "tcp", "udp", "icmp", 2, 6, "x" * 16]
    for _ in range(300):
        rows = [[rng.choice([0, 1, 2**31, 2**32 - 1, MARK_BASE + rng.randrange(1 << 24)]), rng.choice(names),
                 rng.choice(names), rng.choice([0, 1, 2**40, 2**63 - 1]), rng.choice([0, 52, 2**50, 2**63 - 1])]
                for _ in range(rng.randrange(0, 30))]
        as_rows = parse_report("s0", json.dumps({"service": "active", "usage": {"tx": rows, "rx": rows[:3], "epoch": "e"}}), 1.0)
        usage = {"packed": 1, "tx": packed(rows), "rx": packed(rows[:3]), "epoch": "e"}
        as_columns = parse_report("s0", json.dumps({"service": "active", "usage": usage}), 1.0)
        assert as_rows.usage is not None and as_rows.usage_error == ""
        assert (as_columns.usage, as_columns.usage_error) == (as_rows.usage, ""), rows
    kept = packed([[2**32, "ipv4", "tcp", 1, 1], [1, "ipv4", "tcp", -1, 1], [1, "ipv4", "tcp", 1, 2**64], [1, "a", "b", True, 1],
                   [5, "ipv4", "tcp", 3, 300]])
    assert (kept["rows"], kept["dropped"]) == (1, 4)
    rep = parse_report("s0", json.dumps({"service": "active", "usage": {"packed": 1, "tx": kept, "rx": packed([]), "epoch": "e"}}), 1.0)
    assert rep.service_ok and rep.usage is None and "could not read 4 of the kernel's `tx` counter rows" in rep.usage_error


def test_hostile_packed_counters_cost_that_servers_usage_never_its_report():
    import base64

    from reconciler.engine.agent import packed

    good = packed([[7, "ipv4", "tcp", 1, 100], [8, "ipv6", "udp", 2, 200]])
    b64 = base64.b64encode

    def hostile() -> list[object]:
        return [
            "x", [], {**good, "rows": 3}, {**good, "rows": -1}, {**good, "rows": True}, {**good, "rows": 10**7},
            {**good, "kinds": "ipv4"}, {**good, "kinds": [["ipv4"]]}, {**good, "kinds": [["ipv4", "tcp"]] * 256},
            {**good, "kinds": [[["a"], "tcp"], ["ipv6", "udp"]]}, {**good, "kinds": [["ipv4", "tcp"]]},  # index 1 is out of range
            {**good, "mark": good["mark"][:-4]}, {**good, "mark": "!" * len(good["mark"])}, {**good, "mark": 7},
            {**good, "packets": b64(np.array([1, 2**63], "<u8").tobytes()).decode()},  # beyond a signed counter
            {**good, "bytes": b64(np.array([1, 2**64 - 1], "<u8").tobytes()).decode()},
            {**good, "kind": b64(bytes([0, 9])).decode()}, {**good, "kind": None}, {**good, "dropped": "x"},
            {**good, "dropped": -1},
        ]

    for tx in hostile():
        rep = parse_report("s0", json.dumps({"service": "active", "usage": {"packed": 1, "tx": tx, "rx": good, "epoch": "e"}}), 1.0)
        assert rep.service_ok and rep.usage is None and rep.usage_error.startswith("unreadable per-user counters"), tx
    rep = parse_report("s0", json.dumps({"service": "active", "usage": {"packed": 1, "tx": good, "rx": good, "epoch": "e"}}), 1.0)
    assert rep.usage is not None and rep.usage.tx.nbytes.tolist() == [100, 200]


def test_devices_are_counted_across_servers_within_the_window():
    c = cluster([{"name": "alice", "device_limit": 2, "on_device_limit": "refuse"}], device_window="60s")
    ledger = Ledger()
    k = Kernel()
    ledger.fold(c, {"s0": k.report("s0", 100.0, {"alice": ["fp1", "fp2"]}, ["alice"]),
                    "s1": k.report("s1", 100.0, {"alice": ["fp2", "fp3"]}, ["alice"])}, 100.0)
    view = ledger.view(c, 100.0)["alice"]
    assert view.devices == 3 and view.servers == ("s0", "s1")
    assert c.users[0].standing(100.0, view) == "device_limit"
    ledger.fold(c, {"s0": k.report("s0", 200.0, {"alice": ["fp1"]}, ["alice"])}, 200.0)
    assert ledger.view(c, 200.0)["alice"].devices == 1  # fp2 and fp3 not seen for longer than the window


# ------------------------------------------------------------------ standing, plan, subscription


def test_standing_decides_who_is_served():
    now = ts(2026, 11, 30)
    c = cluster([{"name": "a"}, {"name": "b", "enabled": False}, {"name": "c", "expires": "2026-11-29"},
                 {"name": "d", "data_limit": "10MB"}, {"name": "e", "device_limit": 1},
                 {"name": "f", "device_limit": 1, "on_device_limit": "refuse"}])
    heavy = UserUsage(up=4 * MB, down=6 * MB, devices=2)
    got = {u.name: u.standing(now, heavy) for u in c.users}
    assert got == {"a": "active", "b": "disabled", "c": "expired", "d": "over_quota", "e": "active", "f": "device_limit"}
    assert c.user("d").standing(now, UserUsage(up=4 * MB, down=6 * MB - 1)) == "active"


def test_an_over_quota_user_leaves_the_configuration_and_the_plan_says_why():
    now = ts(2026, 11, 30)
    c = cluster([{"name": "alice"}, {"name": "carol", "data_limit": "24MB", "reset": "monthly"}])
    usage = {"carol": UserUsage(up=MB, down=24 * MB, period_start=ts(2026, 11, 1), next_reset=ts(2026, 12, 1))}
    served = desired(c, c.servers[0], SECRET, now)
    refused = desired(c, c.servers[0], SECRET, now, usage=usage)
    carol = user_credentials(SECRET, "carol", 0)
    config = lambda d: next(f.content for f in d.files if f.secret).decode()  # noqa: E731
    assert carol.password in config(served) and carol.password not in config(refused)
    assert refused.withheld == (("carol", "over quota: 25.0 MB of 24.0 MB, resets 2026-12-01"),)
    assert withheld_text(refused.withheld) == "not served: carol (over quota: 25.0 MB of 24.0 MB, resets 2026-12-01)"
    many = tuple((f"u{i}", "disabled") for i in range(25))
    assert withheld_text(many).endswith("u9 (disabled) and 15 more users")
    snap = Snapshot(cluster=c, now=now, usage=usage)
    doc = render(snap, "carol", "sing-box", SECRET)
    assert doc.status == 403 and b"used its traffic limit (24.0 MB). It resets on 2026-12-01." in doc.body
    alice = render(Snapshot(cluster=c, now=now, usage={"alice": UserUsage(up=123, down=456)}), "alice", "clash", SECRET)
    assert alice.headers["subscription-userinfo"] == "upload=123; download=456; total=0; expire=0"


def test_events_are_said_once():
    now = ts(2026, 11, 20)
    c = cluster([{"name": "alice", "data_limit": "10MB", "reset": "monthly", "expires": "2026-11-22"},
                 {"name": "bob", "device_limit": 1}])
    said: dict[str, str] = {}
    usage = {"alice": UserUsage(up=0, down=9_500_000, period_start=ts(2026, 11, 1)), "bob": UserUsage(devices=3)}
    kinds = [e.kind for e in user_events(c, usage, now, said)]
    assert sorted(kinds) == ["device_limit", "expiring", "quota_warning"]
    assert user_events(c, usage, now + 60, said) == []  # said once
    usage["alice"] = UserUsage(down=10 * MB, period_start=ts(2026, 11, 1))
    usage["bob"] = UserUsage(devices=1)
    assert [e.kind for e in user_events(c, usage, now + 120, said)] == ["quota_reached"]
    usage["bob"] = UserUsage(devices=2)
    assert [e.kind for e in user_events(c, usage, now + 180, said)] == ["device_limit"]  # over again: said again
    assert [e.kind for e in user_events(c, usage, ts(2026, 11, 23), said)] == ["expired"]


def _receiver(posted: list[dict]) -> http.server.ThreadingHTTPServer:
    """A webhook receiver on loopback: every JSON body POSTed to it, in order."""

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            posted.append(json.loads(self.rfile.read(int(self.headers.get("content-length") or 0))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_loop_applies_within_the_interval_a_user_crosses_the_limit(tmp_path):
    # issue 16 item 2: the interval whose reports carry the crossing asks for a plan at once (not at plan_interval)
    from reconciler.loop.service import Loop

    path = tmp_path / "c.yaml"
    posted: list[dict] = []
    hook = _receiver(posted)
    path.write_text("settings:\n  health: {report_interval: 1s}\n"
                    f"  outputs: {{webhook_url: 'http://127.0.0.1:{hook.server_address[1]}/hook'}}\n"
                    "servers:\n  - {name: s0, host: 198.18.0.10, country: DE, inbounds: [{id: s0-in, name: S, "
                    "protocol: shadowsocks-2022, port: 8388}]}\n"
                    "users:\n  - {name: carol, data_limit: 10MB}\n  - {name: alice}\n")
    c = load_cluster(str(path)).cluster
    assert c is not None
    # The real collection: the fake host's agent answers what its kernel counted; time moves when the test says.
    runner, clock = FakeRunner(tmp_path / "hosts"), FakeClock(start=ts(2026, 11, 30))
    loop = Loop(str(path), c, SECRET, watch=False, runner=runner, clock=clock)
    k = Kernel()
    rng = random.Random(2)
    mark = usage_marks(c, mark_key(SECRET))["carol"]  # the loop reads the counters under the secret's marks

    async def run() -> list[bool]:
        asked = []
        for step in range(4):
            if step == 2:
                k.carry(rng, mark, 1, 11 * MB)  # carol crosses her limit
            install_agent(runner, "s0", answering(k.answer()))
            clock.advance(1)
            await loop.tick()
            asked.append(loop.plan_now.is_set())
            loop.plan_now.clear()
        await asyncio.gather(*loop._posts)  # the webhook's deliveries under way
        return asked

    try:
        asked = asyncio.run(run())
    finally:
        hook.shutdown()
        hook.server_close()
    assert asked == [False, False, True, False]
    users = [p for p in posted if p["subject"] != "fleet"]
    assert [(p["event"], p["subject"]) for p in users] == [("quota_reached", "carol")]
    saved = Path(loop.state.path)
    assert saved.exists()


def test_the_files_follow_usage_in_steps_and_the_refusal_at_once(tmp_path):
    # At a million users, rewriting every active user's files at every interval of traffic would be the disk's
    # whole work: the files' userinfo moves in 100 MB steps (1% of a small limit); a refusal is written at once.
    from reconciler.publish import FileOutlet

    c = cluster([{"name": "alice"}, {"name": "carol", "data_limit": "1GB"}])
    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    now = ts(2026, 11, 30)

    def write(alice: int, carol: int) -> int:
        usage = {"alice": UserUsage(down=alice), "carol": UserUsage(down=carol)}
        return outlet.write(Snapshot(cluster=c, now=now, usage=usage)).written

    assert write(0, 0) == 2
    assert write(50 * MB, 5 * MB) == 0  # within a step for both (carol's step: 10 MB, 1% of 1 GB)
    assert write(120 * MB, 5 * MB) == 1  # alice crossed 100 MB
    assert write(120 * MB, 12 * MB) == 1  # carol crossed 10 MB
    assert write(120 * MB, 1000 * MB) == 1  # carol over quota: her refusal
    token = user_credentials(SECRET, "carol", 0).token
    headers = json.loads((tmp_path / "subs" / token / "headers.json").read_text())
    assert all(h["status"] == "403" for h in headers.values())
