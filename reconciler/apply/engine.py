"""Staging the engine on a server (the install-engine step of an apply, GITOPS-4).

The binary comes one of two ways. A server downloads the pinned release itself and checks its sha256; when it
cannot (no route out, a refused download), the controller fetches the release once and uploads it. Otherwise the
controller uploads its local binary, packed once per process (zstd, else gzip: ``packed_engine``) and shared by
every server's upload. Either way the staged file's sha256 and version are checked before the commit swaps it in;
a version is asked once per release and shared between the servers that stage it.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import logging
import os
import shutil
import threading
import weakref
from typing import Any

import zstandard

from reconciler.engine import release, remote
from reconciler.engine.capabilities import local_version
from reconciler.errors import ReleaseError, RemoteCommandError
from reconciler.plan import lock
from reconciler.plan.actions import SUPPORTED_ARCH
from reconciler.plan.facts import parse_version
from reconciler.plan.observe import Observed
from reconciler.ssh import Runner
from reconciler.ssh.runner import answer
from reconciler.state.files import put_in_place

log = logging.getLogger("reconciler.apply")

# Servers downloading the same release in one apply (one event loop): the first asks its binary's version, the
# others leave it (``version_later``) and take that answer when their binary has the same sha256 — the same
# bytes report the same version, as with the controller's own run of an uploaded engine. On 20 busy lab hosts,
# starting the 44 MB binary cost ~100 ms of CPU on each of them.
_ASKED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Future[tuple[str, str] | None]]] = (
    weakref.WeakKeyDictionary())


_PACKED: dict[str, tuple[bytes, str]] = {}

#: What a release's binary reports as its version, by the release's sha256 (the same bytes report the same version),
#: as a server that staged it answered. A server downloading a release known here stages it in its commit's own
#: session (``in_commit``); the state folder keeps it between runs (``known``, ``learn``).
_VERSIONS: dict[str, str] = {}
_SHA256 = frozenset("0123456789abcdef")


def learn(entries: object) -> None:
    """Versions known from before (the state folder's record: hostile input like any file, odd entries dropped)."""
    if isinstance(entries, dict):
        for pin, version in entries.items():
            if (isinstance(pin, str) and len(pin) == 64 and set(pin) <= _SHA256 and isinstance(version, str)
                    and 0 < len(version) <= 4096):
                _VERSIONS.setdefault(pin, version)


def known() -> dict[str, str]:
    """Every release version known to this process (what the state folder keeps)."""
    return dict(_VERSIONS)


def in_commit(o: Observed) -> tuple[dict[str, Any], list[list[str]]] | None:
    """For a server that downloads a release whose version is known and is the one wanted: the commit's ``stage``
    request (the engine script's, with its source) and the moves it stages; None otherwise (``stage_engine`` first).
    The server checks the download against the pin as ever; the version is the one its bytes report."""
    d = o.desired
    assert d is not None and o.facts is not None
    engine, b = d.engine, d.binary
    arch = SUPPORTED_ARCH.get(o.facts.arch, o.facts.arch)
    pin = b.pin_for(arch) if b.url and not b.local_path else None
    version = _VERSIONS.get(pin) if pin else None
    if version is None or parse_version(version) != b.version:
        return None
    tmp = f"{engine.binary}.reconciler-new"
    req = {"tmp": tmp, "version_args": list(engine.version_args), "name": engine.process, "mode": "download",
           "url": release.release_url(b.url or "", arch), "sha256": pin, "version": version, "library": o.facts.zstd,
           "source": remote.ENGINE.source}
    return req, _moves(tmp, engine.binary)


def _moves(tmp: str, binary: str) -> list[list[str]]:
    """A staged binary and its sidecars into place, the binary first."""
    return [[tmp, binary], [f"{tmp}.sha256", f"{binary}.sha256"], [f"{tmp}.version", f"{binary}.version"]]


ENGINE_UPLOAD_SECONDS = lock.LONGEST_STEP_SECONDS


def _version_asker(pin: str) -> tuple[asyncio.Future[tuple[str, str] | None], bool]:
    """(the future answer for this release's binary, whether this server asks it)."""
    loop = asyncio.get_running_loop()
    asked = _ASKED.setdefault(loop, {})
    fut = asked.get(pin)
    if fut is None or (fut.done() and fut.result() is None):  # none yet, or the asker failed: this one asks
        fut = asked[pin] = loop.create_future()
        return fut, True
    return fut, False


async def _download_engine(runner: Runner, o: Observed, req: dict[str, Any], url: str,
                           pin: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The server's download of the release (``install: download``): its answer, and the version sidecar when the
    version is another server's answer for the same sha256."""
    assert o.facts is not None
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
            if isinstance(said, str) and str(answered.get("sha256", "")).strip() == pin and parse_version(said):
                _VERSIONS[pin] = said
    staged = answered
    sidecar: list[dict[str, Any]] = []
    if staged["ok"] and staged.get("version") is None:  # left to the asker: same sha256, same version
        known = await asyncio.shield(asked)
        if known is not None and known[0] == str(staged.get("sha256", "")).strip():
            staged["version"] = known[1]
            sidecar = [{"path": f"{req['tmp']}.version", "data": base64.b64encode(known[1].encode()).decode(), "mode": 0o644}]
        else:  # the asker failed, or its binary differs: this server runs its own
            res = await runner.script(o.target, remote.ENGINE, {**req, "mode": "version"})
            staged = answer(res, o.target, remote.ENGINE, {"ok": bool})
    return staged, sidecar


async def _download_or_fetch(runner: Runner, o: Observed, req: dict[str, Any], releases: str,
                             tried: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
    """``install: download`` from ``releases`` (the binary's url): (the server's answer, the sidecar, None) when it
    staged the release itself; when it could not fetch or unpack it, the path of the binary the controller fetched
    (and checked) for the upload."""
    d = o.desired
    assert d is not None and o.facts is not None
    engine, b = d.engine, d.binary
    arch = SUPPORTED_ARCH.get(o.facts.arch, o.facts.arch)
    pin = b.pin_for(arch)
    if not pin:
        raise RemoteCommandError(o.plan.server, "install engine", None,
                                 f"no sha256 pinned for {arch} releases of {engine.name} {b.version}: run "
                                 "`reconciler engine pin` (it downloads once, checks the build and writes the pins)")
    url = release.release_url(releases, arch)
    staged, sidecar = (tried, []) if tried is not None else await _download_engine(runner, o, req, url, pin)
    if staged["ok"]:
        return staged, sidecar, None
    if staged.get("kind") not in ("fetch", "codec"):
        raise RemoteCommandError(o.plan.server, "install engine", None, str(staged.get("error"))[:600])
    could_not = "fetch" if staged["kind"] == "fetch" else "unpack"  # codec: a zstd release, no libzstd there
    log.warning("%s cannot %s %s itself (%s): the controller fetches it and uploads it", o.plan.server,
                could_not, url, str(staged.get("error"))[:200])
    try:
        local = await asyncio.to_thread(release.fetch_binary, url, pin, engine.process)
    except ReleaseError as exc:
        raise RemoteCommandError(o.plan.server, "install engine", None,
                                 f"the server could not {could_not} {url} ({str(staged.get('error'))[:200]}), "
                                 f"nor could the controller: {exc}") from None
    return staged, sidecar, local


async def _upload_engine(runner: Runner, o: Observed, req: dict[str, Any], local: str) -> dict[str, Any]:
    """The controller's binary at ``local``, sent to the server and staged there: the server's answer."""
    d = o.desired
    assert d is not None and o.facts is not None
    # Shipped compressed (a Go binary shrinks to a third) and unpacked as it streams in: zstd where the
    # server has libzstd (it inflates in ~40% of zlib's time), else gzip. The codec's checksum and SSH's MAC
    # vouch for the bytes; the sha256 was taken here, once, from the source.
    # The same bytes report the same version: no 44 MB binary to start on every server.
    version = await asyncio.to_thread(_local_version, local, d.engine.version_args)
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
    return staged


async def _check_staged(runner: Runner, o: Observed, staged: dict[str, Any], tmp: str) -> None:
    """The staged binary is the one wanted (its pinned sha256, its version); else it is removed and the server fails."""
    assert o.desired is not None
    b = o.desired.binary
    digest, version = str(staged.get("sha256", "")).strip(), str(staged.get("version", ""))
    problem = None
    if b.local_path and b.sha256 and digest != b.sha256:
        problem = f"the binary's sha256 {digest} differs from the pinned {b.sha256}"
    elif parse_version(version) != b.version:
        problem = f"the binary reports {version.splitlines()[:1]}, not version {b.version}"
    if problem:
        await runner.script(o.target, remote.FILES, {"op": "remove", "paths": [tmp, f"{tmp}.sha256", f"{tmp}.version"]})
        raise RemoteCommandError(o.plan.server, "install engine", None, problem)


async def stage_engine(runner: Runner, o: Observed,
                       tried: dict[str, Any] | None = None) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The engine binary, checked (sha256, version) and staged under a temporary name with its sidecars; the
    commit moves them into place. Returns those moves, the binary first, and the sidecar the commit writes
    (the version another server's identical binary reported).

    ``install: download``: the server fetches the release itself (a VPS's link is faster than the operator's
    uplink) and refuses a file whose sha256 differs from the pin for its architecture, installing nothing.
    When the server cannot fetch it (no route out, a missing file) or unpack it (a zstd release, no libzstd
    there), the controller fetches it once, checks the same pin, and uploads the binary: the fallback.
    ``tried``: the answer of a download the server already attempted in its commit (``in_commit``) and could not
    make: the fallback at once.
    ``install: upload``: the controller's binary, compressed (zstd where the server has libzstd, else gzip)."""
    d = o.desired
    assert d is not None and o.facts is not None
    engine, b = d.engine, d.binary
    tmp = f"{engine.binary}.reconciler-new"
    req: dict[str, Any] = {"tmp": tmp, "version_args": list(engine.version_args), "name": engine.process}
    sidecar: list[dict[str, Any]] = []
    local = b.local_path
    if b.url and not local:
        staged, sidecar, local = await _download_or_fetch(runner, o, req, b.url, tried)
    if local:
        staged = await _upload_engine(runner, o, req, local)
    elif not b.url:
        raise RemoteCommandError(o.plan.server, "install engine", None,
                                 "no engine binary: set settings.engine.binary, or install: download with a url")
    await _check_staged(runner, o, staged, tmp)
    return _moves(tmp, engine.binary), sidecar


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
        put_in_place(tmp, out)
        for old in sorted(glob.glob(os.path.join(cache, f"engine-*.{suffix}")), key=os.path.getmtime)[:-3]:
            os.remove(old)
    with open(out, "rb") as fh:
        _PACKED[key] = (fh.read(), sha.hexdigest())
    return _PACKED[key]
