"""``user url NAME``: the subscription URL to hand a user, and its QR code for a phone's camera.

The URL is ``settings.outputs.public_url`` + ``/sub/<token>`` (+ ``/<format>`` when one is asked for); the token
is derived from the master secret, so this needs it, like ``subscription``. ``--qr`` draws the QR code in the
terminal (segno: a maintained QR encoder, not a hand-written one).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, fleet_snapshot, load, secret_of, user_named, warn
from reconciler.errors import InvalidInput
from reconciler.model.cluster import PUBLIC_URL
from reconciler.subscriptions.urls import subscription_url


def register(sub: Any) -> None:
    u = add_command(sub, "user", HELP["user"], "reconciler user url alice --qr")
    usub = u.add_subparsers(dest="user_command", metavar="ACTION", help="what to do")
    u.set_defaults(group_parser=u)
    url = add_command(usub, "url", "print the user's subscription URL (settings.outputs.public_url)",
                      "reconciler user url alice --format clash --qr")
    url.add_argument("name", help="the user's name")
    url.add_argument("--format", choices=["links", "sing-box", "clash"], help="pin a format (default: the app chooses)")
    url.add_argument("--qr", action="store_true", help="also draw the URL as a QR code in the terminal")
    url.add_argument("--base", metavar="URL", help="the address users' apps reach the endpoint at, for this once "
                                                   "(default: settings.outputs.public_url)")
    add_file(url)
    url.set_defaults(run=cmd_url)


def cmd_url(args: argparse.Namespace) -> int:
    from reconciler.credentials import user_token

    cluster = load(cluster_file(args))
    user = user_named(cluster, args.name)
    base = args.base or cluster.settings.outputs.public_url
    if not base:
        raise InvalidInput(f"{cluster_file(args)}: settings.outputs.public_url is not set: under `settings: outputs:` add "
                           "`public_url: https://vpn.example.com` (the address users' apps reach `listen` at, through "
                           "your reverse proxy), or pass --base URL")
    if not PUBLIC_URL.match(base):
        raise InvalidInput(f"--base {base!r} is not an http(s) URL without a query (e.g. https://vpn.example.com)")
    secret = secret_of(cluster)
    url = subscription_url(base, user_token(secret, user.name, user.rotate), args.format)
    standing = fleet_snapshot(cluster_file(args), cluster, secret=secret).standing(user)  # with the measured usage
    if standing != "active":
        warn(f"{user.name} is {standing.replace('_', ' ')}: this URL answers with a refusal until that changes")
    print(url)
    if args.qr:
        import segno

        segno.make(url, error="m").terminal(out=sys.stdout, compact=True)
    return 0
