"""SSH to the servers (asyncssh): one connection per server, pinned host keys, bounded work.

Its errors (``ConnectError``, ``HostKeyChanged``, ``RemoteCommandError``) are part of the
one tree in ``reconciler.errors``.
"""

from reconciler.ssh.pool import KnownHosts, Result, SSHPool, Target

__all__ = ["KnownHosts", "Result", "SSHPool", "Target"]
