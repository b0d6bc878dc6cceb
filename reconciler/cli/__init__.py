"""The ``reconciler`` command line: small command modules that parse, call and print.

Exit codes: 0 success, 1 error (invalid file, failed command), 2 ``plan`` with changes
pending, 130 interrupted. Errors are the tree in ``reconciler.errors``: each is printed as
``error: <message>`` (with the file's diagnostics for an invalid file) and mapped to its
``exit_code``; a temporary one says that trying again may succeed. Whatever the input, no
traceback reaches the operator; set ``RECONCILER_DEBUG=1`` to see one for a bug report. An error's
text may carry what a server said (SSH's stderr): it is printed through ``reconciler.text.printable``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from reconciler import __version__
from reconciler.cli.commands import COMMANDS


def _command_in(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top level's options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line (None), or ``command``'s in full and only the others' names and help lines:
    each command module imports its own libraries, and only the one that runs is imported."""
    p = argparse.ArgumentParser(prog="reconciler", description="Declarative GitOps reconciler for self-hosted VPN clusters.",
                                epilog="example:\n  reconciler validate -f cluster.yaml\n\n"
                                       "`reconciler COMMAND --help` shows each command's options and an example.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"reconciler {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", help="what to do (each has --help)")
    wanted = sorted({m for m, _ in COMMANDS.values()}) if command is None else \
        [COMMANDS[command][0]] if command in COMMANDS else []
    registered: dict[str, argparse.ArgumentParser] = {}
    for module in wanted:
        importlib.import_module(f"reconciler.cli.{module}").register(_Recording(sub, registered))
    for name, (_, help) in COMMANDS.items():  # in --help's order
        if name not in registered:
            sub.add_parser(name, help=help)
    sub._choices_actions.sort(key=lambda a: list(COMMANDS).index(a.dest) if a.dest in COMMANDS else len(COMMANDS))
    return p


class _Recording:
    """The subparsers action as a module's ``register`` sees it: it notes which commands were registered."""

    def __init__(self, sub: argparse._SubParsersAction[argparse.ArgumentParser],
                 registered: dict[str, argparse.ArgumentParser]):
        self._sub, self._registered = sub, registered

    def add_parser(self, name: str, **kw: object) -> argparse.ArgumentParser:
        parser = self._sub.add_parser(name, **kw)  # type: ignore[arg-type]
        self._registered[name] = parser
        return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    completing = "_ARGCOMPLETE" in os.environ
    p = parser(None if completing else _command_in(argv) or "")  # "": no command, so none is imported
    if completing:  # a shell asks for completions (`reconciler completion SHELL` installs that)
        import argcomplete

        argcomplete.autocomplete(p)
    args = p.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if handler is None:  # no command, or a command group without its action
        (getattr(args, "group_parser", None) or p).print_help(sys.stderr)
        return 1
    from reconciler import safe_read
    from reconciler.cli.common import print_diagnostics
    from reconciler.errors import ConfigError, ReconcilerError
    from reconciler.text import printable

    try:
        with safe_read.allowed(getattr(args, "allow_path", None) or ()):  # --allow-path: for this command only
            return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except ConfigError as exc:
        print_diagnostics(exc.diagnostics)
        print(printable(f"error: {exc}"), file=sys.stderr)
        return exc.exit_code
    except ReconcilerError as exc:
        print(printable(f"error: {exc}") + (" (this may heal by itself: try again later)" if exc.temporary else ""),
              file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 — the last line of defence: never a traceback for the operator
        if os.environ.get("RECONCILER_DEBUG"):
            traceback.print_exc()
        print(printable(f"internal error: {type(exc).__name__}: {exc}"), file=sys.stderr)
        print("  hint: this is a bug in reconciler; rerun with RECONCILER_DEBUG=1 and report the output", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
