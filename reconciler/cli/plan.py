"""``plan`` and ``show``: what would change on each server (GITOPS-3, GITOPS-7); the observation ``apply`` shares."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from reconciler.cli.common import add_command, add_file, base_dir, cluster_file, plural, secret_of, state_of, warn
from reconciler.cli.validate import engine_errors
from reconciler.config import load_cluster
from reconciler.errors import ConfigError
from reconciler.model import Cluster
from reconciler.text import verb

if TYPE_CHECKING:  # imported when a command runs: asyncssh and friends cost ~0.3 s of every other command's start
    from reconciler.plan.observe import Observed
    from reconciler.ssh import SSHPool
    from reconciler.state.folder import StateFolder

T = TypeVar("T")
KEEP = "a server that left the file but stays as it is this time (repeat; for good: `retired:`)"
SERVER = "only this server (repeat; shell globs such as 'fra-*'), like Terraform's -target"
STRICT = "never connect to a server whose host key is neither pinned (ssh.host_key) nor remembered: its plan says why"


def register(sub: Any) -> None:
    pl = add_command(sub, "plan", "what apply would change on each server (GITOPS-3); exit 0 none, 2 changes, 1 error",
                     "reconciler plan -f cluster.yaml --out plan.json")
    add_file(pl)
    pl.add_argument("--json", action="store_true", help="the plan as JSON")
    pl.add_argument("--out", help="save the plan, to apply exactly it with `apply PLAN`")
    pl.add_argument("--comment", metavar="FILE", help="also write counts per server for a PR/MR comment (no address, no diff)")
    pl.add_argument("--keep", action="append", default=[], metavar="SERVER", help=KEEP)
    pl.add_argument("--prune", action="store_true", help=argparse.SUPPRESS)  # the default since issue 15
    pl.add_argument("--strict-host-keys", action="store_true", help=STRICT)
    pl.add_argument("--server", action="append", default=[], metavar="NAME", help=SERVER)
    pl.set_defaults(run=cmd_plan)

    sh = add_command(sub, "show", "print a plan saved with `plan --out`", "reconciler show plan.json")
    sh.add_argument("plan", help="the saved plan")
    sh.add_argument("--markdown", action="store_true", help="counts per server for a PR/MR comment: no address, no diff")
    sh.set_defaults(run=cmd_show)


def _servable(path: str) -> Cluster:
    """The valid cluster in ``path``, or ``ConfigError`` with the diagnostics ``validate`` shows: also when the
    engine cannot serve one of its inbounds, refused here, before any server is touched."""
    result = load_cluster(path)
    if result.cluster is not None:
        result.diagnostics.extend(engine_errors(result.cluster, result.source))
    if result.cluster is None or result.errors:
        raise ConfigError(f"{path}: invalid — {plural(len(result.errors), 'error')}", result.errors)
    return result.cluster


def _observe(path: str, keep: list[str], strict: bool, only: list[str],
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
            # Users over quota stay out: what the loop measured, from the same state folder.
            usage = state.load_learned(cluster).ledger.view(cluster, time.time())
            observed = await observe(cluster, secret, pool, str(base_dir(path)), True, managed, strict_host_keys=known,
                                     only=(lambda name: any(fnmatch(name, g) for g in only)) if only else None,
                                     usage=usage)
            return observed, (await then(cluster, observed, pool, state) if then is not None else None)

    try:
        observed, result = asyncio.run(go())
    finally:
        for note in state.notes:  # state files that could not be read: a fresh start, said, never silent
            warn(note)
    return cluster, state, observed, result


def _warnings(cluster: Cluster) -> list[str]:
    """What clients cannot see yet (ROUTE-4, ROUTE-5): said in every plan, as validate says it."""
    unassigned = ", ".join(r.inbound.id for r in cluster.unassigned)
    empty = [r.id for r in cluster.routes if not cluster.members[r.id]]
    n = len(cluster.unassigned)
    return ([f"{plural(n, 'inbound')} {verb(n, 'is', 'are')} not in any route — clients cannot see them yet: {unassigned}"]
            if unassigned else []) + [f"route {r!r} is empty — hidden from subscriptions until an inbound joins it" for r in empty]

def cmd_plan(args: argparse.Namespace) -> int:
    from reconciler.plan.actions import render_human, render_json, render_markdown
    from reconciler.plan.observe import fingerprint
    from reconciler.plan.saved import save_plan

    path = cluster_file(args)
    cluster, _, observed, _ = _observe(path, args.keep, args.strict_host_keys, args.server)
    plans = [o.plan for o in observed]
    fp = fingerprint(observed)
    notes = _warnings(cluster)
    sys.stdout.write(render_json(plans, fp, notes) if args.json else render_human(plans, notes, color=color()))
    incomplete = any(p.error or p.problems for p in plans)
    if args.comment:
        Path(args.comment).write_text(render_markdown(plans), encoding="utf-8")
    if args.out and incomplete:  # a plan that could not see every server is not one to apply later
        warn(f"not saved to {args.out}: some servers could not be planned (above); plan again once they can")
    elif args.out:
        save_plan(args.out, plans, fp, path, args.keep)
        print(f"saved the plan to {args.out}; apply exactly it with `reconciler apply {args.out}`", file=sys.stderr)
    if incomplete:
        return 1
    return 2 if any(p.changes for p in plans) else 0


def cmd_show(args: argparse.Namespace) -> int:
    from reconciler.plan.actions import render_human, render_markdown
    from reconciler.plan.saved import load_plan, plans_of

    saved = load_plan(args.plan)
    if args.markdown:
        sys.stdout.write(render_markdown(plans_of(saved)))
        return 0
    print(f"# {args.plan}: for {saved.cluster_file}, fingerprint {saved.fingerprint[:12]}", file=sys.stderr)
    sys.stdout.write(render_human(plans_of(saved), color=color()))
    return 0


def color() -> bool:
    """Colour only for a person at a terminal, and never with NO_COLOR set (https://no-color.org)."""
    import os

    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")
