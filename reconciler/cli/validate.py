"""``validate``, ``schema`` and ``init``: the cluster file itself (GITOPS-1, GITOPS-2, ROUTE-6)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, plural, print_diagnostics, state_of
from reconciler.cli.output import summary
from reconciler.config.diagnostics import Diagnostic, at
from reconciler.config.loader import LoadResult
from reconciler.config.schema import SCHEMA_PATH, schema_text
from reconciler.servable import load_servable


def register(sub: Any) -> None:
    v = add_command(sub, "validate", HELP["validate"], "reconciler validate -f cluster.yaml")
    add_file(v, positional=True)
    v.add_argument("--json", action="store_true", help="the result as JSON (errors, warnings, summary)")
    v.set_defaults(run=cmd_validate)

    s = add_command(sub, "schema", HELP["schema"], "reconciler schema --check")
    s.add_argument("--out", default=str(SCHEMA_PATH), help="where to write it ('-' for stdout)")
    s.add_argument("--check", action="store_true", help="exit 1 when the file on disk is stale")
    s.set_defaults(run=cmd_schema)





def host_key_warnings(result: LoadResult, file: str) -> list[Diagnostic]:
    """A warning at each server whose host key is neither pinned in the file nor remembered in the state folder."""
    from reconciler.ssh import KnownHosts, Target
    from reconciler.ssh.pool import first_contact_warning

    assert result.cluster is not None
    known = KnownHosts(state_of(file, result.cluster).known_hosts)
    return [at("warning", result.source.key(("servers", i, "ssh")), first_contact_warning(t), code="host-key")
            for i, t in enumerate(Target.from_server(s) for s in result.cluster.servers) if known.get(t) is None]


def cmd_validate(args: argparse.Namespace) -> int:
    file = cluster_file(args)
    result = load_servable(file)
    cluster = result.cluster
    if cluster is not None:
        result.diagnostics.extend(host_key_warnings(result, file))
    if args.json:
        print(json.dumps({"file": file, "valid": result.ok, "errors": [d.as_json() for d in result.errors],
                          "warnings": [d.as_json() for d in result.warnings],
                          "summary": summary(cluster) if cluster else None}, indent=2, ensure_ascii=False))
        return 0 if result.ok else 1
    print_diagnostics(result.diagnostics)
    if cluster is None or not result.ok:
        print(f"{file}: invalid — {plural(len(result.errors), 'error')}", file=sys.stderr)
        return 1
    s = summary(cluster)
    warn = f"; {plural(len(result.warnings), 'warning')}" if result.warnings else ""
    print(f"{file}: valid — {plural(s['servers'], 'server')}, {plural(s['inbounds'], 'inbound')}, "
          f"{plural(s['routes'], 'route')} ({s['empty_routes']} empty), {plural(s['users'], 'user')}{_not_served(s)}{warn}")
    return 0


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


def _not_served(s: dict[str, int]) -> str:
    """`` (1 disabled, 2 expired)`` after the users' count: those it counts that no server serves."""
    parts = [f"{s[k]} {word}" for k, word in (("users_disabled", "disabled"), ("users_expired", "expired")) if s[k]]
    return f" ({', '.join(parts)})" if parts else ""
