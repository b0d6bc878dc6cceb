"""Apply plans to servers (GITOPS-4, GITOPS-7): in parallel, each server in sequence through its phases.

Phases per server: connect → preflight → lock → install engine → configure → start → verify.
- The lock is a directory on the server (``/run/reconciler.lock``) holding who applies since when; a
  second apply is refused with that holder. The commit step releases it even if our SSH session dies.
- Files are uploaded under temporary names; the commit script (run detached on the server) checks the
  rendered configuration with ``sing-box check``, swaps everything in with atomic renames, reloads or
  restarts, verifies the listeners, and rolls back to the previous files on any failure.
- One server's failure never stops the others; every server gets a result.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import posixpath
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import asyncssh

from reconciler.engine import remote
from reconciler.engine.singbox import BINARY, CONFIG, CONFIG_DIR, SERVICE, TEMPLATE
from reconciler.errors import CommitFailed, LockHeld, RemoteCommandError, RemoteError
from reconciler.plan.observe import LOCK_DIR, LOCK_FILE, Observed
from reconciler.ssh import SSHPool

LEASE_SECONDS = 600  # a lock older than this belongs to an apply that died: every step of ours is bounded far below




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


Progress = Callable[[str, str], None]  # (server, phase)


def holder() -> dict[str, object]:
    return {"by": f"{os.environ.get('USER', 'root')}@{socket.gethostname()}", "pid": os.getpid(), "since": int(time.time())}


async def apply_all(observed: list[Observed], pool: SSHPool, progress: Progress, verify_timeout: float = 20.0) -> list[ServerResult]:
    return list(await asyncio.gather(*(apply_one(o, pool, progress, verify_timeout) for o in observed)))


async def apply_one(o: Observed, pool: SSHPool, progress: Progress, verify_timeout: float) -> ServerResult:
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
        await _lock(pool, o, prepare=None if o.plan.removed else _folders(o))
        locked = True
        try:
            if o.plan.removed:
                await _remove_server(pool, o)
            else:
                await _transaction(pool, o, phase, result, verify_timeout)
                locked = False  # the commit script released it
        finally:
            if locked:
                await pool.run(o.target, f"rm -rf {LOCK_DIR}", check=False)
        result.ok = result.changed = True
        if result.ok:
            phase("done")
    except (LockHeld, CommitFailed, RemoteCommandError) as exc:
        result.ok = False
        result.message = str(exc)
    except RemoteError as exc:
        result.ok = False
        result.message = f"{exc} (the server finishes or rolls back a started commit on its own; run apply again)"
    finally:
        result.seconds = time.monotonic() - start
    return result


def _folders(o: Observed) -> str:
    """The shell command creating the folders the managed files live in (harmless under another's lock)."""
    assert o.desired is not None
    dirs = sorted({f"{CONFIG_DIR}/tls", f"{CONFIG_DIR}/reality", *(posixpath.dirname(f.path) for f in o.desired.files)})
    return f"mkdir -p {' '.join(map(shlex.quote, dirs))} && chmod 700 {CONFIG_DIR}/reality"


async def _lock(pool: SSHPool, o: Observed, take_over: bool = False, prepare: str | None = None) -> None:
    """Take the server's apply lock (one round trip, with ``prepare`` run first when given)."""
    who = shlex.quote(json.dumps(holder()))
    grab = f"mkdir {LOCK_DIR} 2>/dev/null && printf %s {who} > {LOCK_FILE}"
    if take_over:
        grab = f"rm -rf {LOCK_DIR} && {grab}"
    command = f"{{ {grab}; }} || {{ cat {LOCK_FILE} 2>/dev/null; exit 75; }}"
    if prepare:
        command = f"{prepare} && {{ {command}; }}"
    res = await pool.run(o.target, command, check=False)
    if res.code == 75 and not take_over:
        try:
            info = json.loads(res.stdout)
            since_ts = int(info.get("since", 0))
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since_ts))
            who_text = f"{info.get('by')} (pid {info.get('pid')}) since {since}"
        except (ValueError, TypeError):
            info, since_ts, who_text = {}, 0, res.stdout.strip() or "unknown"
        if _stale(info, since_ts):
            await _lock(pool, o, take_over=True)
            return
        raise LockHeld(f"another apply holds the lock on {o.plan.server}: {who_text}. If no apply is running there, "
                       f"remove {LOCK_DIR} on the server (locks also expire after {LEASE_SECONDS // 60} minutes)")
    if res.code != 0:
        raise RemoteCommandError(o.plan.server, "lock", res.code, res.stderr)


def _stale(info: dict, since: int) -> bool:
    """A lock left by an apply that died: on this controller with its process gone, or past the lease."""
    if since and time.time() - since > LEASE_SECONDS:
        return True
    mine = holder()
    if info.get("by") == mine["by"] and isinstance(info.get("pid"), int) and info["pid"] != mine["pid"]:
        return not os.path.exists(f"/proc/{info['pid']}")
    return False


