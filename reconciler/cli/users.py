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
    add_file(url)
    url.set_defaults(run=cmd_url)


def cmd_url(args: argparse.Namespace) -> int:
    from reconciler.credentials import user_token

    cluster = load(cluster_file(args))
    user = user_named(cluster, args.name)
    base = cluster.settings.outputs.public_url
    if not base:
        raise InvalidInput("settings.outputs.public_url is not set: add the address users' apps reach the endpoint at, "
                           "e.g. `public_url: https://vpn.example.com`")
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
