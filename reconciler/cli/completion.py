"""``completion SHELL``: the shell code that completes reconciler's commands, options and choices.

argcomplete writes it from the same parser the commands use, so it never drifts from them::

    reconciler completion bash >> ~/.bashrc
    reconciler completion zsh  >> ~/.zshrc
    reconciler completion fish > ~/.config/fish/completions/reconciler.fish
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command


def register(sub: Any) -> None:
    c = add_command(sub, "completion", HELP["completion"],
                    "reconciler completion bash >> ~/.bashrc")
    c.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete in")
    c.set_defaults(run=cmd_completion)


def cmd_completion(args: argparse.Namespace) -> int:
    from argcomplete.shell_integration import shellcode

    sys.stdout.write(shellcode(["reconciler"], shell=args.shell))
    return 0
