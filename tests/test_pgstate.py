"""The learned state handed over through the users' PostgreSQL (``loop.pgstate``) while etcd keeps the election: a
real PostgreSQL and a real etcd on loopback ports. The channel itself (fenced writes, HMAC-checked reads, replays
refused), then two controllers' real ``Loop``s over the same fake servers: the leader is cut off from etcd (it may
still reach the database) and the standby leads within two leases, continuing every counter the old one wrote."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reconciler.config import load_cluster
from reconciler.credentials import Secret, user_token
from reconciler.lab.demo import free_port
from reconciler.loop.leader import Etcd
from reconciler.loop.pgstate import PgStateChannel
from reconciler.loop.role import Elected
from reconciler.loop.service import Loop
from reconciler.ssh.fake import FakeRunner
from reconciler.userdb import UserDatabase
from tests.fake_agents import install_agent
from tests.postgres import BIN, Postgres, users_in_database
from tests.test_leader import (
    ETCD,
    LEASE,
    SECRET,
    SECRET_TEXT,
    _assert_continued,
    _capture_publishes,
    _cluster_text,
    _controllers,
    _end,
    _leader,
    _network_cut,
    _wait,
    counting_agent,
    running_etcd,
)
from tests.test_leader import (
    _loop_file as leader_loop_file,
)

pytestmark = pytest.mark.skipif(BIN is None or ETCD is None, reason="needs Debian's postgresql and etcd-server "
                                "(`make setup` installs them)")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Postgres, str]]:
    pg = Postgres()
    try:
        pg.start()
        with running_etcd(tmp_path_factory.mktemp("etcd")) as etcd:
            yield pg, etcd
    finally:
        pg.close()


@pytest.fixture
def db(servers: tuple[Postgres, str], monkeypatch: pytest.MonkeyPatch) -> UserDatabase:
    pg, _ = servers
    with psycopg.connect(pg.dsn("postgres"), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS vpn WITH (FORCE)")
        conn.execute("CREATE DATABASE vpn")
    monkeypatch.setenv("RECONCILER_DATABASE_URL", pg.dsn())
    database = UserDatabase(pg.dsn())
    database.migrate()
    return database


def test_the_channel_writes_under_the_fence_and_reads_only_what_the_secret_signed(db):
    channel = PgStateChannel(db, SECRET)
    try:
        first = channel.publish_sync([], 7, b"state one" * 1000, {"by": "x", "ticks": 3})
        assert first is not None
        reader = PgStateChannel(db, SECRET)
        got = reader.read_sync()
        assert got is not None and got.blob == b"state one" * 1000 and got.pointer["ticks"] == 3
        assert reader.read_sync(first) is None  # nothing newer than what the reader has
        # A newer leader's fence wins; the deposed one's writes are refused by the row itself
        newer = PgStateChannel(db, SECRET)
        assert newer.publish_sync([], 9, b"state two", {"by": "y", "ticks": 4}) is not None
        assert channel.publish_sync([], 7, b"stale", {"by": "x", "ticks": 5}) is None
        got = reader.read_sync(first)
        assert got is not None and got.blob == b"state two"
        # The database is trusted with nothing the master secret does not sign
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute("UPDATE reconciler_state SET blob = 'forged'::bytea, "
                         "pointer = jsonb_set(pointer, '{size}', '6'), generation = generation || '0'")
        with pytest.raises(ValueError, match="HMAC does not match"):
            PgStateChannel(db, SECRET).read_sync()
        with pytest.raises(ValueError, match="HMAC does not match"):
            PgStateChannel(db, Secret(b"another-secret-0123456789abcdef!!")).read_sync(first)
    finally:
        channel.close()


def _loop_file(folder: Path, etcd: str, prefix_name: str) -> tuple[str, int]:
    """tests/test_leader.py's controller file, its users in the database."""
    path, port, _ = leader_loop_file(folder.parent, folder.name, etcd, prefix_name)
    Path(path).write_text(users_in_database(Path(path).read_text()))
    return path, port


def test_a_standby_takes_over_from_the_state_in_postgres_with_every_counter(db, servers, tmp_path):
    # spec: the takeover keeps every counter: the new leader continues the capacities, evaluations and bytes
    _, etcd = servers
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO reconciler_users (name) VALUES ('alice')")
    cut = tmp_path / "cut-at"
    agent = counting_agent(cut)
    runner = FakeRunner(tmp_path / "hosts")
    for server in ("a", "b"):
        install_agent(runner, server, agent)
    loops: dict[str, Loop] = {}
    for n in ("x", "y"):
        path, port = _loop_file(tmp_path / n, etcd, f"pg-{os.getpid()}")
        cluster = load_cluster(path).cluster
        assert cluster is not None and [u.name for u in cluster.users] == ["alice"]
        loops[n] = Loop(path, cluster, SECRET, listen=f"127.0.0.1:{port}", watch=False, runner=runner)
        assert isinstance(loops[n].role, Elected) and isinstance(loops[n].role.channel, PgStateChannel)
    published = _capture_publishes(loops)

    # The old leader is cut off from etcd only: it still reaches the database, where its older fence writes nothing
    last, now, took = asyncio.run(_network_cut(loops, published, cut, channel=False))
    _assert_continued(last, now, took)
    new = next(loop for loop in loops.values() if loop.learned is now)
    assert isinstance(new.role, Elected) and new.role.election is not None
    with psycopg.connect(db.dsn) as conn:
        row = conn.execute("SELECT fence, pointer->>'by' FROM reconciler_state").fetchone()
    assert row is not None and int(row[0]) == new.role.election.fence and row[1] == new.role.election.identity
    prefix = f"/reconciler/pg-{os.getpid()}/state/"  # nothing of the state in etcd: only the election's keys
    assert not Etcd([etcd], 3.0).range(prefix, range_end=_end(prefix), keys_only=True).get("kvs")


