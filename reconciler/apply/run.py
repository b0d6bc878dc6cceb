"""Apply plans to servers (GITOPS-4, GITOPS-7): in parallel, each server in sequence through its phases.

Apply carries out exactly the actions of each server's plan (``reconciler.plan.actions``), never
diffing desired state against facts a second time: write-file actions name the files to upload,
generate-key actions the keys, the restart/reload/start action the service action; remove-file,
harden, install-engine and (for a server that left the file) stop do what they say.

Phases per server: connect → preflight → lock → install engine → configure → start → verify.
- The lock (``reconciler.plan.lock``) names who applies since when; a second apply is refused with that
  holder. The commit releases it itself when it is the last step, even if our SSH session dies.
- Changed files travel in the commit's request; the commit script (run under ``setsid -w`` on the server)
  checks the rendered configuration with ``sing-box check``, swaps everything in with atomic renames,
  reloads or restarts, verifies the listeners, and rolls back to the previous files on any failure.
- One server's failure never stops the others; every server gets a result.
- While a server's apply runs, its lock's lease is renewed (``lock.Renewal``), so a slow apply is never
  taken over as stale; renewal stops before a commit that releases the lock, and when the apply ends.
- A result's message and details pass through the server's ``Redactor`` (issue 13): an engine that
  echoes a credential or a key in its error shows its fingerprint, never the value.

Every remote step is a named script run through a ``Runner`` (``reconciler.ssh.runner``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from reconciler.credentials import Redactor
from reconciler.engine import remote
from reconciler.engine.capabilities import version_output
from reconciler.engine.singbox import BINARY, CONFIG, CONFIG_DIR, SERVICE, TEMPLATE
from reconciler.errors import CommitFailed, LockHeld, RemoteCommandError, RemoteError
from reconciler.plan import lock
from reconciler.plan.actions import Action
from reconciler.plan.observe import Observed
from reconciler.ssh import Result, Runner
from reconciler.ssh.runner import answer

log = logging.getLogger("reconciler.apply")

# The actions the commit carries out; a plan with none of them (only harden or remove-file) needs no commit.
COMMIT_KINDS = frozenset({"install-engine", "write-file", "generate-key", "restart", "reload", "start"})
SERVICE_KINDS = ("restart", "reload", "start")
ENGINE_UPLOAD_SECONDS = lock.LONGEST_STEP_SECONDS


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
                    verify_timeout: float = 20.0) -> list[ServerResult]:
    """Every server's plan carried out, in parallel; ``progress(server, phase)`` hears each phase
    (``reconciler.apply.session.Progress`` shows them). One result per server, in order."""
    return list(await asyncio.gather(*(apply_one(o, runner, progress, verify_timeout) for o in observed)))


async def apply_one(o: Observed, runner: Runner, progress: Callable[[str, str], None], verify_timeout: float) -> ServerResult:
    result = await _apply_one(o, runner, progress, verify_timeout)
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


async def _apply_one(o: Observed, runner: Runner, progress: Callable[[str, str], None], verify_timeout: float) -> ServerResult:
    start = time.monotonic()
    result = ServerResult(o.plan.server, ok=False)

    def phase(name: str) -> None:
        result.phase = name
        progress(o.plan.server, name)

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
        if o.plan.removed:
            await lock.acquire(runner, o.target, o.plan.server)
        else:
            await lock.acquire(runner, o.target, o.plan.server, _folders(o), [f"{CONFIG_DIR}/tls"])
        held = _Held()
        try:
            async with lock.Renewal(runner, o.target) as held.renewal:
                if o.plan.removed:
                    await _remove_server(runner, o)
                else:
                    await _transaction(runner, o, phase, result, verify_timeout, held)
        finally:
            if held.ours:
                try:
                    await lock.release(runner, o.target)
                except RemoteError:
                    pass  # the lease ends it
        result.ok = result.changed = True
        result.message = result.message or f"{len(o.plan.actions)} change(s) applied"
        phase("done")
    except (LockHeld, CommitFailed, RemoteCommandError) as exc:
        result.ok = False
        result.message = str(exc)
    except RemoteError as exc:
        result.ok = False
        result.message = f"{exc} (the server finishes or rolls back a started commit on its own; run apply again)"
    except Exception as exc:  # noqa: BLE001 — whatever it is, it is this server's failed result, not the others'
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
    return sorted({f"{CONFIG_DIR}/tls", *(posixpath.dirname(f.path) for f in o.desired.files)})


def _of(o: Observed, kind: str) -> list[Action]:
    return [a for a in o.plan.actions if a.kind == kind]


@dataclass
class _Held:
    """Whether releasing the server's lock is still up to us: not once a commit that releases it has started
    (even if our session drops, the detached commit finishes and releases; another apply may hold it next)."""

    ours: bool = True
    renewal: lock.Renewal | None = None

    async def hand_over(self) -> None:
        """The commit about to start releases the lock: stop renewing it first."""
        self.ours = False
        if self.renewal is not None:
            await self.renewal.stop()


async def _transaction(runner: Runner, o: Observed, phase: Callable[[str], None], result: ServerResult,
                       verify_timeout: float, held: _Held) -> None:
    """The plan's actions under the lock: the commit (engine, files, keys, service), then removals and the
    firewall. The commit releases the lock itself when nothing follows it."""
    after = [a for a in o.plan.actions if a.kind in ("remove-file", "harden")]
    if any(a.kind in COMMIT_KINDS for a in o.plan.actions):
        await _commit(runner, o, phase, result, verify_timeout, held, release=not after)
    removals = [a.target for a in _of(o, "remove-file")]
    if removals:
        await runner.script(o.target, remote.FILES, {"op": "remove", "paths": removals})
    if _of(o, "harden"):
        phase("harden")
        await _harden(runner, o, verify_timeout)  # as long to prove a new connection gets in


async def _commit(runner: Runner, o: Observed, phase: Callable[[str], None], result: ServerResult, verify_timeout: float,
                  held: _Held, release: bool) -> None:
    """Stage what the plan changes, then one commit round trip: keys, render, check, swap, restart, verify."""
    d = o.desired
    assert d is not None and o.facts is not None
    moves: list[list[str]] = []
    binary_new = None
    if _of(o, "install-engine"):
        phase("install engine")
        moves += await _stage_engine(runner, o)
        binary_new = moves[0][0]
    phase("configure")
    by_path = {f.path: f for f in d.files}
    files = []
    for a in _of(o, "write-file"):
        f = by_path[a.target]
        tmp = f"{f.path}.reconciler-new"
        files.append({"path": tmp, "data": base64.b64encode(f.content).decode(), "mode": f.mode})
        moves.append([tmp, f.path])
    generate = {a.target for a in _of(o, "generate-key")}
    action = next((a.kind for a in o.plan.actions if a.kind in SERVICE_KINDS), "none")
    phase("start")
    req = {
        "files": files, "moves": moves, "binary_new": binary_new,
        "keys": [{"inbound": k.inbound, "kind": k.kind, "server_name": k.server_name, "paths": list(k.paths)}
                 for k in d.keys if k.inbound in generate],
        "template": TEMPLATE, "template_new": f"{TEMPLATE}.reconciler-new", "config": CONFIG,
        "config_new": f"{CONFIG}.reconciler-new", "binary": BINARY, "service": SERVICE,
        "action": action, "listeners": [list(x) for x in d.listeners], "verify_timeout": verify_timeout,
        "lock": lock.LOCK_DIR if release else None,
        "running": o.facts.active == "active",
    }
    if release:
        await held.hand_over()
    res = await runner.script(o.target, remote.COMMIT, req, timeout=verify_timeout * 3 + 60)
    phase("verify")
    commit = answer(res, o.target, remote.COMMIT, {"ok": bool})
    public = commit.get("public")
    if isinstance(public, dict) and public:  # what the keys step generated: no second observation needed to learn it
        o.facts = replace(o.facts, public={**o.facts.public, **{str(k): v for k, v in public.items() if isinstance(v, str)}})
    result.details["commit"] = {k: v for k, v in commit.items() if k != "public"}
    if not commit["ok"]:
        result.rolled_back = bool(commit.get("rolled_back"))
        where = "rolled back to the previous configuration" if result.rolled_back else "nothing was changed"
        raise CommitFailed(f"{str(commit.get('stage'))[:60]} failed: {str(commit.get('error'))[:600]} — {where}", o.plan.server)


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


async def _stage_engine(runner: Runner, o: Observed) -> list[list[str]]:
    """The engine binary, checked (sha256, version) and staged under a temporary name with its sidecars,
    in one round trip; the commit moves them into place. Returns those moves, the binary first."""
    d = o.desired
    assert d is not None
    tmp = f"{BINARY}.reconciler-new"
    req: dict[str, Any] = {"tmp": tmp}
    data: bytes | None = None
    if d.binary.url and not d.binary.local_path:
        arch = "arm64" if o.facts and o.facts.arch in ("aarch64", "arm64") else "amd64"
        req.update(mode="download", url=d.binary.url.format(version=d.binary.version, arch=arch))  # hashed there
    elif d.binary.local_path:
        # Shipped compressed (a Go binary shrinks to ~40%) and unpacked as it streams in. gzip's CRC and
        # SSH's MAC vouch for the bytes; the sha256 was taken here, once, from the source.
        data, digest = _gzipped(d.binary.local_path)
        # The same bytes report the same version: no 44 MB binary to start on every server.
        req.update(mode="upload", sha256=digest, version=_local_version(d.binary.local_path))
    else:
        raise RemoteCommandError(o.plan.server, "install engine", None,
                                 "no engine binary: set settings.engine.binary, or install: download with a url")
    res = await runner.script(o.target, remote.ENGINE, req, input=data, timeout=ENGINE_UPLOAD_SECONDS)
    staged = answer(res, o.target, remote.ENGINE, {"sha256": str, "version": str})
    digest, version = staged["sha256"].strip(), staged["version"]
    problem = None
    if d.binary.sha256 and digest != d.binary.sha256:
        problem = f"the binary's sha256 {digest} differs from the pinned {d.binary.sha256}"
    elif d.binary.version not in version:
        problem = f"the binary reports {version.splitlines()[:1]}, not version {d.binary.version}"
    if problem:
        await runner.script(o.target, remote.FILES, {"op": "remove", "paths": [tmp, f"{tmp}.sha256", f"{tmp}.version"]})
        raise RemoteCommandError(o.plan.server, "install engine", None, problem)
    return [[tmp, BINARY], [f"{tmp}.sha256", f"{BINARY}.sha256"], [f"{tmp}.version", f"{BINARY}.version"]]


_PACKED: dict[str, tuple[bytes, str]] = {}
_VERSIONS: dict[tuple[str, int, int], str | None] = {}


def _local_version(path: str) -> str | None:
    """``<binary> version`` run here (bounded, by the one runner of it: engine.capabilities), once per file
    version; None when it does not run here (another architecture or OS): then each server runs it."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _VERSIONS:
        out = version_output(path)
        _VERSIONS[key] = out if out is not None and out.startswith("sing-box version") else None
    return _VERSIONS[key]


