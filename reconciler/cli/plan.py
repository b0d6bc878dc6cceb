"""``plan`` and ``show``: what would change on each server (GITOPS-3, GITOPS-7); the observation ``apply`` shares."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, warn
from reconciler.cli.observation import KEEP, SERVER, STRICT, observe_servers, route_warnings
from reconciler.cli.output import color

if TYPE_CHECKING:  # imported when a command runs: asyncssh and friends cost ~0.3 s of every other command's start
    pass



def register(sub: Any) -> None:
    pl = add_command(sub, "plan", HELP["plan"],
                     "reconciler plan -f cluster.yaml --out plan.json")
    add_file(pl)
    pl.add_argument("--json", action="store_true", help="the plan as JSON")
    pl.add_argument("--out", help="save the plan, to apply exactly it with `apply PLAN`")
    pl.add_argument("--comment", metavar="FILE", help="also write counts per server for a PR/MR comment (no address, no diff)")
    pl.add_argument("--keep", action="append", default=[], metavar="SERVER", help=KEEP)
    pl.add_argument("--prune", action="store_true", help=argparse.SUPPRESS)  # always on now: kept so older scripts still run
    pl.add_argument("--strict-host-keys", action="store_true", help=STRICT)
    pl.add_argument("--server", action="append", default=[], metavar="NAME", help=SERVER)
    pl.set_defaults(run=cmd_plan)

    sh = add_command(sub, "show", HELP["show"], "reconciler show plan.json")
    sh.add_argument("plan", help="the saved plan")
    sh.add_argument("--markdown", action="store_true", help="counts per server for a PR/MR comment: no address, no diff")
    sh.set_defaults(run=cmd_show)





def cmd_plan(args: argparse.Namespace) -> int:
    from reconciler.plan.actions import render_human, render_json, render_markdown
    from reconciler.plan.observe import fingerprint
    from reconciler.plan.saved import save_plan

    path = cluster_file(args)
    cluster, _, observed, _ = observe_servers(path, args.keep, args.strict_host_keys, args.server)
    plans = [o.plan for o in observed]
    fp = fingerprint(observed)
    notes = route_warnings(cluster)
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


