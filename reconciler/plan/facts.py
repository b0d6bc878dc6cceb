"""Facts: what a server looks like now, parsed from the raw output of the facts script. Pure.

Each parser takes command output and returns a typed value; tests feed them
tables of real outputs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from reconciler.certificates import certificate_sha256, spki_pin

__all__ = ["Facts", "Listener", "certificate_sha256", "parse_facts", "parse_ss", "parse_version", "spki_pin"]

#: What each engine's version command prints first: sing-box's ``version``, Mihomo's ``-v``.
_VERSION = re.compile(r"^(?:sing-box version |Mihomo Meta v)(\S+)", re.M)


@dataclass(frozen=True)
class Listener:
    proto: str  # tcp | udp
    port: int
    process: str  # "" when unknown


@dataclass(frozen=True)
class Facts:
    arch: str
    systemd: bool
    python: str
    files: dict[str, str | None]  # path → sha256 (None: missing)
    engine_version: str | None
    engine_sha256: str | None
    engine_size: int | None
    active: str  # systemctl is-active: active, inactive, failed, ...
    enabled: str
    listeners: tuple[Listener, ...]
    public: dict[str, str | None]  # path → content of public material (REALITY .pub, certificates)
    present: dict[str, bool]  # path → private material exists
    lock: dict[str, Any] | None
    extra: tuple[str, ...] = field(default_factory=tuple)  # files found in managed folders
    firewall: bool = False  # our nftables table is loaded
    zstd: str = ""  # where the server's libzstd is ("": none; the engine is then uploaded as gzip)

    def digest(self) -> str:
        """What a saved plan was computed from; a different digest makes the plan stale."""
        stable = {"files": self.files, "engine": [self.engine_version, self.engine_sha256], "active": self.active,
                  "enabled": self.enabled, "public": self.public, "present": self.present, "extra": self.extra,
                  "firewall": self.firewall}
        return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()


def parse_version(output: str) -> str | None:
    """`sing-box version` or `mihomo -v` output → "1.14.4", "1.19.32"."""
    m = _VERSION.search(output or "")
    return m.group(1) if m else None


def parse_ss(output: str) -> tuple[Listener, ...]:
    """`ss -Hlntup` lines → listeners. Columns: netid state recv send local peer [process]."""
    out = []
    for line in (output or "").splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[0] not in ("tcp", "udp"):
            continue
        try:
            port = int(parts[4].rsplit(":", 1)[1])
        except (IndexError, ValueError):
            continue
        proc = ""
        if len(parts) > 6:
            m = re.search(r'\(\("([^"]+)"', parts[6])
            proc = m.group(1) if m else ""
        out.append(Listener(parts[0], port, proc))
    return tuple(sorted(set(out), key=lambda x: (x.port, x.proto, x.process)))


def parse_lock(text: str | None) -> dict[str, Any] | None:
    """The apply lock's holder file (``reconciler.plan.lock.holder`` writes it) → a dict; None when free.

    Anything that is not a JSON object is kept as ``{"holder": text}`` (shown to the operator as is)."""
    if not text:
        return None
    try:
        value = json.loads(text)
        return value if isinstance(value, dict) else {"holder": str(value)}
    except ValueError:
        return {"holder": text.strip()[:200]}


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = data.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"`{key}` is not a {getattr(kind, '__name__', 'valid value')}")
    return value


def _paths(data: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> dict[str, Any]:
    """A map of path → value; each value of ``kind`` (or None: missing)."""
    value = _field(data, key, dict, {})
    for path, v in value.items():
        if v is not None and not isinstance(v, kind):
            raise ValueError(f"`{key}.{path[:80]}` is not a {getattr(kind, '__name__', 'valid value')}")
    return dict(value)


def parse_facts(raw: str) -> Facts:
    """The facts script's answer, checked field by field; ``ValueError`` says which field is wrong
    (a server is untrusted input: a garbled or hostile answer never reaches the plan as a value)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("arch", "systemd", "files", "binary") if k not in data]
    if missing:
        raise ValueError(f"`{missing[0]}` is missing")
    binary = _field(data, "binary", dict, {})
    version = _field(binary, "version", dict, {})
    version_out = _field(version, "out", str, "")
    extra = _field(data, "extra", list, [])
    if not all(isinstance(x, str) for x in extra):
        raise ValueError("`extra` is not a list of paths")
    return Facts(
        arch=_field(data, "arch", str, ""),
        systemd=bool(_field(data, "systemd", bool, False)),
        python=_field(data, "python", str, ""),
        files=_paths(data, "files", str),
        engine_version=parse_version(version_out) if _field(binary, "exists", bool, False) else None,
        engine_sha256=_field(binary, "sha256", str, None),
        engine_size=_field(binary, "size", int, None),
        active=_field(data, "active", str, ""),
        enabled=_field(data, "enabled", str, ""),
        listeners=parse_ss(_field(data, "ss", str, "")),
        public=_paths(data, "public", str),
        present=_paths(data, "present", bool),
        lock=parse_lock(_field(data, "lock", str, None)),
        extra=tuple(extra),
        firewall=bool(_field(data, "firewall", bool, False)),
        zstd=_zstd_path(_field(data, "zstd", str, "")),
    )


def _zstd_path(path: str) -> str:
    """The library path the server reported, only when it looks like one (it goes back to that server's engine
    step, which loads it; anything else means gzip)."""
    return path if re.fullmatch(r"(/[A-Za-z0-9_.+-]+)+/libzstd\.so\.1", path) and ".." not in path else ""
