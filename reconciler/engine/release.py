"""Engine releases on the controller: fetched once, checked against their pins, unpacked.

- ``fetch_binary(url, pin, name)``: the binary ``name`` of the release at ``url`` whose sha256 must be ``pin``
  (what apply uploads when a server cannot fetch the release itself); cached by pin, so a release is fetched
  once per controller;
- ``pin_release(settings)``: what ``reconciler engine pin`` writes: every architecture's release fetched and
  hashed, and the build of the one this machine can run inspected for its capabilities.

The fetching, hashing and unpacking are the servers' own (``reconciler.engine.scripts.engine``): one
implementation on both sides of the wire, and one place that decides what a release may be. A release is hostile
input until its binary is out, so the unpacking stops with an error once a release has inflated past
``MAX_UNPACKED_BYTES`` (counted as the bytes come, whatever the container: gzip, zstd, bzip2, xz, tar), and takes
the binary only from a regular file in it (a link, device or sparse file of that name is refused).
"""

from __future__ import annotations

import os
import stat
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from reconciler.engine.capabilities import CAPABILITIES, MIHOMO, Capability, learn, local_version
from reconciler.engine.scripts import engine as script
from reconciler.engine.scripts.facts import zstd_library
from reconciler.errors import ReleaseError
from reconciler.model import EngineSettings
from reconciler.state.files import put_in_place

ARCHES = ("amd64", "arm64")
LOCAL_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine, "")
#: The kernel's name of each architecture (``uname -m``): what ``{machine}`` expands to in a release URL
#: (sing-box names its Arch Linux packages so: ``sing-box_<version>_linux_x86_64.pkg.tar.zst``).
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
#: The most a release may inflate to on the controller, its tar stream with every member in it (an engine's binary
#: is 30–50 MB); past it the unpacking stops with an error. The servers' own cap (the same script decides).
MAX_UNPACKED_BYTES = script.MAX_UNPACKED_BYTES


def release_url(template: str, arch: str) -> str:
    """A release URL for one architecture (``amd64``, ``arm64``): ``{arch}`` and ``{machine}`` expanded."""
    return template.replace("{arch}", arch).replace("{machine}", MACHINES.get(arch, arch))


def cache_dir() -> str:
    path = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "reconciler", "releases")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _temp(folder: str, prefix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, dir=folder)  # unique: several servers may fall back at once
    os.close(fd)
    return path


def _fetch(url: str) -> tuple[str, str]:
    """(path, sha256) of the file at ``url``, fetched into a file of its own in the cache."""
    path = _temp(cache_dir(), "fetch-")
    try:
        return path, script.fetch(url, path)  # hashed as it arrives
    except script.Failed as exc:
        os.remove(path)
        raise ReleaseError(str(exc), temporary=True) from None
    except OSError as exc:  # the cache's disk, not the release
        os.remove(path)
        raise ReleaseError(f"cannot keep {url} in {cache_dir()}: {exc}", temporary=True) from None


def fetch_binary(url: str, pin: str, name: str, fetched: str | None = None) -> str:
    """The local path of binary ``name`` from the release at ``url``, whose sha256 must be ``pin``; fetched once
    for every server of an apply that needs it (one fetch per pin at a time). ``fetched``: the release already
    fetched (and hashed ``pin``) by the caller, unpacked from there instead of fetched again (consumed)."""
    out = os.path.join(cache_dir(), f"{name}-{pin[:24]}")
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(pin, threading.Lock())
    with lock:
        if os.path.exists(out):
            if fetched:
                os.remove(fetched)
            return out
        path, got = (fetched, pin) if fetched else _fetch(url)
        unpacked = _temp(cache_dir(), f"{name}-")
        try:
            if got != pin:
                raise ReleaseError(f"the file at {url} has sha256 {got}, not the pinned {pin}: refused")
            try:
                script.unpack(path, unpacked, name, zstd_library(), MAX_UNPACKED_BYTES)
            except (script.Failed, RuntimeError, tarfile.TarError, zlib.error, EOFError) as exc:  # pinned, unusable
                raise ReleaseError(f"{url}: {exc}") from None
            except OSError as exc:
                raise ReleaseError(f"{url}: cannot unpack it in {cache_dir()}: {exc}", temporary=True) from None
            put_in_place(unpacked, out, stat.S_IRWXU)
        finally:
            for leftover in (path, unpacked):
                if os.path.exists(leftover):
                    os.remove(leftover)
        return out


@dataclass(frozen=True)
class Pinned:
    sha256: dict[str, str]  # arch → sha256 of its release file
    capabilities: tuple[Capability, ...] | None  # what the build this machine could run can do
    missing: dict[str, str]  # arch → why it has no pin
    #: release sha256 → what its binary printed for its version, for the release this machine could run (apply then
    #: lets a server download it in its commit's session: ``reconciler.apply.engine.in_commit``)
    versions: dict[str, str] = field(default_factory=dict)


def pin_release(settings: EngineSettings, arches: tuple[str, ...] = ARCHES,
                progress: Callable[[str], None] = lambda _: None) -> Pinned:
    """Every architecture's release of ``settings`` fetched and hashed; the capabilities of the one this machine
    runs learnt from its build (sing-box's tags; every Mihomo has them all)."""
    if not settings.url:
        raise ReleaseError("settings.engine.url is not set: nothing to pin (set install: download and its url)")
    base = settings.url.replace("{version}", settings.version)
    pins, missing, versions = {}, {}, {}
    capabilities: tuple[Capability, ...] | None = None
    for arch in arches:
        url = release_url(base, arch)
        progress(f"fetching {url}")
        try:
            path, digest = _fetch(url)
        except ReleaseError as exc:
            missing[arch] = str(exc)
            continue
        pins[arch] = digest
        try:
            if arch == LOCAL_ARCH:
                name = "sing-box" if settings.name == "sing-box" else "mihomo"
                binary = fetch_binary(url, digest, name, fetched=path)  # unpacked from this fetch, not a second one
                said = local_version(binary, ("-v",) if settings.name == "mihomo" else ("version",), named_by_operator=True)
                if said is not None:
                    versions[digest] = said
                if settings.name == "mihomo":
                    capabilities = MIHOMO
                else:
                    build = learn(binary, named_by_operator=True)  # `engine pin`: the operator asked for this release
                    if build is None:
                        raise ReleaseError(f"{url}: the binary in it does not answer `sing-box version`")
                    if build.version != settings.version:
                        raise ReleaseError(f"{url} holds sing-box {build.version}, not {settings.version}")
                    capabilities = tuple(c for c in CAPABILITIES if c in build.capabilities)
        finally:
            if os.path.exists(path):
                os.remove(path)
    return Pinned(pins, capabilities, missing, versions)