async def _transaction(pool: SSHPool, o: Observed, phase, result: ServerResult, verify_timeout: float) -> None:  # type: ignore[no-untyped-def]
    """Stage what changed, then one commit round trip: keys, render, check, swap, restart, verify."""
    d, t = o.desired, o.target
    assert d is not None and o.facts is not None
    kinds = {a.kind for a in o.plan.actions}
    moves: list[list[str]] = []
    binary_new = None
    if "install-engine" in kinds:
        phase("install engine")
        moves += await _stage_engine(pool, o)
        binary_new = moves[0][0]
    phase("configure")
    files = []
    for f in d.files:
        if o.facts.files.get(f.path) == f.sha256:
            continue
        tmp = f"{f.path}.reconciler-new"
        files.append({"path": tmp, "data": base64.b64encode(f.content).decode(), "mode": f.mode})
        moves.append([tmp, f.path])
    action = next((a.kind for a in o.plan.actions if a.kind in ("restart", "reload", "start")), "none")
    phase("start")
    req = {
        "files": files, "moves": moves, "binary_new": binary_new,
        "keys": [{"inbound": k.inbound, "kind": k.kind, "server_name": k.server_name, "paths": list(k.paths)} for k in d.keys],
        "template": TEMPLATE, "template_new": f"{TEMPLATE}.reconciler-new", "config": CONFIG,
        "config_new": f"{CONFIG}.reconciler-new", "binary": BINARY, "service": SERVICE,
        "reality": {k.inbound: k.paths[0] for k in d.keys if k.kind == "reality"},
        "action": action, "listeners": [list(x) for x in d.listeners], "verify_timeout": verify_timeout, "lock": LOCK_DIR,
        "running": o.facts.active == "active",
    }
    # setsid: the commit finishes (or rolls back) on the server even if this SSH session drops.
    res = await pool.run(t, f"setsid -w python3 -I -S -c {shlex.quote(remote.COMMIT)}", input=json.dumps(req),
                         timeout=verify_timeout * 3 + 60)
    phase("verify")
    commit = json.loads(res.stdout.strip().splitlines()[-1])
    if commit.get("public"):  # what the keys step generated or found: no second observation needed to learn it
        o.facts = replace(o.facts, public={**o.facts.public, **commit["public"]})
    result.details["commit"] = {k: v for k, v in commit.items() if k != "public"}
    if commit["ok"]:
        result.ok = True
        result.message = f"{len(o.plan.actions)} change(s) applied"
    else:
        result.rolled_back = bool(commit.get("rolled_back"))
        result.ok = False
        where = "rolled back to the previous configuration" if result.rolled_back else "nothing was changed"
        result.message = f"{commit['stage']} failed: {commit['error']} — {where}"
        raise CommitFailed(result.message)
    for a in o.plan.actions:
        if a.kind == "remove-file":
            await pool.run(t, f"rm -f {shlex.quote(a.target)}", check=False)
    if "harden" in kinds:
        phase("harden")
        await _harden(pool, o)


async def _harden(pool: SSHPool, o: Observed, timeout: float = 20.0) -> None:
    """Load the firewall; keep it only if a brand-new SSH connection still gets in (never lock us out)."""
    d, t = o.desired, o.target
    assert d is not None
    rules, unit = d.firewall
    await pool.run(t, "mkdir -p /etc/reconciler")
    await pool.put(t, unit.content, unit.path, unit.mode)
    await pool.put(t, rules.content, rules.path + ".reconciler-new", rules.mode)
    req = {"new": rules.path + ".reconciler-new", "path": rules.path, "confirm": "/run/reconciler-firewall.ok",
           "loaded": "/run/reconciler-firewall.loaded", "timeout": timeout}
    await pool.put(t, json.dumps(req).encode(), "/run/reconciler-firewall.req", 0o600)
    script = shlex.quote(remote.FIREWALL)
    await pool.run(t, "rm -f /run/reconciler-firewall.out /run/reconciler-firewall.ok /run/reconciler-firewall.loaded; "
                      f"setsid -f sh -c {shlex.quote(f'python3 -c {script} < /run/reconciler-firewall.req > /run/reconciler-firewall.out 2>&1')}"
                      " < /dev/null > /dev/null 2>&1")  # detached stdio: else SSH waits for the script to end
    loaded_by = time.monotonic() + 15
    while time.monotonic() < loaded_by:  # the established session keeps working under any rules
        res = await pool.run(t, "test -e /run/reconciler-firewall.loaded -o -s /run/reconciler-firewall.out", check=False)
        if res.code == 0:
            break
        await asyncio.sleep(0.2)
    try:
        fresh = await pool.fresh(t)  # a new TCP connection: established ones would pass any ruleset
        try:
            await fresh.run("touch /run/reconciler-firewall.ok", check=True)
        finally:
            fresh.close()
    except (OSError, TimeoutError, RemoteError, asyncssh.Error):
        pass  # no confirmation: the server restores the previous rules by itself, and says so below
    deadline = time.monotonic() + timeout + 15
    while time.monotonic() < deadline:
        res = await pool.run(t, "cat /run/reconciler-firewall.out 2>/dev/null", check=False)
        if res.stdout.strip():
            out = json.loads(res.stdout.strip().splitlines()[-1])
            if not out.get("ok"):
                raise CommitFailed(f"firewall: {out.get('error')} — the service itself was applied")
            return
        await asyncio.sleep(0.5)
    raise CommitFailed("firewall: no answer from the server within the timeout")




