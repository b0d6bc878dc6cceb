"""Users benchmark: what counting every user's traffic costs the controller per report interval.

U users across S servers, every one of them carrying traffic in every interval (the worst case: a quiet user
has no counter rows). Each server's agent report holds the kernel's per-user counters for its users (both
directions, TCP and some UDP, IPv4 and IPv6), as JSON text, as the loop receives it over SSH. Per interval:

- anchor: ``json.loads`` of the reports — the floor of merely reading them, measured in the same run;
- parse: ``parse_report`` (every field checked: the reports are hostile input);
- fold: ``Ledger.fold`` (marks → users, deltas, payload, periods, devices, demand);
- view: ``Ledger.view`` + every user's standing (what enforcement, subscriptions and metrics read).

Each interval is a round (``bench/harness.py``): the anchor and our path (parse + fold + view) each read that
interval's reports once, in an order that rotates each round. Figures: CPU seconds and wall time per interval
(medians of the rounds), the ratio to the anchor round by round (median and spread), peak memory of the process,
report bytes per interval, the share of a 60 s report interval on one core, and the machine. ``--lab`` also runs the lab
test (root; real hosts and clients) and adds its figures: per-user accuracy against what real clients carried,
and the enforcement latency from a quota crossed by real traffic to the user refused.

    python bench/users.py [--quick] [--json] [--lab]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

from reconciler.engine.base import usage_marks  # noqa: E402
from reconciler.fleet import parse_report  # noqa: E402
from reconciler.fleet.usage import Ledger  # noqa: E402
from reconciler.model import Cluster  # noqa: E402

INTERVAL = 60.0
TARGET_SHARE = 0.10  # of one interval on one core, for the whole accounting path
TARGET_RSS_MB = 1024


def make_cluster(users: int, servers: int) -> Cluster:
    return Cluster.model_validate({
        "servers": [{"name": f"s{i}", "host": f"198.18.{i // 250}.{i % 250 + 1}", "country": "DE",
                     "inbounds": [{"id": f"s{i}-in", "name": f"S{i}", "protocol": "trojan", "port": 8443, "route": "r",
                                   "tls": {"server_name": "www.example.com"}}]} for i in range(servers)],
        "routes": [{"id": "r", "name": "R"}],
        "users": [{"name": f"user{i}", **({"data_limit": "100GB", "reset": "monthly"} if i % 2 else {}),
                   **({"device_limit": 3} if i % 5 == 0 else {})} for i in range(users)]})


class Fleet:
    """Every server's kernel counters, advanced each interval; reports rendered as the agent prints them."""

    def __init__(self, cluster: Cluster, seed: int = 16) -> None:
        self.rng = random.Random(seed)
        marks = usage_marks(cluster, b"")  # the fold without Trust reads unkeyed marks
        names = [s.name for s in cluster.servers]
        self.rows: dict[str, list[list[object]]] = {n: [] for n in names}
        self.users: dict[str, list[str]] = {n: [] for n in names}
        for i, user in enumerate(cluster.users):
            server = names[i % len(names)]
            self.users[server].append(user.name)
            kinds = [("ipv4", "tcp"), ("ipv4", "udp")] if i % 3 == 0 else [("ipv4", "tcp")]
            if i % 7 == 0:
                kinds.append(("ipv6", "tcp"))
            for family, transport in kinds:
                for side in (0, 1):
                    self.rows[server].append([side, marks[user.name], family, transport, 0, 0])

    def advance(self) -> None:
        for rows in self.rows.values():
            for row in rows:
                pkts = self.rng.randrange(1, 400)
                row[4] += pkts
                row[5] += pkts * self.rng.randrange(60, 1500)

    def reports(self) -> dict[str, str]:
        out = {}
        for server, rows in self.rows.items():
            usage = {"tx": [r[1:] for r in rows if r[0] == 0], "rx": [r[1:] for r in rows if r[0] == 1], "epoch": "b/1/2"}
            devices = {u: [f"{hash((u, 1)) & 0xFFFFFFFF:08x}"] for u in self.users[server]}
            out[server] = json.dumps({"agent": 1, "service": "active", "listeners": {"8443/tcp": True}, "traffic": None,
                                      "users": self.users[server], "connections": len(self.users[server]),
                                      "devices": devices, "usage": usage, "probes": {}, "took_ms": 5.0})
        return out


