"""The topology picture (ROUTE-8): servers and their inbounds → routes → subscriptions.

Pure renderers from a ``Cluster`` (and, once the loop runs, a status per server)
to Mermaid, Graphviz DOT and a self-contained SVG. Unassigned inbounds lead to
an "unassigned" zone; empty routes are drawn dashed and have no link to the
distribution node, since they are hidden from subscriptions (ROUTE-5).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from xml.sax.saxutils import escape

from reconciler.model import Cluster

#: Fill colours by health status; "unknown" before the loop has a verdict.
STATUS_COLOURS = {
    "ok": "#2e7d32",
    "pair-unreachable": "#f9a825",
    "unavailable": "#c62828",
    "unreachable": "#ef6c00",
    "blocked": "#6a1b9a",
    "no_data": "#757575",
    "unknown": "#37474f",
}


def colour_of(label: str) -> str:
    """The fill of a health label (``Verdicts.labels``): ``unreachable from RU`` is unreachable's."""
    if label.startswith("unreachable"):
        return STATUS_COLOURS["unreachable"]
    return STATUS_COLOURS.get(label, STATUS_COLOURS["unknown"])


def _ident(prefix: str, value: str) -> str:
    return prefix + "_" + re.sub(r"[^A-Za-z0-9_]", "_", value)


def _route_label(route_name: str, flag: str | None) -> str:
    return f"{flag} {route_name}" if flag else route_name


@dataclass(frozen=True)
class _Syntax:
    """How one text format writes the parts of the picture; ``_text`` walks the cluster once for all."""

    quote: Callable[[str], str]
    head: tuple[str, ...]
    server_open: str  # {id} {label} {colour}
    inbound: str  # {id} {label} {detail}
    no_inbounds: str  # {id}
    server_close: str  # {id} {colour}
    dist: str
    route: str  # {id} {label}
    empty_route: str  # {id} {label}
    route_link: str  # {id}
    member: str  # {inbound} {route} {pool}: pool is already formatted, or ""
    pool: str  # {pool}
    unassigned: str
    unassigned_link: str  # {inbound}
    tail: tuple[str, ...]


def _text(cluster: Cluster, health: Mapping[str, str] | None, syn: _Syntax) -> str:
    health = health or {}
    q = syn.quote
    lines = list(syn.head)
    for server in cluster.servers:
        sid = _ident("srv", server.name)
        colour = colour_of(health.get(server.name, "unknown"))
        badge = " · prober" if server.prober else ""
        state = f" · {health[server.name]}" if server.name in health else ""
        label = f"{q(server.name)} · {server.country}/{server.region}{badge}{state}"
        lines.append(syn.server_open.format(id=sid, label=label, colour=colour))
        for ib in server.inbounds:
            state = f" · {health[ib.id]}" if ib.id in health else ""
            lines.append(syn.inbound.format(id=_ident("in", ib.id), label=q(ib.name), detail=f"{ib.protocol}:{ib.port}{state}"))
        if not server.inbounds:
            lines.append(syn.no_inbounds.format(id=_ident("none", server.name)))
        lines.append(syn.server_close.format(id=sid, colour=colour))
    lines.append(syn.dist)
    for route in cluster.effective_routes:
        rid = _ident("route", route.id)
        members = cluster.members[route.id]
        label = q(_route_label(route.name, route.flag))
        if members:
            lines.append(syn.route.format(id=rid, label=label))
            lines.append(syn.route_link.format(id=rid))
        else:
            lines.append(syn.empty_route.format(id=rid, label=label))
        for ref in members:
            pool = syn.pool.format(pool=q(ref.inbound.pool)) if ref.inbound.pool else ""
            lines.append(syn.member.format(inbound=_ident("in", ref.inbound.id), route=rid, pool=pool))
    if cluster.unassigned:
        lines.append(syn.unassigned)
        lines.extend(syn.unassigned_link.format(inbound=_ident("in", ref.inbound.id)) for ref in cluster.unassigned)
    lines.extend(syn.tail)
    return "\n".join(line for line in lines if line) + "\n"


_MERMAID = _Syntax(
    quote=lambda s: s.replace('"', "#quot;"),
    head=("flowchart LR",),
    server_open='  subgraph {id}["{label}"]',
    inbound='    {id}["{label}<br/>{detail}"]',
    no_inbounds='    {id}["(no inbounds)"]',
    server_close="  end\n  style {id} stroke:{colour},stroke-width:2px",
    dist='  dist[["subscriptions"]]',
    route='  {id}(["{label}"])',
    empty_route='  {id}(["{label} (empty)"]):::empty',
    route_link="  {id} --> dist",
    member="  {inbound} -->{pool} {route}",
    pool="|{pool}|",
    unassigned='  unassigned{{"unassigned — clients cannot see these"}}',  # written as is, not formatted
    unassigned_link="  {inbound} -.-> unassigned",
    tail=("  classDef empty stroke-dasharray: 5 5",),
)

