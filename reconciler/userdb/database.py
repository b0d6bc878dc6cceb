"""The users' database (PostgreSQL, through psycopg): its schema and migrations, loading every user, importing the
file's users, and the notifications a change of any user sends.

The connection string is a secret (it usually holds a password): it comes from the environment variable or the
0600 file ``settings.users.database`` names, never from the cluster file, and it is never logged; messages name the
database by its host, port and name only. The schema is the project's own and versioned (``reconciler_meta``): an
older one is migrated forward, a newer one (a later release wrote it) is refused with what to do.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from reconciler import gcpause
from reconciler.credentials import read_credential
from reconciler.errors import DatabaseError, SchemaTooNew
from reconciler.model.cluster import User, UserSettings
from reconciler.userdb.rows import COLUMNS, SELECT, row_of, user_of, users_of

SCHEMA_VERSION = 2
CHANNEL = "reconciler_users"
#: Seconds a connection attempt may take (a database that does not answer is down, not slow).
CONNECT_TIMEOUT = 5
#: Each version's statements, applied in order in one transaction from the version found to ``SCHEMA_VERSION``.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE IF NOT EXISTS reconciler_meta (key text PRIMARY KEY, value text NOT NULL)",
        """CREATE TABLE reconciler_users (
            name text PRIMARY KEY,
            enabled boolean NOT NULL DEFAULT true,
            region text,
            expires timestamptz,
            data_limit bigint CHECK (data_limit IS NULL OR data_limit >= 0),
            reset_period text NOT NULL DEFAULT 'never',
            reset_day text,
            device_limit integer,
            on_device_limit text NOT NULL DEFAULT 'report',
            rotate integer NOT NULL DEFAULT 0,
            updated_at timestamptz NOT NULL DEFAULT now())""",
        # Every change of a user tells the listening controllers whose: one notification per row, the name as its
        # payload (PostgreSQL folds the same payload sent twice in one transaction into one).
        f"""CREATE FUNCTION reconciler_users_changed() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF TG_OP <> 'INSERT' THEN PERFORM pg_notify('{CHANNEL}', OLD.name); END IF;
              IF TG_OP <> 'DELETE' AND (TG_OP = 'INSERT' OR NEW.name <> OLD.name) THEN
                PERFORM pg_notify('{CHANNEL}', NEW.name);
              END IF;
              RETURN NULL;
            END $$""",
        """CREATE TRIGGER reconciler_users_changed AFTER INSERT OR UPDATE OR DELETE ON reconciler_users
            FOR EACH ROW EXECUTE FUNCTION reconciler_users_changed()""",
    ),
    # The learned state (the usage ledger and every per-user number with it), written by the leader once per
    # interval in one transaction, fenced: a deposed leader's older fence writes nothing.
    2: (
        """CREATE TABLE reconciler_state (
            id smallint PRIMARY KEY CHECK (id = 1),
            generation text NOT NULL,
            fence bigint NOT NULL,
            pointer jsonb NOT NULL,
            blob bytea NOT NULL,
            written_at timestamptz NOT NULL DEFAULT now())""",
    ),
}


def dsn_of(settings: UserSettings) -> str:
    """The connection string from where ``settings.database`` says (a 0600 file wins over the variable)."""
    where = settings.database
    raw, place = read_credential(where.env, where.file, "users' database connection string")
    if not raw:
        raise DatabaseError(f"settings.users.source is postgres but {place} holds no connection string; set it "
                            "(e.g. postgresql://reconciler@db.internal/vpn) outside the cluster file")
    return raw.decode()


def describe(dsn: str) -> str:
    """The database as messages may name it: host, port and name, never a password."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "the users' database (its connection string does not parse)"
    host = info.get("host") or "localhost"
    return f"database {info.get('dbname') or info.get('user') or '?'} on {host}:{info.get('port') or 5432}"


@dataclass
class Loaded:
    users: list[User]
    bad: list[tuple[str, str]] = field(default_factory=list)  # (the row's key, why it was left out)
    seconds: float = 0.0


@dataclass
class Fetched:
    changed: dict[str, User | None]  # name → the user now, or None: no longer in the database
    bad: list[tuple[str, str]] = field(default_factory=list)


