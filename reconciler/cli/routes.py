"""``route assign|unassign``, ``routes`` and ``topology``: route membership (ROUTE-3..8)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, load, print_diagnostics
from reconciler.cli.output import routes_table
from reconciler.config.edit import assign, unassign
from reconciler.topology import RENDERERS


def register(sub: Any) -> None:
    r = add_command(sub, "route", HELP["route"],
                    "reconciler route assign ber-1-ss europe --pool central")
    rsub = r.add_subparsers(dest="route_command", metavar="ACTION", help="what to do")
    r.set_defaults(group_parser=r)
    ra = add_command(rsub, "assign", "put an inbound into a route (moving it if needed)", "reconciler route assign ber-1-ss usa")
    ra.add_argument("inbound", help="the inbound's id")
    ra.add_argument("route", help="the route's id")
    ra.add_argument("--pool", help="the pool, when the route has pools")
    add_file(ra)
    ra.set_defaults(run=cmd_route)
    ru = add_command(rsub, "unassign", "take an inbound out of its route", "reconciler route unassign fra-1-hy2")
    ru.add_argument("inbound", help="the inbound's id")
    add_file(ru)
    ru.set_defaults(run=cmd_route)

    rl = add_command(sub, "routes", HELP["routes"], "reconciler routes -f cluster.yaml")
    add_file(rl)
    rl.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table", help="the output format")
    rl.set_defaults(run=cmd_routes)

    t = add_command(sub, "topology", HELP["topology"], "reconciler topology --format svg -o topology.svg")
    add_file(t)
    t.add_argument("--format", choices=["svg", "mermaid", "dot"], default="mermaid", help="the picture's format")
    t.add_argument("-o", "--out", default="-", help="output file ('-' for stdout)")
    t.set_defaults(run=cmd_topology)


def cmd_route(args: argparse.Namespace) -> int:
    file = cluster_file(args)
    if args.route_command == "assign":
        result = assign(file, args.inbound, args.route, args.pool)
    else:
        result = unassign(file, args.inbound)
    print_diagnostics(result.warnings)
    print(f"{result.file}: {result.summary}" if result.changed else f"{result.file}: unchanged — {result.summary}")
    return 0




def cmd_routes(args: argparse.Namespace) -> int:
    cluster = load(cluster_file(args))
    if args.output == "table":
        Console().print(routes_table(cluster))
        return 0
    from reconciler.cli.output import emit

    routes = [{"id": r.id, "name": r.name, "flag": r.flag, "balance": r.balance, "steering": r.steering,
               "pools": r.pools or [], "implicit": r.implicit,
               "inbounds": [{"inbound": m.inbound.id, "server": m.server.name, "pool": m.inbound.pool}
                            for m in cluster.members[r.id]]} for r in cluster.effective_routes]
    emit(args.output, {"routes": routes, "unassigned": [r.inbound.id for r in cluster.unassigned]}, "", [], [])
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    import time

    from reconciler.cli.common import state_of

    path = cluster_file(args)
    cluster = load(path)
    # The verdicts the loop keeps, as of now, per server and per inbound: marks and regional verdicts included
    # (none before the loop's first interval: the picture then shows the file alone).
    learned = state_of(path, cluster).load_learned(cluster)
    health = learned.current_verdicts(cluster, time.time()).labels() if learned.ticks else {}
    text = RENDERERS[args.format](cluster, health)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    return 0