_DOT = _Syntax(
    quote=lambda s: s.replace("\\", "\\\\").replace('"', '\\"'),
    head=("digraph topology {", "  rankdir=LR;", '  node [shape=box, fontname="sans-serif"];'),
    server_open='  subgraph cluster_{id} {{\n    label="{label}"; color="{colour}"; penwidth=2;',
    inbound='    {id} [label="{label}\\n{detail}"];',
    no_inbounds='    {id} [label="(no inbounds)", style=dotted];',
    server_close="  }}",
    dist='  dist [label="subscriptions", shape=doubleoctagon];',
    route='  {id} [label="{label}", shape=ellipse];',
    empty_route='  {id} [label="{label} (empty)", shape=ellipse, style=dashed];',
    route_link="  {id} -> dist;",
    member="  {inbound} -> {route}{pool};",
    pool=' [label="{pool}"]',
    unassigned='  unassigned [label="unassigned — clients cannot see these", shape=note, style=dashed];',
    unassigned_link="  {inbound} -> unassigned [style=dotted];",
    tail=("}",),
)


def mermaid(cluster: Cluster, health: Mapping[str, str] | None = None) -> str:
    return _text(cluster, health, _MERMAID)


def dot(cluster: Cluster, health: Mapping[str, str] | None = None) -> str:
    return _text(cluster, health, _DOT)


# --------------------------------------------------------------------------- SVG

_ROW = 22
_HEAD = 26
_GAP = 14
_SERVER_W = 300  # at least; wider when a label needs it
_ROUTE_W = 220


def text_width(text: str, size: float = 13, bold: bool = False) -> float:
    """About how wide ``text`` is in a sans-serif font of ``size`` px: wide glyphs (CJK, emoji) count double."""
    units = sum(2.0 if ord(ch) > 0x2E80 else 1.0 for ch in text)
    return units * size * (0.62 if bold else 0.58)


