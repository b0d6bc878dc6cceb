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
import os
import posixpath
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reconciler.credentials import Redactor
from reconciler.engine import release, remote
from reconciler.engine.base import USAGE_NFT, USAGE_TABLE
from reconciler.engine.capabilities import local_version
from reconciler.errors import CommitFailed, LockHeld, ReleaseError, RemoteCommandError, RemoteError
from reconciler.plan import lock
from reconciler.plan.actions import SUPPORTED_ARCH, Action
from reconciler.plan.facts import parse_version
from reconciler.plan.observe import Observed
from reconciler.ssh import Result, Runner
from reconciler.ssh.runner import answer
from reconciler.text import plural

log = logging.getLogger("reconciler.apply")

# The actions the commit carries out; a plan with none of them (only harden or remove-file) needs no commit.
COMMIT_KINDS = frozenset({"install-engine", "write-file", "restart", "reload", "start"})
SERVICE_KINDS = ("restart", "reload", "start")
ENGINE_UPLOAD_SECONDS = lock.LONGEST_STEP_SECONDS
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
    """Stage what the plan changes, then one commit round trip: render, check, swap, restart, verify."""
    d = o.desired
    assert d is not None and o.facts is not None
    engine = d.engine
    moves: list[list[str]] = []
    binary_new = None
    files: list[dict[str, Any]] = []
    if _of(o, "install-engine"):
        phase("install engine")
        staged_moves, files = await _stage_engine(runner, o)
        moves += staged_moves
        binary_new = moves[0][0]
    phase("configure")
    by_path = {f.path: f for f in d.files}
    for a in _of(o, "write-file"):
        f = by_path[a.target]
        tmp = f"{f.path}.reconciler-new"
        files.append({"path": tmp, "data": base64.b64encode(f.content).decode(), "mode": f.mode})
        moves.append([tmp, f.path])
    action = next((a.kind for a in o.plan.actions if a.kind in SERVICE_KINDS), "none")
    retire = [a.target for a in _of(o, "stop")]
    if retire and action == "none":
        action = "restart"  # the retired engine held the ports: the new one starts once it is stopped
    phase("start")
    req = {
        "files": files, "moves": moves, "binary_new": binary_new, "engine": engine.name,
        "template": engine.template, "template_new": f"{engine.template}.reconciler-new", "config": engine.config,
        "config_new": f"{engine.config}.reconciler-new", "binary": engine.binary, "service": engine.service,
        "check": list(engine.check), "dir": engine.config_dir, "retire": retire,
        "action": action, "listeners": [list(x) for x in d.listeners], "verify_timeout": verify_timeout,
        "lock": lock.LOCK_DIR if release else None, "keep_backups": keep_backups,
        # A server changing engines is serving with the old one: the new configuration is checked before anything moves.
        "running": o.facts.active == "active" or bool(retire),
    }
    lock.check(held.fence, o.plan.server, "the commit")
    if release:
        await held.hand_over()
    res = await runner.script(o.target, remote.COMMIT, req, timeout=verify_timeout * 3 + 60)
    phase("verify")
    commit = answer(res, o.target, remote.COMMIT, {"ok": bool})
    result.details["commit"] = commit
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


# Servers downloading the same release in one apply (one event loop): the first asks its binary's version, the
# others leave it (``version_later``) and take that answer when their binary has the same sha256 — the same
# bytes report the same version, as with the controller's own run of an uploaded engine. On 20 busy lab hosts,
# starting the 44 MB binary cost ~100 ms of CPU on each of them.
_ASKED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Future[tuple[str, str] | None]]] = (
    weakref.WeakKeyDictionary())


def _version_asker(pin: str) -> tuple[asyncio.Future[tuple[str, str] | None], bool]:
    """(the future answer for this release's binary, whether this server asks it)."""
    loop = asyncio.get_running_loop()
    asked = _ASKED.setdefault(loop, {})
    fut = asked.get(pin)
    if fut is None or (fut.done() and fut.result() is None):  # none yet, or the asker failed: this one asks
        fut = asked[pin] = loop.create_future()
        return fut, True
    return fut, False


