"""``engine pin``: fetch an engine release once, check its build, and pin it in the cluster file.

For each engine the file installs by download (``settings.engine`` or ``settings.engines.<name>`` with
``install: download`` and a ``url``): every architecture's release is fetched on this machine and hashed, the
one this machine runs is unpacked and asked what it can do (sing-box's build tags), and ``sha256`` (per
architecture) and ``capabilities`` are written into the file in place, comments kept. The servers then fetch the
release themselves and refuse any file with another hash; review the diff before committing it.

With ``--binary PATH``: the local binary an engine uploads (``install: upload``, its ``binary`` naming PATH). The
controller never runs a binary inside the repository to learn its features (a pull request could have added it:
``engine.capabilities``), so its ``sha256`` and ``capabilities`` are pinned here instead, by the operator. This
command runs what it pins — the release it fetches, the binary ``--binary`` names — on this machine: it is the
operator's own command, for a checkout they trust, never one for CI to run on a pull request.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file, load
from reconciler.errors import InvalidInput, ReleaseError
from reconciler.model import Cluster, EngineSettings

RUNS = ("it runs on this machine the release it fetches (or the binary --binary names) to learn its features: run "
        "it yourself from a checkout you trust, never in CI on a pull request")


def register(sub: Any) -> None:
    e = add_command(sub, "engine", HELP["engine"], "reconciler engine pin -f cluster.yaml")
    esub = e.add_subparsers(dest="engine_command", metavar="ACTION", help="what to do")
    e.set_defaults(group_parser=e)
    help_ = ("fetch each downloaded engine's release once, check its build, write its sha256 and capabilities into the "
             "file")
    pin = add_command(esub, "pin", help_, "reconciler engine pin -f cluster.yaml --engine mihomo\n"
                                          "  reconciler engine pin -f cluster.yaml --binary bin/sing-box",
                      description=f"{help_[:1].upper()}{help_[1:]}; or, with --binary, those of a local binary the file "
                                  f"uploads. Note: {RUNS}.")
    add_file(pin)
    pin.add_argument("--engine", choices=["sing-box", "mihomo"], help="only this engine (default: every one installed by download)")
    pin.add_argument("--binary", metavar="PATH",
                     help="pin the local binary at PATH instead: the one an engine's `binary` names (install: upload). "
                          "This command runs it here (`PATH version`) to learn its features and writes its sha256 and "
                          "capabilities; validate never runs a binary inside the repository, so this is how its features "
                          "become known")
    pin.set_defaults(run=cmd_pin)


def cmd_pin(args: argparse.Namespace) -> int:
    from reconciler.config.engine_pin import pin_engine
    from reconciler.engine.release import pin_release

    path = cluster_file(args)
    cluster = load(path)
    if args.binary:
        return _pin_binary(path, cluster, args.binary, args.engine)
    used = {cluster.engine_of(s).name for s in cluster.servers} | {cluster.settings.engine.name}
    wanted = [cluster.settings.engine_named(n) for n in sorted(used) if not args.engine or n == args.engine]
    downloads = [e for e in wanted if e.install == "download"]
    if not downloads:
        local = next((e.binary for e in _settings(cluster) if e.install == "upload" and e.binary), None)
        also = (f"; to pin the features of the local binary the file uploads, name it: reconciler engine pin -f {path} "
                f"--binary {local}") if local else ""
        raise InvalidInput(f"{path}: no engine{' ' + args.engine if args.engine else ''} is installed by download; set "
                           f"install: download and its url (e.g. an official release) first{also}")
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
        _remember_versions(path, cluster, pinned.versions)
        shown = ", ".join(f"{arch} sha256:{digest[:16]}…" for arch, digest in sorted(merged.items()))
        caps = ", ".join(pinned.capabilities) if pinned.capabilities is not None else "unknown (no release runs here)"
        print(f"pinned {settings.name} {settings.version} in {path}: {shown}; capabilities: {caps}")
    return 0


def _remember_versions(path: str, cluster: Cluster, versions: dict[str, str]) -> None:
    """What the pinned release's binary printed for its version, kept in the state folder: an apply then lets each
    server download it in its commit's own session (the version needs no server to run it first)."""
    from reconciler.apply import engine as staging
    from reconciler.cli.common import state_of

    if not versions:
        return
    state = state_of(path, cluster)
    staging.learn(state.release_versions())
    staging.learn(versions)
    state.remember_release_versions(staging.known())


def _settings(cluster: Cluster) -> list[EngineSettings]:
    return [cluster.settings.engine, *cluster.settings.engines.values()]


def _pin_binary(path: str, cluster: Cluster, binary: str, only: str | None) -> int:
    """Pin the sha256 and capabilities of the local ``binary`` the operator named, into every engine whose
    ``binary`` names that file (relative to the working directory, as the upload reads it). Runs it: the operator
    asked for exactly this binary on the command line."""
    from reconciler.config.engine_pin import pin_engine
    from reconciler.engine.capabilities import CAPABILITIES, MIHOMO, Capability, learn, local_version
    from reconciler.plan.facts import parse_version

    target = os.path.realpath(os.path.expanduser(binary))
    engines = [e for e in _settings(cluster) if e.install == "upload" and e.binary and (not only or e.name == only)
               and os.path.realpath(os.path.expanduser(e.binary)) == target]
    if not engines:
        raise InvalidInput(f"{path}: no engine{' ' + only if only else ''} uploads {binary}: set its settings.engine.binary "
                           f"(or settings.engines.<name>.binary, with install: upload) to it first; nothing was written")
    if not os.path.isfile(target):
        raise InvalidInput(f"{binary}: no such file; nothing was written")
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    pins = []
    for eng in engines:
        capabilities: tuple[Capability, ...]
        if eng.name == "sing-box":
            build = learn(binary, named_by_operator=True)
            found = build.version if build is not None else None
            capabilities = tuple(c for c in CAPABILITIES if build is not None and c in build.capabilities)
        else:  # every Mihomo has the same features; its version is still checked
            out = local_version(binary, ("-v",), named_by_operator=True)
            found = parse_version(out) if out is not None else None
            capabilities = MIHOMO
        if found is None:
            raise InvalidInput(f"{binary} does not answer as {eng.name} on this machine (another architecture, or "
                               f"not {eng.name}): nothing was written; pin it on a machine it runs on, or write its "
                               "capabilities into the file by hand")
        if found != eng.version:
            raise InvalidInput(f"{binary} is {eng.name} {found}, not the {eng.version} the file's settings name: set its "
                               f"version: {found}, or name the right binary; nothing was written")
        pins.append((eng.name, found, capabilities))
    for name, version, capabilities in pins:  # each checked before any is written
        pin_engine(path, name, sha256, capabilities)
        print(f"pinned {name} {version} at {binary} in {path}: sha256:{sha256[:16]}…; capabilities: "
              f"{', '.join(capabilities) or 'none'}")
    return 0
