"""What several commands print: tables, the status formats, a file's summary, and whether to colour."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

    from reconciler.model import Cluster


def emit(fmt: str, data: dict[str, Any], title: str, columns: list[str], rows: list[dict[str, Any]]) -> None:
    if fmt == "json":
        print(json.dumps(data, indent=2, ensure_ascii=False, default=str))
    elif fmt == "yaml":
        from ruamel.yaml import YAML

        yaml = YAML(typ="safe", pure=True)
        yaml.default_flow_style = False
        yaml.dump(json.loads(json.dumps(data, default=str)), sys.stdout)
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for col in columns:
            table.add_column(col)
        for r in rows:
            table.add_row(*(str(r.get(c, "")) for c in columns))
        Console(width=None if sys.stdout.isatty() else 240).print(table)  # piped: whole columns, never '…'


def routes_table(cluster: Cluster) -> Table:
    from rich.table import Table

    table = Table(title="Routes (in subscription order)")
    for column in ("#", "route", "balance", "pools / steering", "inbounds (server)"):
        table.add_column(column)
    for n, route in enumerate(cluster.effective_routes, 1):
        members = cluster.members[route.id]
        label = f"{route.flag} {route.name}" if route.flag else route.name
        if route.implicit:
            label += " (implicit)"
        pools = f"{', '.join(route.pools)} / {route.steering}" if route.pools else "—"
        inbounds = "\n".join(
            f"{ref.inbound.name} ({ref.server.name}{', ' + ref.inbound.pool if ref.inbound.pool else ''})" for ref in members
        ) or "[dim]empty — hidden from subscriptions[/dim]"
        table.add_row(str(n), f"{label}\n[dim]{route.id}[/dim]", route.balance, pools, inbounds)
    if cluster.unassigned:
        table.add_row("", "[yellow]unassigned[/yellow]", "", "",
                      "\n".join(f"{r.inbound.name} ({r.server.name})" for r in cluster.unassigned))
    return table


def summary(cluster: Cluster) -> dict[str, int]:
    """What a file holds, in counts; the users counted whatever their standing, with how many of them are disabled
    and how many expired (by the clock now: usage is not known here)."""
    import time

    now = time.time()
    return {
        "servers": len(cluster.servers),
        "inbounds": len(cluster.inbounds),
        "routes": len(cluster.effective_routes),
        "empty_routes": sum(1 for r in cluster.effective_routes if not cluster.members[r.id]),
        "unassigned_inbounds": len(cluster.unassigned),
        "users": len(cluster.users),
        "users_disabled": sum(not u.enabled for u in cluster.users),
        "users_expired": sum(u.enabled and u.expires_at is not None and u.expires_at < now for u in cluster.users),
    }


def color() -> bool:
    """Colour only for a person at a terminal, and never with NO_COLOR set (https://no-color.org)."""
    import os

    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")
