"""Fleet scale benchmark: one report interval of the whole controller at 100 to 1,000 servers and
100k to 1M users, through the real code path.

The controller is the real ``Loop`` (``reconciler.loop.service``): ``tick()`` collects every server's report over
real asyncssh connections (the loop's own SSH pool, host keys pinned), parses them (hostile input: every field
checked), folds them into verdicts, capacity, RTTs and the users' ledger, builds the snapshot (every user
balanced), and feeds the outlets (the live endpoint's snapshot and the subscription files, on tmpfs); then
the metrics are scraped once (``/metrics``' text). The servers are one asyncssh server in a separate process
(so its CPU is not the controller's) answering each agent request as the agent would: the listeners asked
about, a result for every probe it was asked to make, the kernel's per-user counters of its users (every user
carrying traffic every interval: the worst case; 1% of them a burst of 900 MB, so that their subscription
files' usage step changes and the file outlet rewrites them), their devices and connections.

Figures per N (servers) and U (users), medians over the measured intervals after a warm-up (the first
connection to every server and the first full write of the files are not an interval's work): controller
CPU seconds (this process and the worker processes it waited for) and wall time per interval, bytes of reports
received per interval, probes per server, and the process's peak memory. Targets at N = 1,000, U = 1M: an
interval's work ≤ 10% of a 60 s interval on one core, memory ≤ 2 GB.

The intervals run back to back here, so two costs of a real 60 s interval are counted apart and added to its
CPU: the work between intervals (10 s of idling sampled, scaled to the rest of the interval: timers and
keepalives) and the learned state's save, which a big state (≥ 16 MB) gets every 5 minutes, not every
interval (one save measured; a fifth of it per interval). ``phases_cpu_s`` shows both (``idle``, ``save``).

    python bench/fleet_scale.py [--quick] [--json] [--disk] [--state-in-postgres]
    (--quick: U = 100k only; the full run adds U = 1M)

``--state-in-postgres``: the learned state (the usage ledger with it) also goes to a PostgreSQL started on loopback
by the benchmark, as with ``settings.users.source: postgres``: saved and written in one transaction after every
interval (``pgstate.PgStateChannel``), both counted in full (``phases_cpu_s``: ``save``, ``state_write``). Run it
beside the same case without it, one after the other: alternating the two in one process let one's costs land
in the other's intervals.

The subscription files are on tmpfs (a tmpfs of its own for a million users: root), as an operator serving them
from memory has them; ``--disk`` puts them on the disk under .bench/ for the figure beside it.

The JSON (``--json``, and each ``--case``'s line) records the machine (``bench/harness.py``) and, with
``--state-in-postgres``, PostgreSQL's server version. There is no timing anchor: the targets are shares of 60 s.

FLEET_SCALE_PROFILE=FILE (with py-spy on PATH) writes a sampling profile of the measured intervals (all threads);
FLEET_SCALE_MEMORY=1 prints the process's memory (now, and its peak) after each step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

INTERVAL = 60.0
TARGET_SHARE = 0.10
TARGET_RSS_MB = 2048
SECRET = b"fleet-scale-bench-secret-0123456789abcdef"
ASSIGNED = "assigned.npy"  # in the case's folder: where the controller assigned each user
IDLE_S = 10.0  # seconds of idling sampled after the intervals (the work between intervals)
BURST = 0.01  # the share of users whose usage crosses a step of their subscription-userinfo in an interval


# ------------------------------------------------------------------ the servers (a separate process)


def serve(port_file: str, host_key: str, client_pub: str, servers: int, users: int) -> None:
    """An asyncssh server answering every server's agent request (the servers are told apart by the SSH user)."""
    import asyncssh

    from reconciler.credentials import Secret
    from reconciler.engine.agent import packed  # the agent's own packing of its counters (agent 2)
    from reconciler.engine.base import mark_key, marks_for  # the marks the controller gives the users (the same function)

    rng = random.Random(17)

    marks = marks_for(tuple(f"u{i}" for i in range(users)), mark_key(Secret(SECRET)))
    rows: dict[str, list[list[Any]]] = {}
    steps: dict[str, list[int]] = {}  # with FLEET_SCALE_STEADY=1: each row's packets per request (no bursts)
    steady = os.environ.get("FLEET_SCALE_STEADY") == "1"
    connected: dict[str, list[str]] = {}
    placed = Path(port_file).with_name(ASSIGNED)  # where the controller put each user (after its first interval)
    seen = [-1.0]

    def layout() -> None:
        """Each user's counters on the server the controller assigned it to (a server is believed only about
        its own users), or round robin until the controller has said."""
        at = placed.stat().st_mtime if placed.exists() else 0.0
        if at == seen[0]:
            return
        seen[0] = at
        where = np.load(placed) if at else np.arange(users) % servers
        rows.clear()
        steps.clear()
        connected.clear()
        rows.update({f"s{i}": [] for i in range(servers)})
        steps.update({f"s{i}": [] for i in range(servers)})
        connected.update({f"s{i}": [] for i in range(servers)})
        for i in range(users):
            server = f"s{int(where[i])}"
            name = f"u{i}"
            rows[server].append([marks[name], "ipv4", "tcp", 0, 0])
            steps[server].append(steady_step(i))
            if i % 50 == 0:
                connected[server].append(name)

    def report(server: str, request: dict[str, Any]) -> str:
        layout()
        tx, rx = [], []
        for row, step in zip(rows.get(server, []), steps.get(server, []), strict=True):
            if steady:
                pkts = step
            else:
                pkts = rng.randrange(1, 200) if rng.random() >= BURST else 100_000  # a burst: 90 MB up, 810 MB down
            row[3] += pkts
            row[4] += pkts * 900
            tx.append(row[:])
            rx.append([row[0], row[1], row[2], row[3] * 2, row[4] * 9])
        probes = {p["id"]: {"ok": True, "rtt_ms": round(rng.uniform(5, 80), 3)} for p in request.get("probes", [])}
        users_now = connected.get(server, [])
        return json.dumps({
            "agent": 2, "time": time.time(), "service": "active",
            "listeners": {f"{p}/{t}": True for p, t in request.get("listeners", [])},
            "traffic": {"up": rng.randrange(1 << 40), "down": rng.randrange(1 << 40)}, "users": users_now,
            "connections": len(users_now), "devices": {u: ["0123456789abcdef"] for u in users_now},
            "usage": {"packed": 1, "tx": packed(tx), "rx": packed(rx), "epoch": "boot/1/2"}, "probes": probes,
            "took_ms": 12.0}) + "\n"

    class Server(asyncssh.SSHServer):
        def begin_auth(self, username: str) -> bool:
            return True

    async def handle(process: asyncssh.SSHServerProcess) -> None:
        try:
            text = await process.stdin.read()
            request = json.loads(text) if text.strip() else {}
            process.stdout.write(report(process.get_extra_info("username"), request))
            process.exit(0)
        except Exception as exc:  # noqa: BLE001 — a broken request ends that session, never the server
            process.stderr.write(f"{type(exc).__name__}: {exc}\n")
            process.exit(1)

    async def main() -> None:
        server = await asyncssh.listen("127.0.0.1", 0, server_host_keys=[host_key], authorized_client_keys=client_pub,
                                       process_factory=handle, server_factory=Server, encoding="utf-8",
                                       encryption_algs=["aes128-gcm@openssh.com"], line_editor=False)
        port = server.sockets[0].getsockname()[1]
        Path(port_file).write_text(str(port))
        await asyncio.Event().wait()

    asyncio.run(main())


