"""What plan and apply share: the state folder, the SSH pool, observation, progress output."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from reconciler.model import Cluster
from reconciler.ssh import KnownHosts, SSHPool


@dataclass
class StateDir:
    """The controller's learnt state next to the cluster file: known host keys, facts, managed servers."""

    path: Path

    @classmethod
    def of(cls, cluster_file: str, cluster: Cluster) -> StateDir:
        return cls(Path(cluster_file).resolve().parent / cluster.settings.outputs.state_dir)

    def read(self, name: str) -> dict:
        f = self.path / name
        try:
            return json.loads(f.read_text()) if f.exists() else {}
        except ValueError:
            return {}

    def write(self, name: str, data: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        tmp.replace(self.path / name)

    def pool(self, concurrency: int = 32) -> SSHPool:
        return SSHPool(KnownHosts(self.path / "known_hosts.json"), concurrency=concurrency)


def remember(state: StateDir, cluster: Cluster, observed: list, results: list) -> dict:
    """After an apply: which servers are managed (for --prune) and the public material they generated
    (the commit adds what it generated to the observed facts). Returns the facts now on record."""
    from reconciler.plan.observe import learned_facts

    managed = state.read("managed.json")
    for s in cluster.servers:
        managed[s.name] = {"name": s.name, "host": s.host, "port": s.ssh.port, "user": s.ssh.user,
                           "identity": s.ssh.identity, "host_key": s.ssh.host_key}
    for r in results:
        if r.ok and any(o.plan.removed and o.plan.server == r.server for o in observed):
            managed.pop(r.server, None)
    state.write("managed.json", managed)
    learned = learned_facts(observed)
    old = state.read("facts.json")
    facts = {k: {**old.get(k, {}), **v} for k, v in learned.items()}
    state.write("facts.json", facts)
    return facts


class Progress:
    """Per-server phases: a live table on a terminal, plain lines otherwise (CI logs)."""

    def __init__(self, servers: list[str], stream=None, log=None):  # type: ignore[no-untyped-def]
        self.stream = stream or sys.stderr
        self.log = log  # a callable taking one line (the loop's logger): no live table then
        self.tty = self.stream.isatty() and log is None
        self.phase = {s: "waiting" for s in servers}
        self._live = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(file=self.stream), refresh_per_second=8, transient=True)
            self._live.start()

    def _table(self):  # type: ignore[no-untyped-def]
        from rich.table import Table

        t = Table(title="apply")
        t.add_column("server")
        t.add_column("phase")
        for s, p in self.phase.items():
            t.add_row(s, p)
        return t

    def __call__(self, server: str, phase: str) -> None:
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
