"""SSH to the servers (asyncssh): one connection per server, pinned host keys, bounded work.

Errors (one tree, documented here):

- ``SSHError`` — base of everything below.
  - ``ConnectError`` — the server could not be reached or refused us (may heal: retried with
    backoff, then reported as "no data", never as "down").
  - ``HostKeyChanged`` — the server's host key differs from the pinned one: refused, never retried.
  - ``RemoteCommandError`` — a command ran and failed: carries the command, exit code and stderr.
"""

from reconciler.ssh.pool import (
    ConnectError,
    HostKeyChanged,
    KnownHosts,
    RemoteCommandError,
    Result,
    SSHError,
    SSHPool,
    Target,
)

__all__ = ["ConnectError", "HostKeyChanged", "KnownHosts", "RemoteCommandError", "Result", "SSHError", "SSHPool",
           "Target"]