def measure(users: int, servers: int, intervals: int) -> dict[str, Any]:
    cluster = make_cluster(users, servers)
    fleet = Fleet(cluster)
    ledger = Ledger()
    at = [time.time()]
    stages: dict[str, list[tuple[float, float]]] = {"parse": [], "fold": [], "view": []}
    texts: dict[str, str] = {}

    def interval(measured: bool = True) -> float:
        """The next interval's reports through parse, fold and view: their CPU seconds."""
        keep = stages if measured else None
        fleet.advance()
        texts.clear()
        texts.update(fleet.reports())
        at[0] += INTERVAL
        c0 = time.process_time()
        reports = _timed(keep, "parse", lambda t, now: {s: parse_report(s, x, now) for s, x in t.items()}, texts, at[0])
        _timed(keep, "fold", ledger.fold, cluster, reports, at[0])
        _timed(keep, "view", _standings, ledger, cluster, at[0])
        return time.process_time() - c0

    def anchor() -> float:
        """``json.loads`` of the latest interval's reports: CPU seconds."""
        c0 = time.process_time()
        for text in texts.values():
            json.loads(text)
        return time.process_time() - c0

    interval(measured=False)  # the first fold is every server's baseline: not measured
    got = harness.interleaved({"anchor": anchor, "interval": interval}, intervals, "anchor")
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in stages.items()}
    cpu = got["values"]["interval"]["median"]
    wall = statistics.median(sum(stages[k][i][1] for k in stages) for i in range(intervals))
    return {"users": users, "servers": servers, "report_bytes": sum(len(t) for t in texts.values()),
            "anchor_cpu_s": round(got["values"]["anchor"]["median"], 3), "parse_cpu_s": round(med["parse"][0], 3),
            "fold_cpu_s": round(med["fold"][0], 3), "view_cpu_s": round(med["view"][0], 3),
            "interval_cpu_s": round(cpu, 3), "interval_wall_s": round(wall, 3),
            "cpu_vs_anchor": round(got["ratios"]["interval"]["median"], 2), "share_of_interval": round(cpu / INTERVAL, 4),
            **got}


def _timed(stages: dict[str, list[tuple[float, float]]] | None, stage: str, work: Any, *args: Any) -> Any:
    c0, w0 = time.process_time(), time.perf_counter()
    out = work(*args)
    if stages is not None:
        stages[stage].append((time.process_time() - c0, time.perf_counter() - w0))
    return out


def _standings(ledger: Ledger, cluster: Cluster, now: float) -> int:
    usage = ledger.view(cluster, now)
    return sum(u.standing(now, usage[u.name]) != "active" for u in cluster.users)


def lab_figures() -> dict[str, float]:
    if os.geteuid() != 0:
        return {"lab": "skipped: needs root"}  # type: ignore[dict-item]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    os.unlink(out)
    env = {**os.environ, "RECONCILER_BENCH_OUT": out}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--timeout=900", "-p", "no:cacheprovider",
                          str(ROOT / "tests/lab/test_users.py")], env=env, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-3000:], file=sys.stderr)
        raise SystemExit("the lab test failed: no lab figures")
    return json.loads(Path(out).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k users across 50 servers in 3 rounds, not 5")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--lab", action="store_true", help="also run the lab test for accuracy and enforcement latency")
    args = ap.parse_args()
    machine = harness.machine({"json": json.__version__})
    sizes = [(20_000, 10, 5), (100_000, 50, 3 if args.quick else 5)]  # intervals: rounds, at least 3
    results = [measure(u, s, n) for u, s, n in sizes]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    big = results[-1]
    figures: dict[str, object] = {
        "machine": machine, "ratios": {"cpu_vs_json_anchor_u100k_s50": big["ratios"]["interval"]},
        "interval_cpu_s_u100k_s50": big["interval_cpu_s"], "interval_wall_s_u100k_s50": big["interval_wall_s"],
        "share_of_60s_interval_u100k_s50": big["share_of_interval"], "cpu_vs_json_anchor_u100k_s50": big["cpu_vs_anchor"],
        "report_bytes_u100k_s50": big["report_bytes"], "peak_rss_mb": round(rss_mb, 1), "runs": results}
    if args.lab:
        figures.update(lab_figures())
    ok_share = big["share_of_interval"] <= TARGET_SHARE
    ok_rss = rss_mb <= TARGET_RSS_MB
    figures["targets_met"] = ok_share and ok_rss
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"{'users':>8} {'servers':>7} {'report MB':>9} {'anchor s':>8} {'parse s':>7} {'fold s':>6} {'view s':>6} "
              f"{'total s':>7} {'x anchor':>8} {'of 60 s':>7}")
        for r in results:
            print(f"{r['users']:>8} {r['servers']:>7} {r['report_bytes'] / 1e6:>9.1f} {r['anchor_cpu_s']:>8.3f} "
                  f"{r['parse_cpu_s']:>7.3f} {r['fold_cpu_s']:>6.3f} {r['view_cpu_s']:>6.3f} {r['interval_cpu_s']:>7.3f} "
                  f"{r['cpu_vs_anchor']:>8.1f} {100 * r['share_of_interval']:>6.1f}%  (x anchor: spread {r['ratios']['interval']['spread']:.1%}"
                  f" over {r['rounds']} rounds)")
        print(f"peak RSS {rss_mb:.0f} MB (target ≤ {TARGET_RSS_MB} MB); 100k users × 50 servers: "
              f"{100 * big['share_of_interval']:.1f}% of a 60 s interval on one core (target ≤ {100 * TARGET_SHARE:.0f}%)")
        for k, v in figures.items():
            if k.startswith(("accuracy_", "enforcement_")):
                print(f"lab: {k} = {v}")
    return 0 if figures["targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
