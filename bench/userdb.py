"""Users in PostgreSQL at a million: importing them, loading them, and one user's edit reaching the loop.

A PostgreSQL of its own (Debian's server binaries, a fresh cluster on a loopback port, stopped by its PID at the
end: ``tests/postgres.py``) is filled with U users of the shapes operators keep (a tenth with a data limit and a
monthly reset, a tenth expiring, one in fifty disabled, regions spread) by ``UserDatabase.put`` (COPY, one
transaction). Then, each in a fresh process so that its peak memory is its own:

- ``load``: ``UserDatabase.load()``, every row read and validated into a ``User``;
- ``anchor``: the same rows fetched by psycopg as the loader fetches them (a server-side cursor, 20,000 at a
  time) and dropped (the floor any loader pays);
- ``cluster``: ``load_cluster`` of a file whose users are the database's (servers and routes from the example):
  what ``validate``, ``plan`` and a start pay.

Each reports its wall seconds and its peak RSS above the interpreter with its imports (``ru_maxrss`` minus the
same process's RSS before it starts). The three run once per round, in an order that rotates each round
(``bench/harness.py``, ``--rounds``): their seconds are the medians of the rounds, each ratio to the anchor is
taken round by round (median and spread), and a peak is the largest of the rounds (its target is a ceiling).
Then the learned state's handover through the database (``loop.pgstate``): writing its row and reading it back
checked, at the size a million users' state has (38 MB, incompressible as the compressed state is). Last, the
loop's own path for one edit: a real ``Loop`` over the loaded cluster listens (LISTEN/NOTIFY, ``loop.users``), one
row is updated, and the seconds until the loop holds the new user are measured (median of 5 edits): the edit is in
the next interval's subscriptions and plan, so it reaches its servers within one interval when this is well under
one.

    python bench/userdb.py [--users N] [--rounds 3] [--json]

Targets at U = 1M: load ≤ 5 s and ≤ 500 MB; an edit reaches the loop well within one 60 s interval.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

REGIONS = ("EEU", "WEU", "ENAM", "WNAM", "SEAS", "NEAS", "ME", "SSAM")

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
kind, dsn, path = sys.argv[2], sys.argv[3], sys.argv[4]
import psycopg
from reconciler.config import load_cluster
from reconciler.userdb import UserDatabase
from reconciler.userdb.rows import SELECT
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
t = time.perf_counter()
if kind == "load":
    n = len(UserDatabase(dsn).load().users)
elif kind == "anchor":
    n = 0
    with psycopg.connect(dsn) as conn, conn.cursor("anchor", binary=True) as cur:
        cur.execute(SELECT + " ORDER BY name")
        while rows := cur.fetchmany(20_000):
            n += len(rows)
else:
    loaded = load_cluster(path)
    assert loaded.cluster is not None, [d.render() for d in loaded.errors][:3]
    n = len(loaded.cluster.users)
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"users": n, "seconds": seconds, "peak_mib": (peak - before) / 2**20}))
"""


def users(n: int):  # type: ignore[no-untyped-def]
    from reconciler.model.cluster import User

    for i in range(n):
        data: dict[str, object] = {"name": f"u{i:07d}", "region": REGIONS[i % len(REGIONS)]}
        if i % 10 == 0:
            data |= {"data_limit": 100_000_000_000, "reset": {"period": "monthly", "day": 1 + i % 28}}
        if i % 10 == 3:
            data["expires"] = "2027-06-30"
        if i % 50 == 7:
            data["enabled"] = False
        yield User.model_validate(data)


def child(kind: str, dsn: str, path: Path) -> dict[str, float]:
    env = {**os.environ, "RECONCILER_DATABASE_URL": dsn}
    run = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), kind, dsn, str(path)], capture_output=True, text=True,
                         env=env, timeout=1800)
    if run.returncode != 0:
        raise SystemExit(f"{kind} failed: {run.stderr[-2000:]}")
    out: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def loads(dsn: str, path: Path, users: int, rounds: int, log: Any) -> dict[str, Any]:
    """The anchor, ``load`` and ``cluster``, each in a fresh process, interleaved over ``rounds``."""
    peaks: dict[str, list[float]] = {"anchor": [], "load": [], "cluster": []}

    def run(kind: str) -> float:
        got = child(kind, dsn, path)
        assert got["users"] == users, got
        peaks[kind].append(got["peak_mib"])
        return got["seconds"]

    got = harness.interleaved({kind: functools.partial(run, kind) for kind in peaks}, rounds, "anchor", log)
    figures: dict[str, Any] = {}
    for kind in peaks:
        figures[f"{kind}_s"] = round(got["values"][kind]["median"], 2)
        figures[f"{kind}_peak_mib"] = round(max(peaks[kind]))
    figures["load_vs_anchor"] = round(got["ratios"]["load"]["median"], 2)
    return figures | got


