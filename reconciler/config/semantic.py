"""Rules that relate one part of the file to another (GITOPS-2).

Called by the loader on a schema-valid ``Cluster``. Each rule yields a
``Diagnostic`` positioned at the place the operator has to edit; when two
places collide, the message names the other one too.

Every local file the cluster file names for the controller to read and send on
(``named_files``) must be in the repository or in a folder the operator allows outside
the file (``safe_read``): validate shows where one escapes, and plan, apply and
run, which load the file the same way, refuse it.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Iterator

import asyncssh

from reconciler import safe_read
from reconciler.config.diagnostics import Diagnostic, Path, SourceMap, at, shown
from reconciler.config.includes import allow_hint
from reconciler.model import Cluster
from reconciler.text import plural, verb


def _did_you_mean(value: str, options: list[str]) -> str | None:
    close = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    if options:
        return f"known: {', '.join(options[:12])}{' …' if len(options) > 12 else ''}"
    return None


def check(cluster: Cluster, source: SourceMap, cluster_file: str) -> list[Diagnostic]:
    """The rules of ``cluster``, loaded from ``cluster_file`` (whose folder is the repository)."""
    return (list(_confined(cluster, source, cluster_file)) + list(_missing(cluster, source, cluster_file))
            + list(_errors(cluster, source)) + list(_warnings(cluster, source)))


def _missing(cluster: Cluster, source: SourceMap, cluster_file: str) -> Iterator[Diagnostic]:
    """What plan and apply read and is not there, as they read it: an inbound's certificate and key (an error: they
    live in the repository, from the cluster's folder) and a server's SSH identity (a warning: from the working
    directory, ``~`` expanded)."""
    base = os.path.dirname(os.path.abspath(cluster_file))
    for where, what, value, from_cwd in named_files(cluster):
        if where[-2:-1] == ("tls",) and where[0] == "servers":
            full = safe_read.named(value, os.getcwd() if from_cwd else base)
            if not os.path.isfile(full):
                yield at("error", source.value(where), f"{what}: {shown(value)} is not a file here",
                         "check the path; a relative path is taken from the cluster file's folder", "file")
    # A server's SSH identity is the controller's credential, kept out of git (GITOPS-6): a CI job often validates
    # before it installs the key (or without secrets at all), so its absence warns here, and plan is what fails.
    for si, server in enumerate(cluster.servers):
        identity = server.ssh.identity
        if identity and not os.path.isfile(os.path.expanduser(identity)):
            yield at("warning", source.value(("servers", si, "ssh", "identity")),
                     f"ssh.identity of server {server.name!r}: {shown(identity)} is not a file here: plan and apply "
                     "cannot reach the server with it", "install the key there before plan (taken from the working "
                     "directory; ~ is your home), or leave it out to use the SSH agent and ~/.ssh keys", "file")


# The fields that name a local file the controller reads and sends on (uploads to a server, sends to etcd) or decides
# by: confined to the repository and the allowed folders (``safe_read``). Not among them, by design: the files of
# the controller's own credentials, which never leave it and live outside git (GITOPS-6) — ``settings.secret.file``,
# ``settings.outputs.operations_auth.file``, ``servers[].ssh.identity``, ``settings.leader.tls.key`` — and the folders
# it writes (``settings.outputs.state_dir``, ``subscriptions_dir``). Includes are confined by ``config.includes``.


def named_files(cluster: Cluster) -> Iterator[tuple[Path, str, str, bool]]:
    """(where in the file, what it is, the value, relative to the working directory rather than the file's folder) of
    every confined path the cluster sets: each relative the way its reader takes it."""
    s = cluster.settings
    for name, eng in [("engine", s.engine), *((f"engines.{n}", e) for n, e in s.engines.items())]:
        if eng.binary:
            where: Path = ("settings", "engine", "binary") if name == "engine" else ("settings", "engines", name[8:], "binary")
            yield where, f"the engine binary settings.{name}.binary", eng.binary, True
    if s.steering.geoip_database:
        yield ("settings", "steering", "geoip_database"), "settings.steering.geoip_database", s.steering.geoip_database, False
    if s.acme.ca_bundle:
        yield ("settings", "acme", "ca_bundle"), "settings.acme.ca_bundle", s.acme.ca_bundle, True
    if s.leader.tls is not None:
        for key in ("ca", "cert"):
            value = getattr(s.leader.tls, key)
            if value:
                yield ("settings", "leader", "tls", key), f"settings.leader.tls.{key}", value, False
    if s.leader.password_file:
        yield ("settings", "leader", "password_file"), "settings.leader.password_file", s.leader.password_file, True
    for si, server in enumerate(cluster.servers):
        for ii, inbound in enumerate(server.inbounds):
            tls = getattr(inbound, "tls", None)
            for key in ("certificate", "key"):
                value = getattr(tls, key, None) if tls is not None else None
                if value:
                    yield (("servers", si, "inbounds", ii, "tls", key), f"tls.{key} of inbound {inbound.id!r}", value, False)


def _confined(cluster: Cluster, source: SourceMap, cluster_file: str) -> Iterator[Diagnostic]:
    """An error at each confined path (``named_files``) that resolves (symlinks followed) outside the repository and the allowed
    folders, decided by ``safe_read.confine`` as the readers decide it."""
    base = os.path.dirname(os.path.abspath(cluster_file))
    folders = safe_read.roots(base)
    private = safe_read.private_paths(cluster.controller_private(), base)
    cwd = os.getcwd()
    for where, what, value, from_cwd in named_files(cluster):
        full = safe_read.named(value, cwd if from_cwd else base)
        pos = source.value(where)
        try:
            safe_read.confine(full, folders, private if where[-2:-1] == ("tls",) and where[0] == "servers" else ())
        except ValueError:
            yield at("error", pos, f"{what}: the path contains a NUL character", None, "path")
        except safe_read.OutsideRepository as exc:
            if str(exc.strerror) == safe_read.PRIVATE:
                yield at("error", pos, f"{what} names {shown(value)}, which {safe_read.PRIVATE}",
                         "name a certificate and key of the repository's own for this inbound", "controller-file")
                continue
            how = "leads through a symlink" if safe_read.through_symlink(full, folders) else "is"
            relative = (" (taken from the working directory, as a relative path here is)"
                        if from_cwd and not os.path.isabs(os.path.expanduser(value)) else "")
            yield at("error", pos, f"{what} names {shown(value)}, which {how} outside the cluster's folder (the "
                                   f"repository){relative}", allow_hint(os.path.dirname(exc.resolved)), "outside-repository")


def _duplicates(items: list[str], what: str, section: str, field: str, source: SourceMap) -> Iterator[Diagnostic]:
    first: dict[str, int] = {}
    for i, value in enumerate(items):
        if value in first:
            other = source.value((section, first[value], field))
            yield at("error", source.value((section, i, field)), f"duplicate {what} {value!r} (first at {other})",
                     f"{what}s must be unique; rename one of them", "duplicate")
        else:
            first[value] = i


def _host_keys(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """A pinned host key must be a key asyncssh can use, not only a blob of the right type (the model's check)."""
    for si, server in enumerate(cluster.servers):
        if server.ssh.host_key is None:
            continue
        try:
            asyncssh.import_public_key(server.ssh.host_key)
        except Exception:  # noqa: BLE001 — asyncssh parses hostile bytes here: any failure means "not a usable key"
            yield at("error", source.value(("servers", si, "ssh", "host_key")),
                     f"host_key of server {server.name!r} is not a usable SSH public key (the key data is damaged)",
                     "copy the line from `ssh-keyscan -t ed25519 HOST` or the server's /etc/ssh/ssh_host_*_key.pub", "host-key")


def _errors(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    yield from _host_keys(cluster, source)
    yield from _retired_active(cluster, source)
    yield from _duplicates([s.name for s in cluster.servers], "server name", "servers", "name", source)
    yield from _duplicates([r.id for r in cluster.routes], "route id", "routes", "id", source)
    yield from _duplicates([u.name for u in cluster.users], "user name", "users", "name", source)
    yield from _duplicate_inbound_ids(cluster, source)
    yield from _shared_ports(cluster, source)
    yield from _inbound_references(cluster, source)
    yield from _route_pools(cluster, source)


def _retired_active(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    names = {s.name for s in cluster.servers}
    for i, name in enumerate(cluster.retired):
        if name in names:
            yield at("error", source.value(("retired", i)), f"server {name!r} is both in `servers` and `retired`",
                     "remove it from `retired` to keep serving it, or from `servers` to retire it", "retired-active")


def _duplicate_inbound_ids(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """Inbound ids are unique across the whole file, not only per server."""
    seen: dict[str, tuple[int, int]] = {}
    for si, server in enumerate(cluster.servers):
        for ii, inbound in enumerate(server.inbounds):
            here = ("servers", si, "inbounds", ii, "id")
            if inbound.id in seen:
                other = source.value(("servers", *seen[inbound.id][:1], "inbounds", seen[inbound.id][1], "id"))
                yield at("error", source.value(here), f"duplicate inbound id {inbound.id!r} (first at {other})",
                         "inbound ids must be unique in the whole file; rename one", "duplicate")
            else:
                seen[inbound.id] = (si, ii)


def _shared_ports(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """Two listeners on one server cannot share a port on the same transport."""
    for si, server in enumerate(cluster.servers):
        taken: dict[tuple[int, str], int] = {}
        for ii, inbound in enumerate(server.inbounds):
            for transport in sorted(inbound.transports):
                key = (inbound.port, transport)
                if key in taken:
                    holder = server.inbounds[taken[key]]
                    yield at("error", source.value(("servers", si, "inbounds", ii, "port")),
                             f"port {inbound.port}/{transport} on server {server.name!r} is already used by inbound "
                             f"{holder.id!r} ({source.value(('servers', si, 'inbounds', taken[key], 'port'))})",
                             "choose another port; TCP and UDP listeners may share a number", "port")
                    break
                taken[key] = ii


def _inbound_references(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """Each inbound's route must exist, and its pool must be one of that route's (given exactly when the route has pools)."""
    routes = {r.id: r for r in cluster.routes}
    route_ids = list(routes)
    for si, server in enumerate(cluster.servers):
        for ii, inbound in enumerate(server.inbounds):
            base = ("servers", si, "inbounds", ii)
            if inbound.route is not None and inbound.route not in routes:
                hint = _did_you_mean(inbound.route, route_ids)
                if not routes:
                    hint = f"this file declares no routes: add one under `routes:` with `id: {inbound.route}`"
                yield at("error", source.value(base + ("route",)), f"inbound {inbound.id!r} names unknown route {inbound.route!r}",
                         hint, "reference")
                continue
            route = routes.get(inbound.route) if inbound.route else None
            if inbound.pool is not None:
                if route is None:
                    yield at("error", source.value(base + ("pool",)), f"inbound {inbound.id!r} has a pool but no route",
                             "set `route:` too, or remove `pool:`", "reference")
                elif not route.pools:
                    yield at("error", source.value(base + ("pool",)),
                             f"inbound {inbound.id!r} names pool {inbound.pool!r}, but route {route.id!r} has no pools",
                             f"declare `pools: [{inbound.pool}]` on route {route.id!r}, or remove `pool:`", "reference")
                elif inbound.pool not in route.pools:
                    yield at("error", source.value(base + ("pool",)),
                             f"inbound {inbound.id!r} names pool {inbound.pool!r}, which route {route.id!r} does not declare",
                             _did_you_mean(inbound.pool, route.pools), "reference")
            elif route is not None and route.pools:
                yield at("error", source.key(base + ("route",)),
                         f"inbound {inbound.id!r} is in route {route.id!r}, which has pools, but names no pool",
                         f"add `pool:` with one of: {', '.join(route.pools)}", "reference")


def _route_pools(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """A route's pools are listed once, and its fallback_pool and geo map name only those."""
    for ri, route in enumerate(cluster.routes):
        path = ("routes", ri)
        pools = route.pools or []
        dup = {p for p in pools if pools.count(p) > 1}
        for pool in sorted(dup):
            yield at("error", source.value(path + ("pools",)), f"route {route.id!r} lists pool {pool!r} twice", None, "duplicate")
        if route.fallback_pool is not None and route.fallback_pool not in pools:
            hint = _did_you_mean(route.fallback_pool, pools) if pools else "declare `pools:` on the route first"
            yield at("error", source.value(path + ("fallback_pool",)),
                     f"fallback_pool {route.fallback_pool!r} is not one of route {route.id!r}'s pools", hint, "reference")
        for region, geo_pools in (route.geo or {}).items():
            for gi, pool in enumerate(geo_pools):
                if pool not in pools:
                    hint = _did_you_mean(pool, pools) if pools else "declare `pools:` on the route first"
                    yield at("error", source.value(path + ("geo", region, gi)),
                             f"geo {region} names pool {pool!r}, which route {route.id!r} does not declare", hint, "reference")


def _warnings(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    yield from _placeholders(cluster, source)
    yield from _unserved(cluster, source)
    yield from _insecure_tls(cluster, source)
    yield from _unpinned_engines(cluster, source)
    yield from _torrent_heuristics(cluster, source)
    yield from _route_warnings(cluster, source)


#: Addresses and names kept for documentation (RFC 5737, RFC 3849, RFC 2606): a file holding one holds a placeholder.
_DOC_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32"))
_DOC_NAMES = ("example.com", "example.net", "example.org", "example", "invalid", "test")


def placeholder(value: str) -> str | None:
    """What makes ``value`` (an address or a DNS name) a placeholder, or None."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        name = value.rstrip(".").lower()
        return next(("a name reserved for examples" for d in _DOC_NAMES if name == d or name.endswith("." + d)), None)
    return "a documentation address" if any(address in n for n in _DOC_NETWORKS) else None


def _placeholders(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """One warning for the server addresses and one for the REALITY camouflages that are placeholders (what `init`
    and the example write), at the first of them: nothing answers there, so nothing would be served."""
    hosts: list[tuple[Path, str]] = []
    sites: list[tuple[Path, str]] = []
    for si, server in enumerate(cluster.servers):
        why = placeholder(server.host)
        if why:
            hosts.append((("servers", si, "host"), f"{server.name} ({server.host}: {why})"))
        for ii, inbound in enumerate(server.inbounds):
            camouflage = getattr(inbound, "camouflage", None)
            why = placeholder(camouflage) if isinstance(camouflage, str) else None
            if why:
                sites.append((("servers", si, "inbounds", ii, "camouflage"), f"{inbound.id} ({camouflage}: {why})"))

    def listed(items: list[tuple[Path, str]]) -> str:
        shown_ = ", ".join(text for _, text in items[:4])
        return shown_ + (f" and {len(items) - 4} more" if len(items) > 4 else "")

    if hosts:
        yield at("warning", source.value(hosts[0][0]),
                 f"{plural(len(hosts), 'server')} {verb(len(hosts), 'has', 'have')} a placeholder for an address, "
                 f"where no server answers: {listed(hosts)}", "put your servers' addresses there", "placeholder")
    if sites:
        yield at("warning", source.value(sites[0][0]),
                 f"{plural(len(sites), 'REALITY inbound')} {verb(len(sites), 'has', 'have')} a placeholder for a "
                 f"camouflage, so strangers probing would see no real site: {listed(sites)}",
                 "name a real site that serves TLS 1.3, near each server", "placeholder")


def _inbound_pos(cluster: Cluster, inbound_id: str) -> tuple[str | int, ...]:
    for si, server in enumerate(cluster.servers):
        for ii, inbound in enumerate(server.inbounds):
            if inbound.id == inbound_id:
                return ("servers", si, "inbounds", ii)
    return ()


def _unserved(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """No servers, no routes (the implicit one), inbounds in no route: what clients cannot see yet."""
    if not cluster.servers:
        yield at("warning", source.root, "no servers declared", "add servers under `servers:`", "empty")

    implicit = [r for r in cluster.effective_routes if r.implicit]
    if implicit:
        first = cluster.members[implicit[0].id][0].inbound
        yield at("warning", source.key(_inbound_pos(cluster, first.id)),
                 f"no routes declared: route 'default' holds the first inbound {first.id!r} (ROUTE-6)",
                 "declare `routes:` to choose which inbounds clients see", "implicit-route")

    if cluster.unassigned:
        names = ", ".join(ref.inbound.id for ref in cluster.unassigned)
        n = len(cluster.unassigned)
        yield at("warning", source.key(_inbound_pos(cluster, cluster.unassigned[0].inbound.id)),
                 f"{plural(n, 'inbound')} {verb(n, 'is', 'are')} not in any route — clients cannot see them yet: {names}",
                 "set `route:` on them, or run `reconciler route assign INBOUND ROUTE`", "unassigned")


def _insecure_tls(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    for si, server in enumerate(cluster.servers):  # no unverified TLS entry that nobody was told of
        for ii, inbound in enumerate(server.inbounds):
            tls = getattr(inbound, "tls", None)
            if tls is not None and tls.insecure:
                yield at("warning", source.value(("servers", si, "inbounds", ii, "tls", "insecure")),
                         f"inbound {inbound.id!r} tells clients to skip certificate verification: anyone on their path "
                         "can read and change their traffic",
                         "remove `insecure: true`: a self-signed certificate is pinned where a format can pin (sing-box, "
                         "Mihomo, Hysteria2 links), or give a certificate", "insecure")


def _unpinned_engines(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    used = {cluster.engine_of(s).name for s in cluster.servers}
    for name in sorted(used):  # a downloaded engine is pinned, or apply refuses to install it
        eng = cluster.settings.engine_named(name)
        where = ("settings", "engine") if name == cluster.settings.engine.name else ("settings", "engines", name)
        if eng.install == "download" and eng.sha256 is None:
            yield at("warning", source.key(where),
                     f"the {name} release the servers download is not pinned by sha256: apply refuses to install it",
                     "run `reconciler engine pin` (it fetches the release once, checks its build and writes the pins)",
                     "engine-unpinned")


def _torrent_heuristics(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    for ri, route in enumerate(cluster.routes):
        mihomo = sorted({ref.server.name for ref in cluster.members[route.id]
                         if route.block_torrent and cluster.engine_of(ref.server).name == "mihomo"})
        if mihomo:
            yield at("warning", source.value(("routes", ri, "block_torrent")),
                     f"route {route.id!r} blocks BitTorrent, but {', '.join(mihomo)} {verb(len(mihomo), 'runs', 'run')} Mihomo, "
                     "which cannot recognise "
                     "it: only its well-known ports and tracker names are refused there, which a client can evade",
                     "serve this route from sing-box servers, which sniff BitTorrent and refuse it", "torrent-heuristic")


def _route_warnings(cluster: Cluster, source: SourceMap) -> Iterator[Diagnostic]:
    """A route nobody is in, pools too small to be healthy, steering that has nothing to steer."""
    for ri, route in enumerate(cluster.routes):
        members = cluster.members[route.id]
        if not members:
            yield at("warning", source.key(("routes", ri)),
                     f"route {route.id!r} is empty — hidden from subscriptions until an inbound joins it",
                     f"run `reconciler route assign INBOUND {route.id}`", "empty-route")
            continue
        if route.pools:
            for pool in route.pools:
                size = sum(1 for ref in members if ref.inbound.pool == pool)
                if size == 0:
                    yield at("warning", source.value(("routes", ri, "pools")),
                             f"pool {pool!r} of route {route.id!r} has no inbounds — it is never healthy", None, "empty-pool")
                elif size < route.minimum_healthy:
                    yield at("warning", source.value(("routes", ri, "minimum_healthy")),
                             f"pool {pool!r} of route {route.id!r} has {plural(size, 'inbound')}, fewer than minimum_healthy "
                             f"{route.minimum_healthy} — it is never healthy", None, "pool-size")
        elif "steering" in route.model_fields_set or "fallback_pool" in route.model_fields_set:
            yield at("warning", source.key(("routes", ri, "steering")),
                     f"route {route.id!r} has no pools, so steering does nothing", "declare `pools:` to steer", "steering")
        if route.steering == "geo" and not route.geo:
            yield at("warning", source.value(("routes", ri, "steering")),
                     f"route {route.id!r} steers by geo but has no `geo:` map — every user gets failover order", None, "geo")