# ------------------------------------------------------------------ the controller


def steady_step(i: int) -> int:
    """User ``i``'s packets per report with FLEET_SCALE_STEADY=1: its bytes grow by ``10 * 900 * steady_step(i)``
    a report (900 bytes a packet up, nine times as many bytes down)."""
    return 1 + i % 7


def cluster_data(servers: int, users: int, port: int, key: str, host_pub: str) -> dict[str, Any]:
    """The cluster as the file would hold it (validated by the same model; the file loader's own scale is
    tests/test_yaml_scale.py's business: the interval's work starts from a loaded cluster)."""
    countries = ["DE", "NL", "FR", "US", "GB", "FI", "PL", "SE", "JP", "SG"]
    return {
        "settings": {"health": {"report_interval": "60s"}, "outputs": {"subscriptions_dir": "subs", "state_dir": "state"},
                     "self_heal": False},
        "servers": [{"name": f"s{i}", "host": "127.0.0.1", "country": countries[i % len(countries)],
                     "ssh": {"user": f"s{i}", "port": port, "identity": key, "host_key": host_pub}, "prober": i < 2,
                     "inbounds": [{"id": f"s{i}-in", "name": f"S{i}", "protocol": "trojan", "port": 8443, "route": "r",
                                   "tls": {"server_name": "www.example.com"}}]} for i in range(servers)],
        "routes": [{"id": "r", "name": "R"}],
        "users": [{"name": f"u{i}", **({"data_limit": "100GB", "reset": "monthly"} if i % 2 else {})} for i in range(users)],
    }


