"""Agents for fake hosts: what a server's installed agent answers, as a small script put where apply installs it.

The loop runs the agent like every other script (``engine.remote.AGENT``), so a test feeds the real loop's
collection by installing an agent on each fake host (``ssh.fake.FakeRunner``): the report goes through the same
runner, parsing, logging and backoff as a real server's.
"""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.config import load_cluster
from reconciler.engine.base import AGENT
from reconciler.model import Cluster
from reconciler.ssh.fake import FakeRunner

#: An agent that answers every probe it is asked with a success and every listener as open.
HEALTHY = """import json, sys
req = json.load(sys.stdin)
probes = {p["id"]: {"ok": True, "rtt_ms": 12.0} for p in req.get("probes", [])}
listeners = {"%s/%s" % (p, t): True for p, t in req.get("listeners", [])}
tick = int(req.get("interval", 0))
print(json.dumps({"agent": 4, "service": "active", "listeners": listeners, "traffic": {"up": 1000 * tick, "down": 5000 * tick},
                  "users": [], "connections": 0, "probes": probes, "took_ms": 3}))
"""


def probing(rtt_ms: dict[str, float]) -> str:
    """A healthy agent whose probes of each inbound take ``rtt_ms[inbound]`` (+ the interval's number mod 3), and
    whose engine's traffic grows each interval."""
    return HEALTHY.replace('{"ok": True, "rtt_ms": 12.0}', '{"ok": True, "rtt_ms": RTT[p["id"]] + tick % 3}').replace(
        "req = json.load(sys.stdin)\n", f"req = json.load(sys.stdin)\nRTT = {rtt_ms!r}\ntick = int(req.get('interval', 0))\n", 1)


def answering(document: object) -> str:
    """An agent that prints ``document`` (JSON) whatever it is asked."""
    return f"print({json.dumps(json.dumps(document))})\n"


def install_agent(runner: FakeRunner, server: str, source: str = HEALTHY) -> None:
    path = runner.host(server).root / AGENT.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def shadowsocks_fleet(folder: Path, names: str) -> tuple[Path, Cluster, FakeRunner]:
    """A cluster file in ``folder`` of one Shadowsocks server per letter of ``names`` (self_heal off, one-minute
    intervals, one user), loaded, and a fake runner for its hosts (no agent installed yet)."""
    path = folder / "cluster.yaml"
    path.write_text("settings:\n  self_heal: false\n  health: {report_interval: 60s}\nservers:\n" + "".join(
        f"  - {{name: {n}, host: 198.18.0.{10 + i}, country: DE, inbounds: [{{id: {n}-in, name: {n.upper()}, "
        f"protocol: shadowsocks-2022, port: 8388}}]}}\n" for i, n in enumerate(names)) + "users:\n  - name: alice\n")
    cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    return path, cluster, FakeRunner(folder / "hosts")
