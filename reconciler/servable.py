"""What can be served: the one check every path that adopts a cluster file makes (GITOPS-2).

``load_cluster`` checks the file against the schema and its own rules. What the engines can serve is known only
beside them (``engine.capabilities``): an inbound whose server's engine cannot serve it (REALITY on a build
without uTLS, Shadowsocks-2022 on Mihomo, ...) would be dropped or fail on the server. ``load_servable`` is
``load_cluster`` plus those refusals, at their places in the file, and a warning at each engine binary the
controller does not run. ``validate``, ``plan``, ``apply``, ``run`` and every reload of the loop call it, so the
loop never adopts a file ``plan`` refuses: it keeps serving the last good one and logs why.
"""

from __future__ import annotations

import os

from reconciler import safe_read
from reconciler.config import load_cluster
from reconciler.config.diagnostics import Diagnostic, SourceMap, at
from reconciler.config.loader import LoadResult
from reconciler.errors import ConfigError
from reconciler.model import Cluster
from reconciler.text import plural


def engine_diagnostics(cluster: Cluster, source: SourceMap) -> list[Diagnostic]:
    """An error at all the engine cannot serve, and a warning at each engine binary in the repository (the
    controller does not run it to learn its features)."""
    from reconciler.engine.capabilities import not_run, of_engine, refusals  # at use: ~7 ms of every other command's start

    file = source.root.file if source.root else None  # the cluster file: its folder is the repository
    repository = safe_read.repository(os.path.dirname(os.path.abspath(file))) if file else None
    return ([at("warning", source.value(n.path), n.message, n.hint, code="engine-not-run")
             for n in not_run(cluster, repository, file)]
            + [at("error", source.key(r.path), r.message, r.hint, code="engine-capability")
               for r in refusals(cluster, of_engine(cluster))])


def load_servable(path: str, display: str | None = None, migrate_users: bool = False) -> LoadResult:
    """``load_cluster`` and what the engines cannot serve. ``ok`` only when both pass; ``cluster`` is kept when
    only the engines refuse it, for the commands that show a file without serving it (``demo``)."""
    result = load_cluster(path, display, migrate_users=migrate_users)
    if result.cluster is not None:
        result.diagnostics.extend(engine_diagnostics(result.cluster, result.source))
        result.diagnostics.sort(key=lambda d: (d.severity != "error", d.file != result.path, d.file, d.line, d.col))
    return result


def servable(path: str, migrate_users: bool = False) -> Cluster:
    """The cluster in ``path`` when it can be served, else ``ConfigError`` with the diagnostics ``validate`` shows
    (``migrate_users``: as ``load_cluster``'s)."""
    result = load_servable(path, migrate_users=migrate_users)
    if result.cluster is None or result.errors:
        raise ConfigError(f"{path}: invalid — {plural(len(result.errors), 'error')}", result.errors)
    return result.cluster
