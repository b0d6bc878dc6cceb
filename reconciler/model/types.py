"""Small value types shared by the models: durations, byte sizes, names, hosts, listen addresses, host keys.

Operators write ``60s``, ``10m``, ``24h`` and ``100GB``; the models hold plain
seconds and bytes so the pure cores never parse text. Every check here is pure
(stdlib only) and bounded, and says what is wrong in the operator's words:

- a duration is finite, positive and at most ``MAX_DURATION`` (ten years: a longer
  interval is a typo, and ``.inf``/``.nan`` would reach ``sleep`` and arithmetic);
- a size is a whole number of bytes below 2^63 (what the engine's JSON can hold);
- a host is an IPv4 or IPv6 literal (``ipaddress``) or a DNS name by RFC 1123
  (labels of 1–63 letters, digits and '-', at most 253 characters);
- a listen address is ``HOST:PORT`` with a port 1–65535 (``[::1]:8080`` for IPv6);
- a host key is one OpenSSH public key line: a known key type and base64 whose
  decoded blob starts with that same type (the full parse is ``config.semantic``'s).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import ipaddress
import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, WithJsonSchema

MAX_DURATION = 3650 * 86400.0
MAX_SIZE = 2**63 - 1

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?i?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}


def parse_duration(value: Any) -> float:
    """``90``, ``"90s"``, ``"1.5m"``, ``"24h"``, ``"7d"``, ``"250ms"`` → seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 60s, 5m or 24h")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= 64 and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ValueError(f"{_shown(value)} is not a duration; write it like 60s, 5m, 24h or 7d")
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration; write it like 60s, 5m, 24h or 7d")
    if seconds <= 0:
        raise ValueError("a duration must be greater than zero")
    if seconds > MAX_DURATION:
        raise ValueError(f"a duration must be at most {format_duration(MAX_DURATION)} (ten years)")
    return seconds


