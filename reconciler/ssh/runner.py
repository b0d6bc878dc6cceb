"""The seam between the controller and its servers: what plan, apply and the loop may ask of a server.

Every remote action is "run the named script with this request" (``Runner.script``): the script is
Python text (standard library only) that the server's ``python3 -I -S`` runs, the request a JSON-able
dict. ``SSHPool`` (``reconciler.ssh.pool``) is the real runner; ``FakeRunner`` (``reconciler.ssh.fake``)
runs the very same scripts locally against a temporary directory, like httpx's ``MockTransport``.
An installed script (``Script.installed``: the collection agent, a managed file apply puts on every server) is
run from its path, its request on stdin; ``source`` is what apply installs there. ``Runner.run`` remains for raw
commands.

How a request reaches a script (``Script.delivery``):
- spliced (the default): the request replaces the line ``REQUEST: Any = None`` as a Python literal, so
  a script starts without importing json (the facts script runs at every observation);
- on stdin as JSON (``stdin=True``): requests too large for a command line (the commit carries files).

A script may be run ``unless`` the server still looks as it did (``Unless``): a shell command prints the server's
stamp (what the script's answer depends on, cheaply: ``stat`` of files, the unit's processes); when it equals the
stamp the controller last saw, the answer is ``=same`` and the script does not run, in the same session either way.

Errors (``reconciler.errors``): ``ConnectError`` when the server cannot be reached or the connection
drops, ``HostKeyChanged``, ``RemoteCommandError`` when a script exits non-zero.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from reconciler.errors import RemoteError
from reconciler.ssh.types import Result, Target

REQUEST_LINE = "REQUEST: Any = None"  # the line a spliced request replaces, once per script


@dataclass(frozen=True)
class Script:
    """A server-side script: its name (``facts``, ``commit``, ...) and its text."""

    name: str
    source: str
    stdin: bool = False  # the request travels as JSON on stdin instead of being spliced in
    survive: bool = False  # runs under ``setsid -w``: finishes (or rolls back) even if the SSH session drops
    installed: str | None = None  # a script installed on the server at this path (the agent): run from there

    def __post_init__(self) -> None:
        if self.installed is not None and not self.stdin:
            raise ValueError(f"script {self.name}: an installed script reads its request on stdin")
        if not self.stdin and self.source.count(REQUEST_LINE + "\n") != 1:
            raise ValueError(f"script {self.name}: a spliced request needs exactly one line {REQUEST_LINE!r}")

    def prepare(self, request: Mapping[str, Any]) -> tuple[str, str | None]:
        """(the text to run, what goes on stdin) for this request."""
        if self.stdin:
            return self.source, json.dumps(request)
        return self.source.replace(REQUEST_LINE + "\n", f"REQUEST: Any = {dict(request)!r}\n", 1), None


SAME = "=same"
END_STAMP = "=end-stamp"


@dataclass(frozen=True)
class Unless:
    """Run a script unless ``command`` (POSIX shell) prints ``expected``. The answer is then ``SAME`` alone;
    otherwise it is what ``command`` printed, a line ``END_STAMP``, and the script's own output."""

    command: str
    expected: str


def split_stamp(stdout: str) -> tuple[str | None, str]:
    """(the stamp, the script's output) of an answer to a script run with ``Unless`` (stamp None: the answer
    carried none, or the runner does not stamp)."""
    head, sep, rest = stdout.partition("\n" + END_STAMP + "\n")
    return (head, rest) if sep else (None, stdout)


class Runner(Protocol):
    """What the controller may do on a server. Implementations: ``SSHPool``, ``FakeRunner``."""

    async def script(self, target: Target, script: Script, request: Mapping[str, Any], *, input: bytes | None = None,
                     timeout: float = 120.0, detach: bool = False, fresh: bool = False,
                     unless: Unless | None = None) -> Result:
        """Run ``script`` with ``request`` on ``target`` and return its output.

        ``input``: bytes for the script's stdin (only for spliced scripts). ``detach``: start it in its own
        session and return at once (its output is lost: such a script writes its answer to a file).
        ``fresh``: over a brand-new connection, to prove new sessions still get through (the firewall).
        ``unless``: not when the server's stamp is the one expected (see ``Unless``).
        Raises ``RemoteCommandError`` if it exits non-zero, ``ConnectError`` if the server cannot be reached.
        """
        ...

    async def run(self, target: Target, command: str, check: bool = True, timeout: float = 120.0,
                  input: str | bytes | None = None) -> Result:
        """A raw shell command (the SSH pool's own checks; the fake host refuses every one)."""
        ...

    async def close(self) -> None:
        """Close every connection (and, for a fake, wait for what it started)."""
        ...


def answer(result: Result, target: Target, script: Script, keys: Mapping[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """A script's answer (the last line of its output) as a JSON object whose ``keys`` have the given types.

    Servers are hostile input like everything else: an answer that is not JSON, not an object, or whose
    fields have other types raises ``RemoteError`` naming the server and the script — that server's
    failure, never an exception that reaches the others."""
    lines = [ln for ln in result.stdout.strip().splitlines() if ln.strip()]
    try:
        doc = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        shown = (lines[-1] if lines else "nothing")[:120]
        raise RemoteError(f"{target.name}: the {script.name} script answered something that is not its answer: {shown!r}",
                          target.name)
    for key, kind in keys.items():
        if not isinstance(doc.get(key), kind) or (kind is int and isinstance(doc.get(key), bool)):
            raise RemoteError(f"{target.name}: the {script.name} script's answer has no valid `{key}`", target.name)
    return doc
