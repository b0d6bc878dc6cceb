"""Facts: what a server looks like now, parsed from the raw output of the facts script. Pure.

Each parser takes command output and returns a typed value; tests feed them
tables of real outputs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

_VERSION = re.compile(r"^sing-box version (\S+)", re.M)


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

    def digest(self) -> str:
        """What a saved plan was computed from; a different digest makes the plan stale."""
        stable = {"files": self.files, "engine": [self.engine_version, self.engine_sha256], "active": self.active,
                  "enabled": self.enabled, "public": self.public, "present": self.present, "extra": self.extra,
                  "firewall": self.firewall}
        return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()


def parse_version(output: str) -> str | None:
    """`sing-box version` output → "1.14.4"."""
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


def spki_pin(cert_pem: str) -> str:
    """base64 SHA-256 of a certificate's public key (what sing-box's certificate_public_key_sha256 takes)."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def parse_facts(raw: str) -> Facts:
    data = json.loads(raw)
    binary = data.get("binary") or {}
    version_out = (binary.get("version") or {}).get("out", "")
    return Facts(
        arch=data.get("arch", ""),
        systemd=bool(data.get("systemd")),
        python=data.get("python", ""),
        files=dict(data.get("files") or {}),
        engine_version=parse_version(version_out) if binary.get("exists") else None,
        engine_sha256=binary.get("sha256"),
        engine_size=binary.get("size"),
        active=data.get("active", ""),
        enabled=data.get("enabled", ""),
        listeners=parse_ss(data.get("ss", "")),
        public=dict(data.get("public") or {}),
        present=dict(data.get("present") or {}),
        lock=parse_lock(data.get("lock")),
        extra=tuple(data.get("extra") or ()),
        firewall=bool(data.get("firewall")),
    )