async def measure(servers: int, users: int, intervals: int, work: Path, port: int, key: str, host_pub: str,
                  dsn: str | None = None) -> dict[str, Any]:
    from prometheus_client import generate_latest

    import reconciler.loop.collect as collection
    import reconciler.loop.service as service
    from reconciler.apply.session import pool_for
    from reconciler.credentials import Secret
    from reconciler.fleet.reports import agent_request
    from reconciler.loop.pgstate import PgStateChannel
    from reconciler.loop.role import Alone
    from reconciler.loop.service import Loop
    from reconciler.model import Cluster
    from reconciler.ssh.pool import IDLE_KEEPALIVE_S
    from reconciler.userdb import UserDatabase

    case = work / f"n{servers}-u{users}"
    case.mkdir()
    path = case / "c.yaml"
    path.write_text("# the cluster is built in memory by bench/fleet_scale.py\n")
    cluster = Cluster.model_validate(cluster_data(servers, users, port, key, host_pub))
    loop = Loop(str(path), cluster, Secret(SECRET), watch=False, role=Alone())
    loop.pool = pool_for(loop.state, concurrency=64)
    pg_role = None
    if dsn is not None:
        db = UserDatabase(dsn)
        db.migrate()
        pg_role = Alone(PgStateChannel(db, Secret(SECRET)))
        pg_role.attach(loop)
    received = [0]
    parse = collection.parse_report

    def counting(name: str, text: str, at: float, *rest: Any) -> Any:
        received[0] += len(text)
        return parse(name, text, at, *rest)

    collection.parse_report = counting  # type: ignore[assignment]
    phases = phase_clock(loop, service)
    if pg_role is not None:
        pg_role.publish = clocked(phases, "state_write", pg_role.publish)  # type: ignore[method-assign]
        loop.role = pg_role  # type: ignore[assignment]
    _memory("the cluster and the loop made")
    samples = []
    profiler: subprocess.Popen[bytes] | None = None
    try:
        for i in range(intervals + 1):
            if i == 1 and os.environ.get("FLEET_SCALE_PROFILE"):  # a sampling profile of the measured intervals
                profiler = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--format", "raw",
                                             "--rate", "50", "-o", os.environ["FLEET_SCALE_PROFILE"]])
                await asyncio.sleep(1.0)
            received[0] = 0
            phases.clear()
            c0, w0 = _cpu(), time.perf_counter()
            verdicts = await loop._tick_by_role()
            t = time.process_time()
            metrics = generate_latest(loop.registry)
            phases["metrics"] += time.process_time() - t
            cpu, wall = _cpu() - c0, time.perf_counter() - w0
            assert verdicts is not None, loop._interval_error
            ok = sum(v.status == "ok" for v in verdicts.servers().values())
            if i:  # the first interval connects to every server and writes every user's files: a warm-up
                samples.append((cpu, wall, received[0], len(metrics), ok, dict(phases)))
            else:  # from now on the servers report each user where the controller assigned it
                tell_assignments(loop, work / ASSIGNED, servers, users)
        # Work between intervals (timers, keepalives: the pool's idle connections send one after IDLE_KEEPALIVE_S,
        # longer than the rest of an interval), measured over IDLE_S of idling and scaled to the rest of 60 s.
        wall = statistics.median(s[1] for s in samples)
        c0 = _cpu()
        await asyncio.sleep(IDLE_S)
        idle = (_cpu() - c0) * max(0.0, INTERVAL - wall) / IDLE_S
        assert IDLE_KEEPALIVE_S > INTERVAL, "the idle sample would miss the keepalives"
        # A big learned state is saved every BIG_STATE_EVERY seconds, not after every interval (the intervals here
        # run back to back, so none of them did): one save measured, and its share of a 60 s interval counted.
        c0 = _cpu()
        loop._save()
        save_once = _cpu() - c0
    finally:
        if profiler is not None:
            profiler.send_signal(2)
            profiler.wait(60)
        collection.parse_report = parse  # type: ignore[assignment]
        await loop.pool.close()
        if pg_role is not None and pg_role.channel is not None:
            pg_role.channel.close()
    ordinary = "s5"  # s0 and s1 are probers: they probe everyone (HEALTH-9)
    probes = len(agent_request(cluster, ordinary, "x", 1.0, interval=loop._tick_index)["probes"])  # type: ignore[arg-type]
    big = loop._saved[1] >= service.BIG_STATE_BYTES and pg_role is None  # with the database: saved every interval
    save = save_once * INTERVAL / service.BIG_STATE_EVERY if big else statistics.median(s[5].get("save", 0.0) for s in samples)
    cpu = statistics.median(s[0] - s[5].get("save", 0.0) for s in samples) + save + idle
    phases_cpu = {k: round(statistics.median(s[5].get(k, 0.0) for s in samples), 3) for k in samples[-1][5]}
    phases_cpu.update(save=round(save, 3), idle=round(idle, 3))
    return {"servers": servers, "users": users, "state": "postgres" if pg_role is not None else "folder",
            "interval_cpu_s": round(cpu, 3),
            "interval_wall_s": round(wall, 3),
            "save_once_cpu_s": round(save_once, 3), "state_bytes": loop._saved[1],
            "state_saved_every_s": service.BIG_STATE_EVERY if big else INTERVAL,
            "report_bytes": int(statistics.median(s[2] for s in samples)), "metrics_bytes": samples[-1][3],
            "servers_ok": samples[-1][4], "probes_per_server": probes,
            "rows_not_believed": sum(rows for rows, _ in loop.learned.ledger.refused.values()),  # 0: all counted
            "share_of_60s": round(cpu / INTERVAL, 4), "phases_cpu_s": phases_cpu}


