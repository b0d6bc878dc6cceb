"""What plan and apply share around the servers: the SSH pool of a state folder, remembering what an
apply learnt, and progress output."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from reconciler.model import Cluster
from reconciler.ssh import KnownHosts, SSHPool, Target
from reconciler.ssh.pool import first_contact_warning
from reconciler.state.folder import StateFolder
from reconciler.text import printable

if TYPE_CHECKING:
    from rich.live import Live
    from rich.table import Table


def pool_for(state: StateFolder, concurrency: int = 32, strict_host_keys: bool = False) -> SSHPool:
    """The SSH pool whose first-contact host keys are recorded in ``state`` (refused with ``strict_host_keys``)."""
    return SSHPool(KnownHosts(state.known_hosts), concurrency=concurrency, strict_host_keys=strict_host_keys)


def targets(cluster: Cluster, state: StateFolder, prune: bool = False) -> list[Target]:
    """How to reach every server of the file (and, with ``prune``, those that left it but are still managed)."""
    names = {s.name for s in cluster.servers}
    found = [Target.from_server(s) for s in cluster.servers]
    if prune:
        found += [t for name, info in state.managed().items() if name not in names
                  if (t := Target.from_record(info)) is not None]
    return found


def first_contact_warnings(cluster: Cluster, state: StateFolder, prune: bool = False) -> list[str]:
    """One warning per server whose host key is neither pinned in the file nor remembered in ``state``."""
    return [first_contact_warning(t) for t in KnownHosts(state.known_hosts).first_contact(targets(cluster, state, prune))]


def recall(state: StateFolder) -> None:
    """Before an apply: the versions this state folder knows its engine releases report (a server downloading one
    of them stages it in its commit's own session, ``engine.in_commit``)."""
    from reconciler.apply import engine

    engine.learn(state.release_versions())


def remember(state: StateFolder, cluster: Cluster, observed: list[Any], results: list[Any]) -> None:
    """After an apply: which servers are managed (removed once they leave the file and an apply removed them), and
    the versions the engine releases staged reported. Nothing else is learnt from servers: keys and pins are derived
    from the master secret."""
    from reconciler.apply import engine

    managed = state.managed()
    for s in cluster.servers:
        managed[s.name] = {"name": s.name, "host": s.host, "port": s.ssh.port, "user": s.ssh.user,
                           "identity": s.ssh.identity, "host_key": s.ssh.host_key}
    for r in results:
        if r.ok and any(o.plan.removed and o.plan.server == r.server for o in observed):
            managed.pop(r.server, None)
    state.write_managed(managed)
    state.remember_release_versions(engine.known())


async def certificates(cluster: Cluster, pool: Any, base_dir: str) -> None:
    """Before an apply: order the ACME certificates that are due (``reconciler.apply.acme``), saying so on stderr;
    one that cannot be had is a warning (its server's plan then says it has none yet)."""
    from reconciler.apply.acme import ensure_certificates

    failed = await ensure_certificates(cluster, pool, base_dir, say=lambda line: print(line, file=sys.stderr, flush=True))
    for inbound, why in failed.items():
        print(printable(f"warning: no certificate for inbound {inbound!r}: {why}"), file=sys.stderr)  # the CA's or a server's words


class Progress:
    """Per-server phases: a live table on a terminal, plain lines otherwise (CI logs).

    The one progress type: ``apply_all`` takes any ``(server, phase)`` callable, and this is the one we pass."""

    def __init__(self, servers: list[str], stream: TextIO | None = None, log: Callable[[str], object] | None = None):
        self.stream = stream or sys.stderr
        self.log = log  # a callable taking one line (the loop's logger): no live table then
        self.tty = self.stream.isatty() and log is None
        self.phase = {s: "waiting" for s in servers}
        self._live: Live | None = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(file=self.stream), refresh_per_second=8, transient=True)
            self._live.start()

    def _table(self) -> Table:
        from rich.table import Table

        t = Table(title="apply")
        t.add_column("server")
        t.add_column("phase")
        for s, p in self.phase.items():
            t.add_row(s, p)
        return t

    def __call__(self, server: str, phase: str) -> None:
        phase = printable(phase)  # a failure's phase carries what the server said
        self.phase[server] = phase
        if self._live is not None:
            self._live.update(self._table())
        elif self.log is not None:
            self.log(f"{server}: {phase}")
        else:
            print(f"{server}: {phase}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