async def _stage_engine(pool: SSHPool, o: Observed) -> list[list[str]]:
    """The engine binary, checked (sha256, version) and staged under a temporary name with its sidecars,
    in one round trip; the commit moves them into place. Returns those moves, the binary first."""
    d, t = o.desired, o.target
    assert d is not None
    tmp = f"{BINARY}.reconciler-new"
    version_cmd = f"{tmp} version"  # run on the server unless the controller could run the same bytes
    data: bytes | None = None
    if d.binary.url and not d.binary.local_path:
        arch = "arm64" if o.facts and o.facts.arch in ("aarch64", "arm64") else "amd64"
        url = d.binary.url.format(version=d.binary.version, arch=arch)
        fetch = f"import urllib.request; urllib.request.urlretrieve({url!r}, {tmp!r})"
        # Downloaded on the server: hashed there.
        cmd = f"python3 -c {shlex.quote(fetch)} && sha256sum {tmp} | cut -d' ' -f1 | tr -d '\\n' > {tmp}.sha256"
    elif d.binary.local_path:
        # Shipped compressed (a Go binary shrinks to ~40%) and unpacked as it streams in. gzip's CRC and
        # SSH's MAC vouch for the bytes; the sha256 was taken here, once, from the source.
        data, digest = _gzipped(d.binary.local_path)
        known = _local_version(d.binary.local_path)
        if known:  # the same bytes report the same version: no 44 MB binary to start on every server
            version_cmd = f"printf %s {shlex.quote(known)}"
        cmd = f"python3 -I -S -c {shlex.quote(remote.INFLATE)} {tmp} && printf %s {digest} > {tmp}.sha256"
    else:
        raise RemoteCommandError(o.plan.server, "install engine", None,
                                 "no engine binary: set settings.engine.binary, or install: download with a url")
    record = f"chmod 755 {tmp} && {version_cmd} > {tmp}.version && cat {tmp}.sha256 && echo && cat {tmp}.version"
    clean = f"rm -f {tmp} {tmp}.sha256 {tmp}.version"
    res = await pool.run(t, f"umask 022; {{ {cmd} && {record}; }} || {{ s=$?; {clean}; exit $s; }}", input=data, timeout=600)
    digest, _, version = res.stdout.partition("\n")
    digest = digest.strip()
    problem = None
    if d.binary.sha256 and digest != d.binary.sha256:
        problem = f"the binary's sha256 {digest} differs from the pinned {d.binary.sha256}"
    elif d.binary.version not in version:
        problem = f"the binary reports {version.splitlines()[:1]}, not version {d.binary.version}"
    if problem:
        await pool.run(t, clean, check=False)
        raise RemoteCommandError(o.plan.server, "install engine", None, problem)
    return [[tmp, BINARY], [f"{tmp}.sha256", f"{BINARY}.sha256"], [f"{tmp}.version", f"{BINARY}.version"]]


_PACKED: dict[str, tuple[bytes, str]] = {}
_VERSIONS: dict[tuple[str, int, int], str | None] = {}


def _local_version(path: str) -> str | None:
    """``<binary> version`` run here, once per file version; None when it does not run here (another
    architecture or OS): then each server runs it."""
    import subprocess

    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _VERSIONS:
        try:
            out = subprocess.run([path, "version"], capture_output=True, text=True, timeout=20)
            _VERSIONS[key] = out.stdout if out.returncode == 0 and out.stdout.startswith("sing-box version") else None
        except (OSError, subprocess.SubprocessError):
            _VERSIONS[key] = None
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


async def _remove_server(pool: SSHPool, o: Observed) -> None:
    cmds = [f"systemctl disable --now {SERVICE} 2>/dev/null || true"]
    for a in o.plan.actions:
        if a.kind == "remove-file":
            cmds.append(f"rm -f {shlex.quote(a.target)} {shlex.quote(a.target)}.sha256")
    cmds.append(f"rm -f {CONFIG} {BINARY}.version; systemctl daemon-reload")
    await pool.run(o.target, " && ".join(cmds))
