"""Users kept in a real PostgreSQL (``settings.users.source: postgres``): the example's users imported by
``reconciler users import``, then served from the database exactly as from the file; bad rows left out one by one;
a schema from a later release refused; the database down (its password never shown); the loop following edits by
LISTEN/NOTIFY and keeping the users it has while the database is away. PostgreSQL runs on a loopback port for this
module only (``tests.postgres``), stopped by its PID."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reconciler.credentials import Secret
from reconciler.loop.clock import SystemClock
from reconciler.loop.service import Loop
from reconciler.userdb import SCHEMA_VERSION, UserDatabase
from tests.conftest import example_text
from tests.fake_agents import HEALTHY, install_agent, shadowsocks_fleet
from tests.postgres import BIN, Postgres, users_in_database

PASSWORD = "pw-never-shown-7f3a"
SECRET = Secret(b"userdb-test-secret-0123456789abcdef")

pytestmark = pytest.mark.skipif(BIN is None, reason="needs Debian's postgresql package (`make setup` installs it)")


@pytest.fixture(scope="module")
def server() -> Iterator[Postgres]:
    pg = Postgres()
    try:
        yield pg.start()
    finally:
        pg.close()


@pytest.fixture
def pg(server: Postgres, monkeypatch: pytest.MonkeyPatch) -> Postgres:
    """A fresh, empty database ``vpn`` for each test, its DSN (with a password) in RECONCILER_DATABASE_URL."""
    if server.proc is None:
        server.start_again()
    with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS vpn WITH (FORCE)")
        conn.execute("CREATE DATABASE vpn")
    monkeypatch.setenv("RECONCILER_DATABASE_URL", server.dsn(password=PASSWORD))
    monkeypatch.setenv("RECONCILER_SECRET", "userdb-test-secret-0123456789abcdef")
    return server


def from_database(text: str) -> str:
    """The same file with its users moved out: no `users:` list, the source set to postgres."""
    head = users_in_database(text)
    assert "name: alice" not in head
    return head


def sql(pg: Postgres, statement: str, *params: object) -> None:
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(statement, params)  # type: ignore[arg-type]


def test_import_then_every_command_serves_the_same_users_from_the_database(pg, cli, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(example_text())
    before = {name: cli("subscription", name, "--format", "links", "-f", str(path)).out for name in ("alice", "bob")}
    run = cli("users", "import", "-f", str(path))
    assert run.rc == 0, run.err
    assert f"imported 4 user(s) into the database vpn on 127.0.0.1:{pg.port}" in run.out and "schema created" in run.err
    assert PASSWORD not in run.out + run.err
    assert cli("users", "import", "-f", str(path)).rc == 0  # again: the same rows (upserted by name), no duplicates
    path.write_text(from_database(example_text()))
    run = cli("validate", "-f", str(path))
    assert run.rc == 0 and "4 users (1 disabled)" in run.out + run.err, run.out + run.err
    listed = cli("users", "-o", "json", "-f", str(path))
    users = {u["name"]: u for u in json.loads(listed.out)["users"]}
    assert listed.rc == 0 and list(users) == ["alice", "bob", "carol", "dave"]
    assert users["bob"]["limit_bytes"] == 200_000_000_000 and users["bob"]["expires"] == "2027-06-30T23:59:59Z"
    assert users["carol"]["device_limit"] == 3 and users["dave"]["state"] == "disabled"
    # Every credential and limit came back as it was: the same subscriptions, byte for byte
    for name, text in before.items():
        assert cli("subscription", name, "--format", "links", "-f", str(path)).out == text
    bob = json.loads(cli("status", "bob", "-o", "json", "-f", str(path)).out)
    assert bob["state"] == "active" and {e["route"] for e in bob["entries"]} == {"europe", "fast", "usa"}
    refused = cli("subscription", "dave", "-f", str(path))
    assert refused.rc == 1 and "disabled" in refused.err
    assert cli("user", "url", "alice", "-f", str(path)).rc == 0
    # The file may not list users the database holds: one home for them
    path.write_text(from_database(example_text()) + "users:\n  - name: zed\n")
    run = cli("validate", "-f", str(path))
    assert run.rc == 1 and "settings.users.source is postgres" in run.out + run.err and "users import" in run.out + run.err


def test_bad_rows_are_left_out_one_by_one_and_the_rest_are_served(pg, cli, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(example_text())
    assert cli("users", "import", "-f", str(path)).rc == 0
    sql(pg, "INSERT INTO reconciler_users (name, region) VALUES ('eve', 'MARS')")
    sql(pg, "INSERT INTO reconciler_users (name, device_limit) VALUES ('frank', 0)")
    sql(pg, "INSERT INTO reconciler_users (name, reset_period, reset_day) VALUES ('gus', 'monthly', 'tuesday')")
    sql(pg, "INSERT INTO reconciler_users (name) VALUES ('not a name!')")
    path.write_text(from_database(example_text()))
    run = cli("validate", "-f", str(path))
    said = run.out + run.err
    assert run.rc == 0 and "4 users" in said, said
    for key in ("eve", "frank", "gus", "not a name!"):
        assert f"the database's user '{key}' is left out" in said
    assert "region" in said and "device_limit" in said
    run = cli("subscription", "alice", "--format", "links", "-f", str(path))
    assert run.rc == 0 and "'eve' is left out" in run.err


def test_a_schema_from_a_later_release_is_refused(pg, cli, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(example_text())
    assert cli("users", "import", "-f", str(path)).rc == 0
    sql(pg, "UPDATE reconciler_meta SET value = %s WHERE key = 'schema_version'", str(SCHEMA_VERSION + 1))
    run = cli("users", "import", "-f", str(path))
    assert run.rc == 1 and f"schema version {SCHEMA_VERSION + 1}, newer than this release knows" in run.err
    path.write_text(from_database(example_text()))
    run = cli("validate", "-f", str(path))
    assert run.rc == 1 and "upgrade the reconciler" in run.out + run.err


def test_a_connection_string_that_does_not_parse_is_not_quoted(pg, cli, tmp_path, monkeypatch):
    path = tmp_path / "cluster.yaml"
    path.write_text(from_database(example_text()))
    monkeypatch.setenv("RECONCILER_DATABASE_URL", f"host=127.0.0.1 password {PASSWORD}")  # psycopg's error quotes it
    run = cli("validate", "-f", str(path))
    assert run.rc == 1 and "connection string does not parse" in run.out + run.err
    assert PASSWORD not in run.out + run.err and PASSWORD[-6:] not in run.out + run.err


def test_the_database_down_is_said_without_its_password(pg, cli, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(example_text())
    assert cli("users", "import", "-f", str(path)).rc == 0
    path.write_text(from_database(example_text()))
    pg.stop()
    try:
        run = cli("validate", "-f", str(path))
        said = run.out + run.err
        assert run.rc == 1 and f"cannot reach the users' database vpn on 127.0.0.1:{pg.port}" in said, said
        assert PASSWORD not in said
    finally:
        pg.start_again()
    assert cli("validate", "-f", str(path)).rc == 0


def test_the_loop_follows_edits_and_keeps_its_users_while_the_database_is_away(pg, tmp_path, cli, caplog):
    caplog.set_level(logging.INFO, logger="reconciler.loop")
    path, _, runner = shadowsocks_fleet(tmp_path, "ab")
    text = path.read_text()
    assert cli("users", "import", "-f", str(path)).rc == 0
    sql(pg, "INSERT INTO reconciler_users (name) VALUES ('bob')")
    path.write_text(from_database(text))
    for name in "ab":
        install_agent(runner, name, HEALTHY)
    # The system's clock: the reconnection waits its backoff (a second, then two) in real time
    loop = Loop(str(path), UserDatabaseCluster(path), SECRET, watch=False, runner=runner, clock=SystemClock())
    assert [u.name for u in loop.cluster.users] == ["alice", "bob"]

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(loop.users.run(stop, lambda: loop.cluster, loop.reload_all_users, loop.reload_users))
        try:
            await until(lambda: loop.users.listening and loop.users.error is None, "listening")
            assert await loop.tick() is not None and not loop.answers.answer("bob", "links").refused
            sql(pg, "UPDATE reconciler_users SET enabled = false WHERE name = 'bob'")
            await until(lambda: not loop.cluster.user("bob").enabled, "bob's edit to reach the loop")
            assert await loop.tick() is not None and loop.answers.answer("bob", "links").refused  # the next interval
            assert loop.users.batches == 1
            # One row read, not every user: the edit is adopted as a change of one user, never as a reload
            assert any("1 user changed in the database vpn" in r.getMessage() for r in caplog.records)
            assert not any(r.getMessage().startswith("reloaded ") for r in caplog.records)
            kept = loop.cluster.user("alice")
            sql(pg, "INSERT INTO reconciler_users (name, data_limit) VALUES ('carol', 1000000)")
            await until(lambda: [u.name for u in loop.cluster.users] == ["alice", "bob", "carol"], "carol to arrive")
            assert loop.cluster.user("alice") is kept  # the others carried over as they were
            sql(pg, "UPDATE reconciler_users SET region = 'MARS' WHERE name = 'carol'")  # a bad edit: carol kept
            await until(lambda: any("user 'carol' is bad now" in r.getMessage() for r in caplog.records), "the bad row")
            assert loop.cluster.user("carol").data_limit == 1000000 and loop.cluster.user("carol").region is None
            pg.stop()  # the database goes away: the loop keeps its users and says why
            await until(lambda: loop.users.error is not None, "the loss to be noticed")
            assert "users' database vpn" in loop.users.error and PASSWORD not in loop.users.error
            assert [u.name for u in loop.cluster.users] == ["alice", "bob", "carol"]
            await asyncio.to_thread(pg.start_again)
            await until(lambda: loop.users.error is None, "listening again")
            # The catch-up reads every user again: carol's row is still bad, and a full load keeps her as an edit does
            await until(lambda: any("database's user 'carol' is bad now: keeping" in r.getMessage() for r in caplog.records),
                        "the catch-up's full load")
            assert [u.name for u in loop.cluster.users] == ["alice", "bob", "carol"]
            assert loop.cluster.user("carol").data_limit == 1000000 and loop.cluster.user("carol").region is None
            sql(pg, "UPDATE reconciler_users SET region = 'EEU' WHERE name = 'carol'")  # mended
            await until(lambda: loop.cluster.user("carol").region == "EEU", "carol's mended row")
            sql(pg, "DELETE FROM reconciler_users WHERE name = 'bob'")
            await until(lambda: [u.name for u in loop.cluster.users] == ["alice", "carol"], "bob's removal to reach the loop")
            sql(pg, "UPDATE reconciler_users SET name = 'caroline' WHERE name = 'carol'")  # a rename: both names told
            await until(lambda: [u.name for u in loop.cluster.users] == ["alice", "caroline"], "the rename")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)

    asyncio.run(scenario())


def UserDatabaseCluster(path: Path):
    """The cluster as `reconciler run` loads it (its users from the database)."""
    from reconciler.config import load_cluster

    loaded = load_cluster(str(path))
    assert loaded.cluster is not None, [d.render() for d in loaded.errors]
    return loaded.cluster


async def until(condition, what: str, seconds: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"waited {seconds:g}s for {what}"
        await asyncio.sleep(0.05)


def test_an_import_is_one_transaction(pg):
    """A bad user in the middle of an import leaves the table as it was (one transaction)."""
    from reconciler.model.cluster import User

    db = UserDatabase(pg.dsn())
    db.migrate()
    good = [User(name=f"u{i}") for i in range(1000)]

    class Broken(Exception):
        pass

    def users():  # type: ignore[no-untyped-def]
        yield from good[:500]
        raise Broken

    with pytest.raises(Broken):
        db.put(users())
    assert db.load().users == []
    assert db.put(good) == 1000 and len(db.load().users) == 1000


def test_with_users_replaces_adds_and_removes_without_touching_the_others():
    from reconciler.model.cluster import User

    _, cluster, _ = shadowsocks_fleet(Path(__import__("tempfile").mkdtemp()), "a")
    c = cluster.with_users({"bob": User(name="bob"), "cat": User(name="cat", enabled=False)})
    assert [u.name for u in c.users] == ["alice", "bob", "cat"] and c.users[0] is cluster.users[0]
    c2 = c.with_users({"bob": None, "alice": User(name="alice", region="EEU"), "nobody": None})
    assert [(u.name, u.region) for u in c2.users] == [("alice", "EEU"), ("cat", None)]
    assert c2.roster.index == {"alice": 0, "cat": 1} and c2.user("cat").enabled is False
    assert c.roster.index == {"alice": 0, "bob": 1, "cat": 2}  # the old cluster is as it was (frozen)


def test_an_empty_database_is_refused_by_validate_and_migrated_by_a_start(pg, cli, tmp_path):
    from reconciler.servable import servable

    path = tmp_path / "cluster.yaml"
    path.write_text(from_database(example_text()))
    run = cli("validate", "-f", str(path))
    assert run.rc == 1 and "holds no reconciler schema yet" in run.out + run.err
    cluster = servable(str(path), migrate_users=True)  # what `reconciler run` loads with
    assert cluster.users == [] and cli("validate", "-f", str(path)).rc == 0
