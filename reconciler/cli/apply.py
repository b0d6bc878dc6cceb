"""``apply``: make the servers match the file (GITOPS-4, GITOPS-7), on the observation ``plan`` makes.

Without a saved plan, on a terminal, the plan is shown first and applied only after ``yes`` (Terraform's way;
``--auto-approve`` skips the question, and a pipeline without a terminal is never asked)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file
from reconciler.cli.observation import KEEP, SERVER, STRICT, observe_servers, route_warnings
from reconciler.cli.output import color
from reconciler.errors import InvalidInput
from reconciler.model import Cluster
from reconciler.text import printable

if TYPE_CHECKING:
    from reconciler.apply.run import ServerResult
    from reconciler.plan.observe import Observed
    from reconciler.ssh import SSHPool
    from reconciler.state.folder import StateFolder


def register(sub: Any) -> None:
    ap = add_command(sub, "apply", HELP["apply"], "reconciler apply plan.json")
    ap.add_argument("plan", nargs="?", help="a plan saved with `plan --out`; refused when stale")
    add_file(ap)
    ap.add_argument("--keep", action="append", default=[], metavar="SERVER", help=KEEP)
    ap.add_argument("--prune", action="store_true", help=argparse.SUPPRESS)  # always on now: kept so older scripts still run
    ap.add_argument("--server", action="append", default=[], metavar="NAME", help=SERVER)
    ap.add_argument("--auto-approve", action="store_true", help="apply without showing the plan and asking (CI)")
    ap.add_argument("--wave", metavar="SPEC", help="apply in waves, e.g. 1,25%%,rest; `all` at once (default: "
                                                   "settings.rollout; engine upgrades 1,25%%,rest)")
    ap.add_argument("--json", action="store_true", help="the results as JSON")
    ap.add_argument("--strict-host-keys", action="store_true", help=STRICT)
    ap.set_defaults(run=cmd_apply)


def _approved(cluster: Cluster, observed: list[Observed]) -> bool:
    """On a terminal: show the plan and ask. Elsewhere (a pipeline): yes, as before."""
    from reconciler.plan.actions import render_human

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return True
    sys.stdout.write(render_human([o.plan for o in observed], route_warnings(cluster), color=color()))
    if not any(o.plan.changes for o in observed):
        return True
    print("\nDo you want to perform these actions? Only 'yes' will be accepted.")
    try:
        return input("  Enter a value: ").strip() == "yes"
    except EOFError:
        return False


def cmd_apply(args: argparse.Namespace) -> int:
    from reconciler.apply import waves
    from reconciler.apply.run import apply_all
    from reconciler.apply.session import Progress, recall, remember
    from reconciler.plan.saved import check_fresh, load_plan

    if args.wave:
        from reconciler.apply.waves import parse

        parse(args.wave)  # a wrong spec is refused before any server is touched
    path, keep, only = cluster_file(args), list(args.keep), list(args.server)
    saved = load_plan(args.plan) if args.plan else None
    if saved is not None:
        path, keep, only = saved.cluster_file, list(saved.keep), []

    async def then(cluster: Cluster, observed: list[Observed], pool: SSHPool, state: StateFolder) -> list[ServerResult]:
        if saved is not None:
            check_fresh(saved, observed)  # StalePlan: nothing is applied
        elif not args.auto_approve and not _approved(cluster, observed):
            raise InvalidInput("apply cancelled: nothing was changed")
        progress = Progress([o.plan.server for o in observed])
        spec = args.wave or cluster.settings.rollout or (waves.DEFAULT if waves.upgrades_engine(observed) else "all")
        # One apply per state folder at a time (LockHeld names the other); held until it is remembered.
        with state.lock("apply"):
            recall(state)
            try:
                if spec == "all":
                    results = await apply_all(observed, pool, progress)
                else:
                    results = await waves.apply_in_waves(observed, pool, progress, spec,
                                                         say=lambda line: print(line, file=sys.stderr, flush=True))
            finally:
                progress.close()
            remember(state, cluster, observed, results)
        return results

    cluster, state, observed, results = observe_servers(path, keep, args.strict_host_keys, only, then)
    assert results is not None
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2, default=str))
    else:
        for r in results:
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.server:16s} {r.seconds:6.1f}s  {printable(r.message)}")  # a server's words
        failed = sum(not r.ok for r in results)
        print(f"Apply: {sum(r.ok for r in results)} ok, {failed} failed, {sum(r.changed for r in results)} changed.")
    return 0 if all(r.ok for r in results) else 1
