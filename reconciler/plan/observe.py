"""Gather facts from servers through a ``Runner`` and build their plans (the I/O half of planning).

Called by the CLI's plan and apply and by the loop: ``observe`` → one ``Observed`` per server (its plan,
facts, desired state, target) and ``fingerprint`` of them (saved plans carry it).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reconciler.credentials import Secret
from reconciler.engine import remote
from reconciler.engine.adapters import LAYOUTS, desired
from reconciler.engine.base import SHARED_FILES, DesiredServer
from reconciler.errors import RemoteError
from reconciler.model import Cluster, Server, UserUsage
from reconciler.plan.actions import ServerPlan, plan_removal, plan_server, preflight
from reconciler.plan.facts import Facts, parse_facts
from reconciler.plan.lock import LOCK_FILE
from reconciler.plan.stamp import SETTLED, FactsCache, stamp_command
from reconciler.ssh import KnownHosts, Runner, Target
from reconciler.ssh.pool import first_contact_refusal
from reconciler.ssh.runner import SAME, Unless, answer, split_stamp

log = logging.getLogger("reconciler.plan")

DIFF_LIMIT = 1 << 20  # old contents read for a diff, per file


def facts_request(d: DesiredServer | None) -> dict[str, object]:
    """What the facts script reads: the desired engine's binary, unit and files, and the other engines' files (to
    retire them); for a server that left the file (``d`` None), every engine's."""
    retire = d.retire if d is not None else LAYOUTS
    engine = d.engine if d is not None else LAYOUTS[0]
    files = [engine.template, engine.unit] + ([f.path for f in (*d.files, *d.firewall)] if d else [])
    files += [p for x in retire for p in x.paths()]
    if d is None:  # what every engine shares: the agent and the per-user counters' table
        files += SHARED_FILES
    # The reality folder is listed only so that --prune finds pairs older versions generated there.
    dirs = sorted({f"{x.config_dir}/{sub}" for x in (engine, *retire) for sub in ("reality", "tls")})
    return {"files": sorted(set(files)), "binary": engine.binary, "version_args": list(engine.version_args),
            "service": engine.service, "wants": engine.wants, "public": [], "private": [],
            "lock": LOCK_FILE, "dirs": dirs,
            # Without harden, whether our table is loaded matters only when a server is being removed.
            "firewall": d is None or bool(d.firewall)}


async def gather(runner: Runner, target: Target, d: DesiredServer | None, cache: FactsCache | None = None) -> Facts:
    """The server's facts. With ``cache`` (and a desired state): asked ``unless`` the server's stamp is the one kept
    with its last facts (``reconciler.plan.stamp``); then those are the facts, and the server ran no Python."""
    request = facts_request(d)
    key = cache.key(target, request, d.digest()) if cache is not None and d is not None else None
    held = cache.get(target.name, key) if cache is not None and key is not None else None
    unless = Unless(stamp_command(request), held[0] if held else "") if key is not None else None
    res = await runner.script(target, remote.FACTS, request, unless=unless)
    out, stamp = res.stdout, None
    if unless is not None:
        if held is not None and out.strip() == SAME:
            out, stamp = held[1], held[0]
        else:
            stamp, out = split_stamp(out)
    try:
        facts = parse_facts(out)
    except ValueError as exc:  # the server is hostile input too: its answer is checked field by field
        raise RemoteError(f"{target.name}: the facts script answered something that is not facts: {str(exc)[:200]}",
                          target.name) from None
    if cache is not None and key is not None:
        if stamp is not None and facts.active in SETTLED:
            cache.put(target.name, key, stamp, out)
        else:
            cache.drop(target.name)
    return facts


async def current_contents(runner: Runner, target: Target, paths: list[str]) -> dict[str, bytes | None]:
    """Old contents of changed files, for diffs (small files only: at most ``DIFF_LIMIT`` bytes each)."""
    res = await runner.script(target, remote.FILES, {"op": "read", "paths": paths, "limit": DIFF_LIMIT})
    files = answer(res, target, remote.FILES, {"files": dict})["files"]
    out: dict[str, bytes | None] = {}
    for p in paths:
        value = files.get(p)
        try:
            out[p] = base64.b64decode(value, validate=True) if isinstance(value, str) else None
        except ValueError:
            out[p] = None  # shown as a new file rather than trusted
    return out


@dataclass
class Observed:
    plan: ServerPlan
    facts: Facts | None
    desired: DesiredServer | None
    target: Target


