"""The observation ``plan`` and ``apply`` share: every server observed over SSH (GITOPS-3, GITOPS-7), with the
options both take and the warnings both show."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from fnmatch import fnmatch
from typing import TYPE_CHECKING, TypeVar

from reconciler.cli.common import base_dir, plural, secret_of, state_of, warn
from reconciler.servable import servable
from reconciler.text import verb

if TYPE_CHECKING:  # imported when a command runs: asyncssh and friends cost ~0.3 s of every other command's start
    from reconciler.model import Cluster
    from reconciler.plan.observe import Observed
    from reconciler.ssh import SSHPool
    from reconciler.state.folder import StateFolder

T = TypeVar("T")
KEEP = "a server that left the file but stays as it is this time (repeat; for good: `retired:`)"
SERVER = "only this server (repeat; shell globs such as 'fra-*'), like Terraform's -target"
STRICT = "never connect to a server whose host key is neither pinned (ssh.host_key) nor remembered: its plan says why"


def observe_servers(path: str, keep: list[str], strict: bool, only: list[str],
             then: Callable[[Cluster, list[Observed], SSHPool, StateFolder], Awaitable[T]] | None = None
             ) -> tuple[Cluster, StateFolder, list[Observed], T | None]:
    """Observe every server and those that left the file but ``keep`` (GITOPS-7); ``then`` runs on the same SSH
    connections after (apply; due ACME certificates are ordered first). First contacts: warned or refused."""
    from reconciler.apply.session import certificates, first_contact_warnings, pool_for
    from reconciler.plan.observe import observe
    from reconciler.plan.stamp import FactsCache
    from reconciler.ssh import KnownHosts

    cluster = servable(path)
    secret = secret_of(cluster)
    state = state_of(path, cluster)
    for note in [] if strict else first_contact_warnings(cluster, state, prune=True):
        warn(note)
    known = KnownHosts(state.known_hosts) if strict else None

    async def go() -> tuple[list[Observed], T | None]:
        async with pool_for(state, strict_host_keys=strict) as pool:
            if then is not None:
                await certificates(cluster, pool, str(base_dir(path)))
            managed = {n: v for n, v in state.managed().items() if n not in keep}  # GITOPS-7: what left is removed
            # Users over quota stay out: what the loop measured, from the same state folder.
            usage = state.load_learned(cluster).ledger.view(cluster, time.time())
            kept = FactsCache(state.observed())  # a server as it was last time answers in one short shell session
            observed = await observe(cluster, secret, pool, str(base_dir(path)), True, managed, strict_host_keys=known,
                                     only=(lambda name: any(fnmatch(name, g) for g in only)) if only else None,
                                     usage=usage, facts_cache=kept)
            if kept.changed:
                state.remember_observed(kept.entries)
            return observed, (await then(cluster, observed, pool, state) if then is not None else None)

    try:
        observed, result = asyncio.run(go())
    finally:
        for note in state.notes:  # state files that could not be read: a fresh start, said, never silent
            warn(note)
    return cluster, state, observed, result


def route_warnings(cluster: Cluster) -> list[str]:
    """What clients cannot see yet (ROUTE-4, ROUTE-5): said in every plan, as validate says it."""
    unassigned = ", ".join(r.inbound.id for r in cluster.unassigned)
    empty = [r.id for r in cluster.routes if not cluster.members[r.id]]
    n = len(cluster.unassigned)
    return ([f"{plural(n, 'inbound')} {verb(n, 'is', 'are')} not in any route — clients cannot see them yet: {unassigned}"]
            if unassigned else []) + [f"route {r!r} is empty — hidden from subscriptions until an inbound joins it" for r in empty]
