"""Apply plans to servers (GITOPS-4, GITOPS-7): in parallel, each server in sequence through its phases.

Apply carries out exactly the actions of each server's plan (``reconciler.plan.actions``), never
diffing desired state against facts a second time: write-file actions name the files to upload,
generate-key actions the keys, the restart/reload/start action the service action; remove-file,
harden, install-engine and (for a server that left the file) stop do what they say.

Phases per server: connect → preflight → lock → install engine → configure → start → verify.
- The lock (``reconciler.plan.lock``) names who applies since when; a second apply is refused with that
  holder. The commit releases it itself when it is the last step, even if our SSH session dies.
- Changed files travel in the commit's request; the commit script (run under ``setsid -w`` on the server)
  checks the rendered configuration with the engine's own check, swaps everything in with atomic renames,
  reloads or restarts, verifies the listeners, and rolls back to the previous files on any failure.
- One server's failure never stops the others; every server gets a result.
- While a server's apply runs, its lock's lease is renewed (``lock.Renewal``), so a slow apply is never
  taken over as stale; renewal stops before a commit that releases the lock, and when the apply ends.
- A result's message and details pass through the server's ``Redactor``: an engine that
  echoes a credential or a key in its error shows its fingerprint, never the value.

Every remote step is a named script run through a ``Runner`` (``reconciler.ssh.runner``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reconciler.apply.engine import ENGINE_UPLOAD_SECONDS, in_commit, stage_engine
from reconciler.credentials import Redactor
from reconciler.engine import remote
from reconciler.engine.base import USAGE_NFT, USAGE_TABLE
from reconciler.errors import CommitFailed, LockHeld, RemoteCommandError, RemoteError
from reconciler.plan import lock
from reconciler.plan.actions import Action
from reconciler.plan.observe import Observed
from reconciler.ssh import Result, Runner
from reconciler.ssh.runner import answer
from reconciler.text import plural

log = logging.getLogger("reconciler.apply")

# The actions the commit carries out; a plan with none of them (only harden or remove-file) needs no commit.
COMMIT_KINDS = frozenset({"install-engine", "write-file", "restart", "reload", "start"})
SERVICE_KINDS = ("restart", "reload", "start")
DEFER_LOCK = True  # a plan that installs the engine takes the lock in the engine step's session (lock.Deferred)


@dataclass
class ServerResult:
    server: str
    ok: bool
    changed: bool = False
    phase: str = "connect"
    message: str = ""
    rolled_back: bool = False
    seconds: float = 0.0
    details: dict[str, object] = field(default_factory=dict)


async def apply_all(observed: list[Observed], runner: Runner, progress: Callable[[str, str], None],
                    verify_timeout: float = 20.0, fence: lock.Fence | None = None) -> list[ServerResult]:
    """Every server's plan carried out, in parallel; ``progress(server, phase)`` hears each phase
    (``reconciler.apply.session.Progress`` shows them). One result per server, in order. ``fence``: a leading
    controller's (``reconciler.plan.lock``)."""
    return list(await asyncio.gather(*(apply_one(o, runner, progress, verify_timeout, fence=fence) for o in observed)))


async def apply_one(o: Observed, runner: Runner, progress: Callable[[str, str], None], verify_timeout: float,
                    keep_backups: bool = False, fence: lock.Fence | None = None) -> ServerResult:
    """One server's plan; ``keep_backups``: its replaced files are kept until its wave is judged (``apply.waves``)."""
    result = await _apply_one(o, runner, progress, verify_timeout, keep_backups, fence)
    redactor = o.desired.redactor() if o.desired is not None else Redactor()
    result.message = redactor(result.message, structural=True)
    result.details = _scrubbed(result.details, redactor)
    return result


def _scrubbed(value: Any, redactor: Redactor) -> Any:
    if isinstance(value, str):
        return redactor(value, structural=True)
    if isinstance(value, dict):
        return {k: _scrubbed(v, redactor) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrubbed(v, redactor) for v in value]
    return value


