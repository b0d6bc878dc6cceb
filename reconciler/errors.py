"""Every error the reconciler raises on purpose, in one tree (the only place they are defined).

Each says whether it may heal by itself (``temporary``: try again later, the loop
retries it with backoff) or needs an operator (``permanent``: retrying changes
nothing), and carries a message written for the operator — what happened, where,
and what to do. The CLI prints ``error: <message>`` and exits with ``exit_code``
(1 for all of them today); no traceback reaches the operator.

    ReconcilerError                   base of the tree
    ├── InvalidInput                  permanent: something the operator gave us is wrong
    │   ├── ConfigError               the cluster file (or a file it names) is invalid; carries diagnostics
    │   ├── EditError                 an in-place edit of the cluster file cannot be made; nothing was written
    │   ├── SecretError               the master secret is missing or weak; says where it was looked for
    │   └── StalePlan                 a saved plan no longer matches the file or the servers; plan again
    ├── RemoteError                   on a server, or on the way to it (``server`` names it)
    │   ├── ConnectError              temporary: cannot reach the server or the connection dropped
    │   ├── LockHeld                  temporary: another apply holds the server's lock
    │   ├── HostKeyChanged            permanent: the server's host key is not the pinned one; refused
    │   ├── RemoteCommandError        permanent: a command ran and failed (command, exit code, stderr)
    │   └── CommitFailed              permanent: the server refused the new state and rolled back
    ├── ReleaseError                  an engine release could not be fetched (temporary), or is not the pinned file
    ├── ReportError                   temporary: a server's report could not be read this interval
    └── LabError                      permanent: the local sandbox could not do what was asked

``is_temporary(exc)`` answers for any exception: only our temporary errors are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


class ReconcilerError(Exception):
    """Base of every error the reconciler raises on purpose."""

    temporary: ClassVar[bool] = False
    exit_code: ClassVar[int] = 1


# --------------------------------------------------------------------------- the operator's input


class InvalidInput(ReconcilerError):
    """Something the operator gave us is wrong; nothing was changed because of it."""


class ConfigError(InvalidInput):
    """The cluster file, or a file it names, is invalid. ``diagnostics`` say where (``file:line:col``)."""

    def __init__(self, message: str, diagnostics: Sequence[Any] = ()):
        super().__init__(message)
        self.diagnostics = list(diagnostics)


class EditError(ConfigError):
    """An in-place edit of the cluster file cannot be made; nothing was written."""


class SecretError(InvalidInput):
    """The master secret is missing, unreadable or too weak; says where it was looked for."""


class StalePlan(InvalidInput):
    """A saved plan was computed from other desired state or other facts than there are now."""

    def __init__(self, servers: Sequence[str]):
        self.servers = list(servers)
        where = ", ".join(self.servers) or "the set of servers"
        super().__init__(f"the saved plan is stale — the desired state or the facts changed since on: {where}; "
                         "run `reconciler plan --out` again")


# --------------------------------------------------------------------------- servers


class RemoteError(ReconcilerError):
    """Something failed on a server or on the way to it."""

    def __init__(self, message: str, server: str = ""):
        super().__init__(message)
        self.server = server


class ConnectError(RemoteError):
    """The server could not be reached, refused us, or the connection dropped (may heal)."""

    temporary = True


class LockHeld(RemoteError):
    """Another apply holds the server's lock (it ends, or its lease runs out)."""

    temporary = True


class HostKeyChanged(RemoteError):
    """The server presented a host key other than the pinned one: refused, never retried."""


class RemoteCommandError(RemoteError):
    """A command ran on the server and failed."""

    def __init__(self, server: str, command: str, code: int | None, stderr: str):
        self.command, self.code, self.stderr = command, code, stderr
        super().__init__(f"{server}: `{command[:80]}` exited {code}: {stderr.strip()[-400:]}", server)


class CommitFailed(RemoteError):
    """The server rejected or could not run the new state; it rolled back (or changed nothing)."""


class ReleaseError(ReconcilerError):
    """An engine release the controller fetches: unreachable (``temporary``), or not the pinned file."""

    def __init__(self, message: str, temporary: bool = False):
        super().__init__(message)
        self.temporary = temporary  # type: ignore[misc]


# --------------------------------------------------------------------------- the loop and the lab


class ReportError(ReconcilerError):
    """A report that cannot be read; the server then counts as not having reported (no_data) this interval."""

    temporary = True


class LabError(ReconcilerError):
    """The lab could not do what was asked; says what and what to do."""


def is_temporary(exc: BaseException) -> bool:
    """Whether trying again later may succeed: true only for our temporary errors."""
    return isinstance(exc, ReconcilerError) and exc.temporary
