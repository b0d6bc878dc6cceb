"""``plan`` and ``apply``: what would change on each server, and making it so (GITOPS-3, GITOPS-4, GITOPS-7)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

from reconciler.cli.common import add_command, add_file, base_dir, cluster_file, plural, secret_of, state_of, warn
from reconciler.cli.validate import engine_errors
from reconciler.config import load_cluster
from reconciler.errors import ConfigError
from reconciler.model import Cluster

if TYPE_CHECKING:  # imported when a command runs: asyncssh and friends cost ~0.3 s of every other command's start
    from reconciler.apply.run import ServerResult
    from reconciler.plan.observe import Observed
    from reconciler.ssh import SSHPool
    from reconciler.state.folder import StateFolder

T = TypeVar("T")
KEEP = "a server that left the file but stays as it is this time (repeat; for good: `retired:`)"
STRICT = "never connect to a server whose host key is neither pinned (ssh.host_key) nor remembered: its plan says why"


def register(sub: Any) -> None:
    pl = add_command(sub, "plan", "what apply would change on each server (GITOPS-3); exit 0 none, 2 changes, 1 error",
                     "reconciler plan -f cluster.yaml --out plan.json")
    add_file(pl)
    pl.add_argument("--json", action="store_true", help="the plan as JSON")
    pl.add_argument("--out", help="save the plan, to apply exactly it with `apply PLAN`")
    pl.add_argument("--keep", action="append", default=[], metavar="SERVER", help=KEEP)
    pl.add_argument("--prune", action="store_true", help=argparse.SUPPRESS)  # the default since issue 15
    pl.add_argument("--strict-host-keys", action="store_true", help=STRICT)
    pl.set_defaults(run=cmd_plan)

    ap = add_command(sub, "apply", "make the servers match the file (GITOPS-4)", "reconciler apply plan.json")
    ap.add_argument("plan", nargs="?", help="a plan saved with `plan --out`; refused when stale")
    add_file(ap)
    ap.add_argument("--keep", action="append", default=[], metavar="SERVER", help=KEEP)
    ap.add_argument("--prune", action="store_true", help=argparse.SUPPRESS)  # the default since issue 15
    ap.add_argument("--json", action="store_true", help="the results as JSON")
    ap.add_argument("--strict-host-keys", action="store_true", help=STRICT)
    ap.set_defaults(run=cmd_apply)


def _servable(path: str) -> Cluster:
    """The valid cluster in ``path``, or ``ConfigError`` with the diagnostics ``validate`` shows: also when the
    engine cannot serve one of its inbounds (issue 14), refused here, before any server is touched."""
    result = load_cluster(path)
    if result.cluster is not None:
        result.diagnostics.extend(engine_errors(result.cluster, result.source))
    if result.cluster is None or result.errors:
        raise ConfigError(f"{path}: invalid — {plural(len(result.errors), 'error')}", result.errors)
    return result.cluster


def _observe(path: str, keep: list[str], strict: bool,
             then: Callable[[Cluster, list[Observed], SSHPool, StateFolder], Awaitable[T]] | None = None
             ) -> tuple[Cluster, StateFolder, list[Observed], T | None]:
    """Observe every server and those that left the file but ``keep`` (GITOPS-7); ``then`` runs on the same SSH
    connections after (apply; due ACME certificates are ordered first). First contacts: warned or refused."""
    from reconciler.apply.session import certificates, first_contact_warnings, pool_for
    from reconciler.plan.observe import observe
    from reconciler.ssh import KnownHosts

    cluster = _servable(path)
    secret = secret_of(cluster)
    state = state_of(path, cluster)
    for note in [] if strict else first_contact_warnings(cluster, state, prune=True):
        warn(note)
    known = KnownHosts(state.known_hosts) if strict else None

    async def go() -> tuple[list[Observed], T | None]:
        async with pool_for(state, strict_host_keys=strict) as pool:
            if then is not None:
                await certificates(cluster, pool, str(base_dir(path)))
            managed = {n: v for n, v in state.managed().items() if n not in keep}  # GITOPS-7: what left is removed
            observed = await observe(cluster, secret, pool, str(base_dir(path)), True, managed, strict_host_keys=known)
            return observed, (await then(cluster, observed, pool, state) if then is not None else None)

    try:
        observed, result = asyncio.run(go())
    finally:
        for note in state.notes:  # state files that could not be read: a fresh start, said, never silent
            warn(note)
    return cluster, state, observed, result


def _warnings(cluster: Cluster) -> list[str]:
    unassigned = ", ".join(r.inbound.id for r in cluster.unassigned)
    return [f"{len(cluster.unassigned)} inbound(s) are not in any route — clients cannot see them yet: {unassigned}"] if unassigned else []

def cmd_plan(args: argparse.Namespace) -> int:
    from reconciler.plan.actions import render_human, render_json
    from reconciler.plan.observe import fingerprint
    from reconciler.plan.saved import save_plan

    path = cluster_file(args)
    cluster, _, observed, _ = _observe(path, args.keep, args.strict_host_keys)
    plans = [o.plan for o in observed]
    fp = fingerprint(observed)
    sys.stdout.write(render_json(plans, fp) if args.json else render_human(plans, _warnings(cluster)))
    if args.out:
        save_plan(args.out, plans, fp, path, args.keep)
        print(f"saved the plan to {args.out}; apply exactly it with `reconciler apply {args.out}`", file=sys.stderr)
    if any(p.error or p.problems for p in plans):
        return 1
    return 2 if any(p.changes for p in plans) else 0


def cmd_apply(args: argparse.Namespace) -> int:
    from reconciler.apply.run import apply_all
    from reconciler.apply.session import Progress, remember
    from reconciler.plan.saved import check_fresh, load_plan

    path, keep = cluster_file(args), list(args.keep)
    saved = load_plan(args.plan) if args.plan else None
    if saved is not None:
        path, keep = saved.cluster_file, list(saved.keep)

    async def then(cluster: Cluster, observed: list[Observed], pool: SSHPool, state: StateFolder) -> list[ServerResult]:
        if saved is not None:
            check_fresh(saved, observed)  # StalePlan: nothing is applied
        progress = Progress([o.plan.server for o in observed])
        # One apply per state folder at a time (LockHeld names the other); held until it is remembered.
        with state.lock("apply"):
            try:
                # The commit returns the public material the servers generated: `observed` then holds it.
                results = await apply_all(observed, pool, progress)
            finally:
                progress.close()
            remember(state, cluster, observed, results)
        return results

    cluster, state, observed, results = _observe(path, keep, args.strict_host_keys, then)
    assert results is not None
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2, default=str))
    else:
        for r in results:
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.server:16s} {r.seconds:6.1f}s  {r.message}")
        failed = sum(not r.ok for r in results)
        print(f"Apply: {sum(r.ok for r in results)} ok, {failed} failed, {sum(r.changed for r in results)} changed.")
    return 0 if all(r.ok for r in results) else 1