async def _apply_one(o: Observed, runner: Runner, progress: Callable[[str, str], None], verify_timeout: float,
                     keep_backups: bool, fence: lock.Fence | None = None) -> ServerResult:
    start = time.monotonic()
    result = ServerResult(o.plan.server, ok=False)

    def phase(name: str) -> None:
        result.phase = name
        progress(o.plan.server, name)

    held: _Held | None = None

    try:
        phase("connect")
        if o.plan.error:
            result.message = o.plan.error
            return result
        phase("preflight")
        if o.plan.problems:
            result.message = "refused by preflight: " + "; ".join(o.plan.problems)
            return result
        if not o.plan.actions:
            result.ok = True
            result.message = "up to date"
            phase("done")
            return result
        phase("lock")
        held = _Held(fence=fence)
        base = runner  # the lock's own renewals and release go straight to the server
        if o.plan.removed:
            await lock.acquire(runner, o.target, o.plan.server, fence=fence)
        elif DEFER_LOCK and _of(o, "install-engine"):  # the lock is taken by the engine step's session (lock.Deferred)
            assert o.desired is not None
            runner = held.deferred = lock.Deferred(runner, o.target, o.plan.server, _folders(o),
                                                   [o.desired.engine.tls_dir], fence)
        else:
            assert o.desired is not None
            await lock.acquire(runner, o.target, o.plan.server, _folders(o), [o.desired.engine.tls_dir], fence=fence)
        try:
            async with lock.Renewal(base, o.target, deferred=held.deferred) as held.renewal:
                if o.plan.removed:
                    await _remove_server(runner, o)
                else:
                    await _transaction(runner, o, phase, result, verify_timeout, held, keep_backups)
        finally:
            if held.ours:
                try:
                    await lock.release(base, o.target)
                except RemoteError:
                    pass  # the lease ends it
        result.ok = result.changed = True
        result.message = result.message or f"{plural(len(o.plan.actions), 'change')} applied"
        phase("done")
    except (LockHeld, CommitFailed, RemoteCommandError) as exc:
        result.ok = False
        result.message = str(exc)
        if isinstance(exc, LockHeld) and held is not None and not held.taken:  # refused by the session taking it
            result.phase = "lock"
    except RemoteError as exc:
        result.ok = False
        result.message = f"{exc} (the server finishes or rolls back a started commit on its own; run apply again)"
    except Exception as exc:  # whatever it is, it is this server's failed result, not the others'
        log.exception("apply %s: unexpected error", o.plan.server)
        result.ok = False
        result.message = (f"unexpected error: {type(exc).__name__}: {exc} — a bug in reconciler (rerun with "
                          "RECONCILER_DEBUG=1 and report it); the other servers were not affected")
    finally:
        result.seconds = time.monotonic() - start
    return result


def _folders(o: Observed) -> list[str]:
    """The folders the managed files live in (created before the lock: harmless under another's)."""
    assert o.desired is not None
    return sorted({o.desired.engine.tls_dir, *(posixpath.dirname(f.path) for f in o.desired.files)})


def _of(o: Observed, kind: str) -> list[Action]:
    return [a for a in o.plan.actions if a.kind == kind]


@dataclass
class _Held:
    """Whether releasing the server's lock is still up to us: not before a deferred lock is taken (a lock held by
    another apply is never ours to release), not once a commit that releases it has started (even if our session
    drops, the detached commit finishes and releases; another apply may hold it next)."""

    renewal: lock.Renewal | None = None
    fence: lock.Fence | None = None  # a leading controller's: still leading before the commit?
    deferred: lock.Deferred | None = None  # the lock is taken by the apply's first script
    handed: bool = False  # to a commit that releases it

    @property
    def taken(self) -> bool:
        return self.deferred is None or self.deferred.is_taken.is_set()

    @property
    def ours(self) -> bool:
        return self.taken and not self.handed

    async def hand_over(self) -> None:
        """The commit about to start releases the lock: stop renewing it first."""
        self.handed = True
        if self.renewal is not None:
            await self.renewal.stop()


