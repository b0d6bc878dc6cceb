"""In-place edits of the cluster file: ``route assign`` and ``route unassign`` (ROUTE-3).

ruamel finds the inbound and the exact positions of its keys; the edit itself is
a splice of the original text at those positions, so every other byte of the
file — comments, order, quoting, blank lines — stays as it was. The edited text
is validated together with the rest of the cluster (includes too) before it is
written, and it is written atomically; an edit that would leave the file
invalid writes nothing.

Arguments are operator input too: a route or pool that is not a ``Name`` is refused
before the file is touched (``--pool 'a, method: x'`` once spliced a new key into the
file), and a value YAML would read as something else (``null``, ``123``) is quoted.
A symlinked cluster file is edited where it points; the link stays a link.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError
from ruamel.yaml import YAML

from reconciler.config.diagnostics import Diagnostic
from reconciler.config.loader import LoadResult, load_cluster
from reconciler.config.yamlread import Budget, parse_yaml, read_text
from reconciler.errors import EditError, Problem
from reconciler.model import Cluster, InboundRef
from reconciler.model.types import Name
from reconciler.state.files import write_atomic

_SCALAR = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\']|\'\')*\'|[^\s,}\]#]+')
_NAME: TypeAdapter[str] = TypeAdapter(Name)


def _check_name(what: str, value: str) -> None:
    try:
        _NAME.validate_python(value)
    except ValidationError:
        raise EditError(f"{what} {value[:80]!r} is not a valid name: use lower-case letters, digits, '.', '_' and '-' "
                        "(e.g. fra-1)") from None


def _yaml_scalar(value: str) -> str:
    """``value`` as YAML text that reads back as exactly this string (quoted when plain would not)."""
    try:
        plain, _ = parse_yaml(value, "<value>", Budget())
    except Problem:
        plain = None
    return value if plain == value else f'"{value}"'


@dataclass
class EditResult:
    file: str
    changed: bool
    summary: str
    warnings: list[Diagnostic] = field(default_factory=list)


def _load_for_edit(path: str, inbound_id: str) -> tuple[LoadResult, Cluster, InboundRef]:
    """The load result, its valid cluster and the inbound to edit, or an EditError saying why not."""
    result = load_cluster(path)
    cluster = result.cluster
    if cluster is None:
        raise EditError("the file has errors; fix them first", result.errors)
    ref = next((r for r in cluster.inbounds if r.inbound.id == inbound_id), None)
    if ref is None:
        raise EditError(f"no inbound with id {inbound_id!r}; known: {', '.join(r.inbound.id for r in cluster.inbounds)}")
    return result, cluster, ref


def assign(path: str, inbound_id: str, route_id: str, pool: str | None = None) -> EditResult:
    """Put an inbound into a route (moving it out of any other), with a pool when the route has pools."""
    _check_name("route", route_id)
    if pool is not None:
        _check_name("pool", pool)
    result, cluster, ref = _load_for_edit(path, inbound_id)
    routes = {r.id: r for r in cluster.routes}
    if route_id not in routes:
        known = ", ".join(routes) or "none (declare `routes:` first)"
        raise EditError(f"no route with id {route_id!r}; known: {known}")
    route = routes[route_id]
    if route.pools and pool is None:
        raise EditError(f"route {route_id!r} has pools; choose one with --pool ({', '.join(route.pools)})")
    if not route.pools and pool is not None:
        raise EditError(f"route {route_id!r} has no pools; drop --pool")
    current = cluster.route_of(inbound_id)
    if current == route_id and ref.inbound.pool == pool:
        return EditResult(path, False, f"{inbound_id} is already in route {route_id}", result.warnings)
    updates: dict[str, str | None] = {"route": route_id, "pool": pool}
    file = _apply(path, result, cluster, inbound_id, updates)
    moved = f" (moved from {current})" if current and current != route_id else ""
    where = f", pool {pool}" if pool else ""
    return EditResult(file.path, True, f"{inbound_id} → route {route_id}{where}{moved}", file.warnings)


def unassign(path: str, inbound_id: str) -> EditResult:
    """Take an inbound out of its route (it stays on its server, invisible to clients)."""
    result, cluster, ref = _load_for_edit(path, inbound_id)
    if ref.inbound.route is None:
        if cluster.route_of(inbound_id) is not None:
            raise EditError(
                f"{inbound_id} is in the implicit 'default' route (ROUTE-6); declare `routes:` to control membership"
            )
        return EditResult(path, False, f"{inbound_id} is not in any route", result.warnings)
    file = _apply(path, result, cluster, inbound_id, {"route": None, "pool": None})
    return EditResult(file.path, True, f"{inbound_id} removed from route {ref.inbound.route}", file.warnings)


@dataclass
class _Written:
    path: str
    warnings: list[Diagnostic]


def _apply(main: str, loaded: LoadResult, cluster: Cluster, inbound_id: str, updates: dict[str, str | None]) -> _Written:
    target = _file_of(loaded, cluster, inbound_id)
    try:
        text = read_text(target, target)
    except Problem as problem:
        raise EditError(f"cannot read {target}: {problem.diagnostic.message}") from None
    new_text = text
    for key, value in updates.items():
        # Re-parse after every splice so the next one works from fresh positions.
        node = _find_inbound(new_text, inbound_id)
        if node is None:
            raise EditError(f"could not locate inbound {inbound_id!r} in {target}")
        new_text = _set_key(new_text, node, key, None if value is None else _yaml_scalar(value))
    check = load_cluster(main, overrides={os.path.abspath(target): new_text})
    if check.cluster is None:
        raise EditError("the edit would make the file invalid; nothing was written", check.errors)
    _atomic_write(target, new_text)
    return _Written(target, check.warnings)


def _file_of(loaded: LoadResult, cluster: Cluster, inbound_id: str) -> str:
    for si, server in enumerate(cluster.servers):
        for ii, inbound in enumerate(server.inbounds):
            if inbound.id == inbound_id:
                pos = loaded.source.key(("servers", si, "inbounds", ii))
                return pos.file if pos and pos.file else loaded.path
    return loaded.path


def _find_inbound(text: str, inbound_id: str) -> Any:
    yaml = YAML(typ="rt")
    with warnings.catch_warnings():  # a reused anchor warns; the loader already accepted the file
        warnings.simplefilter("ignore")
        doc = yaml.load(text)
    for server in (doc or {}).get("servers") or []:
        for inbound in (server or {}).get("inbounds") or []:
            if isinstance(inbound, dict) and str(inbound.get("id")) == inbound_id:
                return inbound
    return None


def _offset(text: str, line: int, col: int) -> int:
    """0-based (line, col) → character offset."""
    starts = [0]
    for m in re.finditer("\n", text):
        starts.append(m.end())
    return starts[line] + col


def _set_key(text: str, node: Any, key: str, value: str | None) -> str:
    flow = node.fa.flow_style()
    if key in node:
        kstart = _offset(text, *node.lc.key(key))
        vstart = _offset(text, *node.lc.value(key))
        if text[vstart:vstart + 1] in ("{", "["):  # a flow collection: replaced whole
            vend = _flow_close(text, vstart) + 1
        elif isinstance(node[key], dict | list) and len(node[key]):
            raise EditError(f"`{key}` is a block mapping or list here; write it on one line ({key}: {{…}}) or remove it, "
                            "then run this again")
        else:
            m = _SCALAR.match(text, vstart)
            vend = m.end() if m else vstart
        if value is not None:
            return text[:vstart] + value + text[vend:]
        if flow:
            # Remove "key: value" and one neighbouring comma.
            after = re.compile(r"\s*,\s*").match(text, vend)
            if after:
                return text[:kstart] + text[after.end():]
            before = re.compile(r",\s*$").search(text, 0, kstart)
            return text[: before.start() if before else kstart] + text[vend:]
        line_start = text.rfind("\n", 0, kstart) + 1
        line_end = text.find("\n", vend)
        line_end = len(text) if line_end < 0 else line_end + 1
        if text[line_start:kstart].strip() in ("", "-"):
            if text[line_start:kstart].strip() == "-":
                # "- route: x" opens the item: keep the dash for the next key.
                nxt = re.compile(r"[ \t]*\n?[ \t]*").match(text, vend)
                return text[:kstart] + text[nxt.end() if nxt else vend:]
            return text[:line_start] + text[line_end:]
        return text[:kstart] + text[vend:]
    if value is None:
        return text
    if flow:
        close = _flow_close(text, _offset(text, node.lc.line, node.lc.col))
        body = text[_offset(text, node.lc.line, node.lc.col) + 1 : close].strip()
        sep = ", " if body else ""
        return text[:close].rstrip() + f"{sep}{key}: {value}" + (" " if text[close - 1] == " " else "") + text[close:]
    # Block mapping: a new line after a one-line scalar key (`pool` after `route`, else after `port`),
    # at the indent of the mapping's keys.
    anchor = next((k for k in (("route", "port") if key == "pool" else ("port",)) if k in node), next(iter(node)))
    kline, kcol = node.lc.key(anchor)
    line_end = text.find("\n", _offset(text, kline, kcol))
    if line_end < 0:
        return text + f"\n{' ' * kcol}{key}: {value}\n"
    return text[: line_end + 1] + f"{' ' * kcol}{key}: {value}\n" + text[line_end + 1 :]


def _flow_close(text: str, start: int) -> int:
    """Offset of the '}' closing the flow mapping that opens at ``start``."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch in "\"'":
            m = _SCALAR.match(text, i)
            i = m.end() if m else i + 1
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise EditError("unterminated flow mapping")


def _atomic_write(path: str, text: str) -> None:
    real = os.path.realpath(path)  # a symlinked file is written where it points, and stays a link
    write_atomic(real, text.encode("utf-8"), os.stat(real).st_mode & 0o777)  # keep the file's permissions
