"""``secret new``: a strong master secret (GITOPS-6), printed once, never written into the repository.

The secret goes to stdout alone (so ``> file`` or ``$(…)`` captures exactly it); where to keep it goes to
stderr: the environment variable or the 0600 file the cluster file's ``settings.secret`` names.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file
from reconciler.credentials import MIN_SECRET_BITS, Secret

SECRET_BYTES = 32  # 256 bits: token_urlsafe(32) is 43 characters


def register(sub: Any) -> None:
    s = add_command(sub, "secret", HELP["secret"], "reconciler secret new")
    ssub = s.add_subparsers(dest="secret_command", metavar="ACTION", help="what to do")
    s.set_defaults(group_parser=s)
    new = add_command(ssub, "new", "print a new random master secret and where to keep it (never in git)",
                      "reconciler secret new > ~/.config/reconciler/secret",
                      description="Print a new random master secret (256 bits) on stdout, and on stderr where to keep "
                                  "it: the environment variable or the 0600 file the cluster file's settings.secret "
                                  "names. Changing the secret rotates every credential and subscription URL.")
    add_file(new)
    new.set_defaults(run=cmd_new)


def _where(args: argparse.Namespace) -> tuple[str, str | None]:
    """(environment variable, file) the cluster file reads the secret from; the defaults without a valid file."""
    path = cluster_file(args)
    if os.path.exists(path):
        from reconciler.config import load_cluster

        cluster = load_cluster(path).cluster
        if cluster is not None:
            return cluster.settings.secret.env, cluster.settings.secret.file
    return "RECONCILER_SECRET", None


def cmd_new(args: argparse.Namespace) -> int:
    value = secrets.token_urlsafe(SECRET_BYTES)
    Secret(value.encode())  # the floor holds (MIN_SECRET_BITS) for whatever we print
    env, file = _where(args)
    print(value)
    if file:
        where = f"the file {file}, readable by you alone: `umask 077; reconciler secret new > {file}`"
    else:
        where = (f"the environment variable {env} (in CI: a masked, protected secret), or a file readable by you "
                 "alone (chmod 600) named by settings.secret.file")
    print(f"keep it in {where} — never in the repository. Every credential and subscription URL derives from it: "
          f"a new secret rotates them all. (It has well over the {MIN_SECRET_BITS} bits the floor asks.)", file=sys.stderr)
    return 0
