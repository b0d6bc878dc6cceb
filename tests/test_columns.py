"""The users and the assignments as columns (issue 17: a million users in one controller): the columns must say
exactly what the per-user objects say, across file changes, restarts and the state's older formats."""

from __future__ import annotations

import io
import json
import random
from datetime import UTC, datetime

import numpy as np
import pytest

from reconciler.balance import Snapshot, rebalance
from reconciler.balance.assignments import Assignments
from reconciler.engine.base import usage_marks
from reconciler.fleet.learned import Learned, _npz, state_arrays
from reconciler.fleet.reports import parse_report
from reconciler.fleet.usage import Ledger
from reconciler.model import Cluster, UserUsage
from reconciler.model.roster import STANDINGS
from reconciler.model.usage import UsageView


def ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


def cluster(users: list[dict], servers: int = 3) -> Cluster:
    return Cluster.model_validate({
        "servers": [{"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": "DE",
                     "inbounds": [{"id": f"s{i}-in", "name": f"S{i}", "protocol": "trojan", "port": 8443, "route": "r",
                                   "tls": {"server_name": "www.example.com"}}]} for i in range(servers)],
        "routes": [{"id": "r", "name": "R"}], "users": users})


def random_users(rng: random.Random, n: int) -> list[dict]:
    users = []
    for i in range(n):
        u: dict = {"name": f"u{i}"}
        if rng.random() < 0.2:
            u["enabled"] = False
        if rng.random() < 0.3:
            u["expires"] = rng.choice(["2026-11-29", "2026-12-01", "2027-01-01T00:00:00Z"])
        if rng.random() < 0.5:
            u["data_limit"] = rng.choice(["1MB", "10MB", "1GB"])
            u["reset"] = rng.choice(["monthly", "weekly", "never", {"period": "monthly", "day": 15}])
        if rng.random() < 0.3:
            u["device_limit"] = rng.randint(1, 3)
            u["on_device_limit"] = rng.choice(["report", "refuse"])
        users.append(u)
    return users


def test_every_users_standing_from_the_columns_is_the_users_own():
    # spec: HEALTH-10 (who is balanced at all): the roster's columns and one user's rule agree on every case
    rng = random.Random(17)
    c = cluster(random_users(rng, 3000))
    now = ts(2026, 11, 30, 12)
    usage = {u.name: UserUsage(up=rng.choice([0, 400_000, 6_000_000, 2_000_000_000]), devices=rng.randint(0, 5))
             for u in c.users if rng.random() < 0.8}
    codes = c.roster.standings(now, usage)
    expected = [u.standing(now, usage.get(u.name)) for u in c.users]
    assert [STANDINGS[k] for k in codes.tolist()] == expected
    assert len(set(expected)) == len(STANDINGS)  # every standing occurs: the comparison covers each rule
    snap = Snapshot(cluster=c, now=now, usage=usage)
    assert [snap.standing(u) for u in c.users] == expected
    # A User the snapshot's cluster does not hold (an edited copy) is decided afresh, not by its name's column.
    changed = c.users[0].model_copy(update={"enabled": not c.users[0].enabled})
    assert snap.standing(changed) == changed.standing(now, usage.get(changed.name)) != snap.standing(c.users[0])


def test_users_share_their_reset_rule_and_given_fields():
    c = cluster([{"name": f"u{i}", "data_limit": "1GB", "reset": "monthly"} for i in range(3)])
    a, b = c.users[0], c.users[1]
    assert a.reset is b.reset and a.model_fields_set is b.model_fields_set == {"name", "data_limit", "reset"}
    assert a.model_copy(update={"rotate": 1}).model_fields_set >= {"rotate"}  # a copy's own set, the shared one intact
    assert b.model_fields_set == {"name", "data_limit", "reset"}