PACK_LEVEL = 6  # inflates ~35% faster than level 1 on the servers (and is 10% smaller); packed once per version


def _gzipped(path: str) -> tuple[bytes, str]:
    """(gzip bytes, sha256 of the original) of a local file: compressed once per file version (cached on
    disk across runs, the three newest versions kept) and held once in memory for every server of this run."""
    import glob
    import gzip
    import hashlib
    import shutil

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{PACK_LEVEL}".encode()).hexdigest()[:16]
    if key in _PACKED:
        return _PACKED[key]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "reconciler")
    os.makedirs(cache, exist_ok=True)
    out = os.path.join(cache, f"engine-{key}.gz")
    sha = hashlib.sha256()
    with open(path, "rb") as src:
        for block in iter(lambda: src.read(1 << 20), b""):
            sha.update(block)
    if not os.path.exists(out):
        tmp = out + f".{os.getpid()}.tmp"
        with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=PACK_LEVEL) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, out)
        for old in sorted(glob.glob(os.path.join(cache, "engine-*.gz")), key=os.path.getmtime)[:-3]:
            os.remove(old)
    with open(out, "rb") as fh:
        _PACKED[key] = (fh.read(), sha.hexdigest())
    return _PACKED[key]


async def _remove_server(runner: Runner, o: Observed) -> None:
    """A server that left the file: stop and disable the engine, remove what the plan names (and the
    files the commit made beside them: the rendered configuration, the binary's sidecars)."""
    paths = []
    for a in _of(o, "remove-file"):
        paths += [a.target, f"{a.target}.sha256"]
    paths += [CONFIG, f"{BINARY}.version"]
    stop = SERVICE if _of(o, "stop") else None
    await runner.script(o.target, remote.FILES, {"op": "remove", "stop": stop, "paths": paths, "daemon_reload": True})
