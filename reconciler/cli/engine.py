"""``engine pin``: fetch an engine release once, check its build, and pin it in the cluster file.

For each engine the file installs by download (``settings.engine`` or ``settings.engines.<name>`` with
``install: download`` and a ``url``): every architecture's release is fetched on this machine and hashed, the
one this machine runs is unpacked and asked what it can do (sing-box's build tags), and ``sha256`` (per
architecture) and ``capabilities`` are written into the file in place, comments kept. The servers then fetch the
release themselves and refuse any file with another hash; review the diff before committing it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reconciler.cli.common import add_command, add_file, cluster_file, load
from reconciler.errors import InvalidInput, ReleaseError


def register(sub: Any) -> None:
    e = add_command(sub, "engine", "pin engine releases the servers download", "reconciler engine pin -f cluster.yaml")
    esub = e.add_subparsers(dest="engine_command", metavar="ACTION", help="what to do")
    e.set_defaults(group_parser=e)
    pin = add_command(esub, "pin", "fetch each downloaded engine's release once, check its build, write its sha256 and "
                                   "capabilities into the file", "reconciler engine pin -f cluster.yaml --engine mihomo")
    add_file(pin)
    pin.add_argument("--engine", choices=["sing-box", "mihomo"], help="only this engine (default: every one installed by download)")
    pin.set_defaults(run=cmd_pin)


def cmd_pin(args: argparse.Namespace) -> int:
    from reconciler.config.engine_pin import pin_engine
    from reconciler.engine.release import pin_release

    path = cluster_file(args)
    cluster = load(path)
    used = {cluster.engine_of(s).name for s in cluster.servers} | {cluster.settings.engine.name}
    wanted = [cluster.settings.engine_named(n) for n in sorted(used) if not args.engine or n == args.engine]
    downloads = [e for e in wanted if e.install == "download"]
    if not downloads:
        raise InvalidInput(f"{path}: no engine{' ' + args.engine if args.engine else ''} is installed by download; set "
                           "install: download and its url (e.g. an official release) first")
    for settings in downloads:
        pinned = pin_release(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
        for arch, why in pinned.missing.items():
            print(f"warning: {settings.name} {settings.version} for {arch}: {why}; servers of that architecture are "
                  "refused until it is pinned", file=sys.stderr)
        if not pinned.sha256:
            raise ReleaseError(f"no release of {settings.name} {settings.version} could be fetched; nothing was written",
                               temporary=True)
        kept: dict[str, str] = {str(a): d for a, d in settings.sha256.items()} if isinstance(settings.sha256, dict) else {}
        merged = {**{a: d for a, d in kept.items() if a in pinned.missing}, **pinned.sha256}  # a failed fetch keeps its pin
        pin_engine(path, settings.name, merged, pinned.capabilities)
        shown = ", ".join(f"{arch} sha256:{digest[:16]}…" for arch, digest in sorted(merged.items()))
        caps = ", ".join(pinned.capabilities) if pinned.capabilities is not None else "unknown (no release runs here)"
        print(f"pinned {settings.name} {settings.version} in {path}: {shown}; capabilities: {caps}")
    return 0
