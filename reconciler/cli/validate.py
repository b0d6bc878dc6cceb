"""``validate``, ``schema`` and ``init``: the cluster file itself (GITOPS-1, GITOPS-2, ROUTE-6)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from reconciler import safe_read
from reconciler.cli.common import add_command, add_file, cluster_file, plural, print_diagnostics, state_of
from reconciler.config import load_cluster
from reconciler.config.diagnostics import Diagnostic, SourceMap, at
from reconciler.config.loader import LoadResult
from reconciler.config.schema import SCHEMA_PATH, schema_text
from reconciler.model import Cluster


def register(sub: Any) -> None:
    v = add_command(sub, "validate", "check a cluster file: schema and semantics (GITOPS-2)", "reconciler validate -f cluster.yaml")
    add_file(v, positional=True)
    v.add_argument("--json", action="store_true", help="the result as JSON (errors, warnings, summary)")
    v.set_defaults(run=cmd_validate)

    s = add_command(sub, "schema", "write the JSON Schema of the cluster file (GITOPS-1)", "reconciler schema --check")
    s.add_argument("--out", default=str(SCHEMA_PATH), help="where to write it ('-' for stdout)")
    s.add_argument("--check", action="store_true", help="exit 1 when the file on disk is stale")
    s.set_defaults(run=cmd_schema)



def summary(cluster: Cluster) -> dict[str, int]:
    return {
        "servers": len(cluster.servers),
        "inbounds": len(cluster.inbounds),
        "routes": len(cluster.effective_routes),
        "empty_routes": sum(1 for r in cluster.effective_routes if not cluster.members[r.id]),
        "unassigned_inbounds": len(cluster.unassigned),
        "users": len(cluster.users),
    }


def host_key_warnings(result: LoadResult, file: str) -> list[Diagnostic]:
    """A warning at each server whose host key is neither pinned in the file nor remembered in the state folder."""
    from reconciler.ssh import KnownHosts, Target
    from reconciler.ssh.pool import first_contact_warning

    assert result.cluster is not None
    known = KnownHosts(state_of(file, result.cluster).known_hosts)
    return [at("warning", result.source.key(("servers", i, "ssh")), first_contact_warning(t), code="host-key")
            for i, t in enumerate(Target.from_server(s) for s in result.cluster.servers) if known.get(t) is None]


def engine_errors(cluster: Cluster, source: SourceMap) -> list[Diagnostic]:
    """An error at all the engine cannot serve (``engine.capabilities``): validate, plan and apply refuse it. And a
    warning at each engine binary in the repository, which the controller does not run to learn its features."""
    from reconciler.engine.capabilities import not_run, of_engine, refusals  # at use: ~7 ms of every other command's start

    file = source.root.file if source.root else None  # the cluster file: its folder is the repository
    repository = safe_read.repository(os.path.dirname(os.path.abspath(file))) if file else None
    return ([at("warning", source.value(n.path), n.message, n.hint, code="engine-not-run") for n in not_run(cluster, repository, file)]
            + [at("error", source.key(r.path), r.message, r.hint, code="engine-capability") for r in refusals(cluster, of_engine(cluster))])


def cmd_validate(args: argparse.Namespace) -> int:
    file = cluster_file(args)
    result = load_cluster(file)
    cluster = result.cluster
    if cluster is not None:
        result.diagnostics.extend(engine_errors(cluster, result.source) + host_key_warnings(result, file))
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
          f"{plural(s['routes'], 'route')} ({s['empty_routes']} empty), {plural(s['users'], 'user')}{warn}")
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