async def observe(cluster: Cluster, secret: Secret, runner: Runner, base_dir: str, prune: bool,
                  previous: dict[str, dict[str, Any]] | None = None, now: float | None = None,
                  strict_host_keys: KnownHosts | None = None, only: Callable[[str], bool] | None = None,
                  usage: Mapping[str, UserUsage] | None = None, facts_cache: FactsCache | None = None) -> list[Observed]:
    """Facts and plans for every server in parallel; one server's failure never stops the others.

    ``strict_host_keys``: the known keys; a server with none (neither pinned nor remembered) is not contacted
    and its plan's error says why (``--strict-host-keys``). ``only``: the servers (by name) to look at (``--server``).
    ``usage``: what the fleet measured of each user (over quota, devices): those users are left out.
    ``facts_cache``: each server's last facts and stamp: a server that still looks so answers in one short shell
    session (``reconciler.plan.stamp``); updated in place."""
    now = time.time() if now is None else now

    def refused(target: Target, plan: ServerPlan) -> bool:
        if strict_host_keys is not None and strict_host_keys.get(target) is None:
            plan.error = first_contact_refusal(target)
            return True
        return False

    async def one(server: Server) -> Observed:
        target = Target.from_server(server)
        plan = ServerPlan(server.name, server.host)
        try:
            d = desired(cluster, server, secret, now, base_dir, usage)
        except OSError as exc:
            plan.error = f"cannot read a file the cluster names: {exc}"
            return Observed(plan, None, None, target)
        plan.desired_digest = d.digest()
        if refused(target, plan):
            return Observed(plan, None, d, target)
        facts = await _facts_or_error(runner, target, d, plan, facts_cache)
        if facts is None:
            return Observed(plan, None, d, target)
        plan.problems = preflight(facts, d)
        if not plan.problems:
            # Opaque files (keys, certificates) are never read back: their diff is their fingerprints.
            changed = [f.path for f in d.files if not f.opaque and facts.files.get(f.path) not in (None, f.sha256)]
            old = await current_contents(runner, target, changed) if changed else {}
            plan.actions = plan_server(d, facts, old, prune)
        return Observed(plan, facts, d, target)

    async def gone(name: str, target: Target) -> Observed:
        plan = ServerPlan(name, target.host, removed=True)
        if refused(target, plan):
            return Observed(plan, None, None, target)
        facts = await _facts_or_error(runner, target, None, plan)
        if facts is None:
            return Observed(plan, None, None, target)
        plan.actions = plan_removal(facts, LAYOUTS)
        return Observed(plan, facts, None, target)

    async def isolated(name: str, host: str, target: Target, removed: bool, work: Awaitable[Observed]) -> Observed:
        """Whatever goes wrong observing one server is that server's plan error, never the others'."""
        try:
            return await work
        except Exception as exc:  # logged with its traceback; the plan says it
            log.exception("observing %s: unexpected error", name)
            plan = ServerPlan(name, host, removed=removed)
            plan.error = (f"unexpected error: {type(exc).__name__}: {str(exc)[:300]} — a bug in reconciler "
                          "(rerun with RECONCILER_DEBUG=1 and report it); the other servers were observed")
            return Observed(plan, None, None, target)

    wanted = only or (lambda name: True)
    if facts_cache is not None:
        facts_cache.keep_only({s.name for s in cluster.servers})
    tasks = [isolated(s.name, s.host, Target.from_server(s), False, one(s)) for s in cluster.servers if wanted(s.name)]
    if prune and previous:
        tasks += [isolated(n, target.host, target, True, gone(n, target)) for n, target in _departed(cluster, previous, wanted)]
    return list(await asyncio.gather(*tasks))


def _departed(cluster: Cluster, previous: dict[str, dict[str, Any]], wanted: Callable[[str], bool]) -> list[tuple[str, Target]]:
    """The servers the state folder knows that left the cluster file (retired ones excepted), with their targets: what
    prune removes. A record that names no usable target is skipped, with a warning."""
    names = {s.name for s in cluster.servers} | set(cluster.retired)  # retired: kept on purpose (GITOPS-7)
    out: list[tuple[str, Target]] = []
    for n, info in previous.items():
        if n not in names and wanted(n):
            target = Target.from_record(info)
            if target is None:
                log.warning("the state folder's record of %s is not usable; it cannot be pruned", n)
                continue
            out.append((n, target))
    return out


async def _facts_or_error(runner: Runner, target: Target, d: DesiredServer | None, plan: ServerPlan,
                          cache: FactsCache | None = None) -> Facts | None:
    """The server's facts (their digest noted on the plan), or None with the plan's error set."""
    try:
        facts = await gather(runner, target, d, cache)
    except RemoteError as exc:
        plan.error = d.redactor()(str(exc)) if d is not None else str(exc)
        return None
    plan.facts_digest = facts.digest()
    return facts


def fingerprint(observed: list[Observed]) -> str:
    h = hashlib.sha256()
    for o in sorted(observed, key=lambda o: o.plan.server):
        h.update(f"{o.plan.server}\0{o.plan.desired_digest}\0{o.plan.facts_digest}\n".encode())
    return h.hexdigest()