async def _transaction(runner: Runner, o: Observed, phase: Callable[[str], None], result: ServerResult,
                       verify_timeout: float, held: _Held, keep_backups: bool = False) -> None:
    """The plan's actions under the lock: the commit (engine, files, service; stopping a retired engine), then
    removals and the firewall. The commit releases the lock itself when nothing follows it."""
    after = [a for a in o.plan.actions if a.kind in ("remove-file", "harden")]
    if any(a.kind in COMMIT_KINDS for a in o.plan.actions):
        await _commit(runner, o, phase, result, verify_timeout, held, release=not after, keep_backups=keep_backups)
    if not any(a.kind in COMMIT_KINDS for a in o.plan.actions):
        for a in _of(o, "stop"):  # a retired engine, when nothing else changes
            await runner.script(o.target, remote.FILES, {"op": "remove", "stop": a.target, "paths": []})
    removals = _removal_paths(o)
    if removals:
        await runner.script(o.target, remote.FILES, {"op": "remove", "paths": removals, "daemon_reload": bool(_of(o, "stop"))})
    if _of(o, "harden"):
        phase("harden")
        await _harden(runner, o, verify_timeout)  # as long to prove a new connection gets in


async def _commit(runner: Runner, o: Observed, phase: Callable[[str], None], result: ServerResult, verify_timeout: float,
                  held: _Held, release: bool, keep_backups: bool = False) -> None:
    """Stage what the plan changes, then one commit round trip: render, check, swap, restart, verify. A release whose
    version is known is downloaded by the commit itself (``engine.in_commit``): with the lock, one session in all."""
    d = o.desired
    assert d is not None and o.facts is not None
    engine = d.engine
    staged: list[list[str]] = []
    sidecar: list[dict[str, Any]] = []
    stage: dict[str, Any] | None = None
    if _of(o, "install-engine"):
        phase("install engine")
        quick = in_commit(o)
        if quick is not None:
            stage, staged = quick
        else:
            staged, sidecar = await stage_engine(runner, o)
    phase("configure")
    by_path = {f.path: f for f in d.files}
    written: list[dict[str, Any]] = []
    moves: list[list[str]] = []
    for a in _of(o, "write-file"):
        f = by_path[a.target]
        tmp = f"{f.path}.reconciler-new"
        written.append({"path": tmp, "data": base64.b64encode(f.content).decode(), "mode": f.mode})
        moves.append([tmp, f.path])
    action = next((a.kind for a in o.plan.actions if a.kind in SERVICE_KINDS), "none")
    retire = [a.target for a in _of(o, "stop")]
    if retire and action == "none":
        action = "restart"  # the retired engine held the ports: the new one starts once it is stopped
    phase("start")
    req = {
        "files": sidecar + written, "moves": staged + moves, "binary_new": staged[0][0] if staged else None,
        "engine": engine.name, "template": engine.template, "template_new": f"{engine.template}.reconciler-new",
        "config": engine.config, "config_new": f"{engine.config}.reconciler-new", "binary": engine.binary,
        "service": engine.service, "check": list(engine.check), "dir": engine.config_dir, "retire": retire,
        "action": action, "listeners": [list(x) for x in d.listeners], "verify_timeout": verify_timeout,
        "lock": lock.LOCK_DIR if release else None, "keep_backups": keep_backups, "stage": stage,
        # A server changing engines is serving with the old one: the new configuration is checked before anything moves.
        "running": o.facts.active == "active" or bool(retire),
        # systemd knew no such unit when observed: enabled and started at once (if that fails, the long way)
        "fresh": o.facts.enabled == "not-found" and not retire,
    }
    commit = await _send_commit(runner, o, req, held, release, verify_timeout)
    if stage is not None and not commit["ok"] and commit.get("stage") == "engine":
        # The server could not stage the release in its commit: nothing changed. A commit given the lock released
        # it (as it would have, had this controller been gone): where the controller steps in, it takes it again.
        tried = commit.get("engine")
        tried = tried if isinstance(tried, dict) and tried.get("ok") is False else {"ok": False, "error": commit.get("error")}
        if tried.get("kind") not in ("fetch", "codec"):
            raise RemoteCommandError(o.plan.server, "install engine", None, str(tried.get("error"))[:600])
        if release:
            await lock.acquire(runner, o.target, o.plan.server, _folders(o), [d.engine.tls_dir], fence=held.fence)
            held.handed = False  # ours again until the next commit releases it
        phase("install engine")
        staged, sidecar = await stage_engine(runner, o, tried=tried)  # the controller fetches it and uploads it
        phase("start")
        req.update(files=sidecar + written, moves=staged + moves, binary_new=staged[0][0], stage=None)
        commit = await _send_commit(runner, o, req, held, release, verify_timeout)
    phase("verify")
    result.details["commit"] = commit
    if not commit["ok"]:
        result.rolled_back = bool(commit.get("rolled_back"))
        where = "rolled back to the previous configuration" if result.rolled_back else "nothing was changed"
        raise CommitFailed(f"{str(commit.get('stage'))[:60]} failed: {str(commit.get('error'))[:600]} — {where}", o.plan.server)


