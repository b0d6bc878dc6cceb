"""The verdict timeline ``simulate`` prints: every change of every server, then a summary."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from reconciler.health.simulate import Scenario, run
from reconciler.health.topology import Topology
from reconciler.health.verdicts import Verdicts
from reconciler.model.cluster import HealthSettings

COLOURS = {"ok": "green", "no_data": "bright_black", "blocked": "magenta", "unreachable": "dark_orange", "unavailable": "red"}


def print_timeline(scenario: Scenario, topology: Topology, settings: HealthSettings, show_all: bool) -> None:
    table = Table(title=f"verdict timeline — {scenario.ticks} ticks of {settings.report_interval:g}s, seed {scenario.seed}")
    for col in ("tick", "server", "status", "in rotation", "reason"):
        table.add_column(col)
    previous: dict[str, tuple[str, str, str]] = {}
    changes: dict[str, int] = {name: 0 for name in topology.servers}
    last: Verdicts | None = None
    for tick, verdicts in run(scenario, topology, settings):
        last = verdicts
        for name, v in verdicts.servers().items():
            key = (v.label, v.rotation, v.reason)
            if show_all or previous.get(name, ("ok", "yes", "ok")) != key:
                if name in previous and previous[name][:2] != key[:2]:
                    changes[name] += 1
                c = COLOURS.get(v.status, "white")
                rotation = v.rotation if v.in_rotation else f"[red]{v.rotation}[/red]"
                table.add_row(str(tick), name, f"[{c}]{v.label}[/{c}]", rotation, v.reason)
            previous[name] = key
    console = Console() if sys.stdout.isatty() else Console(width=200)  # no wrapping when piped or logged
    console.print(table)
    if last is not None:
        summary = Table(title=f"after tick {scenario.ticks - 1}")
        for col in ("server", "status", "in rotation", "verdict changes", "reason"):
            summary.add_column(col)
        for name, v in last.servers().items():
            summary.add_row(name, v.label, v.rotation, str(changes[name]), v.reason)
        console.print(summary)