def parse_size(value: Any) -> int:
    """``1000000``, ``"100GB"``, ``"1.5TiB"`` → bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 100GB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and len(value) <= 64 and (m := _SIZE.match(value)):
        unit = (m.group(2) or "B").lower()
        amount = float(m.group(1)) * _SIZE_UNITS[unit]
        if not amount < MAX_SIZE:
            raise ValueError(f"{value!r} is too large; at most {MAX_SIZE} bytes")
        size = int(amount)
    else:
        raise ValueError(f"{_shown(value)} is not a size; write it like 500MB, 100GB or 1TiB")
    if size <= 0:
        raise ValueError("a size must be greater than zero")
    if size > MAX_SIZE:
        raise ValueError(f"a size must be at most {MAX_SIZE} bytes")
    return size


def format_duration(seconds: float) -> str:
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"},
                {"type": "number", "exclusiveMinimum": 0},
            ],
            "description": "A duration: seconds, or a number with ms, s, m, h or d.",
        }
    ),
]

ByteSize = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGTPkmgtp]?i?[Bb])?\s*$"},
                {"type": "integer", "exclusiveMinimum": 0},
            ],
            "description": "A size in bytes, or a number with B, KB, MB, GB, TB (or KiB, MiB, GiB, TiB).",
        }
    ),
]

# Names end up in SSH logs, metric labels, file names and URLs: keep them tame.
Name = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$",
        description="Lower-case letters, digits, '.', '_' and '-'; starts and ends with a letter or digit.",
    ),
]


def _shown(value: Any) -> str:
    """A value for a message: repr, cut short (a 1 MB value must not become a 1 MB message)."""
    text = repr(value)
    return text if len(text) <= 48 else text[:45] + "…"


# --------------------------------------------------------------------------- hosts and addresses

_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def check_host(value: str) -> str:
    """An IPv4/IPv6 literal or an RFC 1123 DNS name (a trailing dot allowed); ``ValueError`` says which rule broke."""
    if len(value) > 253:
        raise ValueError(f"{_shown(value)} is too long for a host name (at most 253 characters)")
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if ":" in value:
        raise ValueError(f"{_shown(value)} is not an IPv6 address")
    name = value[:-1] if value.endswith(".") else value
    if not name:
        raise ValueError("a host name must not be empty")
    labels = name.split(".")
    for label in labels:
        if not _LABEL.match(label):
            raise ValueError(f"{_shown(value)} is not a host name: each dot-separated part is 1 to 63 letters, "
                             "digits or '-', not starting or ending with '-'")
    if all(c.isdigit() for c in labels[-1]):
        raise ValueError(f"{_shown(value)} is neither an IPv4 address nor a host name")
    return value


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port): host an IPv4 literal, ``[IPv6]``, a DNS name or empty (loopback); port 1–65535."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        raise ValueError(f"{_shown(value)} is not HOST:PORT (e.g. 127.0.0.1:8080 or [::1]:8080)")
    if not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5 or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"the port of {_shown(value)} must be a number from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{_shown(value)}: {_shown(host)} is not an IPv6 address") from None
        return host[1:-1], int(port_text)
    if host:
        if ":" in host:
            raise ValueError(f"{_shown(value)}: write an IPv6 address in brackets, e.g. [::1]:8080")
        check_host(host)
    return host, int(port_text)


def _check_listen(value: str) -> str:
    parse_listen(value)
    return value


# OpenSSH public key types a server may present (RFC 4253, 5656, 8709; the sk- types of OpenSSH 8.2).
HOST_KEY_TYPES = frozenset({
    "ssh-ed25519", "ssh-ed448", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
    "ssh-rsa", "ssh-dss", "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com",
})


def host_key_blob(value: str) -> tuple[str, bytes]:
    """One OpenSSH public key line (``TYPE BASE64 [comment]``) → (type, key blob); ``ValueError`` says what is wrong.

    The blob must start with the same type, length-prefixed (RFC 4253 §6.6): base64 of
    anything else, or a key of another type under this name, is refused.
    """
    parts = value.strip().split(None, 2)
    if len(parts) < 2:
        raise ValueError("write the server's public key line, e.g. 'ssh-ed25519 AAAAC3Nza…' (from ssh-keyscan or "
                         "/etc/ssh/ssh_host_ed25519_key.pub)")
    kind, data = parts[0], parts[1]
    if kind not in HOST_KEY_TYPES:
        raise ValueError(f"{_shown(kind)} is not an SSH public key type; use e.g. ssh-ed25519 or ecdsa-sha2-nistp256")
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the {kind} key is not valid base64") from None
    name = kind.encode()
    if len(blob) < 4 + len(name) + 4 or blob[:4] != len(name).to_bytes(4, "big") or blob[4:4 + len(name)] != name:
        raise ValueError(f"the base64 part is not an {kind} key (its blob does not start with the key type)")
    return kind, blob


def _check_host_key(value: str) -> str:
    host_key_blob(value)
    return value


Host = Annotated[
    str,
    Field(min_length=1, max_length=253, description="An IPv4 or IPv6 address, or a DNS name (RFC 1123)."),
    AfterValidator(check_host),
]

Listen = Annotated[
    str,
    Field(min_length=1, max_length=300, description="HOST:PORT; an IPv6 host in brackets, e.g. [::1]:8080."),
    AfterValidator(_check_listen),
]

HostKey = Annotated[
    str,
    Field(min_length=1, max_length=16384, description="An OpenSSH public key line: 'ssh-ed25519 AAAA…'."),
    AfterValidator(_check_host_key),
]


@functools.lru_cache(maxsize=4096)  # (the same few inbounds in every failover order of a pass: thousands of templates)
def order_id(inbound_id: str) -> str:
    """An inbound as an app's failover order names it in a health check's URL (no operator's name in a URL). The
    responder on the servers (``reconciler/engine/responder.py``, standard library only) computes the same."""
    return hashlib.blake2b(inbound_id.encode(), digest_size=4).hexdigest()