async def _send_commit(runner: Runner, o: Observed, req: dict[str, Any], held: _Held, release: bool,
                       verify_timeout: float) -> dict[str, Any]:
    """The commit's round trip (with the lock's, when the lock is taken by it): its answer."""
    lock.check(held.fence, o.plan.server, "the commit")
    if release:
        await held.hand_over()
    timeout = verify_timeout * 3 + 60 + (ENGINE_UPLOAD_SECONDS if req.get("stage") else 0)
    res = await runner.script(o.target, remote.COMMIT, req, timeout=timeout)
    return answer(res, o.target, remote.COMMIT, {"ok": bool})


FIREWALL_PATHS = {"confirm": "/run/reconciler-firewall.ok", "loaded": "/run/reconciler-firewall.loaded",
                  "out": "/run/reconciler-firewall.out"}


async def _harden(runner: Runner, o: Observed, timeout: float) -> None:
    """Load the firewall; keep it only if a brand-new SSH connection still gets in (never lock us out)."""
    d, t = o.desired, o.target
    assert d is not None
    rules, unit = d.firewall
    base = {**FIREWALL_PATHS, "new": rules.path + ".reconciler-new", "path": rules.path, "timeout": timeout}
    files = [{"path": unit.path, "data": base64.b64encode(unit.content).decode(), "mode": unit.mode},
             {"path": rules.path + ".reconciler-new", "data": base64.b64encode(rules.content).decode(), "mode": rules.mode}]
    await runner.script(t, remote.FIREWALL, {**base, "op": "prepare", "files": files})
    await runner.script(t, remote.FIREWALL, {**base, "op": "apply"}, detach=True)
    loaded_by = time.monotonic() + 15
    while time.monotonic() < loaded_by:  # the established session keeps working under any rules
        status = answer(await runner.script(t, remote.FIREWALL, {**base, "op": "status"}), t, remote.FIREWALL,
                        {"loaded": bool, "out": str})
        if status["loaded"] or status["out"]:
            break
        await asyncio.sleep(0.2)
    try:  # a new TCP connection: established ones would pass any ruleset
        await runner.script(t, remote.FIREWALL, {**base, "op": "confirm"}, fresh=True, timeout=15)
    except RemoteError:
        pass  # no confirmation: the server restores the previous rules by itself, and says so below
    deadline = time.monotonic() + timeout + 15
    while time.monotonic() < deadline:
        status = answer(await runner.script(t, remote.FIREWALL, {**base, "op": "status"}), t, remote.FIREWALL,
                        {"loaded": bool, "out": str})
        if status["out"].strip():
            out = answer(Result(0, status["out"], ""), t, remote.FIREWALL, {})
            if not out.get("ok"):
                raise CommitFailed(f"firewall: {out.get('error')} — the service itself was applied", o.plan.server)
            return
        await asyncio.sleep(0.5)
    raise CommitFailed("firewall: no answer from the server within the timeout", o.plan.server)
























def _removal_paths(o: Observed) -> list[str]:
    """The files the plan's remove-file actions name, and what the commit made beside them (a binary's sidecars)."""
    return [p for a in _of(o, "remove-file") for p in (a.target, f"{a.target}.sha256", f"{a.target}.version")]


async def _remove_server(runner: Runner, o: Observed) -> None:
    """A server that left the file: stop and disable the engine, remove what the plan names (and the
    files the commit made beside them: the rendered configuration, the binary's sidecars)."""
    paths = _removal_paths(o)
    for a in _of(o, "stop"):
        await runner.script(o.target, remote.FILES, {"op": "remove", "stop": a.target, "paths": [], "daemon_reload": False})
    await runner.script(o.target, remote.FILES, {"op": "remove", "stop": None, "paths": paths, "daemon_reload": True,
                                                 "nft_tables": [USAGE_TABLE] if USAGE_NFT in paths else []})