def tell_assignments(loop: Any, path: Path, servers: int, users: int) -> None:
    """Write each user's assigned server (index) for the servers' process: the bench's users use what they were
    given, as real apps do, so every row the servers report is believed (the worst case for the fold)."""
    where = np.arange(users) % servers
    for (user, _route), inbound in loop.learned.assignments.items():
        where[int(user[1:])] = int(inbound.split("-", 1)[0][1:])
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, where.astype(np.int32))
    os.replace(tmp, path)


def phase_clock(loop: Any, service: Any) -> Counter[str]:
    """Where an interval's CPU goes: the process's CPU time across each step of ``tick`` (they run one after
    another, so the process-wide clock is theirs; collect includes the SSH sessions and parsing the reports)."""
    phases: Counter[str] = Counter()
    loop.collection.collect = clocked(phases, "collect", loop.collection.collect)
    loop.learned.fold = clocked(phases, "fold", loop.learned.fold)
    service.snapshot = clocked(phases, "snapshot", service.snapshot)
    loop.answers.publish = clocked(phases, "publish", loop.answers.publish)
    loop._tell = clocked(phases, "tell", loop._tell)  # the events, the log and whether to plan now (users out or back)
    loop.files.write = clocked(phases, "files", loop.files.write)
    loop._save = clocked(phases, "save", loop._save)
    return phases


