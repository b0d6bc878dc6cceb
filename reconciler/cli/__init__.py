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
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from reconciler import __version__, safe_read
from reconciler.cli import apply as apply
from reconciler.cli import completion as completion
from reconciler.cli import engine as engine
from reconciler.cli import fleet as fleet
from reconciler.cli import hostkeys as hostkeys
from reconciler.cli import init as init
from reconciler.cli import lab as lab
from reconciler.cli import plan as plan
from reconciler.cli import routes as routes
from reconciler.cli import run as run
from reconciler.cli import secret as secret
from reconciler.cli import status as status
from reconciler.cli import usage as usage
from reconciler.cli import users as users
from reconciler.cli import validate as validate
from reconciler.cli.common import print_diagnostics
from reconciler.errors import ConfigError, ReconcilerError
from reconciler.text import printable

MODULES = (validate, init, routes, plan, apply, fleet, status, usage, users, run, lab, secret, hostkeys, engine, completion)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reconciler", description="Declarative GitOps reconciler for self-hosted VPN clusters.",
                                epilog="example:\n  reconciler validate -f cluster.yaml\n\n"
                                       "`reconciler COMMAND --help` shows each command's options and an example.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"reconciler {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", help="what to do (each has --help)")
    for module in MODULES:
        module.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    if "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (`reconciler completion SHELL` installs that)
        import argcomplete

        argcomplete.autocomplete(p)
    args = p.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if handler is None:  # no command, or a command group without its action
        (getattr(args, "group_parser", None) or p).print_help(sys.stderr)
        return 1
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
    except Exception as exc:  # the last line of defence: never a traceback for the operator
        if os.environ.get("RECONCILER_DEBUG"):
            traceback.print_exc()
        print(printable(f"internal error: {type(exc).__name__}: {exc}"), file=sys.stderr)
        print("  hint: this is a bug in reconciler; rerun with RECONCILER_DEBUG=1 and report the output", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
