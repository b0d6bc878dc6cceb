"""``subscription USER`` and ``status USER``: what a user gets and why, from the one fleet snapshot
the loop answers from (the same bytes as the live endpoint and the files)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from reconciler.cli.common import add_command, add_file, base_dir, cluster_file, fleet_snapshot, load, secret_of, user_named
from reconciler.errors import ConfigError, InvalidInput


def register(sub: Any) -> None:
    sp = add_command(sub, "subscription", "print a user's subscription document (needs the master secret, GITOPS-6)",
                     "reconciler subscription alice --format sing-box")
    sp.add_argument("user", help="the user's name")
    sp.add_argument("--format", choices=["links", "sing-box", "clash"], default="links", help="the document's format")
    add_file(sp)
    sp.add_argument("--headers", action="store_true", help="print the HTTP headers too")
    sp.add_argument("--decode", action="store_true", help="links: print the share links, not base64")
    sp.add_argument("--address", help="the client's IP: its region (settings.steering.geoip_database) steers geo routes")
    sp.set_defaults(run=cmd_subscription)

    st = add_command(sub, "status", "what a user's entries are and why (HEALTH-13)", "reconciler status alice --json")
    st.add_argument("user", nargs="?", help="the user's name")
    st.add_argument("--user", dest="user_option", metavar="USER", help="the same as the positional USER (older spelling)")
    add_file(st)
    st.add_argument("--json", action="store_true", help="the result as JSON")
    st.set_defaults(run=cmd_status)


def _region(path: str, db: str | None, address: str) -> str | None:
    from reconciler.balance.geoip import open_geoip

    if not db:
        raise InvalidInput("--address needs settings.steering.geoip_database (a MaxMind-format file)")
    where = base_dir(path) / os.path.expanduser(db)
    try:
        region = open_geoip(str(where)).region(address)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the GeoIP database {where}: {exc}") from None
    print(f"note: {address} → region {region or 'unknown (failover order)'}", file=sys.stderr)
    return region


def cmd_subscription(args: argparse.Namespace) -> int:
    from reconciler.subscriptions import render

    path = cluster_file(args)
    cluster = load(path)
    user_named(cluster, args.user)
    secret = secret_of(cluster)
    region = _region(path, cluster.settings.steering.geoip_database, args.address) if args.address else None
    snap = fleet_snapshot(path, cluster, secret=secret)
    doc = render(snap, args.user, args.format, secret, region=region)
    if doc.refused:
        print(f"note: {args.user} is refused (HTTP {doc.status} from the live endpoint): {doc.body.decode().strip()}",
              file=sys.stderr)
    elif not doc.entries:
        print(f"note: {args.user} gets no entries (no route has a usable inbound)", file=sys.stderr)
    if args.headers:
        for k, v in doc.headers.items():
            print(f"{k}: {v}")
        print()
    body = base64.b64decode(doc.body) if (args.decode and args.format == "links") else doc.body
    sys.stdout.write(body.decode())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from reconciler.balance import decide

    name = args.user or args.user_option
    if not name:
        raise InvalidInput("status needs a user: reconciler status USER")
    path = cluster_file(args)
    cluster = load(path)
    user = user_named(cluster, name)
    snap = fleet_snapshot(path, cluster)
    active = user.active(snap.now)
    entries = decide(snap, user.name)
    rows: list[dict[str, Any]] = [
        {"route": e.route.id, "entry": e.name, "server": e.ref.server.name, "inbound": e.ref.inbound.id, "pool": e.pool,
         "status": e.status, "in_rotation": e.in_rotation, "why": e.why, "health": e.health} for e in entries]
    shown = {e.route.id for e in entries}
    hidden = [r.id for r in cluster.effective_routes if r.id not in shown]
    if args.json:
        print(json.dumps({"user": user.name, "active": active, "entries": rows, "hidden_routes": hidden},
                         indent=2, ensure_ascii=False))
        return 0
    table = Table(title=f"{user.name}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}"
                        + ("" if active else " (disabled or expired)"))
    for col in ("route", "entry", "server", "status", "why this inbound", "health"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[k]) for k in ("route", "entry", "server", "status", "why", "health")))
    Console().print(table)
    if hidden:
        print(f"hidden routes (empty or nothing usable yet): {', '.join(hidden)}")
    return 0
