"""``status``: the fleet like ``kubectl get``, one server like ``describe``, one user's entries (HEALTH-13).

``status`` lists every server: its verdict and whether it is in rotation, why, its users and traffic, its
engine; ``status SERVER`` describes one: each inbound's verdict with its reason and marks, the witnesses'
current streaks against it, how long since it reported; ``status USER`` shows the user's entries and why.
Verdicts come from the state the loop keeps (the state folder), evaluated as of now. ``-o table|json|yaml``
(``--json`` is ``-o json``); the file's warnings (ROUTE-4/5) come with the fleet.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, load, state_of, user_named, warn
from reconciler.cli.output import emit
from reconciler.errors import InvalidInput
from reconciler.text import iso_time, lasted_text, plural


def register(sub: Any) -> None:
    st = add_command(sub, "status", HELP["status"],
                     "reconciler status fra-1 -o yaml")
    st.add_argument("name", nargs="?", help="a server or a user (default: the whole fleet)")
    st.add_argument("--user", dest="user_option", metavar="USER", help="a user's entries (older spelling of NAME)")
    add_file(st)
    st.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table", help="the output format")
    st.add_argument("--json", action="store_true", help="the same as -o json")
    st.set_defaults(run=cmd_status)




def cmd_status(args: argparse.Namespace) -> int:
    from reconciler.balance.decide import held_by_server
    from reconciler.config import load_cluster

    path = cluster_file(args)
    loaded = load_cluster(path)  # once: the cluster and its warnings
    if loaded.cluster is None:
        load(path)  # raises ConfigError with the diagnostics, as every command does
    cluster = loaded.cluster
    assert cluster is not None
    fmt = "json" if args.json else args.output
    name = args.name or args.user_option
    state = state_of(path, cluster)
    learned = state.load_learned(cluster)
    for note in state.notes:
        warn(note)
    now = time.time()
    verdicts = learned.current_verdicts(cluster, now)
    if name and not args.user_option and not any(s.name == name for s in cluster.servers) \
            and not any(u.name == name for u in cluster.users):
        close = difflib.get_close_matches(name, [s.name for s in cluster.servers] + [u.name for u in cluster.users], n=1)
        raise InvalidInput(f"no server or user {name!r} in {path}" + (f"; did you mean {close[0]!r}?" if close else ""))
    if args.user_option or (name and not any(s.name == name for s in cluster.servers)):
        return _user(args, path, cluster, user_named(cluster, str(name)).name, fmt)
    if name:
        server = next(s for s in cluster.servers if s.name == name)
        sv = verdicts.server(name)
        idx = {s: i for i, s in enumerate(verdicts.topology.servers)}
        inbounds = []
        for ib in server.inbounds:
            v = verdicts.inbound(ib.id)
            t = verdicts.topology.inbounds.index(ib.id)
            streaks = {w: int(verdicts.fail[i, t]) for w, i in idx.items() if w != name and int(verdicts.fail[i, t]) > 0}
            inbounds.append({"inbound": ib.id, "protocol": ib.protocol, "port": ib.port, "status": v.label,
                             "in_rotation": v.rotation, "reason": v.reason, "marks": [m.text for m in v.marks],
                             "unreachable_from": v.unreachable_from, "out_for": v.out_for, "failing_witnesses": streaks})
        eng = cluster.engine_of(server)
        data = {"server": name, "host": server.host, "engine": f"{eng.name} {eng.version}", "status": sv.status,
                "label": sv.label, "in_rotation": sv.in_rotation, "rotation": sv.rotation, "reason": sv.reason,
                "marks": [m.text for m in sv.marks], "unreachable_from": sv.unreachable_from, "out_for": sv.out_for,
                "unreliable_witness": sv.unreliable_witness, "censored_witness": sv.censored_witness, "sees": sv.sees,
                "seconds_since_report": sv.seconds_since_report,
                "traffic_mbps": learned.traffic_mbps.get(name, 0.0), "connected": len(learned.connected.get(name, ())),
                "inbounds": inbounds,
                "history": [{"since": iso_time(c.at), "status": c.status, "for_seconds": round(lasted), "reason": c.reason}
                            for c, lasted in learned.history.of(name, now)]}
        title = f"{name} ({server.host}): {sv.label}, in rotation: {sv.rotation} — {sv.reason}"
        emit(fmt, data, title,
             ["inbound", "protocol", "port", "status", "in_rotation", "reason", "marks", "failing_witnesses"], inbounds)
        if fmt == "table" and sv.sees and sv.sees not in sv.reason:
            print(f"as a witness: {sv.sees}")
        if fmt == "table":
            history = learned.history.of(name, now)
            print("verdicts of the last 7 days:" if history else "verdicts of the last 7 days: none recorded yet")
            for c, lasted in history:
                print(f"  {iso_time(c.at)}  {c.status:<11}  for {lasted_text(lasted)}  — {c.reason}")
        return 0
    assigned = held_by_server(cluster, learned.assignments)
    rows = []
    for s in cluster.servers:
        sv = verdicts.server(s.name)
        eng = cluster.engine_of(s)
        rows.append({"server": s.name, "host": s.host, "status": sv.label, "in_rotation": sv.rotation,
                     "why": sv.reason, "marks": len(sv.marks), "users": assigned.get(s.name, 0),
                     "connected": len(learned.connected.get(s.name, ())),
                     "mbps": round(learned.traffic_mbps.get(s.name, 0.0), 1), "engine": f"{eng.name} {eng.version}"})
    warnings = [d.message for d in loaded.warnings if d.code in ("unassigned", "empty-route", "empty-pool")]
    emit(fmt, {"servers": rows, "warnings": warnings, "as_of": now}, plural(len(rows), "server"),
         ["server", "host", "status", "in_rotation", "marks", "why", "users", "connected", "mbps", "engine"], rows)
    if fmt == "table":
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
    return 0


def _user(args: argparse.Namespace, path: str, cluster: Any, name: str, fmt: str) -> int:
    from reconciler.balance import decide
    from reconciler.cli.common import fleet_snapshot

    snap = fleet_snapshot(path, cluster)
    user = cluster.user(name)
    entries = decide(snap, name)
    never = snap.verdicts is None  # the loop never ran with this state folder: nothing was assigned or measured yet
    rows = [{"route": e.route.id, "entry": e.name, "server": e.ref.server.name, "inbound": e.ref.inbound.id,
             "pool": e.pool, "status": "not run yet" if never else e.status, "in_rotation": e.in_rotation,
             "why": e.why.replace("kept from the last assignment", "what the first interval would assign") if never
             else e.why, "health": e.health}
            for e in entries]
    shown = {e.route.id for e in entries}
    hidden = [r.id for r in cluster.effective_routes if r.id not in shown]
    standing = snap.standing(user)  # with the usage the loop measured (snapshot.usage)
    used = snap.usage.get(name)
    n = len(rows)
    usage = {"used_bytes": used.used, "limit_bytes": user.data_limit, "devices": used.devices,
             "next_reset": used.next_reset} if used else {}
    if never and fmt == "table":
        warn(f"`reconciler run` has not run with {path}'s state folder yet: these are the entries its first interval "
             "would give, with no health data")
    emit(fmt, {"user": name, "active": standing == "active", "state": standing, "usage": usage, "entries": rows,
               "hidden_routes": hidden, "run_yet": not never},
         f"{name}: {n} entr{'y' if n == 1 else 'ies'}" + ("" if standing == "active" else f" ({standing.replace('_', ' ')})"),
         ["route", "entry", "server", "status", "why", "health"], rows)
    if hidden and fmt == "table":
        print(f"hidden routes (empty or nothing usable yet): {', '.join(hidden)}")
    return 0

