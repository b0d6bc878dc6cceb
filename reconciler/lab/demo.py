"""``reconciler demo`` against sandbox servers: provision, run the loop, optionally block one server.

Everything here is bounded: every wait has a deadline in intervals, the loop
runs with ``--duration``, and the lab is torn down on every exit path.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from reconciler.credentials import load_secret, user_credentials
from reconciler.errors import LabError
from reconciler.lab.cluster import lab_cluster_yaml
from reconciler.lab.hosts import Host, Lab

COUNTRIES = ["DE", "DE", "DE", "NL", "RU"]  # three witnesses in one country, one elsewhere, a prober


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopProcess:
    """``reconciler run`` as a child process (so it can be stopped, or killed, like in production)."""

    def __init__(self, cluster_file: Path, listen: str, duration: float, log_path: Path | None = None,
                 operations_listen: str | None = None):
        self.listen = listen
        self.operations_listen = operations_listen or f"127.0.0.1:{free_port()}"
        self.base = f"http://{listen}"
        self.operations = f"http://{self.operations_listen}"
        out = open(log_path, "ab") if log_path else None  # closed in stop()
        self._out = out
        self.proc = subprocess.Popen([sys.executable, "-m", "reconciler", "run", "-f", str(cluster_file), "--listen", listen,
                                      "--operations-listen", self.operations_listen, "--duration", str(duration)], stdin=subprocess.DEVNULL,
                                     stdout=out or None, stderr=subprocess.STDOUT if out else None)

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes, dict[str, str]]:
        """GET ``path``: subscriptions from the public listener, everything else from the operations one."""
        base = self.base if path.startswith("/sub/") else self.operations
        try:
            with urllib.request.urlopen(base + path, timeout=timeout) as resp:
                return resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), dict(exc.headers)
        except (OSError, urllib.error.URLError):
            return 0, b"", {}

    def status(self) -> dict[str, Any]:
        code, body, _ = self.get("/status.json")
        doc: dict[str, Any] = json.loads(body) if code == 200 else {"ready": False}
        return doc

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, poll: float = 0.5) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return None
            st = self.status()
            if st.get("ready") and predicate(st):
                return st
            time.sleep(poll)
        return None

    def kill(self) -> int | None:
        """SIGKILL, as a crash or an OOM killer would."""
        return self.stop(signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._out:
            self._out.close()
            self._out = None
        return self.proc.returncode


def subscription_hosts(loop: LoopProcess, token: str) -> list[str]:
    """The server addresses in a user's sing-box subscription, as the live endpoint serves it (the format that
    carries every protocol verified: share links leave out TLS entries they cannot pin)."""
    code, body, _ = loop.get(f"/sub/{token}/sing-box")
    if code != 200:
        return []
    outbounds = [o for o in json.loads(body).get("outbounds", []) if isinstance(o, dict)]
    by_tag = {o.get("tag"): o for o in outbounds}
    backups = {t for o in outbounds if o.get("type") == "urltest" for t in o.get("outbounds", [])[1:]}
    firsts = {o["outbounds"][0] for o in outbounds if o.get("type") == "urltest" and o.get("outbounds")}
    # The chosen server of each entry: a failover group's first member (its backups are not where the user is)
    return [str(by_tag[t]["server"]) for t in by_tag if t in firsts or (
        t not in backups and "server" in by_tag[t] and by_tag[t].get("type") != "urltest")]


def reconciler_command(argv: list[str]) -> int:
    """``reconciler ARGV`` as its own process, its output shown as it comes (as an operator would run it)."""
    return subprocess.run([sys.executable, "-m", "reconciler", *argv], stdin=subprocess.DEVNULL, check=False).returncode


def run_lab_demo(console: Console, out: Path, hosts_wanted: int, duration: float, scenario: str, interval: float) -> int:
    started = time.monotonic()
    os.environ.setdefault("RECONCILER_SECRET", secrets.token_urlsafe(32))  # a throwaway secret for the demo
    hosts_wanted = max(4, hosts_wanted)
    lab = Lab(log=lambda s: console.print(f"[dim]{s}[/dim]"))
    lab.down()
    loop: LoopProcess | None = None
    try:
        console.rule("provisioning sandbox servers (network namespaces with systemd and sshd)")
        hosts = lab.up(hosts_wanted)
        countries = [COUNTRIES[i % len(COUNTRIES)] for i in range(len(hosts))]
        countries[-1] = "RU"
        listen = f"127.0.0.1:{free_port()}"
        path = out / "lab-cluster.yaml"
        path.write_text(lab_cluster_yaml(lab, hosts, countries, prober_index=len(hosts) - 1, report_interval=interval,
                                     listen=listen, users=8))
        console.print(f"wrote {path}: {len(hosts)} servers in {', '.join(sorted(set(countries)))}; "
                      f"{hosts[-1].name} (RU) is the designated prober; report interval {interval:g}s")
        for title, argv, expected in (("plan", ["plan", "-f", str(path)], 2), ("apply", ["apply", "-f", str(path)], 0)):
            console.rule(f"reconciler {title}")
            code = reconciler_command(argv)
            if code != expected:
                console.print(f"[red]{title} exited {code}, expected {expected}[/red]")
                return 1
        remaining = duration - (time.monotonic() - started)
        if remaining < 20 * interval:
            console.print(f"[red]--duration {duration:g}s leaves {remaining:.0f}s for the loop: give it more[/red]")
            return 1
        console.rule(f"reconciler run (bounded: {remaining:.0f}s)")
        loop = LoopProcess(path, listen, remaining)
        ready = loop.wait(lambda st: all(s["status"] == "ok" for s in st["servers"].values()), 15 * interval + 30)
        if ready is None:
            console.print("[red]the loop did not report every server ok in time[/red]")
            return 1
        _print_status(console, ready)
        console.print(f"metrics: {loop.operations}/metrics · console: {loop.operations}/ · "
                      f"subscriptions: http://{listen}/sub/<token> and files under {out / 'subscriptions-lab'}")
        code = 0
        if scenario == "block":
            code = _block_scenario(console, lab, hosts, countries, loop, path, interval)
        else:
            time.sleep(max(0.0, min(10 * interval, duration - (time.monotonic() - started) - 5)))
            _print_status(console, loop.status())
        rc = loop.stop()
        console.print(f"loop stopped (exit {rc}); learned state kept in {path.parent / '.reconciler-lab'}")
        if code == 0:
            console.print("[green]demo done: provisioned, watched, and every step behaved; tearing the lab down[/green]")
        return code
    except LabError as exc:
        console.print(f"[red]lab: {exc}[/red]")
        return 1
    finally:
        if loop is not None:
            loop.stop()
        lab.down()


def _print_status(console: Console, st: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="verdicts")
    for col in ("server", "country", "status", "in rotation", "assigned users", "why"):
        table.add_column(col)
    for name, s in st["servers"].items():
        table.add_row(name, s["country"], s["status"], "yes" if s["in_rotation"] else "no", str(s["assigned_users"]), s["reason"])
    console.print(table)


def _block_scenario(console: Console, lab: Lab, hosts: list[Host], countries: list[str], loop: LoopProcess, path: Path,
                    interval: float) -> int:
    from reconciler.config import load_cluster

    cluster = load_cluster(str(path)).cluster
    assert cluster is not None  # written and planned from above
    secret = load_secret(cluster.settings.secret.env, cluster.settings.secret.file)
    tokens = {u.name: user_credentials(secret, u.name, u.rotate).token for u in cluster.users}
    F = cluster.settings.health.failure_streak
    # The target: a server of the biggest country group with users on it; its witnesses in that country block it.
    st = loop.status()
    group = [h for h, c in zip(hosts, countries, strict=True) if c == "DE"]
    target = max(group, key=lambda h: st["servers"][h.name]["assigned_users"])
    witnesses = [h for h in group if h is not target]
    before = {u: subscription_hosts(loop, t) for u, t in tokens.items()}
    moved_users = [u for u, hs in before.items() if target.ip in hs]
    console.rule(f"scenario: block {target.name} from its same-country witnesses {', '.join(w.name for w in witnesses)}")
    console.print(f"users whose subscription points at {target.name} ({target.ip}): {', '.join(moved_users) or 'none'}")
    port = cluster.server(target.name).inbounds[0].port
    t0 = time.monotonic()
    for w in witnesses:
        lab.block(w, target, port)
    got = loop.wait(lambda s: s["servers"][target.name]["status"] == "unreachable", (F + 4) * interval + 10)
    if got is None:
        console.print(f"[red]{target.name} did not become unreachable within {F + 4} intervals[/red]")
        lab.unblock_all()
        return 1
    took = time.monotonic() - t0
    console.print(f"[orange3]{target.name} → unreachable after {took:.1f}s ({took / interval:.1f} intervals; failure streak {F})[/orange3]: "
                  f"{got['servers'][target.name]['reason']}")
    _print_status(console, got)
    after = {u: subscription_hosts(loop, t) for u, t in tokens.items()}
    ok = True
    for u in moved_users:
        console.print(f"  {u}: subscription {', '.join(before[u])} → {', '.join(after[u])}")
        ok &= target.ip not in after[u] and bool(after[u])
    if not ok:
        console.print("[red]a user still points at the unreachable server[/red]")
    console.rule(f"scenario: unblock {target.name}")
    lab.unblock_all()
    t1 = time.monotonic()
    healed = loop.wait(lambda s: s["servers"][target.name]["status"] == "ok", 12 * interval + 10)
    if healed is None:
        console.print(f"[red]{target.name} did not recover[/red]")
        return 1
    console.print(f"[green]{target.name} → ok after {time.monotonic() - t1:.1f}s, with no manual step[/green]")
    _print_status(console, healed)
    return 0 if ok else 1
