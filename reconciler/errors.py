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
    │   ├── Problem                   a file cannot be read or parsed; carries its one diagnostic
    │   └── StalePlan                 a saved plan no longer matches the file or the servers; plan again
    ├── RemoteError                   on a server, or on the way to it (``server`` names it)
    │   ├── ConnectError              temporary: cannot reach the server or the connection dropped
    │   ├── LockHeld                  temporary: another apply holds the server's lock
    │   │   └── FenceRefused          permanent: a deposed leader's apply, refused by the server or by itself
    │   ├── HostKeyChanged            permanent: the server's host key is not the pinned one; refused
    │   ├── RemoteCommandError        permanent: a command ran and failed (command, exit code, stderr)
    │   └── CommitFailed              permanent: the server refused the new state and rolled back
    ├── ReleaseError                  an engine release could not be fetched (temporary), or is not the pinned file
    ├── ReportError                   temporary: a server's report could not be read this interval
    ├── WorkerStartError              temporary: a live worker process could not start (also an ``OSError``)
    └── LabError                      permanent: the local sandbox could not do what was asked

Three more are the standard library's kinds, for the code that catches those (``except ValueError``): a path outside
the repository (``OutsideRepository``, a ``PermissionError``), bytes read back whose HMAC is not ours
(``MacMismatch``) and a learned state this service cannot have written (``StateRefused``, both ``ValueError``).

``is_temporary(exc)`` answers for any exception: our temporary errors, and the network's own (a timeout, a connection
refused or reset). The loop's retries follow it: a temporary failure is tried again after a backoff that grows, a
permanent one (a changed host key, a refused command) only after the longest wait (``backoff.Streaks.failed``).
"""

from __future__ import annotations

import errno
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


class Problem(InvalidInput):
    """A file cannot be read or parsed; ``diagnostic`` (a ``config.diagnostics.Diagnostic``) says where and why."""

    def __init__(self, diagnostic: Any):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


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


class SessionLost(ConnectError):
    """Connected, but the session was lost or outlived its time: the server's end stopped answering (may heal)."""


class LockHeld(RemoteError):
    """Another apply holds the server's lock (it ends, or its lease runs out)."""

    temporary = True


class FenceRefused(LockHeld):
    """A deposed leader's apply: refused by the server (a newer fence applied there) or by itself."""

    temporary = False


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


class WorkerStartError(ReconcilerError, OSError):
    """A live worker could not start: it could not bind the port (the bind's errno), load the snapshot, or did not
    answer in time. An ``OSError`` too, as a bind's failure is."""

    temporary = True


class DatabaseError(ReconcilerError):
    """The users' database cannot be reached or read; names the database by host, port and name, never its password."""

    temporary = True


class SchemaTooNew(InvalidInput):
    """The users' database holds a schema a later release wrote: this one refuses to read or migrate it."""


class LabError(ReconcilerError):
    """The lab could not do what was asked; says what and what to do."""


# --------------------------------------------------------------------------- the standard library's kinds


class OutsideRepository(PermissionError):
    """A path the cluster file names resolves outside the repository and every allowed folder."""

    def __init__(self, path: str, resolved: str, why: str) -> None:
        super().__init__(errno.EACCES, why, path)
        self.resolved = resolved


class MacMismatch(ValueError):
    """Bytes read back are not what this service wrote: their HMAC is missing or does not match."""


class StateRefused(ValueError):
    """A learned state read back is not one this service can have written: broken, too big or inconsistent."""


def is_temporary(exc: BaseException) -> bool:
    """Whether trying again later may succeed: our temporary errors, a timeout, a connection refused or reset."""
    if isinstance(exc, ReconcilerError):
        return exc.temporary
    return isinstance(exc, TimeoutError | ConnectionError)