def clocked(phases: Counter[str], name: str, fn: Any) -> Any:
    """``fn`` with the process's CPU time across each call added to ``phases[name]``."""
    if asyncio.iscoroutinefunction(fn):
        async def waiting(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return await fn(*a, **k)
            finally:
                phases[name] += time.process_time() - t
                _memory(name)
        return waiting

    def plain(*a: Any, **k: Any) -> Any:
        t = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            phases[name] += time.process_time() - t
            _memory(name)
    return plain


def _memory(step: str) -> None:
    """With FLEET_SCALE_MEMORY set: the process's memory after ``step`` (now and its peak so far), on stderr."""
    if not os.environ.get("FLEET_SCALE_MEMORY"):
        return
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    print(f"memory after {step}: {int(status['VmRSS'].split()[0]) >> 10} MiB, peak {int(status['VmHWM'].split()[0]) >> 10} MiB",
          file=sys.stderr, flush=True)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="U = 100k at N = 100, 300, 1,000 (no 1M run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--case", nargs=2, type=int, help=argparse.SUPPRESS)  # one (N, U) in a fresh process
    ap.add_argument("--intervals", type=int, default=3)
    ap.add_argument("--disk", action="store_true", help="the subscription files on the disk (.bench/), not on tmpfs")
    ap.add_argument("--state-in-postgres", action="store_true",
                    help="also measure intervals whose learned state goes to PostgreSQL, alternating with the folder's")
    args = ap.parse_args()
    if args.serve:
        port_file, host_key, client_pub, n, u = args.serve
        serve(port_file, host_key, client_pub, int(n), int(u))
        return 0
    logging.basicConfig(level=logging.ERROR)  # per-inbound notes would flood the output at 1,000 servers
    if args.case:
        return run_case(*args.case, args.intervals, args.disk, args.state_in_postgres)
    cases = [(100, 100_000), (300, 100_000), (1000, 100_000)] + ([] if args.quick else [(1000, 1_000_000)])
    machine = harness.machine()
    results = []
    for n, u in cases:  # each case in its own process: its peak memory is its own
        out = subprocess.run([sys.executable, __file__, "--case", str(n), str(u), "--intervals", str(args.intervals)]
                             + (["--disk"] if args.disk else [])
                             + (["--state-in-postgres"] if args.state_in_postgres else []),
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
            return 1
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        machine["anchors"].update(results[-1].pop("machine")["anchors"])  # PostgreSQL's version, when it ran
        if not args.json:
            r = results[-1]
            print(f"N={r['servers']:>5} U={r['users']:>8}: {r['interval_cpu_s']:7.2f} CPU-s {r['interval_wall_s']:7.2f} s wall "
                  f"({100 * r['share_of_60s']:.1f}% of 60 s), reports {r['report_bytes'] / 1e6:.1f} MB, "
                  f"{r['probes_per_server']} probes/server, peak {r['peak_rss_mb']:.0f} MB, files on {r['files_on']}\n    CPU-s by "
                  "step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_cpu_s"].items()), flush=True)
    by = {(r["servers"], r["users"]): r for r in results}
    figures: dict[str, Any] = {"machine": machine, "runs": results}
    for (n, u), r in by.items():
        tag = f"n{n}" + ("" if u == 100_000 else "_u1m")
        figures[f"interval_cpu_s_{tag}"] = r["interval_cpu_s"]
        figures[f"interval_wall_s_{tag}"] = r["interval_wall_s"]
        figures[f"report_bytes_{tag}"] = r["report_bytes"]
        figures[f"peak_rss_mb_{tag}" if u == 100_000 else f"peak_rss_mb_n{n}_u1m"] = r["peak_rss_mb"]
    big = by.get((1000, 1_000_000)) or by[(1000, 100_000)]
    small = by[(100, 100_000)]
    figures["growth_cpu_n100_to_n1000"] = round(by[(1000, 100_000)]["interval_cpu_s"] / small["interval_cpu_s"], 2)
    figures["targets_met"] = big["share_of_60s"] <= TARGET_SHARE and big["peak_rss_mb"] <= TARGET_RSS_MB
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"N 100 → 1,000 at U = 100k: CPU ×{figures['growth_cpu_n100_to_n1000']} (linear would be ×10); "
              f"targets (≤ {100 * TARGET_SHARE:.0f}% of 60 s, ≤ {TARGET_RSS_MB} MB at the largest case): "
              f"{'met' if figures['targets_met'] else 'NOT met'}")
    return 0 if figures["targets_met"] else 1


