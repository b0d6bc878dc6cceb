"""The plan: per server, the actions that make its facts match the desired state (GITOPS-3). Pure.

An action is data — what changes and why — so it can be printed, saved, tested
and applied. Secrets never appear in a plan (issue 13), by the types the engine
adapter gives: an ``opaque`` file (key material, certificates) is shown as
``content differs: sha256:… → sha256:…``; a file holding credentials keeps a
structural diff in which every value it is known to hold, every value under a
credential key (in the old content read back from the server too) and every PEM
block is replaced by its fingerprint (``reconciler.credentials.Redactor``).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field

from reconciler.credentials import Redactor, fingerprint_digest
from reconciler.engine.base import DesiredServer, Layout, ManagedFile
from reconciler.plan.facts import Facts

SUPPORTED_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
DIFF_LINES = 200


@dataclass(frozen=True)
class Action:
    sign: str  # "+" add, "~" change, "-" remove
    kind: str  # install-engine, write-file, restart, reload, start, remove-file, stop, harden
    target: str  # path, service or inbound
    reason: str
    diff: str = ""

    def as_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class ServerPlan:
    server: str
    host: str
    actions: list[Action] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # preflight refusals: nothing will be changed
    error: str = ""  # could not be observed
    desired_digest: str = ""
    facts_digest: str = ""
    removed: bool = False  # the server left the file (prune)

    @property
    def changes(self) -> bool:
        return bool(self.actions)

    def counts(self) -> tuple[int, int, int]:
        return (sum(a.sign == "+" for a in self.actions), sum(a.sign == "~" for a in self.actions),
                sum(a.sign == "-" for a in self.actions))

    def as_json(self) -> dict[str, object]:
        return {"server": self.server, "host": self.host, "actions": [a.as_json() for a in self.actions],
                "problems": self.problems, "error": self.error, "desired_digest": self.desired_digest,
                "facts_digest": self.facts_digest, "removed": self.removed}


def redact(text: str, redactor: Redactor | None = None) -> str:
    """``text`` with every credential value under a JSON credential key, every value ``redactor`` knows and
    every PEM block replaced by its fingerprint."""
    return (redactor or Redactor())(text, structural=True)


def file_diff(f: ManagedFile, old: bytes | None, have: str | None = None, redactor: Redactor | None = None) -> str:
    """What a person sees of a file's change. ``have``: the sha256 of the server's copy (its facts); ``old``:
    its content when read back (only for files that are not opaque)."""
    new_fp = fingerprint_digest(f.sha256)
    if f.opaque:
        return f"create: {new_fp}" if have is None else f"content differs: {fingerprint_digest(have)} → {new_fp}"
    new_text = f.content.decode(errors="replace")
    old_text = old.decode(errors="replace") if old is not None else ""
    lines = list(difflib.unified_diff(old_text.splitlines(), new_text.splitlines(), f"{f.path} (now)",
                                      f"{f.path} (desired)", lineterm="", n=1))
    if old is None and have is not None:  # not read back (too large, or gone since the facts)
        lines = [f"content differs: {fingerprint_digest(have)} → {new_fp}"]
    text = "\n".join(lines[:DIFF_LINES]) + ("\n… (diff truncated)" if len(lines) > DIFF_LINES else "")
    red = (redactor or Redactor()) + Redactor.of(f.secrets)
    return red(text, structural=f.secret)


def preflight(facts: Facts, desired: DesiredServer) -> list[str]:
    """Reasons this host cannot be served; checked before anything changes."""
    problems = []
    if not facts.systemd:
        problems.append("not a systemd host (/run/systemd/system is missing): the engine runs as a systemd unit")
    if facts.arch not in SUPPORTED_ARCH:
        problems.append(f"unsupported architecture {facts.arch!r}; supported: x86_64, aarch64")
    want = desired.binary
    arch = SUPPORTED_ARCH.get(facts.arch, facts.arch)
    if want.url and not want.local_path and not want.pin_for(arch) and facts.engine_version != want.version:
        problems.append(f"no sha256 is pinned for {arch} releases of {desired.engine.name} {want.version}: run "
                        "`reconciler engine pin` (it fetches them once and writes the pins into the file)")
    ours = {desired.engine.process, *(x.process for x in desired.retire), ""}  # a retired engine is stopped first
    for port, proto in desired.listeners:
        for lst in facts.listeners:
            if lst.port == port and lst.proto == proto and lst.process not in ours:
                problems.append(f"port {port}/{proto} is taken by {lst.process!r}; free it or choose another port")
    return problems


def plan_server(desired: DesiredServer, facts: Facts, current_files: dict[str, bytes | None] | None = None,
                prune: bool = False) -> list[Action]:
    """The actions that turn ``facts`` into ``desired``. ``current_files``: old contents for diffs (never
    of opaque files; whatever they hold, the diffs pass through ``desired.redactor()``)."""
    actions: list[Action] = []
    current_files = current_files or {}
    engine = desired.engine
    binary_change = False
    want = desired.binary
    name = engine.name
    if facts.engine_version is None:
        actions.append(Action("+", "install-engine", engine.binary, f"install {name} {want.version} (not installed)"))
        binary_change = True
    elif facts.engine_version != want.version:
        actions.append(Action("~", "install-engine", engine.binary, f"{name} {facts.engine_version} → {want.version}"))
        binary_change = True
    elif want.local_path and want.sha256 and facts.engine_sha256 and facts.engine_sha256 != want.sha256:
        actions.append(Action("~", "install-engine", engine.binary, "binary differs from the pinned sha256: reinstall"))
        binary_change = True

    # Another engine an earlier apply installed (the server changed engines): stopped before the new one starts,
    # its files removed once the new one serves.
    for old in desired.retire:
        found = engine_leftovers(facts, old)
        if found:
            actions.append(Action("-", "stop", old.service, f"the server runs {name} now"))
            actions += [Action("-", "remove-file", p, f"{old.name} is retired") for p in found]

    unit_change = config_change = False
    redactor = desired.redactor()
    for f in desired.files:
        have = facts.files.get(f.path)
        if have == f.sha256:
            continue
        if have is None:
            actions.append(Action("+", "write-file", f.path, "create", file_diff(f, None, None, redactor)))
        else:
            actions.append(Action("~", "write-file", f.path, "content differs",
                                  file_diff(f, current_files.get(f.path), have, redactor)))
        if f.path == engine.unit:
            unit_change = True
        elif f.engine:
            config_change = True

    service = engine.service
    if binary_change or unit_change:
        actions.append(Action("~", "restart", service,
                              "restart: " + ("the engine changed" if binary_change else "the unit changed")))
    elif config_change:
        if facts.active == "active" and engine.reloads:
            actions.append(Action("~", "reload", service, "reload (SIGHUP): the configuration changed"))
        elif facts.active == "active":
            actions.append(Action("~", "restart", service, f"restart: the configuration changed ({name} has no reload)"))
        else:
            actions.append(Action("+", "start", service, "start with the new configuration"))
    elif facts.active != "active":
        actions.append(Action("+", "start", service, f"the service is {facts.active or 'not running'}"))
    elif facts.enabled != "enabled":
        actions.append(Action("~", "start", service, "enable at boot"))

    if desired.firewall:
        stale = [f for f in desired.firewall if facts.files.get(f.path) != f.sha256]
        if stale or not facts.firewall:
            sign = "+" if all(facts.files.get(f.path) is None for f in desired.firewall) else "~"
            ports = ", ".join(f"{p}/{t}" for p, t in desired.listeners)
            actions.append(Action(sign, "harden", "nftables", f"allow SSH and the inbound ports only ({ports}); "
                                  "kept only if a fresh SSH connection still gets in"))

    if prune:
        wanted = {f.path for f in desired.files}
        for path in facts.extra:
            if path.endswith((".reconciler-new", ".reconciler-old", ".tmp")):
                continue
            if path.startswith(f"{engine.config_dir}/reality/"):  # generated there by versions before issue 14
                actions.append(Action("-", "remove-file", path, "REALITY keys are derived on the controller now (prune)"))
            elif path.startswith(f"{engine.tls_dir}/") and path not in wanted:
                actions.append(Action("-", "remove-file", path, "its inbound left the cluster file (prune)"))
    return actions


def engine_leftovers(facts: Facts, engine: Layout) -> list[str]:
    """What of ``engine`` a server holds: its binary, configuration and unit, and its keys and certificates (the one
    list both a retired engine and a removed server lose)."""
    found = [p for p in engine.paths() if facts.files.get(p)]
    return found + [p for p in facts.extra if p.startswith(f"{engine.config_dir}/") and p not in found]


def plan_removal(facts: Facts, layouts: tuple[Layout, ...]) -> list[Action]:
    """A server that left the cluster file: stop every engine found and remove what we installed (prune)."""
    actions = []
    for engine in layouts:
        found = engine_leftovers(facts, engine)
        if found:
            actions.append(Action("-", "stop", engine.service, "the server left the cluster file (prune)"))
            actions += [Action("-", "remove-file", p, "the server left the cluster file (prune)") for p in found]
    return actions


def summary_line(plans: list[ServerPlan]) -> str:
    add = sum(p.counts()[0] for p in plans)
    change = sum(p.counts()[1] for p in plans)
    destroy = sum(p.counts()[2] for p in plans)
    return f"Plan: {add} to add, {change} to change, {destroy} to destroy."


def render_human(plans: list[ServerPlan], warnings: list[str] | None = None) -> str:
    out = []
    for w in warnings or []:
        out.append(f"warning: {w}")
    for p in plans:
        head = f"server {p.server} ({p.host})" + (" — left the cluster file" if p.removed else "")
        if p.error:
            out.append(f"! {head}: cannot observe: {p.error}")
            continue
        if p.problems:
            out.append(f"! {head}: refused by preflight:")
            out.extend(f"    - {x}" for x in p.problems)
            continue
        if not p.actions:
            out.append(f"  {head}: up to date")
            continue
        a, c, d = p.counts()
        out.append(f"  {head}: {a} to add, {c} to change, {d} to destroy")
        for act in p.actions:
            out.append(f"    {act.sign} {act.kind} {act.target}: {act.reason}")
            if act.diff:
                out.extend("        " + line for line in act.diff.splitlines())
    out.append("")
    out.append(summary_line(plans))
    return "\n".join(out) + "\n"


def render_json(plans: list[ServerPlan], fingerprint: str) -> str:
    add, change, destroy = (sum(p.counts()[i] for p in plans) for i in range(3))
    return json.dumps({"fingerprint": fingerprint, "summary": {"add": add, "change": change, "destroy": destroy},
                       "servers": [p.as_json() for p in plans]}, indent=2, ensure_ascii=False) + "\n"