def test_a_sigkilled_leader_is_replaced_and_the_standby_goes_on_from_the_row(db, servers, tmp_path, monkeypatch):
    # Two real `reconciler run` processes; the leader is SIGKILLed: the standby leads within two leases and counts
    # on from the state the killed one last wrote to the database (etcd held only the election)
    _, etcd = servers
    monkeypatch.setenv("RECONCILER_SECRET", SECRET_TEXT)
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO reconciler_users (name) VALUES ('alice')")
    name = f"pgprocs-{os.getpid()}"
    text = users_in_database(_cluster_text(etcd, name, free_port()))
    token = user_token(SECRET, "alice")
    with _controllers(tmp_path, text, 120) as start:
        a = start("a")
        assert _wait(lambda: _leader(a).get("role") == "leader" and (_leader(a)["state"]["ticks"] or 0) >= 2
                     and _leader(a)["state"]["generation"], 60), (tmp_path / "a.log").read_text()[-3000:]
        b = start("b")
        st = _wait(lambda: (lb := _leader(b)).get("role") == "standby" and (lb["state"]["ticks"] or 0) >= 3 and lb, 60)
        assert st and st["state"]["published_by"] == _leader(a)["identity"], (tmp_path / "b.log").read_text()[-3000:]
        assert b.get(f"/sub/{token}/links")[0] == 200  # the standby serves, its users from the database
        prefix = f"/reconciler/{name}/state/"
        assert not Etcd([etcd], 3.0).range(prefix, range_end=_end(prefix), keys_only=True).get("kvs")
        fence_a = int(_leader(a)["fence"])
        with psycopg.connect(db.dsn) as conn:  # what the killed leader had written at least (it may write once more)
            row = conn.execute("SELECT pointer->>'ticks' FROM reconciler_state").fetchone()
        assert row is not None
        ticks_a = int(row[0])
        a.kill()
        killed_at = time.time()
        assert _wait(lambda: _leader(b).get("role") == "leader", 3 * LEASE + 5), (tmp_path / "b.log").read_text()[-3000:]
        assert float(_leader(b)["since"]) - killed_at < 2 * LEASE
        st = _wait(lambda: (lb := _leader(b))["state"]["published_by"] == lb["identity"] and lb, 20)
        assert st and int(st["fence"]) > fence_a and int(st["state"]["ticks"]) > ticks_a, (st, ticks_a)
        with psycopg.connect(db.dsn) as conn:
            row = conn.execute("SELECT fence, pointer->>'by' FROM reconciler_state").fetchone()
        assert row is not None and row[1] == st["identity"] and int(row[0]) == int(st["fence"])
        assert "leading from interval" in (tmp_path / "b.log").read_text()
        assert b.stop() == 0


def test_a_lone_controller_writes_its_state_every_interval_and_a_restart_goes_on_from_it(db, tmp_path):
    # A crash loses at most one interval: the state folder's big state is written once every few minutes, the row
    # after every interval; a restart whose folder lost the newest state goes on from the row.
    from reconciler.loop.role import Alone
    from tests.fake_agents import HEALTHY, shadowsocks_fleet

    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO reconciler_users (name) VALUES ('alice')")
    path, _, runner = shadowsocks_fleet(tmp_path, "ab")
    text = users_in_database(path.read_text())
    path.write_text(text.replace("report_interval: 60s", "report_interval: 1s"))
    for name in "ab":
        install_agent(runner, name, HEALTHY)
    cluster = load_cluster(str(path)).cluster
    assert cluster is not None

    def started() -> Loop:
        return Loop(str(path), cluster, SECRET, watch=False, runner=runner, max_ticks=4,
                    listen=f"127.0.0.1:{free_port()}", operations_listen=f"127.0.0.1:{free_port()}")

    first = started()
    assert isinstance(first.role, Alone) and first.role.publishing()
    assert asyncio.run(first.run()) == 0
    with psycopg.connect(db.dsn) as conn:
        row = conn.execute("SELECT pointer->>'ticks', pointer->>'by' FROM reconciler_state").fetchone()
    assert row is not None and int(row[0]) == first.learned.ticks >= 4 and row[1] == "alone"
    # The crash took the folder's state with it: the next start goes on from the row, not from zero
    for saved in (tmp_path / ".reconciler").glob("learned*"):
        saved.unlink()
    second = started()
    assert second.learned.ticks == 0
    asyncio.run(second.role.take_over())
    assert second.learned.ticks == first.learned.ticks
