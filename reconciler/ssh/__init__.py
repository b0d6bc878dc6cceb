"""SSH to the servers (asyncssh): one connection per server, pinned host keys, bounded work.

Plan, apply and the loop talk to a ``Runner`` (``reconciler.ssh.runner``): ``SSHPool`` is the real one,
``reconciler.ssh.fake.FakeRunner`` the tests'. Its errors (``ConnectError``, ``HostKeyChanged``,
``RemoteCommandError``) are part of the one tree in ``reconciler.errors``.
"""

from reconciler.ssh.pool import KnownHosts, SSHPool
from reconciler.ssh.runner import Runner, Script
from reconciler.ssh.types import Result, Target

__all__ = ["KnownHosts", "Result", "Runner", "SSHPool", "Script", "Target"]
