"""``hostkeys pin``: write the servers' host keys into the cluster file as ``ssh.host_key``.

A server without a pinned key trusts whatever key it presents at first contact (plan warns; ``--strict-host-keys``
refuses). Pinning ends that: for each server without ``ssh.host_key``, the key remembered in the state folder
(``known_hosts.json``, learnt at an earlier contact) is used, else the server is asked for it (a key exchange,
no login), and the keys are spliced into the file in place, comments kept (``reconciler.config.hostkeys``).
Review the diff before committing it: a key learnt now is trusted from now on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, load, print_diagnostics, state_of
from reconciler.errors import ConnectError, InvalidInput


def register(sub: Any) -> None:
    h = add_command(sub, "hostkeys", HELP["hostkeys"],
                    "reconciler hostkeys pin -f cluster.yaml")
    hsub = h.add_subparsers(dest="hostkeys_command", metavar="ACTION", help="what to do")
    h.set_defaults(group_parser=h)
    pin = add_command(hsub, "pin", "write each server's host key into the file as ssh.host_key, comments kept",
                      "reconciler hostkeys pin -f cluster.yaml --server vps-1")
    add_file(pin)
    pin.add_argument("--server", action="append", metavar="NAME", help="only this server (repeat for more; default: all)")
    pin.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each server's key (default: 10)")
    pin.set_defaults(run=cmd_pin)


def cmd_pin(args: argparse.Namespace) -> int:
    from reconciler.config.hostkeys import pin_host_keys
    from reconciler.ssh import KnownHosts, Target
    from reconciler.ssh.pool import presented_host_key

    path = cluster_file(args)
    cluster = load(path)
    names = [s.name for s in cluster.servers]
    unknown = [n for n in args.server or [] if n not in names]
    if unknown:
        raise InvalidInput(f"no server named {', '.join(map(repr, unknown))}; known: {', '.join(names) or 'none'}")
    wanted = [s for s in cluster.servers if not args.server or s.name in args.server]
    known = KnownHosts(state_of(path, cluster).known_hosts)
    if known.note:
        print(f"warning: {known.note}", file=sys.stderr)
    keys: dict[str, str] = {}
    asked: list[Target] = []
    for server in wanted:
        target = Target.from_server(server)
        if server.ssh.host_key:
            continue
        remembered = known.remembered(target)
        if remembered:
            keys[server.name] = remembered
            print(f"{server.name}: the key remembered in the state folder: {remembered.split()[0]}", file=sys.stderr)
        else:
            asked.append(target)

    async def ask() -> list[str | BaseException]:
        return list(await asyncio.gather(*(presented_host_key(t, args.timeout) for t in asked), return_exceptions=True))

    failed = 0
    for target, got in zip(asked, asyncio.run(ask()) if asked else [], strict=True):
        if isinstance(got, BaseException):
            if not isinstance(got, ConnectError):
                raise got
            print(f"{target.name}: not pinned — {got}", file=sys.stderr)
            failed += 1
            continue
        keys[target.name] = got
        known.record(target, got)  # what we now trust, the state folder trusts too
        print(f"{target.name}: the key it presents now, {_fingerprint(got)}: compare it with "
              "`ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` on the server", file=sys.stderr)
    result = pin_host_keys(path, keys)
    print_diagnostics(result.warnings)
    for name in [s.name for s in wanted if s.ssh.host_key] + result.already:
        print(f"{name}: already pinned (ssh.host_key); left as it is")
    for name, file in result.pinned.items():
        print(f"{name}: pinned in {file}")
    return 1 if failed else 0


def _fingerprint(key: str) -> str:
    """``TYPE SHA256:…`` as ``ssh-keygen -l`` shows it."""
    import asyncssh

    return f"{key.split()[0]} {asyncssh.import_public_key(key).get_fingerprint('sha256')}"