def run_case(servers: int, users: int, intervals: int, disk: bool = False, postgres: bool = False) -> int:
    import asyncssh

    from reconciler.lab.processes import stop
    from tests.postgres import Postgres

    pg = Postgres() if postgres else None
    machine = harness.machine()

    work, files_on = workspace(users, disk)
    host = asyncssh.generate_private_key("ssh-ed25519")
    client = asyncssh.generate_private_key("ssh-ed25519")
    (work / "host").write_bytes(host.export_private_key())
    (work / "client").write_bytes(client.export_private_key())
    os.chmod(work / "client", 0o600)
    (work / "client.pub").write_bytes(client.export_public_key())
    port_file = work / "port"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file), str(work / "host"),
                               str(work / "client.pub"), str(servers), str(users)])
    try:
        if pg is not None:
            pg.start()
            machine["anchors"]["postgresql"] = postgres_version(pg.dsn())
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the fake fleet did not start")
            time.sleep(0.1)
        host_pub = host.export_public_key().decode().split()[:2]
        result = asyncio.run(measure(servers, users, intervals, work, int(port_file.read_text()), str(work / "client"),
                                     " ".join(host_pub), pg.dsn() if pg is not None else None))
        result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        result["files_on"] = files_on
        result["machine"] = machine
        print(json.dumps(result))
        return 0
    finally:
        stop(server)
        if pg is not None:
            pg.close()
        if files_on == "tmpfs (own mount)":  # five million files go with the mount, in a second
            unmount(work)
        else:
            subprocess.run(["rm", "-rf", str(work)], check=False)


def postgres_version(dsn: str) -> str:
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def unmount(work: Path) -> None:
    """Our tmpfs away (lazily when busy: its memory is freed once nothing holds it), and its mount point."""
    if subprocess.run(["umount", str(work)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(work)], capture_output=True)
    subprocess.run(["rm", "-rf", str(work)], check=False)


def workspace(users: int, disk: bool) -> tuple[Path, str]:
    """The case's folder (its subscription files and state) and where it is. The files go to tmpfs, as an operator
    serving them from memory would have them: /dev/shm up to 200k users; a million users' five million files
    exceed /dev/shm's inodes, so then a tmpfs of its own without an inode limit (root), else the disk under
    .bench/. ``disk``: the disk, for the figure beside it (ext4 takes ~130 µs of CPU per replaced file)."""
    (ROOT / ".bench").mkdir(exist_ok=True)
    if not disk and users <= 200_000 and os.path.isdir("/dev/shm"):
        return Path(tempfile.mkdtemp(prefix="fleet-scale-", dir="/dev/shm")), "tmpfs (/dev/shm)"
    with open("/proc/mounts") as mounts:  # a killed run's tmpfs (its finally never ran) holds gigabytes of memory
        for line in mounts:
            device, point = line.split()[:2]
            if device == "fleet-scale" and point.startswith(str(ROOT / ".bench") + "/"):
                unmount(Path(point))
    work = Path(tempfile.mkdtemp(prefix="fleet-scale-", dir=ROOT / ".bench"))
    if not disk and os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16g,nr_inodes=0,mode=0700", "fleet-scale", str(work)],
            capture_output=True).returncode == 0:
        return work, "tmpfs (own mount)"
    return work, "disk"


if __name__ == "__main__":
    raise SystemExit(main())
