"""The ``reconciler`` command line.

Exit codes: 0 success, 1 error (invalid file, failed command), 2 reserved for
``plan`` ("changes pending"), 130 interrupted. Whatever the input, no traceback
reaches the operator; set ``RECONCILER_DEBUG=1`` to see one for a bug report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from reconciler import __version__

DEFAULT_FILE = os.environ.get("RECONCILER_FILE", "cluster.yaml")
SCHEMA_PATH = Path("schemas") / "cluster.schema.json"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reconciler", description="Declarative GitOps reconciler for self-hosted VPN clusters.")
    p.add_argument("--version", action="version", version=f"reconciler {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    v = sub.add_parser("validate", help="check a cluster file: schema and semantics (GITOPS-2)")
    v.add_argument("file", nargs="?", default=DEFAULT_FILE)
    v.add_argument("--json", action="store_true", help="machine-readable result")

    s = sub.add_parser("schema", help="write the JSON Schema of the cluster file (GITOPS-1)")
    s.add_argument("--out", default=str(SCHEMA_PATH), help="where to write it ('-' for stdout)")
    s.add_argument("--check", action="store_true", help="exit 1 when the file on disk is stale")

    i = sub.add_parser("init", help="scaffold a minimal valid cluster file")
    i.add_argument("file", nargs="?", default=DEFAULT_FILE)
    i.add_argument("--force", action="store_true", help="overwrite an existing file")

    r = sub.add_parser("route", help="edit route membership in place (ROUTE-3)")
    rsub = r.add_subparsers(dest="route_command", metavar="ACTION")
    ra = rsub.add_parser("assign", help="put an inbound into a route (moving it if needed)")
    ra.add_argument("inbound")
    ra.add_argument("route")
    ra.add_argument("--pool", help="the pool, when the route has pools")
    ra.add_argument("-f", "--file", default=DEFAULT_FILE)
    ru = rsub.add_parser("unassign", help="take an inbound out of its route")
    ru.add_argument("inbound")
    ru.add_argument("-f", "--file", default=DEFAULT_FILE)

    rl = sub.add_parser("routes", help="list routes, their inbounds and warnings")
    rl.add_argument("-f", "--file", default=DEFAULT_FILE)

    t = sub.add_parser("topology", help="draw servers, inbounds and routes (ROUTE-8)")
    t.add_argument("-f", "--file", default=DEFAULT_FILE)
    t.add_argument("--format", choices=["svg", "mermaid", "dot"], default="mermaid")
    t.add_argument("-o", "--out", default="-", help="output file ('-' for stdout)")

    pl = sub.add_parser("plan", help="what apply would change on each server (GITOPS-3); exit 0 none, 2 changes, 1 error")
    pl.add_argument("-f", "--file", default=DEFAULT_FILE)
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--out", help="save the plan, to apply exactly it with `apply FILE`")
    pl.add_argument("--prune", action="store_true", help="also remove what left the cluster file (GITOPS-7)")

    ap = sub.add_parser("apply", help="make the servers match the file (GITOPS-4)")
    ap.add_argument("plan", nargs="?", help="a plan saved with `plan --out`; refused when stale")
    ap.add_argument("-f", "--file", default=DEFAULT_FILE)
    ap.add_argument("--prune", action="store_true", help="remove what left the cluster file (GITOPS-7)")
    ap.add_argument("--json", action="store_true", help="results as JSON")

    lab = sub.add_parser("lab", help="local sandbox servers (root): network namespaces with systemd and sshd")
    labsub = lab.add_subparsers(dest="lab_command", metavar="ACTION")
    lu = labsub.add_parser("up", help="start N hosts and write a cluster file for them")
    lu.add_argument("--hosts", type=int, default=3)
    lu.add_argument("--countries", default="DE,DE,US", help="comma-separated, cycled over the hosts")
    lu.add_argument("--write", default="lab-cluster.yaml", help="the cluster file to write")
    lu.add_argument("--protocol", default="vless-tls",
                    choices=["vless-tls", "trojan", "shadowsocks-2022", "hysteria2", "tuic", "vless-reality"])
    labsub.add_parser("down", help="tear the lab down")

    sim = sub.add_parser("simulate", help="replay a health scenario through the verdict engine (HEALTH-1..13)")
    sim.add_argument("scenario")
    sim.add_argument("--json", action="store_true", help="one JSON object per line per tick")
    sim.add_argument("--all", action="store_true", help="table: every server every tick, not only changes")

    sp = sub.add_parser("subscription", help="print a user's subscription document (GITOPS-6 secret needed)")
    sp.add_argument("user")
    sp.add_argument("--format", choices=["links", "sing-box", "clash"], default="links")
    sp.add_argument("-f", "--file", default=DEFAULT_FILE)
    sp.add_argument("--headers", action="store_true", help="print the HTTP headers too")
    sp.add_argument("--decode", action="store_true", help="links: print the share links, not base64")
    sp.add_argument("--address", help="the client's IP: its region (settings.steering.geoip_database) steers geo routes")

    st = sub.add_parser("status", help="what each user's entries are and why (HEALTH-13)")
    st.add_argument("-f", "--file", default=DEFAULT_FILE)
    st.add_argument("--user", required=True)
    st.add_argument("--json", action="store_true")

    rn = sub.add_parser("run", help="the reconcile loop: collect, verdicts, outlets, drift correction (GITOPS-5)")
    rn.add_argument("-f", "--file", default=DEFAULT_FILE)
    rn.add_argument("--listen", help="HTTP address (default: settings.outputs.listen)")
    rn.add_argument("--duration", type=float, help="stop after this many seconds (tests, demos)")
    rn.add_argument("--ticks", type=int, help="stop after this many intervals")
    rn.add_argument("--no-watch", action="store_true", help="do not watch the file for changes")
    rn.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    d = sub.add_parser("demo", help="show what the reconciler does with the example cluster")
    d.add_argument("-f", "--file", default="cluster.example.yaml")
    d.add_argument("--out-dir", default="demo-output", help="where to write the topology pictures")
    d.add_argument("--no-lab", action="store_true", help="skip provisioning sandbox servers (needs root)")
    d.add_argument("--hosts", type=int, default=5, help="sandbox servers to provision (at least 4)")
    d.add_argument("--duration", type=float, default=120.0, help="seconds the loop runs against the sandbox")
    d.add_argument("--scenario", choices=["none", "block"], default="none",
                   help="block: block one server from its same-country witnesses, then unblock it")
    d.add_argument("--interval", type=float, default=3.0, help="report interval of the demo cluster (seconds)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # the last line of defence: never a traceback for the operator
        if os.environ.get("RECONCILER_DEBUG"):
            traceback.print_exc()
        print(f"internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("  hint: this is a bug in reconciler; rerun with RECONCILER_DEBUG=1 and report the output", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command is None:
        _parser().print_help()
        return 1
    if args.command == "lab" and args.lab_command is None:
        print("usage: reconciler lab {up,down} ...", file=sys.stderr)
        return 1
    if args.command == "route" and args.route_command is None:
        print("usage: reconciler route {assign,unassign} ...", file=sys.stderr)
        return 1
    handler = {
        "validate": cmd_validate,
        "schema": cmd_schema,
        "init": cmd_init,
        "route": cmd_route,
        "routes": cmd_routes,
        "topology": cmd_topology,
        "demo": cmd_demo,
        "simulate": cmd_simulate,
        "subscription": cmd_subscription,
        "status": cmd_status,
        "plan": cmd_plan,
        "apply": cmd_apply,
        "run": cmd_run,
        "lab": cmd_lab,
    }[args.command]
    return handler(args)


# --------------------------------------------------------------------------- validate


def _print_diagnostics(diagnostics: Sequence[object]) -> None:
    for d in diagnostics:
        print(d.render(), file=sys.stderr)  # type: ignore[attr-defined]


def _load_or_report(path: str):  # -> Cluster | None
    """Load the cluster for a command other than validate: report errors only (validate shows warnings)."""
    from reconciler.config import load_cluster

    result = load_cluster(path)
    _print_diagnostics(result.errors)
    return result.cluster


def cmd_validate(args: argparse.Namespace) -> int:
    from reconciler.config import load_cluster

    result = load_cluster(args.file)
    cluster = result.cluster
    if args.json:
        summary = _summary(cluster) if cluster else None
        print(json.dumps({
            "file": args.file,
            "valid": result.ok,
            "errors": [d.as_json() for d in result.errors],
            "warnings": [d.as_json() for d in result.warnings],
            "summary": summary,
        }, indent=2, ensure_ascii=False))
        return 0 if result.ok else 1
    _print_diagnostics(result.diagnostics)
    if not result.ok:
        n = len(result.errors)
        print(f"{args.file}: invalid — {n} error{'s' if n != 1 else ''}", file=sys.stderr)
        return 1
    s = _summary(cluster)
    warn = f"; {len(result.warnings)} warning(s)" if result.warnings else ""
    print(
        f"{args.file}: valid — {s['servers']} servers, {s['inbounds']} inbounds, {s['routes']} routes "
        f"({s['empty_routes']} empty), {s['users']} users{warn}"
    )
    return 0


def _summary(cluster) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {
        "servers": len(cluster.servers),
        "inbounds": len(cluster.inbounds),
        "routes": len(cluster.effective_routes),
        "empty_routes": sum(1 for r in cluster.effective_routes if not cluster.members[r.id]),
        "unassigned_inbounds": len(cluster.unassigned),
        "users": len(cluster.users),
    }


# --------------------------------------------------------------------------- schema, init


def schema_text() -> str:
    from reconciler.model import Cluster

    schema = Cluster.model_json_schema(mode="validation")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://reconciler.invalid/schemas/cluster.schema.json",
        **schema,
        "title": "reconciler cluster file",
        "description": "Desired state of a self-hosted VPN cluster: settings, servers, routes, users.",
    }
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def cmd_schema(args: argparse.Namespace) -> int:
    text = schema_text()
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if args.check:
        current = out.read_text(encoding="utf-8") if out.exists() else ""
        if current != text:
            print(f"{out} is stale; run `reconciler schema` and commit the result", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


INIT_TEMPLATE = """\
# yaml-language-server: $schema=schemas/cluster.schema.json
# A minimal cluster: one server, one inbound, one route. Validate with
#   reconciler validate {file}
# Secrets never go here: set RECONCILER_SECRET (see settings.secret).

