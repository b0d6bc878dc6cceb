"""``users``: every user at a glance — usage this period, limit, reset, expiry, state, devices, last seen, servers.

Read from the state the loop keeps (the state folder's learned state, where the kernel counters the servers
report are turned into each user's usage), evaluated as of now with the file as it is: a raised limit or a
renewed date shows at once. ``-o table|json|yaml`` (``--json`` is ``-o json``); ``--state`` keeps one state.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, load, state_of, warn
from reconciler.errors import InvalidInput
from reconciler.text import iso_time, size_text

STATES = ("active", "over_quota", "expired", "disabled", "device_limit")


def register(sub: Any) -> None:
    us = add_command(sub, "users", HELP["users"],
                     "reconciler users --state over_quota")
    us.add_argument("action", nargs="?", choices=["import"],
                    help="import: copy the file's `users:` into the database settings.users.database names (its schema "
                         "created or migrated), then set settings.users.source: postgres and delete the list")
    add_file(us)
    us.add_argument("--state", choices=STATES, help="only the users in this state")
    us.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table", help="the output format")
    us.add_argument("--json", action="store_true", help="the same as -o json")
    us.set_defaults(run=cmd_users)


def _day(t: float | None) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t)) if t else "-"


def _iso(t: float | None) -> str | None:
    """``text.iso_time``, or None for never."""
    return iso_time(t) if t else None


def _ago(t: float | None, now: float) -> str:
    if not t:
        return "never"
    s = max(0, int(now - t))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago" if s < 172800 else _day(t)


def cmd_import(path: str) -> int:
    """The file's users into the database (upserted by name, in one transaction); the file is left as it is."""
    from reconciler.userdb import UserDatabase, dsn_of

    cluster = load(path)
    if cluster.settings.users.source == "postgres":
        raise InvalidInput(f"{path} already reads its users from the database (settings.users.source: postgres): "
                           "there is no list in the file to import")
    if not cluster.users:
        raise InvalidInput(f"{path} lists no users to import")
    db = UserDatabase(dsn_of(cluster.settings.users))
    found, now = db.migrate()
    if found != now:
        warn(f"the {db.name}: schema {'created' if found == 0 else f'migrated from version {found}'} (version {now})")
    n = db.put(cluster.users)
    print(f"imported {n} user(s) into the {db.name}; next: set settings.users.source: postgres in {path} and delete "
          "its `users:` list (the database is their home from then on)")
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    from reconciler.balance import Snapshot
    from reconciler.cli.output import emit

    if args.action == "import":
        return cmd_import(cluster_file(args))
    path = cluster_file(args)
    cluster = load(path)
    state = state_of(path, cluster)
    learned = state.load_learned(cluster)
    for note in state.notes:
        warn(note)
    for server, why in sorted(learned.ledger.unavailable.items()):
        warn(f"{server}: no per-user traffic: {why}")
    now = time.time()
    snap = Snapshot(cluster=cluster, now=now, usage=learned.ledger.view(cluster, now))
    chosen = [(u, snap.usage[u.name], snap.standing(u)) for u in cluster.users]
    chosen = [(u, used, st) for u, used, st in chosen if not args.state or st == args.state]
    users = [{
        "name": u.name, "state": st, "upload_bytes": used.up, "download_bytes": used.down, "used_bytes": used.used,
        "limit_bytes": u.data_limit, "period_start": _iso(used.period_start), "next_reset": _iso(used.next_reset),
        "expires": _iso(u.expires_at), "devices": used.devices, "device_limit": u.device_limit,
        "last_seen": _iso(used.last_seen),
        "servers": list(used.servers), "total_bytes": used.total, "demand_mbps": round(used.demand_mbps, 3)}
        for u, used, st in chosen]
    fmt = "json" if args.json else args.output
    rows = [{"USER": u.name, "STATE": st.replace("_", " "), "USED": size_text(used.used),
             "LIMIT": size_text(u.data_limit) if u.data_limit else "unlimited",
             "USE": f"{100 * used.used / u.data_limit:.0f}%" if u.data_limit else "-",
             "RESETS": _day(used.next_reset), "EXPIRES": _day(u.expires_at),
             "DEVICES": f"{used.devices}/{u.device_limit}" if u.device_limit else str(used.devices),
             "LAST SEEN": _ago(used.last_seen, now), "SERVERS": ",".join(used.servers) or "-"} for u, used, st in chosen]
    columns = ["USER", "STATE", "USED", "LIMIT", "USE", "RESETS", "EXPIRES", "DEVICES", "LAST SEEN", "SERVERS"]
    served = sum(st == "active" for _, _, st in chosen)
    if fmt == "table" and served != len(chosen):  # the count the table's title gives counts every user it lists
        warn(f"{len(chosen) - served} of {len(chosen)} user(s) listed are not served (disabled, expired, over a limit)")
    emit(fmt, {"time": _iso(now), "users": users}, "Users", columns, rows)
    return 0
