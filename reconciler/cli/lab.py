"""``lab up|down`` (sandbox servers on this machine, root) and ``demo``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_allow_path, add_command, plural, print_diagnostics
from reconciler.cli.output import routes_table, summary
from reconciler.lab import Lab, lab_cluster_yaml
from reconciler.lab.cluster import PROTOCOLS
from reconciler.servable import load_servable
from reconciler.topology import RENDERERS


def register(sub: Any) -> None:
    lab = add_command(sub, "lab", HELP["lab"], "reconciler lab up --hosts 3")
    labsub = lab.add_subparsers(dest="lab_command", metavar="ACTION", help="what to do")
    lab.set_defaults(group_parser=lab)
    lu = add_command(labsub, "up", "start N hosts and write a cluster file for them", "reconciler lab up --hosts 3 --write lab-cluster.yaml")
    lu.add_argument("--hosts", type=int, default=3, help="how many hosts")
    lu.add_argument("--countries", default="DE,DE,US", help="comma-separated, cycled over the hosts")
    lu.add_argument("--write", default="lab-cluster.yaml", help="the cluster file to write")
    lu.add_argument("--protocol", default="vless-tls", choices=PROTOCOLS, help="the protocol of every host's inbound")
    lu.set_defaults(run=cmd_lab_up)
    ld = add_command(labsub, "down", "tear the lab down", "reconciler lab down")
    ld.set_defaults(run=cmd_lab_down)

    d = add_command(sub, "demo", HELP["demo"], "reconciler demo --scenario block")
    d.add_argument("-f", "--file", default="cluster.example.yaml", help="the cluster file to show")
    add_allow_path(d)
    d.add_argument("--out-dir", default="demo-output", help="where to write the topology pictures")
    d.add_argument("--no-lab", action="store_true", help="skip provisioning sandbox servers (needs root)")
    d.add_argument("--hosts", type=int, default=5, help="sandbox servers to provision (at least 4)")
    d.add_argument("--duration", type=float, default=120.0, help="seconds the loop runs against the sandbox")
    d.add_argument("--scenario", choices=["none", "block"], default="none",
                   help="block: block one server from its same-country witnesses, then unblock it")
    d.add_argument("--interval", type=float, default=3.0, help="report interval of the demo cluster (seconds)")
    d.set_defaults(run=cmd_demo)


def _lab() -> Lab:
    return Lab(log=lambda s: print(s, file=sys.stderr))


def cmd_lab_down(args: argparse.Namespace) -> int:
    _lab().down()
    print("lab is down")
    return 0


def cmd_lab_up(args: argparse.Namespace) -> int:
    lab = _lab()
    hosts = lab.up(args.hosts)
    countries = [c.strip().upper() for c in args.countries.split(",") if c.strip()] or ["DE"]
    Path(args.write).write_text(lab_cluster_yaml(lab, hosts, countries, args.protocol))
    print(f"{plural(len(hosts), 'host')} up; wrote {args.write}. Next: reconciler plan -f {args.write}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Validate the example and draw it; as root, also provision sandbox servers and run the loop against them."""
    console = Console()
    console.rule(f"reconciler demo — {args.file}")
    result = load_servable(args.file)
    # What the engine cannot serve is shown, not fatal here: the sandbox part runs its own cluster file.
    refused = [d for d in result.errors if d.code == "engine-capability"]
    print_diagnostics(result.diagnostics)
    if result.cluster is None:
        return 1
    cluster = result.cluster
    s = summary(cluster)
    console.print(
        f"[green]valid[/green]: {s['servers']} servers in {len({x.country for x in cluster.servers})} countries, "
        f"{s['inbounds']} inbounds, {s['routes']} routes, {s['users']} users, {plural(len(result.warnings), 'warning')}"
    )
    if refused:
        console.print(f"[yellow]{plural(len(refused), 'engine error')} (above): validate, plan and apply refuse this file "
                      "until its engine can serve every inbound[/yellow]")
    console.print(routes_table(cluster))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for fmt, ext in (("svg", "svg"), ("mermaid", "mmd"), ("dot", "dot")):
        (out / f"topology.{ext}").write_text(RENDERERS[fmt](cluster), encoding="utf-8")
    console.print(f"topology written to {out}/topology.svg, .mmd and .dot")
    if args.no_lab or os.geteuid() != 0:
        if not args.no_lab:
            console.print("[yellow]not root: skipping the sandbox servers (network namespaces need root)[/yellow]")
        return 0
    from reconciler.lab.demo import run_lab_demo

    return run_lab_demo(console, out, args.hosts, args.duration, args.scenario, args.interval)