settings:
  health:
    report_interval: 60s

servers:
  - name: vps-1
    host: 203.0.113.10              # your server's address
    ssh: {{user: root, port: 22}}
    country: DE                     # ISO 3166-1 alpha-2; the region is derived
    inbounds:
      - id: vps-1-reality
        name: "My VPN"              # what users see in their app
        protocol: vless-reality
        port: 443
        camouflage: www.example.com # a real TLS site REALITY presents
        route: default

routes:
  - id: default                     # the route a file without routes gets implicitly (ROUTE-6)
    name: default

users:
  - name: me
"""


def cmd_init(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if path.exists() and not args.force:
        print(f"{path} already exists; use --force to overwrite", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(INIT_TEMPLATE.format(file=path), encoding="utf-8")
    schema = path.parent / SCHEMA_PATH
    if not schema.exists():
        schema.parent.mkdir(parents=True, exist_ok=True)
        schema.write_text(schema_text(), encoding="utf-8")
        print(f"wrote {schema}")
    print(f"wrote {path}; next: reconciler validate {path}")
    return 0


# --------------------------------------------------------------------------- route editing and listing


def cmd_route(args: argparse.Namespace) -> int:
    from reconciler.config.edit import EditError, assign, unassign

    try:
        if args.route_command == "assign":
            result = assign(args.file, args.inbound, args.route, args.pool)
        else:
            result = unassign(args.file, args.inbound)
    except EditError as exc:
        _print_diagnostics(exc.diagnostics)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print_diagnostics([w for w in result.warnings])
    print(f"{result.file}: {result.summary}" if result.changed else f"{result.file}: unchanged — {result.summary}")
    return 0


def routes_table(cluster) -> object:  # type: ignore[no-untyped-def]
    from rich.table import Table

    table = Table(title="Routes (in subscription order)")
    for column in ("#", "route", "balance", "pools / steering", "inbounds (server)"):
        table.add_column(column)
    for n, route in enumerate(cluster.effective_routes, 1):
        members = cluster.members[route.id]
        label = f"{route.flag} {route.name}" if route.flag else route.name
        if route.implicit:
            label += " (implicit)"
        pools = f"{', '.join(route.pools)} / {route.steering}" if route.pools else "—"
        inbounds = "\n".join(
            f"{ref.inbound.name} ({ref.server.name}{', ' + ref.inbound.pool if ref.inbound.pool else ''})" for ref in members
        ) or "[dim]empty — hidden from subscriptions[/dim]"
        table.add_row(str(n), f"{label}\n[dim]{route.id}[/dim]", route.balance, pools, inbounds)
    if cluster.unassigned:
        table.add_row("", "[yellow]unassigned[/yellow]", "", "",
                      "\n".join(f"{r.inbound.name} ({r.server.name})" for r in cluster.unassigned))
    return table


def cmd_routes(args: argparse.Namespace) -> int:
    from rich.console import Console

    cluster = _load_or_report(args.file)
    if cluster is None:
        return 1
    Console().print(routes_table(cluster))
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    from reconciler.topology import RENDERERS

    cluster = _load_or_report(args.file)
    if cluster is None:
        return 1
    text = RENDERERS[args.format](cluster)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- subscriptions and status


def _snapshot(path: str):  # type: ignore[no-untyped-def]
    """The cluster plus what the controller has learnt (facts of the last apply), as a snapshot."""
    import time

    from reconciler.balance import Snapshot

    cluster = _load_or_report(path)
    if cluster is None:
        return None
    facts_path = Path(path).resolve().parent / cluster.settings.outputs.state_dir / "facts.json"
    facts: dict[str, dict[str, str]] = {}
    if facts_path.exists():
        try:
            facts = json.loads(facts_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            print(f"warning: ignoring unreadable {facts_path}: {exc}", file=sys.stderr)
    from reconciler.loop.learned import Learned
    from reconciler.loop.service import STATE_FILE

    learned, note = Learned.load(facts_path.parent / STATE_FILE, cluster)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    now = time.time()
    verdicts = learned.current_verdicts(cluster, now) if learned.ticks else None
    snapshot = Snapshot(cluster=cluster, now=now, verdicts=verdicts, loads=learned.loads(now),
                        assignments=learned.assignments, public_keys=facts.get("public_keys", {}),
                        tls_pins=facts.get("tls_pins", {}))
    pending = [r.inbound.id for r in cluster.inbounds
               if r.inbound.protocol == "vless-reality" and r.inbound.id not in snapshot.public_keys]
    if pending:
        print(f"note: {len(pending)} REALITY inbound(s) have no public key yet (apply first): {', '.join(pending)}",
              file=sys.stderr)
    return snapshot


def _secret_for(cluster):  # type: ignore[no-untyped-def]
    from reconciler.credentials import SecretError, load_secret

    try:
        return load_secret(cluster.settings.secret.env, cluster.settings.secret.file)
    except SecretError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def cmd_subscription(args: argparse.Namespace) -> int:
    import base64

    from reconciler.subscriptions import render

    snapshot = _snapshot(args.file)
    if snapshot is None:
        return 1
    names = [u.name for u in snapshot.cluster.users]
    if args.user not in names:
        import difflib

        close = difflib.get_close_matches(args.user, names, n=1)
        print(f"error: no user {args.user!r}" + (f"; did you mean {close[0]!r}?" if close else ""), file=sys.stderr)
        return 1
    secret = _secret_for(snapshot.cluster)
    if secret is None:
        return 1
    region = None
    if args.address:
        db = snapshot.cluster.settings.steering.geoip_database
        if not db:
            print("error: --address needs settings.steering.geoip_database (a MaxMind-format file)", file=sys.stderr)
            return 1
        from reconciler.balance.geoip import open_geoip

        path = Path(args.file).resolve().parent / os.path.expanduser(db)
        try:
            region = open_geoip(str(path)).region(args.address)
        except (OSError, ValueError) as exc:
            print(f"error: cannot read the GeoIP database {path}: {exc}", file=sys.stderr)
            return 1
        print(f"note: {args.address} → region {region or 'unknown (failover order)'}", file=sys.stderr)
    doc = render(snapshot, args.user, args.format, secret, region=region)
    if not doc.entries:
        print(f"note: {args.user} gets no entries (disabled, expired, or no route has a usable inbound)", file=sys.stderr)
    if args.headers:
        for k, v in doc.headers.items():
            print(f"{k}: {v}")
        print()
    body = base64.b64decode(doc.body) if (args.decode and args.format == "links") else doc.body
    sys.stdout.write(body.decode())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from reconciler.balance import decide

    snapshot = _snapshot(args.file)
    if snapshot is None:
        return 1
    cluster = snapshot.cluster
    try:
        user = cluster.user(args.user)
    except KeyError:
        print(f"error: no user {args.user!r}", file=sys.stderr)
        return 1
    entries = decide(snapshot, args.user)
    rows = [{"route": e.route.id, "entry": e.name, "server": e.ref.server.name, "inbound": e.ref.inbound.id,
             "pool": e.pool, "status": e.status, "in_rotation": e.in_rotation, "why": e.why, "health": e.health}
            for e in entries]
    shown = {e.route.id for e in entries}
    hidden = [r.id for r in cluster.effective_routes if r.id not in shown]
    if args.json:
        print(json.dumps({"user": user.name, "active": user.active(snapshot.now), "entries": rows, "hidden_routes": hidden},
                         indent=2, ensure_ascii=False))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{user.name}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}"
                        + ("" if user.active(snapshot.now) else " (disabled or expired)"))
    for col in ("route", "entry", "server", "status", "why this inbound", "health"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["route"], r["entry"], r["server"], r["status"], r["why"], r["health"])
    Console().print(table)
    if hidden:
        print(f"hidden routes (empty or nothing usable yet): {', '.join(hidden)}")
    return 0


# --------------------------------------------------------------------------- plan, apply


def _observe(path: str, prune: bool, then=None):  # type: ignore[no-untyped-def]
    """(cluster, state, observed, fingerprint, secret[, what ``then`` returned]) or None after printing why.

    ``then(cluster, state, observed, fingerprint, secret, pool)``, when given, runs on the same SSH
    connections right after the observation (apply: one handshake per server, not two).
    """
    import asyncio

    from reconciler.apply.session import pool_for
    from reconciler.plan.observe import fingerprint, observe
    from reconciler.state.folder import StateFolder

    cluster = _load_or_report(path)
    if cluster is None:
        return None
    secret = _secret_for(cluster)
    if secret is None:
        return None
    state = StateFolder.of(path, cluster.settings.outputs.state_dir)

    async def go():  # type: ignore[no-untyped-def]
        async with pool_for(state) as pool:
            observed = await observe(cluster, secret, pool, str(Path(path).resolve().parent), prune, state.managed())
            fp = fingerprint(observed)
            if then is None:
                return cluster, state, observed, fp, secret
            return cluster, state, observed, fp, secret, await then(cluster, state, observed, fp, secret, pool)

    return asyncio.run(go())


def cmd_plan(args: argparse.Namespace) -> int:
    from reconciler.plan.actions import render_human, render_json

    got = _observe(args.file, args.prune)
    if got is None:
        return 1
    cluster, state, observed, fp, _ = got
    plans = [o.plan for o in observed]
    warnings = [f"{len(cluster.unassigned)} inbound(s) are not in any route — clients cannot see them yet: "
                + ", ".join(r.inbound.id for r in cluster.unassigned)] if cluster.unassigned else []
    if args.json:
        sys.stdout.write(render_json(plans, fp))
    else:
        sys.stdout.write(render_human(plans, warnings))
    if args.out:
        doc = json.loads(render_json(plans, fp))
        doc["file"] = str(Path(args.file).resolve())
        doc["prune"] = args.prune
        Path(args.out).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        print(f"saved the plan to {args.out}; apply exactly it with `reconciler apply {args.out}`", file=sys.stderr)
    if any(p.error or p.problems for p in plans):
        return 1
    return 2 if any(p.changes for p in plans) else 0


def cmd_apply(args: argparse.Namespace) -> int:
    from reconciler.apply.run import apply_all
    from reconciler.apply.session import Progress, remember

    saved = None
    if args.plan:
        try:
            saved = json.loads(Path(args.plan).read_text())
        except (OSError, ValueError) as exc:
            print(f"error: cannot read the saved plan {args.plan}: {exc}", file=sys.stderr)
            return 1
        args.file = saved.get("file", args.file)
        args.prune = bool(saved.get("prune", args.prune))
    stale: list[str] = []

    async def then(cluster, state, observed, fp, secret, pool):  # type: ignore[no-untyped-def]
        if saved is not None and saved.get("fingerprint") != fp:
            before = {s["server"]: s for s in saved.get("servers", [])}
            stale.extend(o.plan.server for o in observed
                         if before.get(o.plan.server, {}).get("desired_digest") != o.plan.desired_digest
                         or before.get(o.plan.server, {}).get("facts_digest") != o.plan.facts_digest)
            return None
        progress = Progress([o.plan.server for o in observed])
        try:
            # The commit returns the public material the servers generated: `observed` then holds it.
            return await apply_all(observed, pool, progress)
        finally:
            progress.close()

    got = _observe(args.file, args.prune, then)
    if got is None:
        return 1
    cluster, state, observed, fp, secret, results = got
    if results is None:
        print(f"error: the saved plan is stale — the desired state or the facts changed since on: "
              f"{', '.join(stale) or 'the set of servers'}; run `reconciler plan --out` again", file=sys.stderr)
        return 1
    remember(state, cluster, observed, results)
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2, default=str))
    else:
        for r in results:
            mark = "ok  " if r.ok else "FAIL"
            print(f"{mark} {r.server:16s} {r.seconds:6.1f}s  {r.message}")
        failed = [r for r in results if not r.ok]
        print(f"Apply: {sum(r.ok for r in results)} ok, {len(failed)} failed, {sum(r.changed for r in results)} changed.")
    return 0 if all(r.ok for r in results) else 1


# --------------------------------------------------------------------------- run


def setup_logging(level: str = "info") -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from reconciler.loop.service import run_loop

    setup_logging(args.log_level)
    cluster = _load_or_report(args.file)
    if cluster is None:
        return 1
    secret = _secret_for(cluster)
    if secret is None:
        return 1
    coro = run_loop(args.file, cluster, secret, listen=args.listen, duration=args.duration, max_ticks=args.ticks,
                    watch=not args.no_watch)
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coro)
        return uvloop.run(coro)
    except KeyboardInterrupt:
        return 130


# --------------------------------------------------------------------------- lab


def cmd_lab(args: argparse.Namespace) -> int:
    from reconciler.lab import Lab, LabError

    lab = Lab(log=lambda s: print(s, file=sys.stderr))
    try:
        if args.lab_command == "down":
            lab.down()
            print("lab is down")
            return 0
        hosts = lab.up(args.hosts)
        countries = [c.strip().upper() for c in args.countries.split(",") if c.strip()] or ["DE"]
        text = lab_cluster_yaml(lab, hosts, countries, args.protocol)
        Path(args.write).write_text(text)
        print(f"{len(hosts)} host(s) up; wrote {args.write}. Next: reconciler plan -f {args.write}")
        return 0
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def lab_cluster_yaml(lab, hosts, countries: list[str], protocol: str | list[str] = "vless-tls",  # type: ignore[no-untyped-def]
                     prober_index: int | None = None, harden: bool = False, report_interval: float | None = None,
                     listen: str | None = None, extra_settings: tuple[str, ...] = (), users: int = 2) -> str:
    """A valid cluster file for the lab hosts: one inbound each, all in one route, host keys pinned."""
    ports = {"vless-tls": 443, "trojan": 443, "shadowsocks-2022": 8388, "hysteria2": 443, "tuic": 443, "vless-reality": 443}
    lines = [
        "# yaml-language-server: $schema=schemas/cluster.schema.json",
        "# Written by `reconciler lab up`: sandbox hosts on this machine (198.18.0.0/24 in network namespaces).",
        "settings:",
        "  outputs: {state_dir: .reconciler-lab, subscriptions_dir: subscriptions-lab"
        + (f", listen: \"{listen}\"" if listen else "") + "}",
        f"  harden: {'true' if harden else 'false'}",
        *([f"  health: {{report_interval: {report_interval:g}s}}"] if report_interval else []),
        *(f"  {line}" for line in extra_settings),
        "servers:",
    ]
    protocols = [protocol] if isinstance(protocol, str) else list(protocol)
    for i, h in enumerate(hosts):
        country = countries[i % len(countries)]
        protocol = protocols[i % len(protocols)]
        extra = {"vless-reality": "camouflage: www.example.com", "shadowsocks-2022": ""}.get(
            protocol, "tls: {server_name: www.lab.test}")
        lines += [
            f"  - name: {h.name}",
            f"    host: {h.ip}",
            f"    ssh: {{user: root, port: 22, identity: {lab.key}, host_key: \"{lab.host_key(h)}\"}}",
            f"    country: {country}",
            *(["    prober: true"] if i == prober_index else []),
            "    inbounds:",
            f"      - {{id: {h.name}-in, name: \"{country} {h.name}\", protocol: {protocol}, port: {ports[protocol]}, route: lab"
            + (f", {extra}" if extra else "") + "}",
        ]
    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    names += [f"user{i}" for i in range(len(names), users)]
    lines += ["routes:", "  - {id: lab, name: Lab}", "users:", *(f"  - name: {n}" for n in names[:users]), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- simulate


def cmd_simulate(args: argparse.Namespace) -> int:
    from reconciler.config import load_cluster, load_document
    from reconciler.config.diagnostics import at
    from reconciler.health.simulate import Scenario, check_names, inline_topology, run
    from reconciler.health.topology import Topology
    from reconciler.model.cluster import HealthSettings

    scenario, diagnostics, source = load_document(args.scenario, Scenario)
    if scenario is None:
        _print_diagnostics(diagnostics)
        return 1
    settings = scenario.health or HealthSettings()
    if scenario.cluster is not None:
        cluster_path = os.path.join(os.path.dirname(os.path.abspath(args.scenario)), scenario.cluster)
        shown = os.path.join(os.path.dirname(args.scenario), scenario.cluster)
        loaded = load_cluster(cluster_path, display=shown)
        if loaded.cluster is None:
            _print_diagnostics(loaded.errors)
            return 1
        topology = Topology.from_cluster(loaded.cluster)
        settings = scenario.health or loaded.cluster.settings.health
    else:
        topology = inline_topology(scenario.servers or [])
    problems = check_names(scenario, topology)
    if problems:
        _print_diagnostics([at("error", source.key(("events", i)), msg, f"known servers: {', '.join(topology.servers)}", "reference")
                            for i, msg in problems])
        return 1
    if args.json:
        for tick, verdicts in run(scenario, topology, settings):
            line = {"tick": tick, "servers": {name: v.as_json() for name, v in verdicts.servers().items()}}
            print(json.dumps(line, ensure_ascii=False))
        return 0
    return _simulate_table(scenario, topology, settings, run, args.all)


def _simulate_table(scenario, topology, settings, run, show_all: bool) -> int:  # type: ignore[no-untyped-def]
    from rich.console import Console
    from rich.table import Table

    colours = {"ok": "green", "no_data": "bright_black", "blocked": "magenta", "unreachable": "dark_orange", "unavailable": "red"}
    table = Table(title=f"verdict timeline — {scenario.ticks} ticks of {settings.report_interval:g}s, seed {scenario.seed}")
    for col in ("tick", "server", "status", "in rotation", "reason"):
        table.add_column(col)
    previous: dict[str, tuple[str, bool, str]] = {}
    changes: dict[str, int] = {name: 0 for name in topology.servers}
    last = None
    for tick, verdicts in run(scenario, topology, settings):
        last = verdicts
        for name, v in verdicts.servers().items():
            key = (v.status, v.in_rotation, v.reason)
            if show_all or previous.get(name, ("ok", True, "ok")) != key:
                if name in previous and previous[name][:2] != key[:2]:
                    changes[name] += 1
                c = colours.get(v.status, "white")
                table.add_row(str(tick), name, f"[{c}]{v.status}[/{c}]", "yes" if v.in_rotation else "[red]no[/red]", v.reason)
            previous[name] = key
    console = Console() if sys.stdout.isatty() else Console(width=200)  # no wrapping when piped or logged
    console.print(table)
    if last is not None:
        summary = Table(title=f"after tick {scenario.ticks - 1}")
        for col in ("server", "status", "in rotation", "verdict changes", "reason"):
            summary.add_column(col)
        for name, v in last.servers().items():
            summary.add_row(name, v.status, "yes" if v.in_rotation else "no", str(changes[name]), v.reason)
        console.print(summary)
    return 0


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    """Validate the example and draw it; as root, also provision sandbox servers and run the loop against them."""
    from rich.console import Console

    from reconciler.config import load_cluster
    from reconciler.topology import RENDERERS

    console = Console()
    console.rule(f"reconciler demo — {args.file}")
    result = load_cluster(args.file)
    _print_diagnostics(result.diagnostics)
    if result.cluster is None:
        return 1
    cluster = result.cluster
    s = _summary(cluster)
    console.print(
        f"[green]valid[/green]: {s['servers']} servers in {len({x.country for x in cluster.servers})} countries, "
        f"{s['inbounds']} inbounds, {s['routes']} routes, {s['users']} users, {len(result.warnings)} warning(s)"
    )
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
    from reconciler.loop.demo import run_lab_demo

    return run_lab_demo(console, out, args.hosts, args.duration, args.scenario, args.interval, main, lab_cluster_yaml)


if __name__ == "__main__":
    sys.exit(main())