def svg(cluster: Cluster, health: Mapping[str, str] | None = None) -> str:
    """A self-contained SVG: servers left (each inbound with its own health), routes middle, distribution right.

    ``health``: the health label by server name and by inbound id (``Verdicts.labels``); the boxes are as wide as their
    longest label, so no label runs out of its box."""
    health = health or {}
    parts: list[str] = []
    anchors: dict[str, tuple[float, float]] = {}  # inbound id → right-edge point
    heads = {s.name: f"{s.name} · {s.country}/{s.region or ''}{' · prober' if s.prober else ''} · "
                     f"{health.get(s.name, 'unknown')}" for s in cluster.servers}
    server_w = max([_SERVER_W] + [text_width(h, bold=True) + 20 for h in heads.values()]
                   + [text_width(f"{ib.name} {ib.protocol}:{ib.port} · {health.get(ib.id, 'unknown')}") + 40
                      for s in cluster.servers for ib in s.inbounds])
    routes = [(r, _route_label(r.name, r.flag) + ("" if cluster.members[r.id] else " (empty)"),
               f"{r.balance}" + (f" · pools: {', '.join(r.pools)}" if r.pools else "")) for r in cluster.effective_routes]
    route_w = max([_ROUTE_W] + [max(text_width(label, bold=True), text_width(detail, 11)) + 32 for _, label, detail in routes])
    y = 40.0
    x_srv = 20.0
    x_route = x_srv + server_w + 120
    x_dist = x_route + route_w + 100
    for server in cluster.servers:
        status = health.get(server.name, "unknown")
        colour = colour_of(status)
        rows = max(1, len(server.inbounds))
        box = _HEAD + rows * _ROW + 6
        parts.append(
            f'<g class="server" data-server="{escape(server.name)}" data-status="{escape(status)}">'
            f'<rect x="{x_srv}" y="{y}" width="{server_w:.0f}" height="{box}" rx="6" fill="#fafafa" stroke="{colour}" stroke-width="2"/>'
            f'<rect x="{x_srv}" y="{y}" width="{server_w:.0f}" height="{_HEAD - 4}" rx="6" fill="{colour}"/>'
            f'<text x="{x_srv + 8}" y="{y + 16}" fill="#fff" font-weight="bold">{escape(heads[server.name])}</text>'
        )
        for i, inbound in enumerate(server.inbounds):
            ry = y + _HEAD + i * _ROW
            ib_status = health.get(inbound.id, "unknown")
            ib_colour = colour_of(ib_status)
            parts.append(
                f'<circle cx="{x_srv + 14}" cy="{ry + 11}" r="5" fill="{ib_colour}" data-inbound="{escape(inbound.id)}"'
                f' data-status="{escape(ib_status)}"><title>{escape(inbound.id)}: {escape(ib_status)}</title></circle>'
                f'<text x="{x_srv + 26}" y="{ry + 15}" data-inbound="{escape(inbound.id)}">{escape(inbound.name)}'
                f'<tspan fill="#666"> {escape(inbound.protocol)}:{inbound.port} · {escape(ib_status)}</tspan></text>'
            )
            anchors[inbound.id] = (x_srv + server_w, ry + 11)
        if not server.inbounds:
            parts.append(f'<text x="{x_srv + 10}" y="{y + _HEAD + 15}" fill="#999">(no inbounds)</text>')
        parts.append("</g>")
        y += box + _GAP
    left_bottom = y

    y = 40.0
    for route, label, detail in routes:
        members = cluster.members[route.id]
        empty = not members
        dash = ' stroke-dasharray="6 4"' if empty else ""
        parts.append(
            f'<g class="route{" empty" if empty else ""}" data-route="{escape(route.id)}">'
            f'<rect x="{x_route:.0f}" y="{y}" width="{route_w:.0f}" height="44" rx="22" fill="#e3f2fd" stroke="#1565c0" stroke-width="2"{dash}/>'
            f'<text x="{x_route + 16:.0f}" y="{y + 19}" font-weight="bold">{escape(label)}</text>'
            f'<text x="{x_route + 16:.0f}" y="{y + 35}" fill="#555" font-size="11">{escape(detail)}</text></g>'
        )
        for ref in members:
            sx, sy = anchors[ref.inbound.id]
            parts.append(_curve(sx, sy, x_route, y + 22, "#1565c0", dashed=False))
        if not empty:
            parts.append(_curve(x_route + route_w, y + 22, x_dist, 62, "#1565c0", dashed=False, cls="to-dist"))
        y += 44 + _GAP
    if cluster.unassigned:
        y += _GAP
        parts.append(
            f'<g class="unassigned"><rect x="{x_route:.0f}" y="{y}" width="{route_w:.0f}" height="44" rx="4" fill="#fff8e1" '
            f'stroke="#f9a825" stroke-width="2" stroke-dasharray="3 3"/>'
            f'<text x="{x_route + 12:.0f}" y="{y + 19}" font-weight="bold">unassigned</text>'
            f'<text x="{x_route + 12:.0f}" y="{y + 35}" fill="#555" font-size="11">clients cannot see these</text></g>'
        )
        for ref in cluster.unassigned:
            sx, sy = anchors[ref.inbound.id]
            parts.append(_curve(sx, sy, x_route, y + 22, "#f9a825", dashed=True))
        y += 44
    parts.append(
        f'<g class="dist"><rect x="{x_dist:.0f}" y="40" width="150" height="44" rx="4" fill="#ede7f6" stroke="#4527a0" stroke-width="2"/>'
        f'<text x="{x_dist + 18:.0f}" y="67" font-weight="bold">subscriptions</text></g>'
    )
    height = max(left_bottom, y) + 20
    width = max(x_dist + 170, 20 + 120 * len(STATUS_COLOURS))  # the legend fits
    legend = " ".join(
        f'<rect x="{20 + i * 120}" y="10" width="12" height="12" fill="{c}"/><text x="{36 + i * 120}" y="21" font-size="11">{s}</text>'
        for i, (s, c) in enumerate(STATUS_COLOURS.items())
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="13">'
        f"<title>cluster topology</title>{legend}{''.join(parts)}</svg>\n"
    )


def _curve(x1: float, y1: float, x2: float, y2: float, colour: str, dashed: bool, cls: str = "link") -> str:
    mid = (x1 + x2) / 2
    dash = ' stroke-dasharray="4 4"' if dashed else ""
    return (
        f'<path class="{cls}" d="M{x1:.0f},{y1:.0f} C{mid:.0f},{y1:.0f} {mid:.0f},{y2:.0f} {x2:.0f},{y2:.0f}" '
        f'fill="none" stroke="{colour}" stroke-width="1.5"{dash}/>'
    )


RENDERERS = {"svg": svg, "mermaid": mermaid, "dot": dot}