class UserDatabase:
    def __init__(self, dsn: str):
        self.dsn = dsn
        self.name = describe(dsn)

    def _checked_dsn(self) -> None:
        """A connection string that does not parse is said without psycopg's words, which quote it (and so, perhaps,
        the password in it)."""
        try:
            psycopg.conninfo.conninfo_to_dict(self.dsn)
        except psycopg.Error:
            raise DatabaseError("the users' database connection string does not parse (it is not shown: it may hold a "
                                "password); write it as postgresql://USER:PASSWORD@HOST:PORT/DATABASE") from None

    @contextlib.contextmanager
    def _connect(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection in one transaction (committed when the block ends, rolled back when it raises); every
        failure of the database's, on the way in or within, is a ``DatabaseError`` naming it."""
        self._checked_dsn()
        try:
            with psycopg.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT) as conn:
                yield conn
        except psycopg.Error as exc:
            raise DatabaseError(f"cannot reach the users' {self.name}: {_first_line(exc)}") from None

    def migrate(self) -> tuple[int, int]:
        """Bring the schema to ``SCHEMA_VERSION`` (one transaction, under an advisory lock so two controllers
        starting together do not both migrate). (the version found, the version now)."""
        with self._connect() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('reconciler_users_schema'))")
            found = _version(conn)
            if found > SCHEMA_VERSION:
                raise SchemaTooNew(self._too_new(found))
            for version in range(found + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)  # our own constant SQL
            conn.execute("INSERT INTO reconciler_meta VALUES ('schema_version', %s) ON CONFLICT (key) "
                         "DO UPDATE SET value = EXCLUDED.value", (str(SCHEMA_VERSION),))
        return found, SCHEMA_VERSION

    def _too_new(self, found: int) -> str:
        return (f"the users' {self.name} has schema version {found}, newer than this release knows ({SCHEMA_VERSION}): "
                "a later release wrote it; upgrade the reconciler, never downgrade a database")

    def _checked(self, conn: psycopg.Connection[Any]) -> None:
        found = _version(conn)
        if found > SCHEMA_VERSION:
            raise SchemaTooNew(self._too_new(found))
        if found == 0:
            raise DatabaseError(f"the users' {self.name} holds no reconciler schema yet: `reconciler users import` "
                                "creates it with the file's users (a start of `reconciler run` creates it empty)")
        if found < SCHEMA_VERSION:
            raise DatabaseError(f"the users' {self.name} has schema version {found}, this release needs "
                                f"{SCHEMA_VERSION}: run `reconciler users import` (it migrates) or start `reconciler run`")

    def load(self) -> Loaded:
        """Every user, in name order (a stable order: the same database gives the same cluster)."""
        started = time.perf_counter()
        users: list[User] = []
        bad: list[tuple[str, str]] = []
        # A million users are millions of objects: the collector would walk them again and again while they are made
        with self._connect() as conn, gcpause.paused():
            self._checked(conn)
            # A server-side cursor: rows arrive 20,000 at a time; a client-side one would hold all of them in libpq's
            # memory at once (240 MB at a million) before the first is read.
            with conn.cursor("reconciler_users_load", binary=True) as cur:
                cur.execute(SELECT + " ORDER BY name")
                while rows := cur.fetchmany(20_000):
                    good, wrong = users_of(rows)
                    users += good
                    bad += wrong
        return Loaded(users, bad, time.perf_counter() - started)

    def fetch(self, names: Iterable[str]) -> Fetched:
        """These users as the database has them now: a row gone is None; a bad row is left out of ``changed``
        (the loop keeps the user as last loaded) and said in ``bad``."""
        wanted = sorted(set(names))
        out = Fetched({})
        with self._connect() as conn:
            self._checked(conn)
            with conn.cursor(binary=True) as cur:
                cur.execute(SELECT + " WHERE name = ANY(%s)", (wanted,))
                for row in cur.fetchall():
                    got = user_of(row)
                    if isinstance(got, str):
                        out.bad.append((str(row[0])[:80], got))
                    else:
                        out.changed[got.name] = got
        bad = {key for key, _ in out.bad}
        for name in wanted:
            if name not in out.changed and name not in bad:
                out.changed[name] = None
        return out

    def put(self, users: Iterable[User]) -> int:
        """Insert or update ``users`` (by name) in one transaction, with COPY into a temporary table: a million
        rows in seconds. The count written."""
        columns = ", ".join(COLUMNS)
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in COLUMNS[1:])
        with self._connect() as conn:
            self._checked(conn)
            conn.execute("CREATE TEMPORARY TABLE incoming (LIKE reconciler_users INCLUDING DEFAULTS) ON COMMIT DROP")
            n = 0
            with conn.cursor().copy(f"COPY incoming ({columns}) FROM STDIN") as copy:
                for user in users:
                    copy.write_row(row_of(user))
                    n += 1
            conn.execute(f"INSERT INTO reconciler_users ({columns}) SELECT {columns} FROM incoming "
                         f"ON CONFLICT (name) DO UPDATE SET {updates}, updated_at = now()")
        return n

    def put_state(self, generation: str, fence: int, pointer: dict[str, Any], blob: bytes) -> bool:
        """The learned state as generation ``generation``, unless one of a newer fence is there (then False: this
        controller no longer leads). One transaction: a crash leaves the previous state whole."""
        with self._connect() as conn:
            self._checked(conn)
            cur = conn.execute(
                "INSERT INTO reconciler_state (id, generation, fence, pointer, blob) VALUES (1, %s, %s, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET generation = EXCLUDED.generation, fence = EXCLUDED.fence, "
                "pointer = EXCLUDED.pointer, blob = EXCLUDED.blob, written_at = now() "
                "WHERE reconciler_state.fence <= EXCLUDED.fence", (generation, fence, Jsonb(pointer), blob))
            return cur.rowcount == 1

    def get_state(self, known: str | None, limit: int) -> tuple[dict[str, Any], bytes] | None:
        """(pointer, blob) of the state there, unless it is generation ``known`` or there is none; a blob over
        ``limit`` bytes is refused before it is read."""
        with self._connect() as conn:
            self._checked(conn)
            row = conn.execute("SELECT generation, pointer, octet_length(blob) FROM reconciler_state WHERE id = 1").fetchone()
            if row is None or row[0] == known:
                return None
            generation, pointer, size = row
            if size > limit:
                raise DatabaseError(f"the learned state in the {self.name} is {size} bytes, more than the {limit} a "
                                    "controller reads: refused")
            blob = conn.execute("SELECT blob FROM reconciler_state WHERE id = 1 AND generation = %s",
                                (generation,)).fetchone()
            if blob is None:  # replaced between the two reads: the next look reads the newer one
                return None
            return (pointer if isinstance(pointer, dict) else {}), bytes(blob[0])

    async def changes(self, batch_seconds: float = 0.5) -> AsyncGenerator[set[str], None]:
        """The names of users changed since the last batch, as the database tells them (LISTEN), gathered for
        ``batch_seconds`` after the first: a bulk edit of a thousand users is one batch, not a thousand."""
        self._checked_dsn()
        try:
            conn = await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT, autocommit=True)
        except psycopg.Error as exc:
            raise DatabaseError(f"cannot listen to the users' {self.name}: {_first_line(exc)}") from None
        async with conn:
            try:
                await conn.execute(f"LISTEN {CHANNEL}")
            except psycopg.Error as exc:
                raise DatabaseError(f"cannot listen to the users' {self.name}: {_first_line(exc)}") from None
            yield set()  # listening: the caller may now read everything once without missing a change
            while True:
                try:
                    names = {n.payload async for n in conn.notifies(stop_after=1)}  # wait for the first
                    names |= {n.payload async for n in conn.notifies(timeout=batch_seconds)}  # and its batch
                except psycopg.Error as exc:  # the connection went: the caller listens again when it can
                    raise DatabaseError(f"lost the users' {self.name}: {_first_line(exc)}") from None
                yield names


def _version(conn: psycopg.Connection[Any]) -> int:
    exists = conn.execute("SELECT to_regclass('reconciler_meta') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return 0
    row = conn.execute("SELECT value FROM reconciler_meta WHERE key = 'schema_version'").fetchone()
    try:
        return int(row[0]) if row else 0
    except ValueError:
        return 10**6  # not ours to read: refused as newer


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
