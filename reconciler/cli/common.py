"""What every command shares: the cluster-file option, loading with diagnostics, the secret, the
fleet snapshot, and the few ways a command reports a problem (by raising from ``reconciler.errors``)."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reconciler import safe_read
from reconciler.errors import ConfigError, InvalidInput
from reconciler.text import plural as plural  # the commands' one import of it

if TYPE_CHECKING:  # the model (pydantic), numpy and the decision cores load only when a command runs: --help is fast
    from reconciler.balance import Snapshot
    from reconciler.config.diagnostics import Diagnostic
    from reconciler.credentials import Secret
    from reconciler.model import Cluster, User
    from reconciler.state.folder import StateFolder

DEFAULT_FILE = os.environ.get("RECONCILER_FILE", "cluster.yaml")


def add_command(sub: Any, name: str, help: str, example: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with an example."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=description or help[:1].upper() + help[1:] + ".",
        epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def add_file(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    """``-f/--file`` on every command; ``positional`` keeps the older ``COMMAND FILE`` spelling as an alias. With it
    ``--allow-path``: every command that loads a cluster file may be allowed folders outside its repository."""
    parser.add_argument("-f", "--file", default=None, help=f"the cluster file (default: $RECONCILER_FILE or {DEFAULT_FILE})")
    if positional:
        parser.add_argument("file_arg", nargs="?", metavar="FILE", help="the cluster file, the same as -f FILE")
    add_allow_path(parser)


def add_allow_path(parser: argparse.ArgumentParser) -> None:
    """``--allow-path DIR`` (repeatable): a folder outside the cluster file's repository whose files the cluster file
    may name (includes, TLS certificates and keys, …; ``safe_read``). ``main`` applies it for the command's run."""
    parser.add_argument(safe_read.OPTION, dest="allow_path", action="append", default=[], metavar="DIR",
                        help="also let the cluster file name files in DIR, outside its folder (repeatable; also "
                             f"${safe_read.ENV}, separated by '{os.pathsep}'). Never a setting in the file: a pull request could edit it")


def cluster_file(args: argparse.Namespace) -> str:
    file: str | None = getattr(args, "file_arg", None) or args.file
    return file or DEFAULT_FILE


def print_diagnostics(diagnostics: Sequence[Diagnostic]) -> None:
    for d in diagnostics:
        print(d.render(), file=sys.stderr)


def load(path: str) -> Cluster:
    """The valid cluster in ``path``, or ``ConfigError`` carrying its diagnostics (warnings are validate's)."""
    from reconciler.config import load_cluster

    result = load_cluster(path)
    if result.cluster is None:
        n = len(result.errors)
        raise ConfigError(f"{path}: invalid — {n} error{'s' if n != 1 else ''}", result.errors)
    for d in result.warnings:
        if d.code == "bad-row":  # a user the database holds but no command can serve: said wherever users are read
            warn(d.message)
    return result.cluster


def secret_of(cluster: Cluster) -> Secret:
    from reconciler.credentials import load_secret

    return load_secret(cluster.settings.secret.env, cluster.settings.secret.file)


def state_of(path: str, cluster: Cluster) -> StateFolder:
    from reconciler.state.folder import StateFolder

    return StateFolder.of(path, cluster.settings.outputs.state_dir)


def warn(note: str) -> None:
    print(f"warning: {note}", file=sys.stderr)


def fleet_snapshot(path: str, cluster: Cluster, now: float | None = None, secret: Secret | None = None) -> Snapshot:
    """The snapshot the loop would answer from now: the same ``fleet.snapshot`` over the state folder, with the
    REALITY public keys derived from the master secret (``secret``, or the cluster's) — none need an apply."""
    from reconciler.fleet import snapshot
    from reconciler.fleet.reality import with_reality_keys

    state = state_of(path, cluster)
    facts, learned = state.facts(), state.load_learned(cluster)
    for note in state.notes:
        warn(note)
    keyed = with_reality_keys(facts, cluster, secret or secret_of(cluster))
    return snapshot(cluster, learned, keyed, time.time() if now is None else now)


def user_named(cluster: Cluster, name: str) -> User:
    try:
        return cluster.user(name)
    except KeyError:
        close = difflib.get_close_matches(name, [u.name for u in cluster.users], n=1)
        raise InvalidInput(f"no user {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")) from None


def base_dir(path: str) -> Path:
    return Path(path).resolve().parent