def test_the_ledger_keeps_each_users_book_across_file_changes_and_restarts():
    c1 = cluster([{"name": "alice"}, {"name": "bob"}, {"name": "carol"}])
    ledger = Ledger()
    marks = usage_marks(c1, b"")

    def report(tx: dict[str, int], at: float) -> object:
        rows = [[marks[u], "ipv4", "udp", 1, 28 + n] for u, n in tx.items()]
        return parse_report("s0", json.dumps({"service": "active", "usage": {"tx": rows, "rx": [], "epoch": "e"}}), at)

    ledger.fold(c1, {"s0": report({"alice": 0, "bob": 0, "carol": 0}, 1.0)}, 1.0)
    ledger.fold(c1, {"s0": report({"alice": 100, "bob": 200, "carol": 300}, 61.0)}, 61.0)
    # The file changes: bob leaves, dave comes, the order changes.
    c2 = cluster([{"name": "dave"}, {"name": "carol"}, {"name": "alice"}])
    marks = usage_marks(c2, b"") | {"bob": marks["bob"]}
    ledger.fold(c2, {"s0": report({"alice": 150, "bob": 260, "carol": 300, "dave": 0}, 121.0)}, 121.0)
    view = ledger.view(c2, 121.0)
    assert list(view) == ["dave", "carol", "alice"]
    assert (view["alice"].up, view["carol"].up, view["dave"].up) == (150, 300, 0)
    assert ledger.book("bob").up == 200  # kept (its bytes after it left the file are nobody's)
    # Restarted from the state, then bob is back: his book is his again.
    meta, arrays = ledger.pack()
    ledger = Ledger.unpack(json.loads(json.dumps(meta)), {k: v.copy() for k, v in arrays.items()})
    c3 = cluster([{"name": "bob"}, {"name": "alice"}])
    assert (ledger.view(c3, 121.0)["bob"].up, ledger.view(c3, 121.0)["alice"].up) == (200, 150)
    assert isinstance(ledger.view(c3, 121.0), UsageView) and dict(ledger.view(c3, 121.0))["bob"].total == 200


def test_a_usage_view_reads_as_the_mapping_it_stands_for():
    names = ("a", "b")
    view = UsageView(names, np.array([1, 0]), np.array([2, 0]), np.array([3, 0]), np.array([10.0, 10.0]),
                     np.array([np.nan, 20.0]), np.array([1, 0]), np.array([5.0, np.nan]), np.array([0.5, 0.0]),
                     {"a": ("s0",)})
    assert dict(view) == {"a": UserUsage(1, 2, 3, 10.0, None, 1, 5.0, ("s0",), 0.5),
                          "b": UserUsage(0, 0, 0, 10.0, 20.0, 0, None, (), 0.0)}
    assert view.get("c") is None and "c" not in view and "a" in view and len(view) == 2
    assert view.used.tolist() == [3, 0]


def test_assignments_read_as_pairs_and_follow_a_changed_file():
    held = Assignments.of({("a", "r"): "x", ("b", "r"): "y", ("a", "r@p"): "y", ("zed", "r"): "x", ("b", "q"): "gone"},
                          ("a", "b"), ("x", "y"))
    assert dict(held) == {("a", "r"): "x", ("b", "r"): "y", ("a", "r@p"): "y"}  # zed and the unknown inbound: left out
    assert dict(held.items()) == dict(held) and held.counts() == {("r", "x"): 1, ("r", "y"): 1, ("r@p", "y"): 1}
    assert held.get(("b", "q")) is None and ("a", "r") in held and ("a", "q") not in held and len(held) == 3
    moved = held.realigned(("c", "a"), ("y", "z", "x"))
    assert dict(moved) == {k: v for k, v in dict(held).items() if k[0] == "a"} and moved.column("r").tolist() == [-1, 2]
    assert dict(held.realigned(("a",), ("y",))) == {("a", "r@p"): "y"}  # inbound x left the file
    with pytest.raises(ValueError):
        Assignments(("a",), ("x",), {"r": np.array([1], np.int32)})  # no inbound 1