def postgres_version(dsn: str) -> str:
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def edit_latency(path: Path, dsn: str, edits: int = 5) -> list[float]:
    """Seconds from an UPDATE's commit to the loop holding the new user (a real Loop listening)."""
    import psycopg

    from reconciler.config import load_cluster
    from reconciler.credentials import Secret
    from reconciler.loop.clock import SystemClock
    from reconciler.loop.service import Loop
    from reconciler.ssh.fake import FakeRunner

    cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    loop = Loop(str(path), cluster, Secret(b"userdb-bench-secret-0123456789abcd"), watch=False,
                runner=FakeRunner(path.parent / "hosts"), clock=SystemClock())
    seen: list[float] = []

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(loop.users.run(stop, lambda: loop.cluster, loop.reload_all_users, loop.reload_users))
        await asyncio.sleep(1.0)  # listening
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for k in range(edits):
                limit = 1_000_000_000 + k
                t = time.perf_counter()
                await conn.execute("UPDATE reconciler_users SET data_limit = %s WHERE name = 'u0000042'", (limit,))
                while loop.cluster.user("u0000042").data_limit != limit:
                    assert time.perf_counter() - t < 120, "the edit did not reach the loop in 120 s"
                    await asyncio.sleep(0.01)
                seen.append(time.perf_counter() - t)
        stop.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(run())
    return seen


#: The learned state's size at 1,000 servers and a million users (bench/fleet_scale.py's saved state), compressed.
STATE_BYTES = 38_000_000


def state_handover(db) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Seconds to write the learned state's row (the leader, every interval) and to read and check it (a standby,
    every interval, and a new leader at its takeover), at the size a million users' state has (median of 3)."""
    from reconciler.credentials import Secret
    from reconciler.loop.pgstate import PgStateChannel

    secret = Secret(b"userdb-bench-secret-0123456789abcd")
    writer, reader = PgStateChannel(db, secret), PgStateChannel(db, secret)
    blob = os.urandom(STATE_BYTES)  # incompressible, as the compressed state is
    writes, reads = [], []
    try:
        for _ in range(3):
            t = time.perf_counter()
            assert writer.publish_sync([], 5, blob, {"by": "bench", "ticks": 1}) is not None
            writes.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = reader.read_sync()
            reads.append(time.perf_counter() - t)
            assert got is not None and len(got.blob) == STATE_BYTES
    finally:
        writer.close()
        reader.close()
    return {"state_mb": STATE_BYTES / 1e6, "state_write_s": round(statistics.median(writes), 2),
            "state_read_s": round(statistics.median(reads), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the loads (at least 3)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import psycopg

    from reconciler.userdb import UserDatabase
    from tests.postgres import BIN, Postgres, users_in_database

    if BIN is None:
        print("needs Debian's postgresql package (`make setup` installs it)")
        return 1
    machine = harness.machine()  # the load before the run; the anchors' versions once the server is up
    pg = Postgres().start()
    try:
        dsn = pg.dsn()
        machine["anchors"] = {"postgresql": postgres_version(dsn), "psycopg": psycopg.__version__}
        db = UserDatabase(dsn)
        db.migrate()
        t = time.perf_counter()
        n = db.put(users(args.users))
        imported = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "cluster.yaml"
            path.write_text(users_in_database((ROOT / "cluster.example.yaml").read_text()))
            os.environ["RECONCILER_DATABASE_URL"] = dsn
            figures: dict[str, Any] = {"machine": machine, "users": n, "import_s": round(imported, 2)}
            figures |= loads(dsn, path, n, args.rounds, None if args.json else harness.stderr)
            figures["load_bytes_per_user"] = round(figures["load_peak_mib"] * 2**20 / n)
            figures |= state_handover(db)
            latencies = edit_latency(path, dsn)
            figures["edit_to_loop_s_median"] = round(statistics.median(latencies), 2)
            figures["edit_to_loop_s_max"] = round(max(latencies), 2)
    finally:
        pg.close()
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            if not isinstance(value, dict):  # the machine, the rounds' values and ratios: in --json
                print(f"{key:>24}: {value}")
        ratio = figures["ratios"]["load"]
        print(f"load / anchor: × {ratio['median']} (spread {ratio['spread']:.1%} over {args.rounds} rounds); "
              f"{machine['cpu_model']}, {machine['cpus']} CPUs, PostgreSQL {machine['anchors']['postgresql']}")
        print(f"targets at 1M: load ≤ 5 s ({figures['load_s']} s), ≤ 500 MiB ({figures['load_peak_mib']} MiB); "
              f"an edit within one 60 s interval ({figures['edit_to_loop_s_max']} s at most)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
