"""Subscription outlets benchmark (issue: benchmarks).

1. The live endpoint (``/sub/<token>/links``, the loop's aiohttp outlet) under
   a real load generator (wrk from Debian), and nginx serving the same
   documents as static files (the file outlet's output), in the same run, with
   the same request mix: every request a random user's token. The live endpoint
   twice: in one process (``settings.outputs.workers: 1``) and in as many worker
   processes as there are CPUs sharing the port (``reconciler.loop.workers``,
   started and fed a snapshot as the loop does).
2. The file outlet for N users (100,000 by default): a full write into an
   empty folder (a new outlet in a process that has written before) against the floor, the outlet's
   very bytes written plainly by one process (mkdir, write, close), in
   interleaved rounds (``--rounds``, at least three; the order alternates, each
   round's ratio and their median), and a no-op rewrite of the same snapshot.
   By default the files go to /dev/shm when it is a roomy
   tmpfs, so the figure is the outlet's cost and not this machine's disk;
   ``--dir`` measures a given disk (the floor then shows the disk's share).
   Beside them, the disk's floor: the outlet's very bytes written plainly
   (mkdir, write, close; nothing rendered, renamed or synced) to ``--disk-dir``
   (default: the system's temporary folder, when it is not a tmpfs).

The cluster: 20 servers in 4 countries, one route, round-robin, every verdict ok.

    python bench/subscriptions.py [--quick] [--json] [--users N] [--seconds S] [--dir D] [--disk-dir D]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

from reconciler.balance import Snapshot, rebalance  # noqa: E402
from reconciler.credentials import Secret  # noqa: E402
from reconciler.model import Cluster  # noqa: E402
from reconciler.publish import FileOutlet, LiveAnswers, Tokens, cluster_digest  # noqa: E402
from reconciler.subscriptions.outbound import pin_record  # noqa: E402

SECRET = Secret(b"subscriptions-bench-secret-0123456789")
LUA = """
local tokens = {}
for line in io.lines("%(tokens)s") do tokens[#tokens + 1] = line end
math.randomseed(%(seed)d)
request = function()
  return wrk.format("GET", "/sub/" .. tokens[math.random(#tokens)] .. "%(suffix)s")
end
"""
# The workers run as the files' owner: subscription folders are 0700 and files 0600 (they hold credentials),
# and that is how an operator's web server publishing them is meant to read them.
NGINX = """
user %(user)s;
worker_processes auto;
pid %(dir)s/nginx.pid;
error_log %(dir)s/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  sendfile on;
  types { text/plain txt; }
  server {
    listen 127.0.0.1:%(port)d reuseport backlog=4096;
    location /sub/ { alias %(root)s/; etag on; }
  }
}
"""


def make_cluster(users: int) -> Cluster:
    countries = ["DE", "NL", "US", "JP"]
    servers = [{"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": countries[i % 4],
                "inbounds": [{"id": f"s{i}-in", "name": f"Server {i}", "protocol": "vless-tls", "port": 443, "route": "r",
                              # insecure: the documents keep the shape earlier runs measured (share links cannot
                              # pin a self-signed vless-tls certificate and would otherwise leave the entry out)
                              "tls": {"server_name": "www.example.com", "insecure": True}}]} for i in range(20)]
    return Cluster.model_validate({"servers": servers, "routes": [{"id": "r", "name": "Main", "balance": "round-robin"}],
                                   "users": [{"name": f"user{j:06d}"} for j in range(users)]})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")


def serve_live(snapshot: Snapshot, port: int) -> None:
    """The loop's HTTP outlet on one snapshot (a forked child: it inherits the snapshot)."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from reconciler.loop.http import HttpOutlet

    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snapshot)
    outlet = HttpOutlet(answers, CollectorRegistry(), lambda: None, lambda: (True, "ok"))

    async def main() -> None:
        await outlet.start("127.0.0.1", port, operations=("127.0.0.1", free_port()))  # as `reconciler run` by default
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await outlet.stop()

    try:
        import uvloop  # as `reconciler run` does
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


def serve_workers(snapshot: Snapshot, port: int, count: int, state: Path, ready: Path) -> None:
    """The loop's worker processes on one snapshot (a forked child plays the loop's process: it starts
    them, publishes the snapshot and waits until every worker answers from it; then ``ready`` appears)."""
    import asyncio

    # Imported here, not with the module: the file outlet's worker processes import the main module again as they
    # start (multiprocessing's forkserver), and the loop's main module (the console script) imports ``reconciler.cli``
    # alone. At the top, this import made each file worker start 0.14 s later than it does under the loop.
    from reconciler.loop.workers import LiveWorkers

    async def main() -> None:
        pool = LiveWorkers(count, "127.0.0.1", port, SECRET, state, str(state), lambda: (True, "ok"))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await pool.start()
        try:
            pool.publish(snapshot)
            while not stop.is_set():
                stats = await pool.stats()
                if len(stats) == count and all(s.generation == pool.generation >= 1 for s in stats):
                    break
                await asyncio.sleep(0.2)
            ready.write_text(" ".join(map(str, pool.pids)))
            await stop.wait()
        finally:
            await pool.stop()

    asyncio.run(main())


def plain_floor(source: Path, folder: Path, budget: float = float("inf")) -> tuple[float, int, int]:
    """The outlet's own bytes written plainly into ``folder`` (mkdir, write, close: nothing rendered, renamed or
    synced), a thousand users at a time read first: (seconds spent writing, bytes, users written). Past ``budget``
    seconds it stops after the current thousand (a slow disk: the caller extrapolates)."""
    folder.mkdir()
    took, total, done = 0.0, 0, 0
    users = sorted(p.name for p in source.iterdir())
    for lo in range(0, len(users), 1000):
        if took > budget:
            break
        batch = [(u, [(f.name, f.read_bytes()) for f in (source / u).iterdir()]) for u in users[lo:lo + 1000]]
        t = time.perf_counter()
        for user, files in batch:
            sub = os.path.join(folder, user)
            os.mkdir(sub, 0o700)
            for name, data in files:
                fd = os.open(os.path.join(sub, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, data)
                os.close(fd)
                total += len(data)
        took += time.perf_counter() - t
        done += len(batch)
    return took, total, done


def rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def disk_floor(source: Path, disk_dir: str, users: int, budget: float) -> dict[str, object]:
    """The disk's floor: the outlet's bytes written plainly to ``disk_dir`` and synced (scaled up when the disk
    cannot write them all within ``budget`` seconds)."""
    disk = Path(tempfile.mkdtemp(prefix="subs-bench-disk-", dir=disk_dir))
    try:
        os.sync()
        took, _, done = plain_floor(source, disk / "plain", budget)
        t = time.perf_counter()
        os.sync()
        synced = time.perf_counter() - t
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    scale = users / done  # > 1: the disk was too slow to write them all within the budget
    out: dict[str, object] = {"files_floor_s_disk": round(took * scale, 3), "files_floor_sync_s_disk": round(synced * scale, 3),
                              "disk_dir": disk_dir, "disk_filesystem": filesystem_of(Path(disk_dir))}
    if done < users:
        out["files_floor_disk_extrapolated_from_users"] = done
    return out


def fs_floor(folder: Path, users: int, size: int = 1500) -> float:
    """The same number of directories and files, written and renamed with nothing computed: the disk's share."""
    folder.mkdir()
    blob = b"x" * size
    t = time.perf_counter()
    for i in range(users):
        sub = os.path.join(folder, f"u{i}")
        os.mkdir(sub)
        for name in ("links.txt", "sing-box.json", "clash.yaml", "headers.json"):
            tmp = os.path.join(sub, f".{name}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, blob)
            os.close(fd)
            os.replace(tmp, os.path.join(sub, name))
    took = time.perf_counter() - t
    shutil.rmtree(folder)
    return took  # (data still in the page cache, as for the measured write: neither run includes writeback)


def default_dir() -> str | None:
    """/dev/shm when it is a tmpfs with room for the run (~2 GB): the figure is then the outlet's own cost,
    not this machine's disk (on the CI VM's ext4 the floor alone — no rendering — takes 30-60 s, see
    files_floor_s with --dir /tmp). None: the system's temporary folder."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    roomy = st.f_bavail * st.f_frsize > 2 << 30
    return shm if roomy and filesystem_of(Path(shm)) == "tmpfs" and os.access(shm, os.W_OK) else None


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts: the longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and (str(path.resolve()) + "/").startswith(parts[1].rstrip("/") + "/") and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def anchor_versions(files_only: bool) -> dict[str, str]:
    if files_only:
        return {}
    nginx = subprocess.run([shutil.which("nginx") or "/usr/sbin/nginx", "-v"], capture_output=True, text=True)
    load = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    return {"nginx": (nginx.stderr or nginx.stdout).strip(), "wrk": (load.stdout or load.stderr).splitlines()[0].strip()}


def wrk(port: int, script: Path, seconds: float, threads: int, connections: int) -> dict[str, float]:
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script),
                          f"http://127.0.0.1:{port}"], capture_output=True, text=True, timeout=seconds + 60)
    text = out.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    lat = {}
    for pct, value, unit in re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)\s*$", text, re.M):
        lat[pct] = round(float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit], 3)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if errors:
        log_path = Path(str(script).rsplit("/", 1)[0]) / "error.log"
        detail = log_path.read_text()[-1500:] if log_path.exists() else ""
        raise RuntimeError(f"wrk saw {errors.group(1)} error responses:\n{text}\n{detail}")
    return {"rps": rps, "p50_ms": lat.get("50", float("nan")), "p99_ms": lat.get("99", float("nan"))}


def load_rounds(work: Path, servers: dict[str, tuple[int, str]], seconds: float, threads: int, conns: int,
                rounds: int, log) -> dict[str, object]:
    """wrk against each server once per round (``harness.interleaved``, nginx the anchor): requests per second,
    and beside them each round's p50 and p99."""
    p99: dict[str, list[float]] = {name: [] for name in servers}
    p50: dict[str, list[float]] = {name: [] for name in servers}

    def contender(name: str, port: int, script: str):
        def run() -> float:
            r = wrk(port, work / script, seconds, threads, conns)
            p99[name].append(r["p99_ms"])
            p50[name].append(r["p50_ms"])
            return r["rps"]
        return run

    out = harness.interleaved({name: contender(name, port, script) for name, (port, script) in servers.items()},
                              rounds, anchor="nginx", log=log)
    out["p99_ms"] = {k: harness.summary(v, 3) for k, v in p99.items()}
    out["p50_ms"] = {k: harness.summary(v, 3) for k, v in p50.items()}
    return out


def file_figures(work: Path, snapshot: Snapshot, pins: dict[str, str], users: int, rounds: int, kind: str,
                 log) -> dict[str, object]:
    """The file outlet's figures: a first write (unmeasured), the no-op passes, then full writes from scratch against
    the floor in interleaved rounds."""
    cluster = snapshot.cluster
    results: dict[str, object] = {}
    outlet = FileOutlet(work / "subs", work / "state", SECRET)
    results["file_workers"] = outlet.workers
    t = time.perf_counter()
    full = outlet.write(snapshot)  # unmeasured: the bytes the floor writes (and the documents the load asks for)
    results["files_first_s"] = round(time.perf_counter() - t, 3)
    assert full.written == users
    log(f"files: a first write of {users} users (unmeasured: the floor's bytes): {results['files_first_s']}s")
    t = time.perf_counter()
    noop = outlet.write(snapshot)
    results["files_noop_s"] = round(time.perf_counter() - t, 4)
    assert noop.written == 0
    outlet2 = FileOutlet(work / "subs", work / "state", SECRET)  # a restarted loop: manifest only
    t = time.perf_counter()
    outlet2.write(Snapshot(cluster=cluster, now=snapshot.now, assignments=snapshot.assignments, tls_pins=pins))
    results["files_noop_new_snapshot_s"] = round(time.perf_counter() - t, 3)
    log(f"files: no-op rewrite {results['files_noop_s']}s (same snapshot), "
        f"{results['files_noop_new_snapshot_s']}s (an equal new snapshot after a restart)")
    sizes: list[int] = []

    def floor() -> float:  # the outlet's very bytes written plainly, one process: the better of two writes
        best = float("inf")
        for _ in range(2):  # (a plain write lands in pages nothing touched yet now and then, ~1.5x slower)
            took, size, _ = plain_floor(work / "subs", work / "plain")
            shutil.rmtree(work / "plain")
            best = min(best, took)
        sizes.append(size)
        return best

    digest = cluster_digest(cluster)  # what the loop computes as it loads the file (for its status, and to tell a
    # change of the file from none): it hands it to its outlet (``FileOutlet.hashed``), which does not hash again

    def ours() -> float:  # a full write from scratch: a new outlet, folder and state (a first start of the outlet; the
        # process has written before: its process-wide caches are warm — the formats' member pieces, the key's HMAC
        # pads, what the cluster derived once, the forkserver — as in a loop whose outlet lost its folder)
        out = FileOutlet(work / "again", work / "again-state", SECRET)
        out.hashed(cluster, digest)  # as the loop does
        fresh = dataclasses.replace(snapshot)  # nothing derived from it yet: a first start
        t = time.perf_counter()
        stats = out.write(fresh)
        took = time.perf_counter() - t
        assert stats.written == users
        shutil.rmtree(work / "again")
        shutil.rmtree(work / "again-state")
        return took

    # Interleaved rounds, the order alternating: each write goes into memory the other freed (writing plainly into
    # pages the machine never touched cost 2.5-3.5x more than into freed ones: a floor measured once, after the
    # write, was a different floor). One floor first, unmeasured, touches that memory for both. Even so a plain
    # write is ~1.5x slower now and then (rounds of 2.2 and 3.6 s in one run): each round's floor is the better of
    # two, the machine's floor; the outlet's rounds varied by 6%.
    floor()
    sizes.clear()
    files = harness.interleaved({"floor": floor, "outlet": ours}, max(3, rounds), "floor", log)
    results["files_rounds"] = files
    results["files_full_s"] = files["values"]["outlet"]["median"]
    results["files_vs_same_bytes"] = files["ratios"]["outlet"]["median"]
    results["files_vs_same_bytes_spread"] = files["ratios"]["outlet"]["spread"]
    results[f"files_{users // 1000}k_write_s_{kind}"] = results["files_full_s"]
    results[f"files_{users // 1000}k_noop_s_{kind}"] = results["files_noop_s"]
    results[f"files_floor_same_bytes_s_{kind}"] = files["values"]["floor"]["median"]
    results["files_bytes"] = sizes[0]
    log(f"files: {users} users in {results['files_full_s']}s, the same {sizes[0] / 1e6:.0f} MB written plainly "
        f"on {work.parent} ({kind}) in {results[f'files_floor_same_bytes_s_{kind}']}s: "
        f"{results['files_vs_same_bytes']}x (rounds {files['ratios']['outlet']['rounds']})")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter load runs (the same 100k-user file figures)")
    ap.add_argument("--json", action="store_true", help="one JSON object with every figure")
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, help="length of each wrk run")
    ap.add_argument("--dir", help="where the files go (default: /dev/shm when it is a roomy tmpfs, else the system's "
                                  "temporary folder); pass a folder on a given disk to measure that disk")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(),
                    help="where the disk's floor is measured (default: the system's temporary folder; skipped on tmpfs)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="worker processes of the multi-process live endpoint (default: one per CPU)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of the load runs and of the file writes (default 5; 3 "
                                               "with --quick)")
    ap.add_argument("--files-only", action="store_true",
                    help="only the file outlet's figures (no live endpoint, nginx or wrk; no disk floor)")
    args = ap.parse_args()
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    args.rounds = args.rounds or (3 if args.quick else 5)
    for exe in () if args.files_only else ("wrk", "nginx"):
        if shutil.which(exe) is None and not Path(f"/usr/sbin/{exe}").exists():
            print(f"{exe} is not installed: `make setup` installs wrk and nginx-light", file=sys.stderr)
            return 1
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    where = args.dir or default_dir()
    work = Path(tempfile.mkdtemp(prefix="subs-bench-", dir=where))
    work.chmod(0o755)  # nginx workers run unprivileged
    results: dict[str, object] = {"machine": harness.machine(anchor_versions(args.files_only)),
                                  "users": args.users, "cpus": os.cpu_count(), "dir": str(work.parent),
                                  "dir_filesystem": filesystem_of(work),
                                  # others' work on this machine moves every figure: say how busy it was
                                  "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    log(f"files go to {work} ({results['dir_filesystem']})")
    nginx = live = workers = None
    kind = "tmpfs" if results["dir_filesystem"] == "tmpfs" else "disk"
    n = args.workers
    try:
        cluster = make_cluster(args.users)
        t = time.perf_counter()
        # The pins an apply learns of each self-signed certificate: without them every TLS entry is left out
        # (no format emits an unverified entry) and the documents would be empty refusals.
        pins = {r.inbound.id: pin_record(base64.b64encode(hashlib.sha256(r.inbound.id.encode()).digest()).decode(),
                                         hashlib.sha256(b"cert:" + r.inbound.id.encode()).hexdigest())
                for r in cluster.inbounds}
        snapshot = Snapshot(cluster=cluster, now=time.time(), tls_pins=pins)
        snapshot = Snapshot(cluster=cluster, now=snapshot.now, assignments=rebalance(snapshot), tls_pins=pins)
        results["snapshot_s"] = round(time.perf_counter() - t, 3)
        log(f"snapshot for {args.users} users: {results['snapshot_s']}s")

        results["files_floor_s"] = round(fs_floor(work / "floor", args.users), 3)
        os.sync()  # the floor's writeback must not slow down the measured write
        log(f"files: the disk's floor (mkdir + 4 files written and renamed per user, one process): {results['files_floor_s']}s")
        results.update(file_figures(work, snapshot, pins, args.users, args.rounds, kind, log))
        if args.files_only:  # the file part alone: its figures, and the ratio to the same bytes written plainly
            results["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            print(json.dumps(results) if args.json else "\n".join(f"{k:28s} {v}" for k, v in results.items()))
            return 0  # (the finally below removes the folder)

        tokens = sorted(p.name for p in (work / "subs").iterdir())
        (work / "tokens.txt").write_text("\n".join(tokens) + "\n")
        for name, suffix in (("live", "/links"), ("nginx", "/links.txt")):
            (work / f"{name}.lua").write_text(LUA % {"tokens": work / "tokens.txt", "seed": 42, "suffix": suffix})

        port_live, port_nginx = free_port(), free_port()
        (work / "nginx.conf").write_text(NGINX % {"dir": work, "port": port_nginx, "root": work / "subs",
                                                  "user": pwd.getpwuid(os.getuid()).pw_name})
        nginx = subprocess.Popen([shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(work / "nginx.conf"), "-g", "daemon off;"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ctx = multiprocessing.get_context("fork")
        live = ctx.Process(target=serve_live, args=(snapshot, port_live), daemon=True)
        live.start()
        port_workers, ready = free_port(), work / "workers.ready"
        (work / "live-state").mkdir(mode=0o700)
        # Forked before any event loop or thread of ours runs; it spawns the workers as the loop does (not a
        # daemon: those may not have children).
        workers = ctx.Process(target=serve_workers, args=(snapshot, port_workers, n, work / "live-state", ready))
        t = time.perf_counter()
        workers.start()
        wait_port(port_nginx)
        wait_port(port_live)
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and workers.is_alive():
            time.sleep(0.1)
        if not ready.exists():
            raise RuntimeError("the live workers did not start")
        results["workers_ready_s"] = round(time.perf_counter() - t, 2)
        results["workers_rss_mb"] = [rss_mb(int(pid)) for pid in ready.read_text().split()]
        log(f"{n} live workers (pids {ready.read_text()}, {results['workers_rss_mb']} MB resident) answer from the "
            f"snapshot after {results['workers_ready_s']}s")
        sample = tokens[:: max(1, len(tokens) // 50)]
        for tok in sample:  # the same documents: the workers' bytes are the files'
            with urllib.request.urlopen(f"http://127.0.0.1:{port_workers}/sub/{tok}/links", timeout=10) as resp:
                body = resp.read()
            assert body == (work / "subs" / tok / "links.txt").read_bytes(), tok
        threads, conns = 2, 32
        log(f"load: wrk -t{threads} -c{conns} -d{seconds:g}s, a random user's token per request")
        live_cold = wrk(port_live, work / "live.lua", seconds, threads, conns)  # first pass renders most documents
        workers_cold = wrk(port_workers, work / "live.lua", seconds, threads, conns)
        # One more unmeasured pass each: a first pass at ~20k req/s reaches ~60% of 100k users in each worker, and
        # the rounds would otherwise start while documents are still being rendered (rounds of 0.41-0.70 of nginx
        # then 0.90-0.94 in a run without it).
        for port in (port_live, port_workers):
            wrk(port, work / "live.lua", seconds, threads, conns)
        # Interleaved rounds (bench/harness.py): each round runs every server once, in an order that rotates, and
        # each round's ratio is to nginx's run of the same round; the figures are the rounds' medians.
        rounds = load_rounds(work, {"nginx": (port_nginx, "nginx.lua"), "live": (port_live, "live.lua"),
                                    "workers": (port_workers, "live.lua")}, seconds, threads, conns, args.rounds, log)
        results["live_rounds"] = rounds
        med = {k: rounds["values"][k]["median"] for k in ("nginx", "live", "workers")}
        nginx_res = {"rps": med["nginx"], "p99_ms": rounds["p99_ms"]["nginx"]["median"],
                     "p50_ms": rounds["p50_ms"]["nginx"]["median"]}
        live_res = {"rps": med["live"], "p99_ms": rounds["p99_ms"]["live"]["median"],
                    "p50_ms": rounds["p50_ms"]["live"]["median"]}
        workers_res = {"rps": med["workers"], "p99_ms": rounds["p99_ms"]["workers"]["median"],
                       "p50_ms": rounds["p50_ms"]["workers"]["median"]}
        # p99 "at that load": wrk keeps 32 requests in flight, so each server answers as fast as it can, and that
        # is the load; the figure is the median of the rounds' p99s.
        results.update({f"live_rps_workers{n}": round(workers_res["rps"]), f"live_p50_ms_workers{n}": workers_res["p50_ms"],
                        f"live_p99_ms_workers{n}": workers_res["p99_ms"],
                        f"live_vs_nginx_workers{n}": rounds["ratios"]["workers"]["median"],
                        f"live_vs_nginx_workers{n}_spread": rounds["ratios"]["workers"]["spread"],
                        f"live_cold_rps_workers{n}": round(workers_cold["rps"]),
                        f"live_cold_p99_ms_workers{n}": workers_cold["p99_ms"]})
        results.update(nginx_rps=round(nginx_res["rps"]), nginx_p99_ms=nginx_res["p99_ms"],
                       live_rps=round(live_res["rps"]), live_p50_ms=live_res["p50_ms"], live_p99_ms=live_res["p99_ms"],
                       live_cold_rps=round(live_cold["rps"]), live_cold_p99_ms=live_cold["p99_ms"],
                       live_share_of_nginx=rounds["ratios"]["live"]["median"], wrk_connections=conns,
                       nginx_p50_ms=nginx_res["p50_ms"])
        log(f"nginx: {nginx_res['rps']:.0f} req/s, p99 {nginx_res['p99_ms']:.2f} ms")
        log(f"live (first pass, rendering): {live_cold['rps']:.0f} req/s, p99 {live_cold['p99_ms']:.2f} ms")
        log(f"live: {live_res['rps']:.0f} req/s ({results['live_share_of_nginx']:.0%} of nginx), "
            f"p50 {live_res['p50_ms']:.2f} ms, p99 {live_res['p99_ms']:.2f} ms")
        log(f"live, {n} workers: {workers_res['rps']:.0f} req/s ({results[f'live_vs_nginx_workers{n}']:.0%} of nginx), "
            f"p50 {workers_res['p50_ms']:.2f} ms, p99 {workers_res['p99_ms']:.2f} ms "
            f"(first pass {workers_cold['rps']:.0f} req/s, p99 {workers_cold['p99_ms']:.2f} ms)")
        # Last: the disk's floor (its writeback and discards would disturb the load runs).
        if filesystem_of(Path(args.disk_dir)) != "tmpfs" and kind == "tmpfs":
            results.update(disk_floor(work / "subs", args.disk_dir, args.users, 45.0 if args.quick else 120.0))
            log(f"files: the same bytes written plainly on {args.disk_dir} ({results['disk_filesystem']}): "
                f"{results['files_floor_s_disk']}s, then {results['files_floor_sync_s_disk']}s to sync them"
                + (" (scaled from a part)" if "files_floor_disk_extrapolated_from_users" in results else ""))
    finally:
        for child in (live, workers):
            if child is not None and child.is_alive():
                os.kill(child.pid, signal.SIGTERM)
                child.join(20)
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    results["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    targets = {"live_share_of_nginx": (results["live_share_of_nginx"], ">=", 0.25), "live_p99_ms": (results["live_p99_ms"], "<=", 20.0),
               "files_full_s": (results["files_full_s"], "<=", 20.0), "files_noop_s": (results["files_noop_s"], "<=", 1.0),
               # the live endpoint on every core, the files on tmpfs
               f"live_vs_nginx_workers{n}": (results[f"live_vs_nginx_workers{n}"], ">=", 0.5),
               f"live_p99_ms_workers{n}": (results[f"live_p99_ms_workers{n}"], "<=", 5.0),
               f"files_{args.users // 1000}k_write_s_{kind}": (results["files_full_s"], "<=", 10.0),
               f"files_{args.users // 1000}k_noop_s_{kind}": (results["files_noop_s"], "<=", 0.5)}
    results["targets_met"] = {k: (v >= t if op == ">=" else v <= t) for k, (v, op, t) in targets.items()}
    if args.json:
        print(json.dumps(results))
    else:
        for k, v in results.items():
            print(f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
