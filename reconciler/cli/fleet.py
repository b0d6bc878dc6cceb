"""``subscription USER``: what a user gets, from the one fleet snapshot
the loop answers from (the same bytes as the live endpoint and the files)."""

from __future__ import annotations

import argparse
import base64
import sys
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, base_dir, cluster_file, fleet_snapshot, load, secret_of, user_named
from reconciler.errors import ConfigError, InvalidInput


def register(sub: Any) -> None:
    sp = add_command(sub, "subscription", HELP["subscription"],
                     "reconciler subscription alice --format sing-box")
    sp.add_argument("user", help="the user's name")
    sp.add_argument("--format", choices=["links", "sing-box", "clash"], default="links", help="the document's format")
    add_file(sp)
    sp.add_argument("--headers", action="store_true", help="print the HTTP headers too")
    sp.add_argument("--decode", action="store_true", help="links: print the share links, not base64")
    sp.add_argument("--address", help="the client's IP: its region (settings.steering.geoip_database) steers geo routes")
    sp.set_defaults(run=cmd_subscription)


def _region(path: str, db: str | None, address: str) -> str | None:
    from reconciler.balance.geoip import database_path, open_geoip

    if not db:
        raise InvalidInput("--address needs settings.steering.geoip_database (a MaxMind-format file)")
    where = database_path(base_dir(path), db)
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
    if doc.refused:  # no document: the refusal's sentence is not one, so nothing goes to stdout (a file it fills)
        print(f"error: {args.user} is refused (HTTP {doc.status} from the live endpoint): {doc.body.decode().strip()}",
              file=sys.stderr)
        return 1
    if not doc.entries:
        print(f"note: {args.user} gets no entries (no route has a usable inbound)", file=sys.stderr)
    if args.headers:
        for k, v in doc.headers.items():
            print(f"{k}: {v}")
        print()
    body = base64.b64decode(doc.body) if (args.decode and args.format == "links") else doc.body
    sys.stdout.write(body.decode())
    return 0