async def _stage_engine(runner: Runner, o: Observed) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The engine binary, checked (sha256, version) and staged under a temporary name with its sidecars; the
    commit moves them into place. Returns those moves, the binary first, and the sidecar the commit writes
    (the version another server's identical binary reported).

    ``install: download``: the server fetches the release itself (a VPS's link is faster than the operator's
    uplink) and refuses a file whose sha256 differs from the pin for its architecture, installing nothing.
    When the server cannot fetch it (no route out, a missing file) or unpack it (a zstd release, no libzstd
    there), the controller fetches it once, checks the same pin, and uploads the binary: the fallback.
    ``install: upload``: the controller's binary, compressed (zstd where the server has libzstd, else gzip)."""
    d = o.desired
    assert d is not None and o.facts is not None
    engine, b = d.engine, d.binary
    tmp = f"{engine.binary}.reconciler-new"
    req: dict[str, Any] = {"tmp": tmp, "version_args": list(engine.version_args), "name": engine.process}
    sidecar: list[dict[str, Any]] = []
    local = b.local_path
    if b.url and not local:
        arch = SUPPORTED_ARCH.get(o.facts.arch, o.facts.arch)
        pin = b.pin_for(arch)
        if not pin:
            raise RemoteCommandError(o.plan.server, "install engine", None,
                                     f"no sha256 pinned for {arch} releases of {engine.name} {b.version}: run "
                                     "`reconciler engine pin` (it downloads once, checks the build and writes the pins)")
        url = release.release_url(b.url, arch)
        asked, asking = _version_asker(pin)
        answered: dict[str, Any] = {}
        try:
            res = await runner.script(o.target, remote.ENGINE, {**req, "mode": "download", "url": url, "sha256": pin,
                                                                "version_later": not asking, "library": o.facts.zstd},
                                      timeout=ENGINE_UPLOAD_SECONDS)
            answered = answer(res, o.target, remote.ENGINE, {"ok": bool})
        finally:
            if asking and not asked.done():  # always answered, so that no other server waits for it
                said = answered.get("version") if answered.get("ok") else None
                asked.set_result((str(answered.get("sha256", "")).strip(), said) if isinstance(said, str) else None)
        staged = answered
        if staged["ok"] and staged.get("version") is None:  # left to the asker: same sha256, same version
            known = await asyncio.shield(asked)
            if known is not None and known[0] == str(staged.get("sha256", "")).strip():
                staged["version"] = known[1]
                sidecar = [{"path": f"{tmp}.version", "data": base64.b64encode(known[1].encode()).decode(), "mode": 0o644}]
            else:  # the asker failed, or its binary differs: this server runs its own
                res = await runner.script(o.target, remote.ENGINE, {**req, "mode": "version"})
                staged = answer(res, o.target, remote.ENGINE, {"ok": bool})
        if not staged["ok"] and staged.get("kind") in ("fetch", "codec"):  # codec: a zstd release, no libzstd there
            could_not = "fetch" if staged["kind"] == "fetch" else "unpack"
            log.warning("%s cannot %s %s itself (%s): the controller fetches it and uploads it", o.plan.server,
                        could_not, url, str(staged.get("error"))[:200])
            try:
                local = await asyncio.to_thread(release.fetch_binary, url, pin, engine.process)
            except ReleaseError as exc:
                raise RemoteCommandError(o.plan.server, "install engine", None,
                                         f"the server could not {could_not} {url} ({str(staged.get('error'))[:200]}), "
                                         f"nor could the controller: {exc}") from None
        elif not staged["ok"]:
            raise RemoteCommandError(o.plan.server, "install engine", None, str(staged.get("error"))[:600])
    if local:
        # Shipped compressed (a Go binary shrinks to a third) and unpacked as it streams in: zstd where the
        # server has libzstd (it inflates in ~40% of zlib's time), else gzip. The codec's checksum and SSH's MAC
        # vouch for the bytes; the sha256 was taken here, once, from the source.
        # The same bytes report the same version: no 44 MB binary to start on every server.
        version = await asyncio.to_thread(_local_version, local, engine.version_args)
        for codec in ("zstd", "gzip") if o.facts.zstd else ("gzip",):
            data, digest = await asyncio.to_thread(packed_engine, local, codec)  # tens of MB: never on the event loop
            res = await runner.script(o.target, remote.ENGINE, {**req, "mode": "upload", "sha256": digest,
                                                                "version": version, "codec": codec,
                                                                "library": o.facts.zstd},
                                      input=data, timeout=ENGINE_UPLOAD_SECONDS)
            staged = answer(res, o.target, remote.ENGINE, {"ok": bool})
            if staged["ok"] or staged.get("kind") != "codec":
                break
            log.warning("%s: %s; the engine is sent as gzip", o.plan.server, str(staged.get("error"))[:200])
        if not staged["ok"]:
            raise RemoteCommandError(o.plan.server, "install engine", None, str(staged.get("error"))[:600])
    elif not b.url:
        raise RemoteCommandError(o.plan.server, "install engine", None,
                                 "no engine binary: set settings.engine.binary, or install: download with a url")
    digest, version = str(staged.get("sha256", "")).strip(), str(staged.get("version", ""))
    problem = None
    if b.local_path and b.sha256 and digest != b.sha256:
        problem = f"the binary's sha256 {digest} differs from the pinned {b.sha256}"
    elif parse_version(version) != b.version:
        problem = f"the binary reports {version.splitlines()[:1]}, not version {b.version}"
    if problem:
        await runner.script(o.target, remote.FILES, {"op": "remove", "paths": [tmp, f"{tmp}.sha256", f"{tmp}.version"]})
        raise RemoteCommandError(o.plan.server, "install engine", None, problem)
    bin_ = engine.binary
    return [[tmp, bin_], [f"{tmp}.sha256", f"{bin_}.sha256"], [f"{tmp}.version", f"{bin_}.version"]], sidecar


_PACKED: dict[str, tuple[bytes, str]] = {}
_PACKING = threading.Lock()  # servers stage in threads: one packs, the others wait for its bytes
def _local_version(path: str, args: tuple[str, ...]) -> str | None:
    """``<binary> version`` (or ``-v``) as run here, once per file version (``engine.capabilities.local_version``);
    None when it does not run here (another architecture or OS), may not (one in the repository: ``executable_allowed``)
    or is no engine's: then each server runs it."""
    out = local_version(path, args)
    return out if out is not None and parse_version(out) else None


PACK_LEVELS = {"gzip": 6, "zstd": 9}  # gzip 6 inflates ~35% faster than 1; zstd 9: 14.3 of 44.6 MB in ~1 s (19: 12.7 in 28 s)


def packed_engine(path: str, codec: str = "gzip") -> tuple[bytes, str]:
    """(compressed bytes, sha256 of the original) of a local file: compressed once per file version and codec
    (cached on disk across runs, the three newest kept) and held once in memory for every server of this run."""
    with _PACKING:
        return _pack(path, codec)


def _pack(path: str, codec: str) -> tuple[bytes, str]:
    import glob
    import gzip
    import hashlib
    import shutil

    import zstandard

    level = PACK_LEVELS[codec]
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{codec}{level}".encode()).hexdigest()[:16]
    if key in _PACKED:
        return _PACKED[key]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "reconciler")
    os.makedirs(cache, exist_ok=True)
    suffix = "gz" if codec == "gzip" else "zst"
    out = os.path.join(cache, f"engine-{key}.{suffix}")
    sha = hashlib.sha256()
    with open(path, "rb") as src:
        for block in iter(lambda: src.read(1 << 20), b""):
            sha.update(block)
    if not os.path.exists(out):
        tmp = out + f".{os.getpid()}.tmp"
        with open(path, "rb") as src, open(tmp, "wb") as raw:
            if codec == "gzip":
                with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=level) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            else:  # the size in the frame header, and a checksum of the content
                zstandard.ZstdCompressor(level=level, write_checksum=True).copy_stream(src, raw, size=st.st_size)
        os.replace(tmp, out)
        for old in sorted(glob.glob(os.path.join(cache, f"engine-*.{suffix}")), key=os.path.getmtime)[:-3]:
            os.remove(old)
    with open(out, "rb") as fh:
        _PACKED[key] = (fh.read(), sha.hexdigest())
    return _PACKED[key]


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