def test_the_balanced_assignments_survive_the_state_and_its_older_format():
    c = cluster([{"name": f"u{i}"} for i in range(500)])
    learned = Learned.fresh(c)
    learned.assignments = rebalance(Snapshot(cluster=c, now=1.0))
    assert len(learned.assignments) == 500 and {i for _, i in learned.assignments.items()} == {"s0-in", "s1-in", "s2-in"}
    back = Learned.from_bytes(learned.to_bytes())
    assert dict(back.assignments) == dict(learned.assignments)
    # State format 2 kept one row per (user, route): still read.
    data = state_arrays(learned.to_bytes())
    meta = json.loads(data.pop("meta").tobytes())
    pairs = list(learned.assignments.items())
    routes, inbounds = ["r"], sorted({i for _, i in pairs})
    meta |= {"format": 2, "assignment_routes": routes, "assignment_inbounds": inbounds}
    del data["a_names"], data["a_columns"]
    data |= {"a_users": np.frombuffer("\n".join(u for (u, _), _ in pairs).encode(), np.uint8),
             "a_routes": np.zeros(len(pairs), np.int32),
             "a_inbounds": np.array([inbounds.index(i) for _, i in pairs], np.int32),
             "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    old = Learned.from_bytes(_npz(data))
    assert dict(old.assignments) == dict(learned.assignments)
    # The next batch starts from what was held (LB-6): nobody moves.
    again = rebalance(Snapshot(cluster=c, now=2.0, assignments=old.assignments))
    assert dict(again) == dict(learned.assignments)


def test_a_hostile_assignment_table_in_the_state_is_refused():
    c = cluster([{"name": "u0"}, {"name": "u1"}])
    learned = Learned.fresh(c)
    learned.assignments = rebalance(Snapshot(cluster=c, now=1.0))
    data = state_arrays(learned.to_bytes())
    for broken in ({"a_columns": np.full((1, 2), 7, np.int32)},  # an inbound that is not there
                   {"a_columns": np.zeros((1, 3), np.int32)},  # more users than names
                   {"a_names": np.frombuffer(b"u0\nu0", np.uint8)}):  # one user twice
        restored, why = Learned.restore(_npz(data | broken), c)
        assert why and "afresh" in why and len(restored.assignments) == 0, broken


def test_the_token_index_finds_each_users_token_and_nothing_else():
    from reconciler.credentials import Secret, user_token
    from reconciler.publish import Tokens

    secret = Secret(b"token-index-test-secret-0123456789abcdef")
    c = Cluster.model_validate({"users": [{"name": f"u{i}", "rotate": i % 3} for i in range(2000)]})
    index = Tokens(secret).index(c)
    assert len(index) == 2000
    for u in c.users[::97]:
        token = user_token(secret, u.name, u.rotate)
        assert index.get(token) == u.name
        assert index.get(user_token(secret, u.name, u.rotate + 1)) is None  # an old token after a rotation
        for hostile in (token[:-1], token + "A", token[:-1] + ("A" if token[-1] != "A" else "B"), token[:-1] + "\x00",
                        token[:-1] + "ж", "", "/" * 32):
            assert index.get(hostile) is None, hostile


def test_usage_at_the_cap_saturates_and_stays_over_quota():
    c = cluster([{"name": "a", "data_limit": "1GB"}])
    cap = 2**63 - 1
    view = UsageView(("a",), np.array([cap]), np.array([cap]), np.array([cap]), np.zeros(1), np.full(1, np.nan),
                     np.zeros(1, np.int64), np.full(1, np.nan), np.zeros(1))
    assert view.used.tolist() == [cap] and view["a"].used == 2 * cap  # the mapping's sum is Python's
    assert STANDINGS[c.roster.standings(1.0, view)[0]] == c.users[0].standing(1.0, view["a"]) == "over_quota"


def test_the_state_is_one_zstd_frame_and_older_zip_compressed_states_are_read():
    c = cluster([{"name": f"u{i}"} for i in range(50)])
    learned = Learned.fresh(c)
    learned.assignments = rebalance(Snapshot(cluster=c, now=1.0))
    blob = learned.to_bytes()
    assert blob[:4] == b"\x28\xb5\x2f\xfd"
    old = io.BytesIO()
    np.savez_compressed(old, **state_arrays(blob))  # how states were written before: zip's own deflate
    assert dict(Learned.from_bytes(old.getvalue()).assignments) == dict(learned.assignments)
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * 50_000_000)  # 50 MB of zeros in a few kB
    for broken in (blob[:len(blob) // 2], blob[:4] + b"\xff" * 40, blob[:-1] + bytes([blob[-1] ^ 0xFF]), bomb):
        restored, why = Learned.restore(broken, c)
        assert why and "afresh" in why and restored.ticks == 0
